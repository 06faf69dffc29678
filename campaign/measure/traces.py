"""Production traces (issue 34): requests with their arrival times, exact lengths and, where the trace has them,
the prefix blocks they share, read from the formats people have, sliced, and turned into prompts.

Formats (each line or row one request; times are re-based so the first request of a slice arrives at 0):
- `mooncake`: JSONL of {"timestamp": milliseconds, "input_length", "output_length", "hash_ids": [...]} (the
  Mooncake traces, kvcache-ai/Mooncake; one hash id per block of `block_size` prompt tokens, 512 in them: two
  requests whose hash ids agree up to block k share their first k blocks, as a prefix cache sees them).
- `azure`: the Azure LLM inference trace's CSV, TIMESTAMP (a date and time, seven fractional digits),
  ContextTokens, GeneratedTokens (Azure/AzurePublicDataset). No prefix structure: every prompt is unique.
- `burstgpt`: BurstGPT's CSV, Timestamp (seconds), Model, Request tokens, Response tokens, Total tokens, Log
  Type (HPMLL/BurstGPT). No prefix structure.
- `campaign`: this project's JSONL (TraceHeader, then a TraceLine a request; docs/traces.md), written by
  `write` (an export of a stored run's requests to it is still to come).

A malformed line is a one-line error naming the file and the line; nothing is skipped silently.
"""

from __future__ import annotations

import array
import csv
import hashlib
import io
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from campaign.core.errors import ConfigError
from campaign.measure.prompts import TOKEN_HIGH, TOKEN_LOW

