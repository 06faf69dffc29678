"""The one exception family that crosses module boundaries; cli.py turns it into `Error: ... / hint: ...`."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


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


class LaunchError(CampaignError):
    """The server did not become ready. `kind` is one of the startup-log failure kinds or a wait outcome."""

    exit_code = 3

    def __init__(self, message: str, *, kind: str, log_tail: str = "", hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.kind = kind
        self.log_tail = log_tail


class MetricMissingError(CampaignError):
    """A metric the measurement relies on is not exported: never read it as 0."""

    exit_code = 4


class ResultFormatError(CampaignError):
    """A stored file this version cannot read."""

    exit_code = 5


def did_you_mean(word: str, candidates: Iterable[str]) -> str | None:
    """A close spelling among `candidates`, for "did you mean ...?" hints."""
    normalized = {c.replace("_", "-").lower(): c for c in candidates}
    match = difflib.get_close_matches(word.replace("_", "-").lower(), list(normalized), n=1, cutoff=0.6)
    return normalized[match[0]] if match else None
