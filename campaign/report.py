"""Presentation only: cell results and facts -> labelled text tables. No measurement, no I/O."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

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
               "TTFT", "Time between tokens", "TTFT p99", "ITL p99", "TPOT", "E2E p99", "Average active",
               "Completed", "Output tokens", "Measured for", "Discarded steps"]


def fmt_itl(ms: float | None) -> str:
    return DASH if ms is None else f"{ms:.1f} ms"


def tail_columns(c: CellResult) -> list[str]:
    """TTFT p99, ITL p99 (per token), TPOT (median), E2E p99: the figures service levels are set on."""
    return [fmt_ms(c.ttft_p99_ms), fmt_itl(c.itl_p99_ms), fmt_itl(c.tpot_ms), fmt_ms(c.e2e_p99_ms)]


def all_measurements(cells: Sequence[CellResult]) -> str:
    rows = []
    for c in cells:
        rows.append([
            "Prefill" if c.phase == "prefill" else f"Decode ({c.spec.mode})",
            fmt_context(c.context_tokens), str(c.concurrency), c.label, c.status,
            fmt_num(c.prompt_tok_s if c.phase == "prefill" else c.total_tok_s),
            fmt_num(c.per_request_tok_s), fmt_ms(c.ttft_ms),
            fmt_itl(c.itl_ms), *tail_columns(c), fmt_num(c.avg_active), fmt_num(c.completed),
            fmt_num(c.output_tokens), DASH if c.measured_s is None else f"{c.measured_s:.1f} s",
            f"{c.discarded_steps} ({c.discarded_tokens} tok)" if c.discarded_steps else "0",
        ])
    text = ("All measurements (TTFT and time between tokens are medians, per token; prefill rows show prompt "
            "tok/s)\n" + table(ALL_HEADERS, rows))
    speculative = [c for c in cells if c.spec_acceptance_rate is not None]
    if speculative:
        text += "\n\nSpeculative decoding (from vllm:spec_decode_* counters over each step)\n" + table(
            ["Context", "Requests at once", "Total tok/s", "Acceptance rate", "Mean acceptance length"],
            [[fmt_context(c.context_tokens), str(c.concurrency), fmt_num(c.total_tok_s),
              f"{100 * (c.spec_acceptance_rate or 0):.1f}%", fmt_num(c.spec_mean_acceptance_length, 2)]
             for c in speculative])
    notes = [f"  {fmt_context(c.context_tokens)} x {c.concurrency} {c.phase}: {c.status}: {r}"
             for c in cells for r in c.reasons]
    if notes:
        text += "\n\nWhy cells are not Valid:\n" + "\n".join(notes)
    remarks = [f"  {fmt_context(c.context_tokens)} x {c.concurrency} {c.phase}: {n}" for c in cells for n in c.notes]
    if remarks:
        text += "\n\nNotes:\n" + "\n".join(remarks)
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


def _fmt_fact(value: object) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return DASH if value is None else str(value)


def diff_text(diffs: Sequence[Any]) -> str:
    """Flag and facts diffs, per-cell verdicts with 95% intervals, and the closing recommendations."""
    blocks = []
    for d in diffs:
        lines = [f"== {d.variant} vs {d.baseline} =="]
        if not d.comparable:
            lines.append(f"NOT COMPARABLE: {d.not_comparable_reason} (use --force to compare anyway)")
        for key, a, b in d.flag_changes:
            lines.append(f"flag  {key}: {_fmt_fact(a)} -> {_fmt_fact(b)}")
        if d.suggested:
            s = d.suggested
            lines.append(f"      ({s['flag']} {s['resolved']:g} = the {s['suggested']:g} vLLM's log suggested, "
                         f"less a {s['margin']:g} safety margin)")
        for key, a, b, pct in d.fact_changes:
            change = "" if pct is None else f" ({pct:+.1f}%)"
            lines.append(f"fact  {key}: {_fmt_fact(a)} -> {_fmt_fact(b)}{change}")
        rows = []
        for cell in d.cells:
            for m in cell.metrics:
                ci = DASH if m.ci95_pct is None else f"[{m.ci95_pct[0]:+.1f}%, {m.ci95_pct[1]:+.1f}%]"
                rows.append([
                    cell.key, cell.label, m.metric, fmt_num(m.baseline), fmt_num(m.variant),
                    DASH if m.change_pct is None else f"{m.change_pct:+.1f}%", ci, f"{m.n_baseline}/{m.n_variant}",
                    m.verdict + (f" ({m.note})" if m.note else ""),
                ])
            if cell.status_note:
                rows.append([cell.key, cell.label, "status", "", "", "", "", "", cell.status_note])
        if rows:
            lines.append(table(["Cell", "Label", "Metric", "Baseline", "Variant", "Change", "95% CI", "n",
                                "Verdict"], rows))
        lines.append(f"recommendation: {d.recommendation}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) if blocks else "nothing to compare: the run has only the baseline"


EXPORT_FIELDS = ["variant", "phase", "context_tokens", "concurrency", "label", "status", "total_tok_s",
                 "per_request_tok_s", "prompt_tok_s", "ttft_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_ms",
                 "itl_p90_ms", "itl_p99_ms", "tpot_ms", "tpot_p90_ms", "tpot_p99_ms", "e2e_ms", "e2e_p90_ms",
                 "e2e_p99_ms", "latency_requests", "itl_samples", "avg_active", "completed",
                 "output_tokens", "measured_s", "discarded_steps", "discarded_tokens", "repeat", "reasons", "notes"]


def export_rows(cells: Sequence[Any]) -> list[dict[str, Any]]:
    rows = []
    for stored in cells:
        data = stored.result.model_dump(mode="json")
        row = {k: data.get(k) for k in EXPORT_FIELDS}
        row["variant"] = stored.variant
        row["repeat"] = stored.repeat
        row["reasons"] = "; ".join(data.get("reasons") or [])
        row["notes"] = "; ".join(data.get("notes") or [])
        rows.append(row)
    return rows


def rows_json(rows: list[dict[str, Any]]) -> str:
    import json

    return json.dumps({"rows": rows}, indent=1) + "\n"


def rows_csv(rows: list[dict[str, Any]]) -> str:
    import csv
    import io

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=EXPORT_FIELDS)
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return buffer.getvalue()


def cells_by_variant_text(run: Any) -> str:
    """Per variant, the speed-test matrix and all measurements (the latest repeat of each cell)."""
    by_variant: dict[str, dict[str, Any]] = {}
    for stored in run.cells():
        by_variant.setdefault(stored.variant, {})[stored.result.spec.key] = stored.result
    parts = []
    for variant, cells in by_variant.items():
        parts.append(f"### {variant}\n{cells_report(list(cells.values()))}")
    failures = [s for s in run.servers() if s.get("kind") == "failure"]
    for failure in failures:
        parts.append(f"### {failure['variant']}: FAILED TO START ({failure['failure_kind']}): {failure['message']}")
    return "\n\n".join(parts)


def short_answers_rows(a: dict[str, Any]) -> list[list[str]]:
    """Seed 000's first table, generated: every number says whether it is one stream or the whole card."""
    def num(value: Any, unit: str = "") -> str:
        return DASH if value is None else f"{fmt_num(value)}{unit}"

    floor = a.get("useful_floor_tok_s")
    return [
        ["One request, nothing else running (single-stream)",
         f"{num(a.get('single_stream_tok_s'), ' tok/s')}, first token in {fmt_ms(a.get('single_stream_ttft_ms'))}"],
        ["The whole server, batched (aggregate peak)",
         f"{num(a.get('aggregate_peak_tok_s'), ' tok/s')}"
         + (f" at {a['aggregate_peak_concurrency']} concurrent" if a.get("aggregate_peak_concurrency") else "")],
        ["Prompt processing", num(a.get("prompt_tok_s"), " tok/s")],
        ["Context window", f"{num(a.get('context_window'))} tokens, prompt and completion share it"],
        ["Concurrent requests accepted (max-num-seqs)", num(a.get("max_num_seqs"))],
        [f"Concurrent requests that are useful (at {floor:g} tok/s each)" if floor else "Useful concurrency",
         num(a.get("useful_concurrency"))],
    ]


