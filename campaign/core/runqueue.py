"""How long one thread has waited for a CPU: the kernel's own account of it.

A thread the host holds off its CPU (other processes on the cores) reads every byte that arrived meanwhile
late by that wait. A probe that only times its own timers sees such a wait only where one of its timers fell
due inside it, and then only the part after that moment: a 5 ms wait between two timers 5 ms apart is
invisible to it. Linux counts every wait (`/proc/thread-self/schedstat`: time on a CPU, time waiting on a
run queue, timeslices; nanoseconds), and adds each whole wait when the thread gets a CPU back, so a reading
taken on the thread itself never splits one. Elsewhere the wait reads as 0 (unknown, not counted).
"""

from __future__ import annotations

import os
from types import TracebackType

SCHEDSTAT = "/proc/thread-self/schedstat"


class RunQueueWait:
    """`with RunQueueWait() as wait: ... wait.seconds()`: the calling thread's total wait on a run queue so far
    (seconds). Open it on the thread to be watched (the file is that thread's once opened); one read costs
    about a microsecond."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open(SCHEDSTAT, os.O_RDONLY)
        except OSError:
            self._fd = None

    def seconds(self) -> float:
        if self._fd is None:
            return 0.0
        try:
            fields = os.pread(self._fd, 128, 0).split()
            return int(fields[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunQueueWait:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