TraceFormat = Literal["mooncake", "azure", "burstgpt", "campaign"]
FORMATS: tuple[str, ...] = get_args(TraceFormat)
MOONCAKE_BLOCK = 512   # tokens a hash id stands for in the Mooncake traces (their README; GuideLLM's default too)
TRACE_SCHEMA_VERSION = 1
_AZURE = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_BURST = ("Timestamp", "Request tokens", "Response tokens")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrives (seconds from the trace's first), its prompt and reply lengths
    in tokens, and the prefix blocks it shares (empty: none; its prompt is unique)."""

    at_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Trace:
    path: Path
    format: TraceFormat
    requests: list[TraceRequest]
    block_size: int | None   # tokens a hash id stands for; None: the trace has no prefix structure
    digest: str              # the first 12 hex digits of the file's SHA-256: which content was read


class TraceHeader(BaseModel):
    """The first line of a `campaign` trace: what it is and what its hash ids stand for."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["trace"] = Field(description="this file's kind")
    schema_version: int = Field(description="the format's version (1)")
    block_size: int | None = Field(default=None, gt=0,
                                   description="prompt tokens a hash id stands for; null: no hash ids")
    source: str = Field(default="", description="where the requests came from (a run, a trace and its slice)")


class TraceLine(BaseModel):
    """One request of a `campaign` trace."""

    model_config = ConfigDict(extra="forbid")
    at_s: float = Field(ge=0, description="arrival, seconds from the trace's start")
    input_tokens: int = Field(gt=0, description="prompt tokens")
    output_tokens: int = Field(gt=0, description="reply tokens (sent as max_tokens with ignore_eos)")
    hash_ids: list[int] = Field(default_factory=list,
                                description="the prompt's blocks, one id a block_size tokens; shared ids, shared "
                                            "blocks")


def _problem(path: Path, line: int, problem: str, hint: str) -> ConfigError:
    return ConfigError(str(path), f"line {line}", problem, hint=hint)


def _contents(path: Path) -> tuple[str, str]:
    """The file's text and its digest, from one read."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(str(path), "", f"cannot read the trace: {exc.strerror or exc}",
                          hint="give the path of a trace file") from None
    try:
        text = data.decode("utf-8-sig")   # a BOM (a CSV saved by a spreadsheet) is not text
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), "", f"not UTF-8 text ({exc.reason})", hint="a trace is JSONL or CSV") from None
    return text, hashlib.sha256(data).hexdigest()[:12]


def digest_of(path: Path) -> str:
    """The digest a read of the file would give (a ConfigError naming it if it cannot be read)."""
    return _contents(path)[1]


def check_unchanged(cells: list[dict[str, Any]]) -> None:
    """A resumed run replays the traces it began with (`cells`: its manifest's cell specs): a trace file edited
    (or gone) since would be other requests under other keys, so the resume is refused naming the file."""
    began = {str(c["trace"]["path"]): str(c["trace"]["digest"]) for c in cells if c.get("trace")}
    for path, digest in sorted(began.items()):
        now = digest_of(Path(path))
        if now != digest:
            raise ConfigError(path, "", f"the trace changed since the run began (digest {digest}, now {now}): a "
                              "resume would replay other requests", hint="restore the file, or start a new run")


def detect(path: Path, text: str | None = None) -> TraceFormat:
    """The format from the file's first line: a `campaign` header, a Mooncake record, or a CSV header."""
    first = (_contents(path)[0] if text is None else text).split("\n", 1)[0].strip()
    if first.startswith("{"):
        try:
            record = json.loads(first)
        except json.JSONDecodeError:
            record = {}
        if isinstance(record, dict) and record.get("kind") == "trace":
            return "campaign"
        if isinstance(record, dict) and "timestamp" in record:
            return "mooncake"
    columns = [c.strip() for c in first.split(",")]
    if all(c in columns for c in _AZURE):
        return "azure"
    if all(c in columns for c in _BURST):
        return "burstgpt"
    raise ConfigError(str(path), "line 1", "not a trace this tool reads (Mooncake JSONL, the Azure LLM inference "
                      "CSV, BurstGPT's CSV or a campaign trace)",
                      hint=f"name its format ({', '.join(FORMATS)}) or convert it; docs/traces.md shows each")


def read(path: Path, fmt: TraceFormat | None = None) -> Trace:
    """Every request of the trace at `path`, in arrival order, times from its first request."""
    text, digest = _contents(path)
    fmt = fmt or detect(path, text)
    readers = {"mooncake": _mooncake, "azure": _azure, "burstgpt": _burstgpt}
    block: int | None = MOONCAKE_BLOCK if fmt == "mooncake" else None
    handle = io.StringIO(text, newline="")
    if fmt == "campaign":
        header, rows = _campaign(path, handle)
        block = header.block_size
        raw = list(rows)
    else:
        raw = list(readers[fmt](path, handle))
    if not raw:
        raise ConfigError(str(path), "", "the trace has no requests", hint="give a trace with at least one")
    for (line, earlier), (_, later) in zip(raw, raw[1:], strict=False):
        if later.at_s < earlier.at_s:
            raise _problem(path, line + 1, f"arrives at {later.at_s:g} s, before the line above ({earlier.at_s:g} s)",
                           "a trace is in arrival order: sort it by its timestamp")
    first = raw[0][1].at_s
    requests = [TraceRequest(r.at_s - first, r.input_tokens, r.output_tokens, r.hash_ids) for _, r in raw]
    if block is None and any(r.hash_ids for r in requests):
        raise ConfigError(str(path), "line 1", "requests carry hash_ids but the header gives no block_size",
                          hint="add block_size (tokens a hash id stands for) to the header")
    return Trace(path, fmt, requests, block, digest)


def _length(path: Path, line: int, name: str, value: object, *, allow_zero: bool = False) -> int:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise _problem(path, line, f"{name} is {value!r}, not a token count", f"a whole number of at least {low}")
    try:
        number = int(value)
    except ValueError:
        raise _problem(path, line, f"{name} is {value!r}, not a token count",
                       f"a whole number of at least {low}") from None
    if number < low:
        raise _problem(path, line, f"{name} is {number}", f"a request has at least {low} token(s) of it"
                       + ("; slice the trace around it" if not allow_zero else ""))
    return number


def _mooncake(path: Path, handle: Iterator[str]) -> Iterator[tuple[int, TraceRequest]]:
    fix = 'one JSON object a line: {"timestamp": ms, "input_length": N, "output_length": N, "hash_ids": [...]}'
    for line, text in enumerate(handle, 1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _problem(path, line, f"not JSON ({exc.msg} at column {exc.colno})", fix) from None
        if not isinstance(record, dict):
            raise _problem(path, line, "not a JSON object", fix)
        missing = [k for k in ("timestamp", "input_length", "output_length") if k not in record]
        if missing:
            raise _problem(path, line, f"no {', '.join(missing)}", fix)
        stamp = record["timestamp"]
        if isinstance(stamp, bool) or not isinstance(stamp, int | float) or not 0 <= stamp < math.inf:
            raise _problem(path, line, f"timestamp is {stamp!r}", "milliseconds from the trace's start, 0 or more")
        ids = record.get("hash_ids", [])
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise _problem(path, line, "hash_ids is not a list of whole numbers", fix)
        yield line, TraceRequest(stamp / 1000.0, _length(path, line, "input_length", record["input_length"]),
                                 _length(path, line, "output_length", record["output_length"]), tuple(ids))


def _csv_rows(path: Path, handle: Iterator[str], needed: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    reader = csv.DictReader(handle)
    columns = [c.strip() for c in reader.fieldnames or []]
    missing = [c for c in needed if c not in columns]
    if missing:
        raise _problem(path, 1, f"no column {', '.join(missing)}", f"the header names {', '.join(needed)}")
    reader.fieldnames = columns
    for row in reader:
        line = reader.line_num
        extra = row.get(None) or []
        count = sum(1 for k, v in row.items() if k is not None and v is not None) + len(extra)
        if count != len(columns):
            raise _problem(path, line, f"has {count} fields, the header {len(columns)}",
                           "one value a column, comma-separated")
        yield line, row


def _azure(path: Path, handle: Iterator[str]) -> Iterator[tuple[int, TraceRequest]]:
    for line, row in _csv_rows(path, handle, _AZURE):
        try:
            when = datetime.fromisoformat(row["TIMESTAMP"].strip())
            # No zone written: read as UTC, so a daylight-saving change on this host moves no gap.
            stamp = (when.replace(tzinfo=UTC) if when.tzinfo is None else when).timestamp()
        except ValueError:
            raise _problem(path, line, f"TIMESTAMP is {row['TIMESTAMP']!r}",
                           "a date and time, as 2023-11-16 18:15:46.6805900") from None
        yield line, TraceRequest(stamp, _length(path, line, "ContextTokens", row["ContextTokens"].strip()),
                                 _length(path, line, "GeneratedTokens", row["GeneratedTokens"].strip()))


def _burstgpt(path: Path, handle: Iterator[str]) -> Iterator[tuple[int, TraceRequest]]:
    for line, row in _csv_rows(path, handle, _BURST):
        try:
            stamp = float(row["Timestamp"])
        except ValueError:
            raise _problem(path, line, f"Timestamp is {row['Timestamp']!r}", "seconds from the trace's start") from None
        if not 0 <= stamp < math.inf:
            raise _problem(path, line, f"Timestamp is {row['Timestamp']!r}", "seconds from the trace's start")
        if row["Response tokens"].strip() == "0":
            raise _problem(path, line, "Response tokens is 0: BurstGPT logs a failed request so",
                           "replay BurstGPT's without-fails file, or slice the trace around it")
        yield line, TraceRequest(stamp, _length(path, line, "Request tokens", row["Request tokens"].strip()),
                                 _length(path, line, "Response tokens", row["Response tokens"].strip()))


def _campaign(path: Path, handle: Iterator[str]) -> tuple[TraceHeader, Iterator[tuple[int, TraceRequest]]]:
    first = next(iter(handle), "")
    try:
        header = TraceHeader.model_validate_json(first)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise _problem(path, 1, f"not a trace header ({'.'.join(map(str, error['loc'])) or 'line'}: {error['msg']})",
                       '{"kind": "trace", "schema_version": 1, "block_size": 512 or null}') from None
    if header.schema_version != TRACE_SCHEMA_VERSION:
        raise _problem(path, 1, f"schema_version {header.schema_version}, this tool reads {TRACE_SCHEMA_VERSION}",
                       "upgrade the tool, or write the trace again in version 1")

    def rows() -> Iterator[tuple[int, TraceRequest]]:
        for line, text in enumerate(handle, 2):
            if not text.strip():
                continue
            try:
                one = TraceLine.model_validate_json(text)
            except ValidationError as exc:
                error = exc.errors()[0]
                raise _problem(path, line, f"{'.'.join(map(str, error['loc'])) or 'the line'}: {error['msg']}",
                               'one request a line: {"at_s": s, "input_tokens": N, "output_tokens": N}') from None
            yield line, TraceRequest(one.at_s, one.input_tokens, one.output_tokens, tuple(one.hash_ids))

    return header, rows()


def dumps(requests: list[TraceRequest], *, block_size: int | None, source: str) -> str:
    """A `campaign` trace's text: its header, then one line a request."""
    header = TraceHeader(kind="trace", schema_version=TRACE_SCHEMA_VERSION, block_size=block_size, source=source)
    lines = [header.model_dump_json()] + [
        TraceLine(at_s=r.at_s, input_tokens=r.input_tokens, output_tokens=r.output_tokens,
                  hash_ids=list(r.hash_ids)).model_dump_json() for r in requests]
    return "\n".join(lines) + "\n"


def write(path: Path, requests: list[TraceRequest], *, block_size: int | None, source: str) -> None:
    """A `campaign` trace written to `path` (`dumps`)."""
    path.write_text(dumps(requests, block_size=block_size, source=source), encoding="utf-8")


def select(requests: list[TraceRequest], *, start_s: float = 0.0, duration_s: float | None = None,
           speed: float = 1.0, sample: float = 1.0, seed: int = 0, length_scale: float = 1.0,
           max_requests: int | None = None) -> list[TraceRequest]:
    """The slice [start_s, start_s + duration_s) of the trace's own time, the first `max_requests` of it, a
    seeded fraction `sample` of those, times re-based to 0 and divided by `speed` (2: twice the rate), and
    lengths times `length_scale` (at least 1 token; a model with a short window replays the trace's shape).
    Hash ids are kept: the blocks they stand for scale with the lengths (block_tokens)."""
    if speed <= 0 or not 0 < sample <= 1 or length_scale <= 0:
        raise ValueError("speed and length_scale are above 0, sample in (0, 1]")
    end = float("inf") if duration_s is None else start_s + duration_s
    kept = [r for r in requests if start_s <= r.at_s < end][:max_requests]
    if sample < 1:
        rng = random.Random(seed)
        kept = [r for r in kept if rng.random() < sample]
    if not kept:
        return []
    first = kept[0].at_s
    return [TraceRequest((r.at_s - first) / speed, max(1, round(r.input_tokens * length_scale)),
                         max(1, round(r.output_tokens * length_scale)), r.hash_ids) for r in kept]


def block_tokens(block_size: int, length_scale: float) -> int:
    """Prompt tokens a hash id stands for once lengths are scaled."""
    return max(1, round(block_size * length_scale))


def implied_hits(requests: list[TraceRequest], block: int, server_block: int = 1) -> list[int]:
    """Prompt tokens each request could be served from a prefix cache that keeps everything, in arrival order:
    its leading hash ids that an earlier request sent (an id stands for its whole prefix, as a block hash
    does), as many of each block's `block` tokens as were sent before (a prompt that ended inside a block sent
    only its start), no more than the prompt less one token (the last is always computed), in whole blocks of
    the server's `server_block` tokens (vLLM caches full blocks only)."""
    sent: dict[int, int] = {}   # hash id -> the most of its block's tokens any request sent
    out = []
    for r in requests:
        shared = 0
        for k, ident in enumerate(r.hash_ids):
            here = min(block, r.input_tokens - k * block)
            if here <= 0:
                break
            before = sent.get(ident, 0)
            shared += min(before, here)
            if before < here:
                break
        out.append(min(shared, r.input_tokens - 1) // server_block * server_block)
        for k, ident in enumerate(r.hash_ids):
            here = min(block, r.input_tokens - k * block)
            if here <= 0:
                break
            sent[ident] = max(sent.get(ident, 0), here)
    return out


class BlockPrompts:
    """Token-id prompts that share what the trace says they share: hash id h is the same `block` tokens in
    every prompt that names it, drawn from this replay's salt (a fresh salt a cell, so no earlier run's cache
    serves it); tokens past a prompt's hash ids are its own. A prompt shorter than its blocks is cut."""

    def __init__(self, block: int, salt: int) -> None:
        self.block = block
        self.salt = salt
        self._blocks: dict[int, list[int]] = {}
        self._own = 0

    def _tokens(self, seed: str, n: int) -> list[int]:
        raw = array.array("H", random.Random(seed).randbytes(2 * n))
        span = TOKEN_HIGH - TOKEN_LOW
        return [TOKEN_LOW + v % span for v in raw]

    def prompt(self, request: TraceRequest) -> list[int]:
        return self.ids(request.hash_ids, request.input_tokens)

    def ids(self, hash_ids: tuple[int, ...], tokens: int) -> list[int]:
        """A prompt of `tokens` ids whose leading blocks are `hash_ids`' (any request's with the same ids)."""
        out: list[int] = []
        for ident in hash_ids:
            if len(out) >= tokens:
                break
            if ident not in self._blocks:
                self._blocks[ident] = self._tokens(f"{self.salt}:b{ident}", self.block)
            out += self._blocks[ident]
        if len(out) < tokens:
            self._own += 1
            out += self._tokens(f"{self.salt}:o{self._own}", tokens - len(out))
        return out[:tokens]


class TraceSlice(BaseModel):
    """What a trace cell replays (format 14): which file (its content's digest, so an edited file is another
    cell), which part of it, how fast and how long its prompts are. Arrivals and lengths come from the file;
    the spec's request_rate is the slice's mean rate and its duration_s the span of its arrivals."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str = Field(description="the trace file, as resolved when the matrix was read")
    digest: str = Field(description="the first 12 hex digits of the file's SHA-256")
    format: TraceFormat = Field(description="mooncake, azure, burstgpt or campaign")
    start_s: float = Field(default=0.0, ge=0, description="where the slice starts, seconds of the trace's time")
    duration_s: float | None = Field(default=None, gt=0,
                                     description="the slice's length in the trace's time (None: to the end)")
    speed: float = Field(default=1.0, gt=0, description="arrivals this many times faster than the trace's")
    sample: float = Field(default=1.0, gt=0, le=1, description="the fraction of the slice's requests kept")
    length_scale: float = Field(default=1.0, gt=0, description="prompt and reply lengths times this")
    max_requests: int | None = Field(default=None, gt=0, description="at most this many requests of the slice")
    block_size: int | None = Field(default=None, gt=0,
                                   description="prompt tokens a hash id stands for in the trace (None: none)")
    requests: int = Field(gt=0, description="requests the slice sends")
    longest: tuple[int, int] | None = Field(
        default=None, description="the (prompt, reply) tokens of its longest prompt: what the window must hold")

    @property
    def key(self) -> str:
        stem = "".join(c if c.isalnum() or c in "_." else "_" for c in Path(self.path).stem)
        out = f"T{stem}.{self.digest[:8]}"
        out += f"-O{self.start_s:.12g}" if self.start_s else ""   # a week-long trace's seconds, exactly
        out += f"-D{self.duration_s:.12g}" if self.duration_s is not None else ""
        out += f"-x{self.speed:g}" if self.speed != 1 else ""   # lower case: -X is an early stop
        out += f"-F{self.sample:g}" if self.sample != 1 else ""
        out += f"-Z{self.length_scale:g}" if self.length_scale != 1 else ""
        out += f"-M{self.max_requests}" if self.max_requests else ""
        out += f"-B{self.block_size}" if self.block_size and self.block_size != MOONCAKE_BLOCK else ""
        return out

    def load(self) -> list[TraceRequest]:
        """The slice's requests, read again from the file (which must be the one the plan read)."""
        trace = read(Path(self.path), self.format)
        if trace.digest != self.digest:
            raise ConfigError(self.path, "", "the trace changed since the plan read it",
                              hint="plan the night again, or restore the file")
        return select(trace.requests, start_s=self.start_s, duration_s=self.duration_s,
                      speed=self.speed, sample=self.sample, seed=int(self.digest, 16),
                      length_scale=self.length_scale, max_requests=self.max_requests)

    @property
    def block_tokens(self) -> int | None:
        """Prompt tokens a hash id stands for as sent (scaled with the lengths)."""
        return None if self.block_size is None else block_tokens(self.block_size, self.length_scale)


class EmptySlice(ValueError):
    """A slice with no rate: fewer than two requests, or all at one instant."""


def plan(path: Path, fmt: TraceFormat | None = None, **slicing: Any) -> tuple[TraceSlice, list[TraceRequest]]:
    """Read and slice a trace for a cell: its stored description and the requests it sends. A slice of fewer
    than two requests, or all at one instant, has no rate (EmptySlice)."""
    trace = read(path, fmt)
    # A block size means something only where requests name blocks: without hash ids every prompt is unique.
    given = slicing.pop("block_size", None)
    block = (given or trace.block_size) if any(r.hash_ids for r in trace.requests) else None
    spec = TraceSlice(path=str(path), digest=trace.digest, format=trace.format, block_size=block, requests=1,
                      **slicing)
    requests = select(trace.requests, start_s=spec.start_s, duration_s=spec.duration_s, speed=spec.speed,
                      sample=spec.sample, seed=int(spec.digest, 16), length_scale=spec.length_scale,
                      max_requests=spec.max_requests)
    if len(requests) < 2 or requests[-1].at_s <= 0:
        raise EmptySlice(f"the slice of {path.name} has {len(requests)} request(s) over "
                         f"{requests[-1].at_s if requests else 0:g} s: a replay needs at least two, at different times")
    return spec.model_copy(update={"requests": len(requests),
                                   "longest": max(((r.input_tokens, r.output_tokens) for r in requests),
                                                  key=sum)}), requests


def mean_rate(requests: list[TraceRequest]) -> float:
    """Requests a second over the slice: n - 1 gaps over the span from its first arrival to its last."""
    return (len(requests) - 1) / requests[-1].at_s
