"""What the machines of a night can hold, checked before it: no launch wider than the GPUs the profile names or
with a window longer than its model's, and no cell wider than the client can open or the server can seat.
"""

from __future__ import annotations

import math
import os
import resource
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from campaign.core.errors import CampaignError, ConfigError, LaunchError
from campaign.core.hardware import LONG_MODEL_LEN_ENV, hardware_label, long_model_len_allowed, resolve_hardware
from campaign.core.model_config import model_shape
from campaign.core.vllm_flags import (
    BOUNDS,
    PARALLEL_SIZES,
    canonical_name,
    merge,
    normalize_flag,
    number_of,
    parallel_width,
)
from campaign.measure import shard
from campaign.measure.cells import CellSpec, longest_request
from campaign.server import flag_list
from campaign.server.profiles import FlagValue, LaunchProfile, parse_gpus
from campaign.spec.matrix import ContextWindowExperiment, DecodeWorkload, LongContextExperiment, Matrix

# Sockets a client process keeps besides one per stream: the /metrics control client, the log, pipes, files.
FD_RESERVE = 64
# Flags that change the model's config, and so the window vLLM derives from it (rope_scaling, YaRN).
WINDOW_OVERRIDES = frozenset({"hf-overrides", "rope-scaling", "rope-theta"})
# vLLM 0.32's max-num-seqs when not set (vllm/engine/arg_utils.py): 1024 on cards of 70 GiB or more but the
# A100, else 256.
BIG_CARD_GIB = 70.0


class PlanWarning(StrEnum):
    """What the plan lets through but says, each with its hint (a closed set, as cells' reasons are)."""

    UNLISTED_FLAG = "unlisted_flag"
    ABOVE_SEATS = "above_seats"
    OPEN_FILES = "open_files"
    DEV_MODE_EXPOSED = "dev_mode_exposed"
    STRETCHED_WINDOW = "stretched_window"


HINTS: dict[PlanWarning, str] = {
    PlanWarning.UNLISTED_FLAG: "a newer vLLM may have it: the launch host asks its own vLLM (--help=all) before the "
                               "first launch, and a flag it does not know fails that launch as a bad argument",
    PlanWarning.ABOVE_SEATS: "streams beyond max-num-seqs wait in the server's queue, so the cell does not run as "
                             "many at once as it asks (a sustained one is Invalid for it): raise max-num-seqs, or "
                             "measure fewer streams",
    PlanWarning.OPEN_FILES: "measure fewer streams, or raise the hard limit (ulimit -Hn) of the machine that "
                            "measures",
    PlanWarning.DEV_MODE_EXPOSED: "keep host 127.0.0.1, or drop VLLM_SERVER_DEV_MODE (trace and rate cells then "
                                  "stand on fresh prompts, their cache not reset)",
    # vLLM's own warning (config/model.py): past it positions "lead to nan" with RoPE, "a CUDA array
    # out-of-bounds error" with absolute ones; public reports: a device-side assert at the first such request.
    PlanWarning.STRETCHED_WINDOW: "vLLM serves it, but a request past the model's max_position_embeddings can "
                                  "crash the engine (a CUDA device-side assert, index out of bounds) or read NaNs: "
                                  "keep the cells within the model's window, or raise the window by RoPE scaling "
                                  "(hf-overrides) where the model supports it",
}
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def dev_mode_exposed(profile: LaunchProfile, profile_path: Path) -> list[Notice]:
    """VLLM_SERVER_DEV_MODE (which lets a cell reset the prefix cache) on a server that listens beyond this
    machine: its dev endpoints answer whoever reaches the port, API key or not."""
    if profile.env.get("VLLM_SERVER_DEV_MODE", "0").strip() in {"", "0"} or profile.host in LOOPBACK:
        return []
    return [Notice(PlanWarning.DEV_MODE_EXPOSED, f"{profile_path}: env: VLLM_SERVER_DEV_MODE with host {profile.host}: "
                                                 "vLLM's dev endpoints (/reset_prefix_cache, /sleep, /collective_rpc) "
                                                 "answer anyone who reaches the port, API key or not")]


@dataclass(frozen=True)
class Notice:
    code: PlanWarning
    message: str

    @property
    def hint(self) -> str:
        return HINTS[self.code]

    def line(self) -> str:
        return f"warning: {self.message} ({self.hint})"


def reach(spec: CellSpec) -> int:
    """The tokens a cell needs of a window, as the runner checks them: its longest prompt and reply."""
    return sum(longest_request(spec))


