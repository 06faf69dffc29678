"""A stored cell's requests as a `campaign` trace: what an earlier run sent, for a later one to replay.

Each request record says when it left (its scheduled time, for an open-loop cell: the arrival it was meant to
have; else when it was sent), how long its prompt was (the server's count where it said it) and the reply it
asked for (`max_tokens`, sent with ignore_eos, so the replay asks the same). Times are re-based to the first
request and in the hardware's seconds (a time-scaled simulator's wall seconds times its scale). Request
records do not keep their prompts' tokens, so the exported trace has no prefix structure (no hash ids): every
replayed prompt is unique. A trace cell's prefix structure is its own trace file's; replay that instead.
"""

from __future__ import annotations

from pathlib import Path

from campaign.core.errors import CampaignError
from campaign.measure import traces
from campaign.measure.cells import CellResult
from campaign.stored import store


def requests_of(cell: CellResult) -> list[traces.TraceRequest]:
    """The cell's requests in the order they arrived, as trace requests."""
    records = cell.records
    if not records:
        return []
    arrivals = [r.scheduled_t if r.scheduled_t is not None else r.send_t for r in records]
    first = min(arrivals)
    out = [traces.TraceRequest(at_s=round((at - first) * cell.time_scale, 6),
                               input_tokens=r.counted_prompt_tokens, output_tokens=r.max_tokens)
           for at, r in zip(arrivals, records, strict=True)]
    return sorted(out, key=lambda request: request.at_s)


def pick(run: store.RunDir, *, cell_key: str | None, variant: str | None, repeat: int) -> store.StoredCell:
    """The stored cell to export: `variant` (default the run's baseline), `repeat`, and `cell_key` (optional
    where the variant has one cell). Anything else is a one-line error naming what the run holds."""
    cells = run.cells()
    chosen_variant = variant or run.manifest().matrix_model().baseline
    mine = [c for c in cells if c.variant == chosen_variant]
    if not mine:
        held = sorted({c.variant for c in cells})
        raise CampaignError(f"{run.root}: no cells of variant {chosen_variant!r}",
                            hint=f"--variant one of: {', '.join(held) or 'none (nothing measured yet)'}")
    keys = sorted({c.result.spec.key for c in mine})
    if cell_key is None:
        if len(keys) != 1:
            raise CampaignError(f"{run.root}: variant {chosen_variant!r} has {len(keys)} cells; say which",
                                hint=f"--cell one of: {', '.join(keys)}")
        cell_key = keys[0]
    found = [c for c in mine if c.result.spec.key == cell_key and c.repeat == repeat]
    if not found:
        if cell_key not in keys:
            raise CampaignError(f"{run.root}: variant {chosen_variant!r} has no cell {cell_key!r}",
                                hint=f"--cell one of: {', '.join(keys)}")
        repeats = sorted(c.repeat for c in mine if c.result.spec.key == cell_key)
        raise CampaignError(f"{run.root}: cell {cell_key!r} of {chosen_variant!r} has no repeat {repeat}",
                            hint=f"--repeat one of: {', '.join(map(str, repeats))}")
    return found[0]


def export(run: store.RunDir, out: Path, *, cell_key: str | None = None, variant: str | None = None,
           repeat: int = 0) -> tuple[store.StoredCell, int]:
    """Write the chosen cell's requests to `out` as a `campaign` trace; the cell and how many were written."""
    stored = pick(run, cell_key=cell_key, variant=variant, repeat=repeat)
    requests = requests_of(stored.result)
    if not requests:
        raise CampaignError(f"{stored.path}: the cell holds no request records (status {stored.result.status})",
                            hint="export a cell that ran")
    source = (f"{run.root.name}: variant {stored.variant}, repeat {stored.repeat}, cell {stored.result.spec.key}: "
              f"{len(requests)} requests as sent (no prefix structure: request records keep no prompt tokens)")
    try:   # atomic: a trace half written is never left for a later run to replay
        store.replace_text(out, traces.dumps(requests, block_size=None, source=source))
    except OSError as exc:
        raise CampaignError(f"cannot write {out}: {exc.strerror or exc}",
                            hint="give --out a path in a folder that exists and can be written") from None
    return stored, len(requests)
