"""The runs/ tree: versioned JSON, written atomically, never overwritten; the resume index.

Layout of one run, `runs/<campaign>/<UTC timestamp>/`:
    manifest.json                                   what was run, on what, by which tool version
    variants/<variant>/launch-<k>/server.log        the full server log (secrets redacted)
    variants/<variant>/launch-<k>/server.json       argv (redacted), flags as run, parsed facts, ready time
    variants/<variant>/launch-<k>/stop.json         how it stopped: mode, exit code, swept processes
    variants/<variant>/launch-<k>/failure.json      instead of the above when it never became ready
    variants/<variant>/launch-<k>/warmup.json       the warm-up before the first cell: requests, seconds
    variants/<variant>/cells/<cell-key>/rep-<n>.json   one measured cell: result, raw requests, telemetry
    variants/<variant>/cells/<cell-key>/guard-<n>.json the launch's first cell measured again at its end, and
                                                    whether the first was measured cold (then it is Invalid)
    variants/<variant>/experiments/<key>/rep-<n>.json one experiment's result
    repeats-<n>.json                                `campaign run --resume RUN --repeats n` raised the repeats
    summary.json                                    written at the end: short answers, drift, diff
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import from_json, to_json

from campaign.core import secret
from campaign.core.errors import CampaignError, ResultFormatError
from campaign.measure.cells import CellResult
from campaign.stored import records
from campaign.stored.records import (
    SCHEMA_VERSION,
    CalibrationRecord,
    CellRecord,
    ExperimentRecord,
    FailureRecord,
    GuardRecord,
    Manifest,
    PlacementRecord,
    RepeatsRecord,
    ServerRecord,
    SettledRecord,
    StopRecord,
    SummaryRecord,
    TuneRecord,
)

R = TypeVar("R", bound=BaseModel)

# The format's versions and history are records.py's (SCHEMA_VERSION, MIGRATIONS, docs/results-format.md).


_NON_ASCII = re.compile(r"[^\x00-\x7f]")


def _dumps(data: Any) -> str:
    """A record's JSON as the format has always written it (one space of indent, keys in order, NaN and
    Infinity as Python writes them, non-ASCII characters escaped): by pydantic-core's serializer, which
    writes indented JSON 7x faster than the standard library's (whose C encoder serves no indent; a
    cell with its request records took a tenth of a night in simulated time). Floats read back the same;
    only an exponent's zero padding differs (2.8e-6 where json wrote 2.8e-06)."""
    text = to_json(data, indent=1, inf_nan_mode="constants", fallback=str).decode()
    if not text.isascii():   # as json.dumps' ensure_ascii: only strings hold them, and JSON escapes them so
        text = _NON_ASCII.sub(lambda m: json.dumps(m.group())[1:-1], text)
    return text + "\n"


def write_new(path: Path, data: dict[str, Any] | BaseModel) -> Path:
    """Write JSON atomically (temp file, fsync, link into place); refuse to overwrite an existing file. A record
    is written as its model dumps it (what is set when read, such as `launch_dir`, is not stored)."""
    if isinstance(data, BaseModel):
        payload = data.model_dump(mode="json", exclude={"launch_dir"} & set(type(data).model_fields))
    else:
        payload = {"schema_version": SCHEMA_VERSION, **data}
    return write_text_new(path, _dumps(payload))


def _redacted(path: Path, text: str) -> str:
    """The text with every known secret redacted. Almost always nothing is there; when something is, a JSON
    file has each of its strings redacted where it stands, so it stays JSON whatever the secret looks like."""
    clean = secret.redact(text)
    if clean != text and path.suffix == ".json":
        with contextlib.suppress(json.JSONDecodeError):
            return _dumps(secret.redact_value(json.loads(text)))
    return clean


def write_text_new(path: Path, text: str) -> Path:
    """A new file, atomically, every known secret redacted: the one way a run's files are written."""
    return _write_new(path, _redacted(path, text))


