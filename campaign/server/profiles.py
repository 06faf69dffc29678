"""Launch profiles (`launch_profiles/*.yaml`): how to start vLLM on one target machine.

A profile is validated once, here, into a frozen model; every error names the file, the key path inside it
and, where a spelling is close, what was probably meant.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from campaign.core import secret
from campaign.core.errors import CampaignError, ConfigError, did_you_mean
from campaign.core.hardware import inline_card, is_measured
from campaign.core.model_config import model_shape
from campaign.core.vllm_flags import RUNNER_OWNED_FLAGS, normalize_flag, value_problems

PROFILE_SCHEMA_VERSION = 1
PROJECT_ROOT = Path(__file__).resolve().parents[2]
PROFILES_DIR = PROJECT_ROOT / "launch_profiles"

FlagValue = bool | int | float | str | dict[str, Any] | list[Any] | None

# The runner owns these: it binds the host/port it checked and passes the key through the environment.
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class TLSConfig(BaseModel):
    """Serve over https: vLLM gets --ssl-certfile/--ssl-keyfile, and the runner verifies it with `ca_bundle`
    (default: the system CAs), or not at all with `insecure: true`. Relative paths are the profile's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    certfile: Path
    keyfile: Path
    ca_bundle: Path | None = None
    insecure: bool = False