def _places(profile: LaunchProfile, profile_path: Path, matrix: Matrix | None,
            matrix_path: Path | None) -> list[tuple[str, str, str, dict[str, FlagValue]]]:
    """Each launch's flags where they are written: (file, key, name, the variant's own flags)."""
    if matrix is None:
        return [(str(profile_path), "flags", "the profile", {})]
    named = {v.name: i for i, v in enumerate(matrix.variants)}
    return [(str(matrix_path or matrix.name), f"variants[{named[v.name]}].flags" if v.name in named else "grid",
             v.name, dict(v.flags)) for v in matrix.all_variants()]


def _written(where: str, key: str, profile_path: Path, flags: Mapping[str, FlagValue],
             overrides: Mapping[str, FlagValue], names: set[str]) -> tuple[str, str]:
    """Where a launch's value of the flags `names` (canonical) was written, for an error to point at: --set
    (its keys spelled as vLLM's command line takes them, a short name such as `dp` kept as given), else the
    variant (`where` and `key`, as _places names it), else the profile."""
    given = [normalize_flag(k) for k in overrides if merge({k: None}).keys() & names]
    if given:
        return "launch --set", ", ".join(given)
    if merge(flags).keys() & names:
        return where, key
    return str(profile_path), "flags"


def check_widths(profile: LaunchProfile, profile_path: Path, matrix: Matrix | None = None,
                 matrix_path: Path | None = None, overrides: dict[str, FlagValue] | None = None, *,
                 placed: bool = False) -> None:
    """No launch is wider than the GPUs the profile names (its pool, else its hardware's cards): vLLM would end
    it with "World size (N) is larger than the number of available GPUs". Where the profile names neither,
    the launch host's own count decides; `placed`: a --gpus pool or Ray places the launches, and checks them
    against its own GPUs (pool.plan, ray_executor.connect)."""
    if placed:
        return
    if profile.gpus is not None:
        count, what = len(parse_gpus(profile.gpus, where="gpus")), f"the profile's GPU pool (gpus: {profile.gpus})"
    else:
        cards = resolve_hardware(profile.hardware)
        if cards is None:
            return
        count, what = cards[1], f"the profile's hardware {hardware_label(profile.hardware or '')}"
    for where, key, name, flags in _places(profile, profile_path, matrix, matrix_path):
        merged = merge(profile.flags, flags, overrides or {})
        width = parallel_width(merged)
        if width is None or width <= count:
            continue
        # Named where a factor that widens it was written.
        wide = {k for k in PARALLEL_SIZES if number_of(BOUNDS[k], merged.get(k, 1)) not in (None, 1)}
        where, key = _written(where, key, profile_path, flags, overrides or {}, wide)
        raise ConfigError(where, key, f"{name} needs {width} GPUs (tensor x pipeline x data parallel size); "
                          f"{what} has {count}", hint="lower the parallel size, or name more GPUs in the profile")


@dataclass(frozen=True)
class _LongWindow:
    """A launch whose max-model-len passes its model's window, named where the value was written."""

    where: str
    key: str
    name: str      # the variant, or "the profile"
    asked: int     # its max-model-len
    model: str     # the profile's model_shape, or its model (whose config.json gave the window)
    window: int    # the model's max_position_embeddings


def _long_model_len_env(profile: LaunchProfile) -> str:
    """VLLM_ALLOW_LONG_MAX_MODEL_LEN as the server will see it: the profile's env over this shell's, as the
    launch passes them."""
    return profile.env.get(LONG_MODEL_LEN_ENV, os.environ.get(LONG_MODEL_LEN_ENV, ""))


def _past_models_window(profile: LaunchProfile, profile_path: Path, matrix: Matrix | None,
                        matrix_path: Path | None, overrides: dict[str, FlagValue] | None) -> Iterator[_LongWindow]:
    """Each launch whose max-model-len is longer than the model's window where the profile states it (its
    model_shape's max_position_embeddings). A model-config override (hf-overrides, rope-scaling: YaRN raises
    the window vLLM derives) or a value not yet a number (an env reference) leaves it to the launch."""
    shape = model_shape(profile.shape_name)
    if shape is None or shape.window is None:
        return
    for where, key, name, flags in _places(profile, profile_path, matrix, matrix_path):
        merged = merge(profile.flags, flags, overrides or {})
        value = merged.get("max-model-len")
        asked = None if value is None else number_of(BOUNDS["max-model-len"], value)
        if WINDOW_OVERRIDES & merged.keys() or asked is None or asked <= shape.window:
            continue
        where, key = _written(where, key, profile_path, flags, overrides or {}, {"max-model-len"})
        yield _LongWindow(where, key, name, int(asked), shape.name, shape.window)