def _write_new(path: Path, text: str) -> Path:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise _write_failed(path, exc) from None
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(tmp, path)  # atomic, and fails if the file exists: nothing measured is overwritten
        except FileExistsError:
            raise ResultFormatError(f"{path} already exists; results are never overwritten",
                                    hint="resume the run, or start a new one") from None
    except OSError as exc:
        raise _write_failed(path, exc) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path


def _write_failed(path: Path, exc: OSError) -> ResultFormatError:
    """Disk full, quota, read-only: nothing half-written is left (the temporary file goes), and every file
    written before stays, so the run can be resumed once there is room."""
    return ResultFormatError(f"cannot write {path}: {exc.strerror or exc}",
                             hint="free space (or fix the permissions) there, then `campaign run --resume` the run")


def replace_text(path: Path, text: str) -> None:
    """Atomic replace (every known secret redacted), for files rewritten on purpose: the summary, a report."""
    text = _redacted(path, text)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class DamagedFileError(ResultFormatError):
    """A stored file that is not JSON any more (truncated by a crash or a full disk, edited by hand)."""


def read(path: Path, time_scale: float = 1.0) -> dict[str, Any]:
    """A stored file as the current format's mapping; `time_scale`: its run's, for older files whose figures
    were the wall clock's (records.MIGRATIONS)."""
    try:
        # pydantic-core's parser: a cell of 256 streamed requests (490 KB) in 1.1 ms against json's 4.3, the same
        # values (NaN and Infinity included, as _dumps writes them); a report reads every cell of its run.
        data = from_json(path.read_bytes())
    except FileNotFoundError:
        raise ResultFormatError(f"{path}: no such file") from None
    except ValueError as exc:   # not JSON, or not UTF-8
        raise DamagedFileError(f"{path}: damaged, not valid JSON ({exc})",
                               hint="`campaign run --resume` on its run sets it aside and measures it again") from None
    version = data.get("schema_version") if isinstance(data, dict) else None
    if not isinstance(version, int):
        raise ResultFormatError(f"{path}: no schema_version; not a vllm-campaign result file")
    if version > SCHEMA_VERSION:
        raise ResultFormatError(
            f"{path} is stored in format {version}, newer than this vllm-campaign understands ({SCHEMA_VERSION})",
            hint="upgrade vllm-campaign to read it")
    return records.migrate(dict(data), time_scale)  # older formats, one explicit step at a time


def read_record(path: Path, model: type[R], time_scale: float = 1.0) -> R:
    """A stored file as its typed record: read, migrated (by its run's `time_scale`), validated."""
    data = read(path, time_scale)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ResultFormatError(f"{path}: {where}: {first['msg']}; not a {model.__name__} this version can read",
                                hint="was it written by another tool, or edited by hand?") from None


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", name)


@dataclass(frozen=True)
class StoredCell:
    variant: str
    repeat: int
    result: CellResult
    path: Path                 # the file its figures come from: the cell's rep file, or its guard's (stand-in)
    launch: str | None = None  # the launch folder it was measured on (e.g. launch-3)


class RunLockedError(CampaignError):
    """Another process is writing this run directory."""