class RateHints(BaseModel):
    """What `campaign plan` assumes of this server before any run of a campaign has measured it. Each figure may
    be left out (the plan guesses it); a profile may state its noise alone."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill_tok_s: float | None = Field(default=None, gt=0, description="prompt tokens per second of one long "
                                                                        "prefill")
    decode_tok_s: float | None = Field(default=None, gt=0, description="generated tokens per second of one stream")
    launch_s: float | None = Field(default=None, gt=0, description="seconds from starting the server to ready")
    launch_noise: float | None = Field(
        default=None, gt=0, lt=1, description="how much a cell's headline figure moves between launches of the same "
        "server, as a fraction (0.02: 2%, the relative spread of one launch's value): the plan's smallest change a "
        "night can tell rests on it")
    measured: str = Field(description="where and how these were measured, said with every estimate")
    launch_noise_measured: str | None = Field(
        default=None, description="where launch_noise comes from, where not as `measured` says")

    @model_validator(mode="after")
    def _states_something(self) -> RateHints:
        if (self.prefill_tok_s, self.decode_tok_s, self.launch_s, self.launch_noise) == (None,) * 4:
            raise ValueError("rates: state at least one of prefill_tok_s, decode_tok_s, launch_s, launch_noise")
        return self


def parse_gpus(text: str | Sequence[int], *, where: str = "--gpus") -> list[int]:
    """`0-7`, `0,1,4-5` or a list of indices, each once, in the order given."""
    if not isinstance(text, str):
        items = [str(i) for i in text]
    else:
        items = [part.strip() for part in text.split(",") if part.strip()]
    out: list[int] = []
    for item in items:
        low, sep, high = item.partition("-")
        try:
            span = range(int(low), int(high) + 1) if sep else range(int(low), int(low) + 1)
        except ValueError:
            raise CampaignError(f"{where}: {item!r} is not a GPU index or range",
                                hint="give indices and ranges, e.g. --gpus 0-7 or --gpus 0,1,4-5") from None
        if not span or span.start < 0:
            raise CampaignError(f"{where}: {item!r} is an empty or negative range", hint="e.g. --gpus 0-3")
        for index in span:
            if index in out:
                raise CampaignError(f"{where}: GPU {index} is named twice", hint="name each GPU once")
            out.append(index)
    if not out:
        raise CampaignError(f"{where}: no GPUs named", hint="e.g. --gpus 0,1")
    return out


class LaunchProfile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = PROFILE_SCHEMA_VERSION
    description: str = ""
    engine: Literal["vllm", "sim"] = "vllm"
    # `serve`: `<executable> serve MODEL`; `api_server`: `<executable> -m vllm.entrypoints.openai.api_server
    # --model MODEL` (the CPU build's `vllm` script dies with "Illegal instruction" on AVX2-only CPUs).
    command: Literal["serve", "api_server"] = "serve"
    executable: str = "vllm"
    model: str
    served_model_name: str | None = None
    # The model's tokenizer (a Hugging Face folder or tokenizer.json), passed as --tokenizer: vLLM's flag, and
    # what makes the simulator count prompts as the model does (without it, its built-in approximation).
    tokenizer: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    flags: dict[str, FlagValue] = Field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int | Literal["auto"] = "auto"
    startup_timeout_s: float = Field(default=900.0, gt=0)
    api_key_env: str | None = None
    tls: TLSConfig | None = None
    # What the simulator imitates, and what roofline figures are computed against.
    hardware: str | None = None
    model_shape: str | None = None
    # The vLLM version the simulator behaves as (its startup log, and its memory accounting: the CUDA-graph
    # reservation came in 0.21); None: the version this project follows. The real server ignores it.
    vllm_version: str | None = None
    rates: RateHints | None = None
    # A GPU pool for `campaign run` (`0-7`, `0,1`, or a list): launches side by side, as --gpus does.
    gpus: str | list[int] | None = None

    @field_validator("api_key_env")
    @classmethod
    def _env_name_not_key(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_NAME.match(value):
            raise ValueError("must be the name of an environment variable (e.g. VLLM_API_KEY), never the key")
        return value

    @field_validator("gpus")
    @classmethod
    def _gpus_parse(cls, value: str | list[int] | None) -> str | list[int] | None:
        if value is not None:
            try:
                parse_gpus(value, where="gpus")
            except CampaignError as exc:
                raise ValueError(f"{exc.message.removeprefix('gpus: ')} ({exc.hint})") from None
        return value

    @field_validator("vllm_version")
    @classmethod
    def _a_version(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                Version(value)
            except InvalidVersion:
                raise ValueError(f"not a version: {value!r} (write it as vLLM prints it, e.g. 0.19.1)") from None
        return value

    @field_validator("env", mode="before")
    @classmethod
    def _env_as_strings(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k): str(v) for k, v in value.items()}
        return value

    @field_validator("hardware", mode="before")
    @classmethod
    def _card_inline(cls, value: Any) -> Any:
        """A mapping states the card by its figures (core.hardware.inline_card); it travels on as JSON."""
        if isinstance(value, dict):
            inline_card(value)
            return json.dumps(value, sort_keys=True, separators=(",", ":"))
        return value

    @field_validator("model_shape")
    @classmethod
    def _shape_or_measured(cls, value: str | None, info: Any) -> str | None:
        hardware = info.data.get("hardware") or ""
        if value and is_measured(hardware):
            raise ValueError(f"hardware {hardware} is a measured file, which carries its own model: drop model_shape")
        return value

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def shape_name(self) -> str:
        """What names the model's shape: model_shape, else the model (a folder relative to the project made
        absolute, as the launch resolves it), whose config.json gives the shape (core.model_config)."""
        if self.model_shape:
            return self.model_shape
        local = PROJECT_ROOT / self.model
        return str(local) if not Path(self.model).is_absolute() and local.exists() else self.model

    @property
    def simulatable(self) -> bool:
        """Whether the simulator can stand in for it: a hardware of the tables and a model whose shape is known
        (model_shape, or the model's config), or a measured file."""
        if not self.hardware:
            return False
        return bool(self.model_shape or is_measured(self.hardware) or model_shape(self.shape_name) is not None)


def sim_hardware(value: str) -> str:
    """The simulator's --hardware for a profile's `hardware:`: a measured file's path made absolute (relative to
    launch_profiles/, where `campaign calibrate` writes measured/<name>.yaml); a row of the tables as it is."""
    if not is_measured(value):
        return value
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else PROFILES_DIR / path)


def _key_path(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts)


def _model_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel]:
    """The nested model a key path leads to (`timeouts` -> TimeoutsConfig), so a hint lists its own keys."""
    current = model
    for item in loc:
        if isinstance(item, int) or item not in current.model_fields:
            continue
        candidates = [current.model_fields[item].annotation]
        found = None
        while candidates:
            annotation = candidates.pop()
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                found = annotation
                break
            candidates.extend(get_args(annotation))
        if found is None:
            return current
        current = found
    return current


def raise_validation(path: str, error: ValidationError, model: type[BaseModel]) -> None:
    """Turn pydantic's first error into a ConfigError naming the file, key and a fix."""
    first = error.errors()[0]
    key = _key_path(tuple(first["loc"]))
    if first["type"] == "extra_forbidden":
        leaf = str(first["loc"][-1])
        known = list(_model_at(model, tuple(first["loc"][:-1])).model_fields)
        suggestion = did_you_mean(leaf, known)
        hint = f"did you mean {suggestion}?" if suggestion else f"known keys: {', '.join(known)}"
        raise ConfigError(path, key, "unknown key", hint=hint)
    if first["type"] == "missing":
        raise ConfigError(path, key, "required key is missing")
    raise ConfigError(path, key, str(first["msg"]).removeprefix("Value error, "))