def check_window(profile: LaunchProfile, profile_path: Path, matrix: Matrix | None = None,
                 matrix_path: Path | None = None, overrides: dict[str, FlagValue] | None = None) -> None:
    """No launch asks for a max-model-len longer than the model's window (_past_models_window): vLLM ends it
    with "User-specified max_model_len (N) is greater than the derived max_model_len", unless
    VLLM_ALLOW_LONG_MAX_MODEL_LEN is set in the server's environment (then stretched_window says it); an env
    reference in it is the launch's to read."""
    allowed = _long_model_len_env(profile)
    if "${" in allowed or long_model_len_allowed(allowed):
        return
    for long in _past_models_window(profile, profile_path, matrix, matrix_path, overrides):
        raise ConfigError(long.where, long.key, f"{long.name}: max-model-len {long.asked:,} is longer than the "
                          f"model's window, {long.window:,} tokens (max_position_embeddings of {long.model}, as "
                          "vLLM derives it); vLLM refuses it",
                          hint=f"lower max-model-len to {long.window} or less, or set {LONG_MODEL_LEN_ENV}=1 in "
                               "the profile's env where the model's RoPE scaling allows it")


def stretched_window(profile: LaunchProfile, profile_path: Path, matrix: Matrix | None = None,
                     matrix_path: Path | None = None, overrides: dict[str, FlagValue] | None = None) -> list[Notice]:
    """Each launch whose max-model-len passes the model's window because VLLM_ALLOW_LONG_MAX_MODEL_LEN lets it
    (check_window refuses it otherwise), said with the cells and experiments that reach past the model's
    window: vLLM serves the launch, and may crash at the first request longer than the model knows."""
    if not long_model_len_allowed(_long_model_len_env(profile)):
        return []
    notices = []
    for long in _past_models_window(profile, profile_path, matrix, matrix_path, overrides):
        past = [] if matrix is None else _past(matrix, long.window, long.asked)
        notices.append(Notice(PlanWarning.STRETCHED_WINDOW, (
            f"{long.where}: {long.key}: {long.name}: max-model-len {long.asked:,} is past the model's window, "
            f"{long.window:,} tokens (max_position_embeddings of {long.model}), stretched by {LONG_MODEL_LEN_ENV}; "
            + (f"past {long.window:,} tokens: {', '.join(past)}" if past
               else "no cell or experiment reaches past it"))))
    return notices


def _past(matrix: Matrix, window: int, asked: int) -> list[str]:
    """The cells and experiments that send a prompt and reply longer than `window` (to at most `asked`, the
    launch's: longer ones are refused, not sent), each with its tokens."""
    out = [f"{c.key} ({reach(c):,} tokens)" for c in matrix.cells() if window < reach(c) <= asked]
    for experiment in matrix.experiments():
        if isinstance(experiment, ContextWindowExperiment):   # its prompts fill the launch's window
            out.append(f"{experiment.key} ({asked:,} tokens)")
        elif isinstance(experiment, LongContextExperiment):
            sent = [c + experiment.reply_tokens for c in experiment.contexts if window < c + experiment.reply_tokens
                    <= asked]
            out += [f"{experiment.key} ({max(sent):,} tokens)"] if sent else []
    return out


def unlisted_flags(unlisted: list[flag_list.FlagUse], source: str) -> list[Notice]:
    """A flag far from every name of a stand-in list, let through: said by name."""
    return [Notice(PlanWarning.UNLISTED_FLAG, f"{use.where}: {use.key} is not in {source}") for use in unlisted]


def _split(mode: str, ttft: str, prompts: str) -> bool:
    """Whether a decode cell's streams are split over client processes (runner._run_step): only a sustained
    cold-TTFT cell of random prompts is."""
    return mode == "sustained" and ttft == "cold" and prompts == "random"


def _concurrencies(matrix: Matrix) -> list[tuple[str, int, bool, bool]]:
    """(key, streams, is a decode cell's, is split over client processes) for every number of concurrent
    streams the matrix asks for. Only a sustained cold-TTFT cell of random prompts is split (runner._run_step);
    a fixed, warm or text cell runs every stream in one process."""
    found: list[tuple[str, int, bool, bool]] = []
    for index, workload in enumerate([*matrix.workloads]):
        decode = isinstance(workload, DecodeWorkload)
        split = isinstance(workload, DecodeWorkload) and _split(workload.mode, workload.ttft, workload.prompts)
        for attr in ("concurrency", "max_concurrency", "sessions"):
            value = getattr(workload, attr, None)
            numbers = value if isinstance(value, list) else [value]
            found += [(f"workloads[{index}].{attr}" + (f"[{k}]" if isinstance(value, list) else ""), n, decode, split)
                      for k, n in enumerate(numbers) if isinstance(n, int) and not isinstance(n, bool)]
    return found


def open_files_limit() -> int | None:
    """What a client process here may open: the hard limit, to which the command raises its own soft limit
    (raise_open_files); None: unlimited."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return None if hard == resource.RLIM_INFINITY else hard


def raise_open_files() -> None:
    """A client of a thousand streams needs a socket each: the soft limit (often 1,024) is raised to the hard
    one, as a process may, and its worker processes inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass   # a platform that refuses: the plan's check names the limit it has


