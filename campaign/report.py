"""Presentation only: cell results and facts -> labelled text tables. No measurement, no I/O."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from campaign.cells import CellResult

DASH = "—"


def fmt_num(value: float | int | None, digits: int = 1) -> str:
    if value is None:
        return DASH
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def fmt_ms(value: float | None) -> str:
    return DASH if value is None else f"{value:,.0f} ms"


def fmt_context(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens >= 1024 and tokens % 1024 == 0 else f"{tokens:,}"


def table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    rows = [list(r) for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def _cell_text(cell: CellResult) -> str:
    if cell.status == "Over capacity":
        return "Over capacity"
    if cell.status != "Valid":
        return f"{cell.status}"
    return f"{fmt_num(cell.total_tok_s)} tok/s · {fmt_ms(cell.ttft_ms)} TTFT"


def decode_matrix(cells: Sequence[CellResult]) -> str | None:
    """Seed 004's speed-test matrix: rows context, columns concurrency, total tok/s and TTFT per cell."""
    decode = [c for c in cells if c.phase == "decode"]
    if not decode:
        return None
    contexts = sorted({c.context_tokens for c in decode})
    concurrencies = sorted({c.concurrency for c in decode})
    by_key = {(c.context_tokens, c.concurrency): c for c in decode}
    headers = ["Context", *(f"{c} (single-stream)" if c == 1 else f"{c} (aggregate)" for c in concurrencies)]
    rows = []
    for ctx in contexts:
        row = [fmt_context(ctx)]
        for conc in concurrencies:
            cell = by_key.get((ctx, conc))
            row.append(DASH if cell is None else _cell_text(cell))
        rows.append(row)
    title = "Decode: total tok/s across all simultaneous requests · rows context, columns requests at once"
    return f"{title}\n{table(headers, rows)}"


def prefill_row(cells: Sequence[CellResult]) -> str | None:
    prefill = sorted((c for c in cells if c.phase == "prefill"), key=lambda c: c.context_tokens)
    if not prefill:
        return None
    rows = [[fmt_context(c.context_tokens),
             f"{fmt_num(c.prompt_tok_s)} prompt tok/s" if c.status == "Valid" else c.status,
             fmt_ms(c.ttft_ms)] for c in prefill]
    return "Prefill (single-stream, one request, max_tokens 1)\n" + table(["Context", "Prompt tok/s", "TTFT"], rows)


ALL_HEADERS = ["Phase", "Context", "Requests at once", "Label", "Status", "Total tok/s", "Per request tok/s",
               "TTFT", "Time between tokens", "Average active", "Completed", "Output tokens", "Measured for",
               "Discarded steps"]


def all_measurements(cells: Sequence[CellResult]) -> str:
    rows = []
    for c in cells:
        rows.append([
            "Prefill" if c.phase == "prefill" else f"Decode ({c.spec.mode})",
            fmt_context(c.context_tokens), str(c.concurrency), c.label, c.status,
            fmt_num(c.prompt_tok_s if c.phase == "prefill" else c.total_tok_s),
            fmt_num(c.per_request_tok_s), fmt_ms(c.ttft_ms),
            DASH if c.itl_ms is None else f"{c.itl_ms:.1f} ms", fmt_num(c.avg_active), fmt_num(c.completed),
            fmt_num(c.output_tokens), DASH if c.measured_s is None else f"{c.measured_s:.1f} s",
            f"{c.discarded_steps} ({c.discarded_tokens} tok)" if c.discarded_steps else "0",
        ])
    text = "All measurements (latencies are medians; prefill rows show prompt tok/s)\n" + table(ALL_HEADERS, rows)
    notes = [f"  {fmt_context(c.context_tokens)} x {c.concurrency} {c.phase}: {c.status}: {r}"
             for c in cells for r in c.reasons]
    if notes:
        text += "\n\nWhy cells are not Valid:\n" + "\n".join(notes)
    return text


def cells_report(cells: Sequence[CellResult]) -> str:
    parts = [p for p in (decode_matrix(cells), prefill_row(cells)) if p]
    parts.append(all_measurements(cells))
    return "\n\n".join(parts)


def cell_json(cell: CellResult, *, with_requests: bool = True) -> dict[str, object]:
    data = cell.model_dump(mode="json")
    data.pop("spec")
    if not with_requests:
        data.pop("requests")
    return data
