"""The one exception family that crosses module boundaries; cli.py turns it into `Error: ... / hint: ...`."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Literal

# Why a launch produced no server, as stored in failure.json: what the startup log showed (the first five, see
# startup_log.FailureKind), how waiting for readiness ended, or what stopped the launch before or around it.
LaunchFailureKind = Literal[
    "kv_cache_insufficient", "out_of_memory", "bad_argument", "engine_init_failed", "crashed",
    "exited", "fatal_log_line", "deadline", "interrupted",
    "port_in_use", "executable_not_found", "unresolved_flag", "metric_missing",
    "node_lost",  # --executor ray: the node (or the Ray worker) running the launch died under it
    "error",  # a campaign error inside the launch (e.g. the control plane failed mid-cell)
    "internal_error",  # an exception nobody expected: a bug, recorded so the night goes on
]

# Exit codes (docs/faults.md): 0 done; 1 a campaign error; 2 bad input (a file, a key, an option);
# 3 a server did not start; 4 a metric the measurement needs is not exported; 5 a stored file this version
# cannot read or write; 6 a campaign that finished, but a launch or a cell of it failed; 70 an unexpected
# error (a bug: CAMPAIGN_DEBUG=1 shows the traceback); 130 interrupted. The classes below carry theirs.
EXIT_USAGE = 2
EXIT_SOME_FAILED = 6
EXIT_INTERNAL = 70


class CampaignError(Exception):
    """A failure the user can act on: what happened, and what to do next."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if self.hint is None else f"{self.message}\nhint: {self.hint}"


class ConfigError(CampaignError):
    """Bad input file: names the file, the key path inside it, and a fix."""

    exit_code = 2

    def __init__(self, path: str, key: str, problem: str, *, hint: str | None = None) -> None:
        where = f"{path}: {key}" if key else path
        super().__init__(f"{where}: {problem}", hint=hint)
        self.path = path
        self.key = key


class OptionError(CampaignError):
    """A command-line option's value the command cannot use, worded as the parser words its own refusals."""

    exit_code = EXIT_USAGE

    def __init__(self, option: str, problem: str) -> None:
        super().__init__(f"Invalid value for '{option}': {problem}", hint="the command's --help lists its options")
        self.option = option


class LaunchError(CampaignError):
    """The server did not become ready. `kind` is one of the startup-log failure kinds or a wait outcome."""

    exit_code = 3

    def __init__(self, message: str, *, kind: LaunchFailureKind, log_tail: str = "", hint: str | None = None
                 ) -> None:
        super().__init__(message, hint=hint)
        self.kind = kind
        self.log_tail = log_tail


class MetricMissingError(CampaignError):
    """A metric the measurement relies on is not exported: never read it as 0."""

    exit_code = 4


class PromptError(CampaignError):
    """The prompts a cell asks for cannot be made against this server (no /tokenize, an unusual chat
    template, a prompts file without text): that cell or experiment fails, the launch goes on."""


class ResultFormatError(CampaignError):
    """A stored file this version cannot read."""

    exit_code = 5


def did_you_mean(word: str, candidates: Iterable[str]) -> str | None:
    """A close spelling among `candidates`, for "did you mean ...?" hints."""
    normalized = {c.replace("_", "-").lower(): c for c in candidates}
    match = difflib.get_close_matches(word.replace("_", "-").lower(), list(normalized), n=1, cutoff=0.6)
    return normalized[match[0]] if match else None


# A stop asked for by a signal. The handler raises KeyboardInterrupt at once, but a raise that lands inside a
# weakref callback or a __del__ is printed and swallowed ("Exception ignored in ..."), so the flag stays set
# and the runner checks it between cells: a SIGTERM or Ctrl-C is never lost.
_stop_requested = False
_stops = 0     # signals received so far
_holding = 0   # blocks (stop_held) now open


def request_stop(signum: int = 0, frame: object = None) -> None:
    """A signal handler: remember the stop, and raise KeyboardInterrupt where the program is (inside
    `stop_held`, at the block's end)."""
    global _stop_requested, _stops
    _stop_requested = True
    _stops += 1
    if not _holding:
        raise KeyboardInterrupt


@contextmanager
def stop_held() -> Iterator[None]:
    """A stop signalled inside the block is raised at its end, not midway: for keeping what has already been
    received and exists nowhere else (a batch of a Ray task's files, taken off its queue), which a
    KeyboardInterrupt between two of its files would lose. A stop asked for before the block is not raised
    again by it (a Ctrl-C's own clean-up drains through it)."""
    global _holding
    before = _stops
    _holding += 1
    try:
        yield
    finally:
        _holding -= 1
    if _stops != before and not _holding:
        raise KeyboardInterrupt


def check_stop() -> None:
    """Between units of work: raise KeyboardInterrupt if a stop was asked for and its first raise was lost."""
    if _stop_requested:
        raise KeyboardInterrupt
