"""Pure: a launch profile plus flag overrides -> the argv and environment of one server process."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from campaign.core import secret
from campaign.core.errors import CampaignError
from campaign.core.vllm_flags import merge, normalize_flag
from campaign.http.endpoint import TLS, Endpoint, Timeouts
from campaign.server.profiles import PROJECT_ROOT, FlagValue, LaunchProfile, sim_hardware
from campaign.sim.config import LAUNCH_ENV

# Plain, uncoloured, logo-free logs are what the parser reads best; a profile's own env still wins.
_LOG_ENV = {"VLLM_LOGGING_COLOR": "0", "NO_COLOR": "1", "VLLM_DISABLE_LOG_LOGO": "1", "PYTHONUNBUFFERED": "1"}


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """`argv` and `env_overrides` as the profile and matrix wrote them: a secret is a `${NAME}` reference there,
    expanded only into the process's own argv and environment (spawn_argv, child_env)."""

    argv: list[str]
    env_overrides: dict[str, str]
    host: str
    port: int
    served_model_name: str
    flags: dict[str, FlagValue]
    api_key: str | None = field(default=None, repr=False)
    tls: TLS | None = None  # how to verify a server launched with --ssl-certfile; None: plain http

    @property
    def base_url(self) -> str:
        return self.endpoint().root

    def endpoint(self, timeouts: Timeouts | None = None) -> Endpoint:
        host = "127.0.0.1" if self.host in {"0.0.0.0", ""} else ("::1" if self.host == "::" else self.host)
        return Endpoint(scheme="https" if self.tls is not None else "http", host=host, port=self.port,
                        api_key=self.api_key, tls=self.tls or TLS(), timeouts=timeouts or Timeouts())

    def child_env(self) -> dict[str, str]:
        """The server's environment, references expanded. Raises secret.UnsetReferenceError."""
        env = dict(os.environ)
        env.update(secret.expand(self.env_overrides))
        if self.api_key is not None:
            # Through the environment, never argv: argv is visible to every user in `ps`.
            env["VLLM_API_KEY"] = self.api_key
        return env

    def spawn_argv(self) -> list[str]:
        """The argv the process gets, references expanded (inside a JSON value too, escaped as JSON).
        Raises secret.UnsetReferenceError."""
        out = []
        for arg in self.argv:
            parsed = None
            if arg.startswith(("{", "[")) and "${" in arg:
                with contextlib.suppress(ValueError):
                    parsed = json.loads(arg)
            out.append(json.dumps(secret.expand(parsed), separators=(",", ":")) if parsed is not None
                       else secret.expand(arg))
        return out

    def redacted_argv(self) -> list[str]:
        """The argv as stored and shown: references as written, and any known secret redacted."""
        return [secret.redact(arg) for arg in self.argv]


def api_key_from(env_name: str | None) -> str | None:
    """The key in that environment variable, without the line ending a key file read with `$(cat ...)` or
    from a CRLF file brings (in a header it would fail, and the error would quote the key). Declared secret."""
    value = os.environ.get(env_name, "").strip() if env_name else ""
    secret.declare(value)
    return value or None


def flag_args(flags: Mapping[str, FlagValue]) -> list[str]:
    """`key: value` -> `--key value`; true -> `--key`; false -> `--no-key`; dict/list -> JSON; None -> omitted."""
    args: list[str] = []
    for raw, value in flags.items():
        name = normalize_flag(raw)
        if value is None:
            continue
        if value is True:
            args.append(f"--{name}")
        elif value is False:
            args.append(f"--no-{name}")
        elif isinstance(value, dict | list):
            args += [f"--{name}", json.dumps(value, separators=(",", ":"))]
        else:
            args += [f"--{name}", str(value)]
    return args


def parse_set(items: list[str]) -> dict[str, FlagValue]:
    """`--set key=value` pairs; values are read as YAML scalars/mappings (`0.95`, `true`, `{method: mtp}`)."""
    import yaml

    result: dict[str, FlagValue] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:

            raise CampaignError(f"--set {item!r}: expected flag=value", hint="e.g. --set max-num-seqs=64")
        result[normalize_flag(key)] = yaml.safe_load(value) if value else ""
    return result


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1" if host in {"0.0.0.0", ""} else host, port))
        except OSError:
            return False
        return True


def resolve_path(path_text: str) -> str:
    """Project-relative paths in profiles (`.venv-vllm/bin/python`, `models/tiny-qwen3`) when they exist."""
    path = Path(os.path.expanduser(os.path.expandvars(path_text)))
    if not path.is_absolute() and (PROJECT_ROOT / path).exists():
        return str(PROJECT_ROOT / path)
    return str(path) if path.exists() else path_text


def build(
    profile: LaunchProfile,
    overrides: Mapping[str, FlagValue] | None = None,
    *,
    port: int | None = None,
    engine: str | None = None,
    launch: str | None = None,
) -> LaunchSpec:
    """`launch`: the launch's identity in its night (`variant/repeat`), which the simulator's launch noise is
    drawn from; passed to the simulator only, in its environment (LAUNCH_ENV)."""
    flags = merge(profile.flags, overrides or {})
    host = profile.host
    chosen_port = port if port is not None else (
        free_port(host if host not in {"0.0.0.0", ""} else "127.0.0.1") if profile.port == "auto"
        else profile.port
    )
    model = resolve_path(profile.model)
    engine = engine or profile.engine
    if engine == "sim":
        head = [sys.executable, "-m", "campaign.sim", "--model", model]
        if profile.hardware:
            head += ["--hardware", sim_hardware(profile.hardware)]
        if profile.model_shape:
            head += ["--model-shape", profile.model_shape]
        if profile.vllm_version:
            head += ["--version-style", profile.vllm_version]
    elif profile.command == "api_server":
        head = [resolve_path(profile.executable), "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    else:
        head = [resolve_path(profile.executable), "serve", model]
    argv = head + flag_args(flags) + ["--host", host, "--port", str(chosen_port)]
    if profile.tokenizer and "tokenizer" not in {normalize_flag(k) for k in flags}:
        argv += ["--tokenizer", resolve_path(profile.tokenizer)]
    if profile.served_model_name:
        argv += ["--served-model-name", profile.served_model_name]
    tls: TLS | None = None
    if profile.tls is not None:
        argv += ["--ssl-certfile", str(profile.tls.certfile), "--ssl-keyfile", str(profile.tls.keyfile)]
        tls = TLS(ca_bundle=profile.tls.ca_bundle, insecure=profile.tls.insecure)

    api_key = api_key_from(profile.api_key_env)
    env = dict(_LOG_ENV)
    env.update(profile.env)
    if engine == "sim" and launch is not None:
        env[LAUNCH_ENV] = launch
    return LaunchSpec(
        argv=argv, env_overrides=env, host=host, port=chosen_port, served_model_name=profile.served_name,
        flags=flags, api_key=api_key, tls=tls,
    )
