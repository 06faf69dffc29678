"""The console's streams: what every process of the tool that prints (the CLI, a pool's worker) sets up first."""

from __future__ import annotations

import io
import sys


def buffered_stdio() -> None:
    """Give stdout and stderr a buffered layer where PYTHONUNBUFFERED (usual in containers, set on CI) left
    the text layer straight on the file descriptor: that layer drops the rest of a short write, and after
    uvloop has run the kernel returned one: `probe --json` (175 KB) to a pipe read late arrived cut at
    64 KiB, with exit 0. A buffered writer goes on writing after a short write; line buffering keeps every
    line as prompt as unbuffered output."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, io.TextIOWrapper) and isinstance(stream.buffer, io.RawIOBase):
            raw = io.FileIO(stream.fileno(), "w", closefd=False)
            setattr(sys, name, io.TextIOWrapper(io.BufferedWriter(raw), encoding=stream.encoding,
                                                errors=stream.errors, line_buffering=True))
