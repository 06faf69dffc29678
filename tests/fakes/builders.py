"""Stored records for constructed runs (no server), written through the same typed models the runner writes,
so that a test's run directory is one this version can read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from campaign.core.errors import LaunchFailureKind
from campaign.server.startup_log import StartupFacts
from campaign.stored import store
from campaign.stored.records import Definition, FailureRecord, MachineInfo, Manifest, ServerRecord, ToolInfo


def manifest(run: store.RunDir, *, baseline: str, variants: list[str] | None = None, model: str = "m",
             gpu: dict[str, Any] | None = None, compare_to: dict[str, str] | None = None,
             engine: str = "vllm", time_scale: float = 1.0, cells: list[dict[str, Any]] | None = None) -> None:
    names = list(dict.fromkeys([baseline, *(variants or [])]))
    raw_matrix = {"name": "t", "profile": "cpu-tiny", "baseline": baseline,
                  "variants": [{"name": n, **({"compare_to": compare_to[n]} if compare_to and n in compare_to
                                              else {})} for n in names],
                  "workloads": [{"kind": "decode", "contexts": [1024], "concurrency": [8]}]}
    store.write_new(run.manifest_path, Manifest(
        campaign="t", created_utc="2026-12-01T00:00:00+00:00",
        tool=ToolInfo(name="vllm-campaign", version="test", git_commit=None, git_dirty=None),
        matrix=Definition(path="t.yaml", raw=raw_matrix, hash="0"),
        profile=Definition(path="p.yaml", raw={"model": model}, hash="0"), engine=engine, time_scale=time_scale,
        machine=MachineInfo(hostname="h", os="Linux", python="3.11", cpu=None, cpu_count=2, memory_gib=24.0,
                            gpu=gpu),
        schedule=[], cells=cells or []))


def server(launch: Path, *, variant: str, repeat: int = 0, flags: dict[str, Any] | None = None,
           facts: dict[str, Any] | None = None, ready_s: float = 60.0) -> None:
    store.write_new(launch / "server.json", ServerRecord(
        variant=variant, repeat=repeat, started_utc="2026-12-01T00:00:00+00:00", command=["vllm", "serve", "m"],
        flags=flags or {}, variant_flags=flags or {}, ready_s=ready_s, facts=StartupFacts(**(facts or {})),
        warnings=[], suggested=None))


def failure(launch: Path, *, variant: str, repeat: int = 0, kind: LaunchFailureKind, message: str,
            log_tail: str = "", hint: str | None = None) -> None:
    store.write_new(launch / "failure.json", FailureRecord(
        variant=variant, repeat=repeat, failure_kind=kind, message=message, hint=hint, log_tail=log_tail))