def _open_files_problem(streams: int, split: bool, limit: int | None, where: str) -> str | None:
    """What is wrong with `streams` sockets (over the client processes a split cell runs on) against `limit`
    open files a process; None: they fit."""
    per_process = math.ceil(streams / shard.client_processes(streams)) if split else streams
    if limit is None or per_process + FD_RESERVE <= limit:
        return None
    return (f"{streams:,} streams need {per_process + FD_RESERVE:,} open files in one client process "
            f"({per_process:,} sockets and {FD_RESERVE} more); a process {where} may open {limit:,} (ulimit -Hn)")


def check_open_files_on_host(cells: list[CellSpec], host: str, *, open_files: int | None = None) -> None:
    """On the host that measures, before a launch is spent on it: the plan checked the controller's limit, but a
    Ray node's client runs under its raylet's (raised to that node's hard limit, raise_open_files). A cell wider
    than this host can open fails the launch here, by name, rather than as refused connections mid-cell."""
    limit = open_files_limit() if open_files is None else open_files
    for spec in cells:
        if spec.phase == "decode":
            streams = spec.concurrency
            split = _split(spec.mode, spec.ttft, spec.prompts)
        else:
            streams = max(spec.max_concurrency or 1, spec.sessions.count if spec.sessions else 1)
            split = False
        problem = _open_files_problem(streams, split, limit, f"on {host}")
        if problem is not None:
            raise CampaignError(f"{spec.key}: {problem}", hint=HINTS[PlanWarning.OPEN_FILES])


def check_concurrency(matrix: Matrix, matrix_path: Path | None, profile: LaunchProfile,
                      overrides: dict[str, FlagValue] | None = None, *, open_files: int | None = None,
                      here: bool = True) -> list[Notice]:
    """Every number of streams the client can open (one socket each, a sustained cell's split over its client
    processes) against what a process here may open, and a warning for each decode cell beyond what a
    variant's server seats (max-num-seqs, as set or vLLM's default for the profile's card). `here`: this
    machine measures (run, launch), so too many streams is an error; a plan may be made elsewhere, so there
    it is a warning naming this machine's limit."""
    where = str(matrix_path or matrix.name)
    limit = open_files_limit() if open_files is None else open_files
    notices: list[Notice] = []
    for key, streams, decode, split in _concurrencies(matrix):
        problem = _open_files_problem(streams, split, limit, "here")
        if problem is not None:
            if here:
                raise ConfigError(where, key, problem, hint=HINTS[PlanWarning.OPEN_FILES])
            notices.append(Notice(PlanWarning.OPEN_FILES, f"{where}: {key}: {problem}"))
        if not decode:
            continue   # an open loop's queue is what it measures
        for variant in matrix.all_variants():
            seats, why = _seats(merge(profile.flags, variant.flags, overrides or {}), profile)
            if seats is not None and streams > seats:
                notices.append(Notice(PlanWarning.ABOVE_SEATS, f"{where}: {key}: {streams:,} streams, and variant "
                                      f"{variant.name} seats {seats:,} ({why})"))
    return notices


def _seats(flags: dict[str, FlagValue], profile: LaunchProfile) -> tuple[int | None, str]:
    value = flags.get("max-num-seqs")
    if value is not None:
        read = number_of(BOUNDS["max-num-seqs"], value)
        return (None if read is None else int(read)), "its max-num-seqs"
    cards = resolve_hardware(profile.hardware)
    if cards is None:
        return None, ""   # not known here: the launch's log says it
    gib = cards[0].memory_gb * 1e9 / 2**30
    big = gib >= BIG_CARD_GIB and "a100" not in cards[0].name
    return (1024 if big else 256), f"vLLM's default max-num-seqs on a {gib:.0f} GiB card"


def check_on_host(profile: LaunchProfile, flags: dict[str, FlagValue], engine: str | None) -> None:
    """A flag the plan let through (far from every name of the list shipped with this tool) is checked on the
    launch host, against its own server's --help=all (asked once per version, cached), before a launch is
    spent on it: one it does not know fails the launch as a bad argument."""
    shipped = flag_list.shipped()
    names = [name for name in {**profile.flags, **flags}
             if canonical_name(name) not in shipped and canonical_name(name).removeprefix("no-") not in shipped]
    if not names:
        return
    listed = flag_list.for_profile(profile, engine)
    unknown = [name for name in names if listed.authoritative and canonical_name(name) not in listed.names
               and canonical_name(name).removeprefix("no-") not in listed.names]
    if unknown:
        raise LaunchError(f"{', '.join(unknown)}: not a flag of {listed.source}", kind="bad_argument",
                          hint="correct or remove it in the matrix or the profile")