def short_answers_notes(a: dict[str, Any]) -> list[str]:
    """The lines under the table: floors, the knee, the naive-capacity warning, the roofline, agents that fit."""
    lines: list[str] = []
    scale = a.get("time_scale") or 1.0
    if scale != 1.0:
        lines.append(f"warning: simulated at a {scale:g}x time scale: these answers are converted back to the "
                     f"simulated hardware's time; rates in the cell tables read {scale:g}x higher")
    capacity = a.get("capacity_at_floor") or {}
    if capacity:
        lines.append("Agents at a speed floor: " + ", ".join(
            f"{f} tok/s -> {DASH if c is None else c}" for f, c in capacity.items()))
    knee = a.get("knee")
    if knee:
        lines.append(f"Knee: {knee['concurrency']} -> {knee['next_concurrency']} concurrent buys "
                     f"{knee['aggregate_gain_pct']:+.0f}% aggregate and costs {knee['per_request_loss_pct']:.0f}% of "
                     "each request's speed: past it the server only queues")
    if a.get("naive_capacity_warning"):
        lines.append(f"warning: {a['naive_capacity_warning']}")
    roof = a.get("roofline") or {}
    if roof.get("known"):
        parts = [f"Roofline ({roof['gpus']} x {roof['hardware']}, {roof['model']}): single-stream decode bound "
                 f"{fmt_num(roof['decode_bound_tok_s'])} tok/s (weights/TP read per token, the group's bandwidth "
                 f"pooled), prefill bound {fmt_num(roof['prefill_bound_tok_s'])} tok/s (dense BF16 peak)"]
        if roof.get("decode_ratio") is not None:
            parts.append(f"decode runs at {100 * roof['decode_ratio']:.0f}% of its bandwidth bound")
        if roof.get("prefill_ratio") is not None:
            parts.append(f"prompt processing runs at {100 * roof['prefill_ratio']:.0f}% of the cards' compute")
        lines.append("; ".join(parts))
    elif roof.get("note"):
        lines.append(str(roof["note"]))
    fit = a.get("agents_that_fit") or {}
    beyond = set(a.get("agents_beyond_window") or [])
    if any(v is not None for v in fit.values()):
        lines.append("Agents that fit in the KV cache: " + ", ".join(
            f"{int(c):,} tokens -> {'beyond the window' if int(c) in beyond else DASH if n is None else n}"
            for c, n in fit.items()))
    return lines


def short_answers_text(variant: str, a: dict[str, Any]) -> str:
    return "\n".join([f"Short answers: {variant}", table(["Question", "Answer"], short_answers_rows(a)),
                      *short_answers_notes(a)])


def experiments_text(stored: Sequence[dict[str, Any]]) -> str:
    lines = []
    for item in stored:
        result = item["result"]
        text = result.get("verdict") or "; ".join(result.get("reasons") or [])
        lines.append(f"  {item['variant']} r{item['repeat'] + 1} {result['key']}: {result['status']}: {text}")
    return "Experiments\n" + "\n".join(lines) if lines else ""
