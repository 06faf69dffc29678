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
from typing import Any

from campaign.cells import CellResult, Reason
from campaign.errors import ResultFormatError

# Format history:
# 1 - first format (vllm-campaign 0.1.0)
# 2 - cells carry `notes` (e.g. tokens counted per chunk) and latency distributions (ttft/itl/tpot/e2e at
#     p50 (unsuffixed), p90 and p99, in ms; itl per token) with `latency_requests` and `itl_samples`;
#     request records carry `token_count` ("usage" or
#     "chunks") and `error_kind` (connect, timeout, tls, protocol, limit, closed, encoding, not-event-stream,
#     http, stream). Format 1 files read unchanged (the new fields take their defaults).
# 3 - sustained cells carry the server's sampled queue: `avg_running`, `avg_waiting`, `kv_usage_max`; a queued
#     cell's reason code names its cause (`queued_scheduler_cap`, `queued_kv_cache`; `queued` where it could
#     not be told, as format 2 stored every queued cell). Formats 1 and 2 read unchanged.
# 4 - request records carry `server_id` (the reply's id as the server named it); sustained cells carry
#     `window` (its bounds on the records' clock), so window figures can be recomputed from the raw records.
#     Formats 1 to 3 read unchanged (the new fields are None).
SCHEMA_VERSION = 4


def _dumps(data: Any) -> str:
    return json.dumps(data, indent=1, sort_keys=False, default=str) + "\n"


def write_new(path: Path, data: dict[str, Any]) -> Path:
    """Write JSON atomically (temp file, fsync, link into place); refuse to overwrite an existing file."""
    payload = {"schema_version": SCHEMA_VERSION, **data}
    return write_text_new(path, _dumps(payload))


def write_text_new(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
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
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path


def replace_text(path: Path, text: str) -> None:
    """Atomic replace, for the one file we rewrite on purpose: a server log scrubbed of a secret."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ResultFormatError(f"{path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise ResultFormatError(f"{path}: not valid JSON ({exc})") from None
    version = data.get("schema_version") if isinstance(data, dict) else None
    if not isinstance(version, int):
        raise ResultFormatError(f"{path}: no schema_version; not a vllm-campaign result file")
    if version > SCHEMA_VERSION:
        raise ResultFormatError(
            f"{path} is stored in format {version}, newer than this vllm-campaign understands ({SCHEMA_VERSION})",
            hint="upgrade vllm-campaign to read it")
    # Older formats would be upgraded here, one step at a time (upgrade_to_2, ...); there are none yet.
    return dict(data)


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", name)


@dataclass(frozen=True)
class StoredCell:
    variant: str
    repeat: int
    result: CellResult
    path: Path


class RunDir:
    def __init__(self, root: Path) -> None:
        self.root = root

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

    def manifest(self) -> dict[str, Any]:
        return read(self.manifest_path)

    def variant_dir(self, variant: str) -> Path:
        return self.root / "variants" / safe_name(variant)

    def cell_path(self, variant: str, cell_key: str, repeat: int) -> Path:
        return self.variant_dir(variant) / "cells" / safe_name(cell_key) / f"rep-{repeat}.json"

    def repeats(self, planned: int, *, more: int | None = None) -> int:
        """The repeats this run is to have: the matrix's, raised by any earlier `--resume --repeats N` (each kept
        as repeats-N.json), and by `more` now (recorded). Never lowered: nothing measured is dropped."""
        recorded = [int(read(p)["repeats"]) for p in self.root.glob("repeats-*.json")]
        current = max([planned, *recorded])
        if more is not None and more > current:
            write_new(self.root / f"repeats-{more}.json", {"kind": "repeats", "repeats": more, "was": current,
                                                          "written_utc": datetime.now(UTC).isoformat()})
            return more
        return current

    def guard_path(self, variant: str, cell_key: str, repeat: int) -> Path:
        """The launch's first cell measured again at the launch's end (the warm-server check)."""
        return self.variant_dir(variant) / "cells" / safe_name(cell_key) / f"guard-{repeat}.json"

    def write_guard(self, variant: str, repeat: int, again: CellResult, *, launch: str,
                    not_warm: str | None) -> Path:
        return write_new(self.guard_path(variant, again.spec.key, repeat), {
            "kind": "guard", "variant": variant, "repeat": repeat, "launch": launch,
            "written_utc": datetime.now(UTC).isoformat(), "not_warm": not_warm,
            "result": again.model_dump(mode="json"),
        })

    def done(self, variant: str, cell_key: str, repeat: int) -> bool:
        return self.cell_path(variant, cell_key, repeat).exists()

    def experiment_path(self, variant: str, key: str, repeat: int) -> Path:
        return self.variant_dir(variant) / "experiments" / safe_name(key) / f"rep-{repeat}.json"

    def write_experiment(self, variant: str, repeat: int, result: Any, *, launch: str) -> Path:
        return write_new(self.experiment_path(variant, result.key, repeat), {
            "kind": "experiment", "variant": variant, "repeat": repeat, "launch": launch,
            "written_utc": datetime.now(UTC).isoformat(), "result": result.model_dump(mode="json"),
        })

    def experiments(self) -> list[dict[str, Any]]:
        """Stored experiment results: dicts with variant, repeat and result (study.ExperimentResult fields)."""
        return [read(p) for p in sorted(self.root.glob("variants/*/experiments/*/rep-*.json"))]

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
        return write_new(self.cell_path(variant, result.spec.key, repeat), {
            "kind": "cell", "variant": variant, "repeat": repeat, "launch": launch,
            "written_utc": datetime.now(UTC).isoformat(), "result": result.model_dump(mode="json"),
            "gpu_telemetry": telemetry,
        })

    def cells(self) -> list[StoredCell]:
        out = []
        for path in sorted(self.root.glob("variants/*/cells/*/rep-*.json")):
            data = read(path)
            result = CellResult.model_validate(data["result"])
            guard = path.with_name(f"guard-{data['repeat']}.json")
            if guard.exists():
                result = _with_guard(result, read(guard))
            out.append(StoredCell(variant=str(data["variant"]), repeat=int(data["repeat"]), result=result, path=path))
        return out

    def servers(self) -> list[dict[str, Any]]:
        """Every launch's server.json or failure.json, in launch order."""
        out = []
        for launch in self.launches():
            for name in ("server.json", "failure.json"):
                if (launch / name).exists():
                    data = read(launch / name)
                    data["launch_dir"] = str(launch.relative_to(self.root))
                    out.append(data)
        return out


def _with_guard(result: CellResult, guard: dict[str, Any]) -> CellResult:
    """A first cell its guard found cold is Invalid (server not warm): it never reaches a verdict. The stored
    cell stays as measured; the judgement is the guard file's."""
    why = guard.get("not_warm")
    if not why or Reason.SERVER_NOT_WARM in result.reason_codes:
        return result
    return result.model_copy(update={
        "status": "Invalid" if result.status == "Valid" else result.status,
        "reasons": [*result.reasons, f"server not warm: {why}"],
        "reason_codes": [*result.reason_codes, Reason.SERVER_NOT_WARM]})


def latest_run(base: Path, campaign: str) -> RunDir | None:
    runs = sorted(p for p in (base / safe_name(campaign)).glob("*") if (p / "manifest.json").exists())
    return RunDir(runs[-1]) if runs else None