def load_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(str(path), "", "file not found") from None
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), "", f"not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "", "expected a mapping at the top level")
    return data


def resolve_named(name_or_path: str, folder: Path, what: str) -> Path:
    """A file by name (`cpu-tiny` -> folder/cpu-tiny.yaml), or by path; a near miss gets "did you mean"."""
    candidate = Path(name_or_path)
    if candidate.suffix in {".yaml", ".yml"} or candidate.exists():
        return candidate
    path = folder / f"{name_or_path}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in folder.glob("*.yaml"))
        suggestion = did_you_mean(name_or_path, known)
        hint = f"did you mean {suggestion}?" if suggestion else f"known: {', '.join(known)}"
        raise ConfigError(str(path), "", f"no {what} named {name_or_path!r}", hint=hint)
    return path


def resolve_profile_path(name_or_path: str) -> Path:
    return resolve_named(name_or_path, PROFILES_DIR, "launch profile")


def flag_problems(key_prefix: str, flags: Mapping[str, Any], *,
                  grid: bool = False) -> list[tuple[str, str, str | None]]:
    """(key, problem, hint) for flags the runner owns, for secrets written inline, and for values vLLM would
    refuse (core.vllm_flags; `grid`: each value is a list of them). Whether a flag exists is for the flag list of
    the server the profile launches to say, all unknown ones at once (flag_list.check, before the night)."""
    owned = [(f"{key_prefix}.{raw}", "this flag is owned by the runner", RUNNER_OWNED_FLAGS[normalize_flag(raw)])
             for raw in flags if normalize_flag(raw) in RUNNER_OWNED_FLAGS]
    rest = {raw: value for raw, value in flags.items() if normalize_flag(raw) not in RUNNER_OWNED_FLAGS}
    return owned + secret_problems(key_prefix, rest) + value_problems(key_prefix, rest, grid=grid)


def secret_problems(key_prefix: str, values: Mapping[str, Any]) -> list[tuple[str, str, str | None]]:
    """(key, problem, hint) for each secret written inline (secret.inline); the value is never repeated."""
    return [(key, "a secret written inline", secret.HOW_TO_PASS)
            for raw, value in values.items() for key in secret.inline(f"{key_prefix}.{raw}", value, raw)]


def raise_flag_problems(path: str, problems: list[tuple[str, str, str | None]]) -> None:
    """One error for all of a file's flag and secret problems, so that a fix is not followed by the next one's error."""
    if len(problems) == 1:
        key, problem, hint = problems[0]
        raise ConfigError(path, key, problem, hint=hint)
    if problems:
        hints = list(dict.fromkeys(hint for _, _, hint in problems if hint))
        listed = "; ".join(f"{key}: {problem}" + (f" ({hint})" if hint and len(hints) > 1 else "")
                           for key, problem, hint in problems)
        raise ConfigError(path, "", f"{len(problems)} problems: {listed}",
                          hint=hints[0] if len(hints) == 1 else None)


def load_profile(name_or_path: str) -> tuple[LaunchProfile, Path]:
    path = resolve_profile_path(name_or_path)
    data = load_yaml(path)
    version = data.get("schema_version", PROFILE_SCHEMA_VERSION)
    if isinstance(version, int) and version > PROFILE_SCHEMA_VERSION:
        raise ConfigError(str(path), "schema_version",
                          f"version {version} is newer than this tool understands ({PROFILE_SCHEMA_VERSION})",
                          hint="upgrade vllm-campaign")
    try:
        profile = LaunchProfile.model_validate(data)
    except ValidationError as exc:
        raise_validation(str(path), exc, LaunchProfile)
        raise  # unreachable: raise_validation always raises
    raise_flag_problems(str(path), [*flag_problems("flags", profile.flags), *secret_problems("env", profile.env)])
    if profile.tls is not None:
        profile = profile.model_copy(update={"tls": _tls_relative_to(profile.tls, path.parent)})
    return profile, path


def _tls_relative_to(tls: TLSConfig, folder: Path) -> TLSConfig:
    def resolve(p: Path | None) -> Path | None:
        if p is None:
            return None
        p = p.expanduser()
        return p if p.is_absolute() else (folder / p).resolve()

    return tls.model_copy(update={"certfile": resolve(tls.certfile), "keyfile": resolve(tls.keyfile),
                                  "ca_bundle": resolve(tls.ca_bundle)})
