"""Progress for a night-long campaign: a live display on a terminal, plain lines elsewhere (logs, CI)."""

from __future__ import annotations

import sys
import time
from types import TracebackType

from rich.console import Console
from rich.live import Live
from rich.text import Text


def fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class Progress:
    """`with Progress(total_cells, estimate_s) as p: p.status(...); p.cell_done(...)`."""

    def __init__(self, *, total_cells: int, estimate_s: float, live: bool | None = None) -> None:
        self.total = total_cells
        self.done = 0
        self.estimate_s = estimate_s
        self.started = time.monotonic()
        self.current = ""
        self.live_mode = sys.stderr.isatty() if live is None else live
        self._console = Console(stderr=True)
        self._live: Live | None = None

    def eta_s(self) -> float:
        elapsed = time.monotonic() - self.started
        if self.done == 0:
            return max(0.0, self.estimate_s - elapsed)
        # Blend the plan's estimate with the pace so far; the pace wins as evidence accumulates.
        pace = elapsed / self.done * (self.total - self.done)
        weight = min(1.0, self.done / max(1, self.total) * 2)
        return weight * pace + (1 - weight) * max(0.0, self.estimate_s - elapsed)

    def _line(self) -> str:
        return (f"[{self.done}/{self.total} cells, {fmt_duration(time.monotonic() - self.started)} elapsed, "
                f"ETA {fmt_duration(self.eta_s())}] {self.current}")

    def status(self, message: str) -> None:
        self.current = message
        if self._live is not None:
            self._live.update(Text(self._line()))
        else:
            print(self._line(), file=sys.stderr, flush=True)  # noqa: T201

    def note(self, message: str) -> None:
        """A line that stays (a warning, a finished cell), printed above the live line."""
        if self._live is not None:
            self._console.print(message, markup=False, highlight=False)
        else:
            print(message, file=sys.stderr, flush=True)  # noqa: T201

    def cell_done(self, message: str) -> None:
        self.done += 1
        self.note(message)

    def __enter__(self) -> Progress:
        if self.live_mode:
            self._live = Live(Text(self._line()), console=self._console, refresh_per_second=2, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._live is not None:
            self._live.__exit__(exc_type, exc, tb)
            self._live = None