class RunDir:
    def __init__(self, root: Path) -> None:
        self.root = root
        # Damaged files the readers below skipped (each a DamagedFileError's message); the CLI says so.
        self.damaged: list[str] = []
        self._time_scale: float | None = None

    @property
    def time_scale(self) -> float:
        """The run's time scale (its manifest's): older files of a time-scaled run are converted by it on read."""
        if self._time_scale is None:
            if not self.manifest_path.exists():
                return 1.0   # not yet written (a run being created): nothing older to convert, nothing cached
            self._time_scale = self.manifest().time_scale
        return self._time_scale

    def read_each(self, paths: Iterator[Path] | list[Path], model: type[R]) -> Iterator[tuple[Path, R]]:
        """Each file as its record; a damaged one is skipped and remembered (self.damaged), never fatal."""
        for path in paths:
            try:
                yield path, read_record(path, model, self.time_scale)
            except DamagedFileError as exc:
                if exc.message not in self.damaged:
                    self.damaged.append(exc.message)

    @contextlib.contextmanager
    def writer(self) -> Iterator[bool]:
        """One writer per run directory: a second `campaign run --resume` of it is refused while the first
        runs. The lock is the kernel's (flock), so a writer killed with SIGKILL leaves no stale lock. Yields
        False where the filesystem has no locks (some network and FUSE mounts): the run goes on unguarded."""
        import errno
        import fcntl

        try:
            handle = (self.root / ".lock").open("a+")
        except OSError as exc:
            raise _write_failed(self.root / ".lock", exc) from None
        try:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "?"
                raise RunLockedError(f"{self.root} is being written by another campaign process (pid {holder})",
                                     hint="let it finish or stop it; a run directory has one writer at a time"
                                     ) from None
            except OSError as exc:
                if exc.errno not in {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}:
                    raise
                yield False
                return
            handle.seek(0)
            handle.truncate()
            handle.write(f"{os.getpid()}\n")
            handle.flush()
            yield True
        finally:
            handle.close()

    def set_aside_damaged(self) -> list[tuple[Path, Path]]:
        """Before a resume: every stored file that is no longer JSON is renamed `<name>.damaged` (kept, never
        deleted) so that what it held is measured again. A damaged manifest cannot be set aside: it says
        what the run is."""
        self.manifest()  # raises DamagedFileError with its hint when the manifest itself is damaged
        moved: list[tuple[Path, Path]] = []
        for path in sorted([*self.root.glob("variants/**/*.json"), *self.root.glob("*.json")]):
            if path == self.manifest_path or path.name.startswith("repeats-"):
                continue  # a repeats file's count is its name: damaged or not, it stays where repeats() reads
            try:
                read(path)
            except DamagedFileError:
                target = path.with_name(path.name + ".damaged")
                index = 1
                while target.exists():
                    index += 1
                    target = path.with_name(f"{path.name}.damaged-{index}")
                os.rename(path, target)
                moved.append((path, target))
        return moved

    @classmethod
    def create(cls, base: Path, campaign: str) -> RunDir:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        root = base / safe_name(campaign) / stamp
        suffix = 1
        while root.exists():
            suffix += 1
            root = base / safe_name(campaign) / f"{stamp}-{suffix}"
        root.mkdir(parents=True)
        return cls(root)

    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    def manifest(self) -> Manifest:
        return read_record(self.manifest_path, Manifest)

    def variant_dir(self, variant: str) -> Path:
        return self.root / "variants" / safe_name(variant)

    def cell_path(self, variant: str, cell_key: str, repeat: int) -> Path:
        return self.variant_dir(variant) / "cells" / safe_name(cell_key) / f"rep-{repeat}.json"

    def repeats(self, planned: int, *, more: int | None = None) -> int:
        """The repeats this run is to have: the matrix's, raised by any earlier `--resume --repeats N` (each kept
        as repeats-N.json), and by `more` now (recorded). Never lowered: nothing measured is dropped."""
        # The count is the file's name: a damaged repeats file still says how many repeats the run has.
        recorded = [int(m.group(1)) for p in self.root.glob("repeats-*.json")
                    if (m := re.fullmatch(r"repeats-(\d+)\.json", p.name))]
        current = max([planned, *recorded])
        if more is not None and more > current:
            write_new(self.root / f"repeats-{more}.json", RepeatsRecord(
                repeats=more, was=current, written_utc=datetime.now(UTC).isoformat()))
            return more
        return current

    def guard_path(self, variant: str, cell_key: str, repeat: int) -> Path:
        """The launch's first cell measured again at the launch's end (the warm-server check)."""
        return self.variant_dir(variant) / "cells" / safe_name(cell_key) / f"guard-{repeat}.json"

    def write_guard(self, variant: str, repeat: int, again: CellResult, *, launch: str,
                    not_warm: str | None, telemetry: list[Any] | None = None) -> Path:
        return write_new(self.guard_path(variant, again.spec.key, repeat), GuardRecord(
            variant=variant, repeat=repeat, launch=launch, written_utc=datetime.now(UTC).isoformat(),
            not_warm=not_warm, result=again, gpu_telemetry=telemetry))

    def done(self, variant: str, cell_key: str, repeat: int) -> bool:
        return self.cell_path(variant, cell_key, repeat).exists()

    def experiment_path(self, variant: str, key: str, repeat: int) -> Path:
        return self.variant_dir(variant) / "experiments" / safe_name(key) / f"rep-{repeat}.json"

    def write_experiment(self, variant: str, repeat: int, key: str, result: Any, *, launch: str) -> Path:
        """Stored under the matrix's key for the experiment (the one resume looks up), whatever the study
        function called its result."""
        return write_new(self.experiment_path(variant, key, repeat), ExperimentRecord(
            variant=variant, repeat=repeat, launch=launch, written_utc=datetime.now(UTC).isoformat(),
            result=result.model_copy(update={"key": key})))

    def experiments(self) -> list[ExperimentRecord]:
        """Every stored experiment result, in path order."""
        paths = sorted(self.root.glob("variants/*/experiments/*/rep-*.json"))
        return [record for _, record in self.read_each(paths, ExperimentRecord)]

    def new_launch_dir(self, variant: str) -> Path:
        base = self.variant_dir(variant)
        base.mkdir(parents=True, exist_ok=True)
        index = 1
        while True:
            path = base / f"launch-{index}"
            try:
                path.mkdir()
                return path
            except FileExistsError:
                index += 1

    def launches(self, variant: str | None = None) -> Iterator[Path]:
        pattern = f"variants/{safe_name(variant)}/launch-*" if variant else "variants/*/launch-*"
        yield from sorted(self.root.glob(pattern), key=lambda p: (p.parent.name, int(p.name.split("-")[1])))

    def write_cell(self, variant: str, repeat: int, result: CellResult, *, launch: str,
                   telemetry: list[Any] | None) -> Path:
        return write_new(self.cell_path(variant, result.spec.key, repeat), CellRecord(
            variant=variant, repeat=repeat, launch=launch, written_utc=datetime.now(UTC).isoformat(), result=result,
            gpu_telemetry=telemetry))

    def cells(self) -> list[StoredCell]:
        out = []
        for path, record in self.read_each(sorted(self.root.glob("variants/*/cells/*/rep-*.json")), CellRecord):
            result, source, launch = record.result, path, record.launch
            guard = path.with_name(f"guard-{record.repeat}.json")
            for _, guarded in self.read_each([guard] if guard.exists() else [], GuardRecord):
                result = _with_guard(result, guarded)
                if result is not record.result:
                    source, launch = guard, guarded.launch
            out.append(StoredCell(variant=record.variant, repeat=record.repeat, result=result, path=source,
                                  launch=launch))
        return out

    def cell_record(self, cell: StoredCell) -> CellRecord | None:
        """The whole stored record of a cell (its GPU telemetry too); None where it is damaged."""
        return next((record for _, record in self.read_each([cell.path], CellRecord)), None)

    def servers(self) -> list[ServerRecord | FailureRecord]:
        """Every launch's server.json and failure.json, in launch order, each with its `launch_dir`."""
        out: list[ServerRecord | FailureRecord] = []
        for launch in self.launches():
            where = {"launch_dir": str(launch.relative_to(self.root))}
            ready = [launch / "server.json"] if (launch / "server.json").exists() else []
            failed = [launch / "failure.json"] if (launch / "failure.json").exists() else []
            out += [record.model_copy(update=where) for _, record in self.read_each(ready, ServerRecord)]
            out += [record.model_copy(update=where) for _, record in self.read_each(failed, FailureRecord)]
        return out

    def write_summary(self, summary: SummaryRecord) -> None:
        """summary.json, rewritten (atomically) whenever the run ends: it is derived from the stored records,
        never a measurement, and a resume that measured more concludes again."""
        path = self.root / "summary.json"
        if path.exists():
            replace_text(path, _dumps(summary.model_dump(mode="json")))
        else:
            write_new(path, summary)

    def ready_servers(self) -> list[ServerRecord]:
        return [s for s in self.servers() if isinstance(s, ServerRecord)]

    def placements(self) -> list[tuple[str, PlacementRecord]]:
        """Every launch's placement.json (format 7 on), in launch order, with the launch's folder."""
        return [(str(path.parent.relative_to(self.root)), record) for path, record in self.read_each(
            [launch / "placement.json" for launch in self.launches() if (launch / "placement.json").exists()],
            PlacementRecord)]

    def write_settled(self, variant: str, rounds: int, outcome: str, recommendation: str) -> Path:
        """A night run until settled retires `variant` after `rounds` rounds (it is not launched again)."""
        return write_new(self.variant_dir(variant) / "settled.json", SettledRecord(
            variant=variant, rounds=rounds, outcome=outcome, recommendation=recommendation,
            written_utc=datetime.now(UTC).isoformat()))

    def write_tune(self, record: TuneRecord) -> Path:
        """tune.json: the tune's predictions beside what this night measured (a tune's confirmation night)."""
        return write_new(self.root / "tune.json", record)

    def tune(self) -> TuneRecord | None:
        """The tune's predictions for this night, where `campaign tune` ran it; None otherwise (or damaged)."""
        path = self.root / "tune.json"
        return next((record for _, record in self.read_each([path] if path.exists() else [], TuneRecord)), None)

    def write_calibration(self, record: CalibrationRecord) -> Path:
        """calibrations/<name>-<time>.json: a fit of the simulator to this run (campaign calibrate)."""
        stamp = record.written_utc.replace(":", "").replace("-", "").split(".")[0]
        return write_new(self.root / "calibrations" / f"{record.entry.name}-{stamp}.json", record)

    def calibrations(self) -> list[CalibrationRecord]:
        """The latest fit of each entry name made from this run, by name."""
        latest: dict[str, CalibrationRecord] = {}
        for _, record in self.read_each(sorted(self.root.glob("calibrations/*.json")), CalibrationRecord):
            if record.entry.name not in latest or record.written_utc > latest[record.entry.name].written_utc:
                latest[record.entry.name] = record
        return [latest[name] for name in sorted(latest)]

    def settled(self) -> dict[str, SettledRecord]:
        """The variants a night run until settled has retired, by name."""
        paths = sorted(self.root.glob("variants/*/settled.json"))
        return {record.variant: record for _, record in self.read_each(paths, SettledRecord)}

    def failures(self) -> list[FailureRecord]:
        return [s for s in self.servers() if isinstance(s, FailureRecord)]

    def stop(self, launch_dir: str) -> StopRecord | None:
        """How the launch in `launch_dir` (relative to the run) stopped; None: not stored, or damaged."""
        path = self.root / launch_dir / "stop.json"
        return next((record for _, record in self.read_each([path] if path.exists() else [], StopRecord)), None)


def _with_guard(result: CellResult, guard: GuardRecord) -> CellResult:
    """A first cell its guard found cold gives way to the guard's re-measurement: the same cell on the same
    launch, taken warm at its end, stands in for the repeat, so a cold start (or a one-off stall of the host
    during a single-request prefill) neither reaches a verdict nor leaves a hole the night cannot fill. The
    first reading stays on disk as measured, and the stand-in says why in its notes."""
    why = guard.not_warm
    if not why or guard.result.status != "Valid":
        return result
    return guard.result.model_copy(update={"notes": [
        *guard.result.notes,
        f"measured again at the end of {guard.launch}: the first reading was cold ({why}); this warm re-measurement "
        "stands in for it, and the first stays in the cell's rep file (keep the warm-up on)"]})


def latest_run(base: Path, campaign: str) -> RunDir | None:
    runs = sorted(p for p in (base / safe_name(campaign)).glob("*") if (p / "manifest.json").exists())
    return RunDir(runs[-1]) if runs else None
