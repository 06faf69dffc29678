"""One self-contained HTML report per run (inline CSS, charts embedded as PNG data), plus Markdown and PNGs.

Built from stored files only, so any run can be reported again later, on any machine, without a server.
No script, no font, no image is fetched from anywhere: the file opens offline in any browser.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from campaign import compare, report
from campaign.cells import CellResult
from campaign.store import RunDir

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1200px;color:#222;
padding:0 1rem;line-height:1.45}
h1{margin-bottom:.2rem}h2{border-bottom:2px solid #ddd;padding-bottom:.2rem;margin-top:2.2rem}
table{border-collapse:collapse;margin:.6rem 0;font-size:.88rem}
th,td{border:1px solid #ccc;padding:.25rem .5rem;text-align:right;vertical-align:top}
th{background:#f3f3f3}td.l,th.l{text-align:left}
.meta td{text-align:left}.cmd{font-family:ui-monospace,monospace;font-size:.8rem;word-break:break-all}
.cell{min-width:7.5rem}.over{background:#e6e6e6;color:#555}.bad{background:#f8d7da}
.better{background:#d4edda}.worse{background:#f8d7da}.noise{background:#f1f1f1}
.note{color:#555;font-size:.85rem}.warn{color:#8a4b00}
img{max-width:100%;border:1px solid #eee;margin:.5rem 0}
"""


@dataclass
class ReportData:
    run: RunDir
    manifest: dict[str, Any]
    servers: list[dict[str, Any]]
    latest: dict[str, dict[str, CellResult]]          # variant -> cell key -> the latest repeat's result
    all_cells: dict[str, list[CellResult]]
    experiments: list[dict[str, Any]]
    short: dict[str, dict[str, Any]]
    diffs: list[compare.VariantDiff]
    drift: compare.Drift
    charts: dict[str, Path] = field(default_factory=dict)


def gather(run: RunDir) -> ReportData:
    latest: dict[str, dict[str, CellResult]] = {}
    all_cells: dict[str, list[CellResult]] = {}
    for stored in sorted(run.cells(), key=lambda s: s.repeat):
        latest.setdefault(stored.variant, {})[stored.result.spec.key] = stored.result
        all_cells.setdefault(stored.variant, []).append(stored.result)
    return ReportData(run=run, manifest=run.manifest(), servers=run.servers(), latest=latest, all_cells=all_cells,
                      experiments=run.experiments(), short=compare.short_answers_by_variant(run),
                      diffs=compare.diff_run(run),
                      drift=compare.drift(run))


def write_charts(data: ReportData, folder: Path) -> dict[str, Path]:
    from campaign import plots

    folder.mkdir(parents=True, exist_ok=True)
    ttft: dict[str, list[tuple[int, float]]] = {}
    prefill: dict[str, list[tuple[int, float]]] = {}
    for variant, cells in data.latest.items():
        for cell in cells.values():
            if cell.phase == "prefill" and cell.status == "Valid" and cell.ttft_ms is not None:
                ttft.setdefault(variant, []).append((cell.context_tokens, cell.ttft_ms))
                if cell.prompt_tok_s is not None:
                    prefill.setdefault(variant, []).append((cell.context_tokens, cell.prompt_tok_s))
    for item in data.experiments:
        result = item["result"]
        if result["kind"] == "long-context":
            for row in result["details"].get("rows", []):
                if row.get("ttft_s"):
                    ttft.setdefault(item["variant"], []).append((row["context_tokens"], 1000 * row["ttft_s"]))
    made = {
        "throughput": plots.throughput_vs_concurrency(data.all_cells, data.short, folder / "throughput.png"),
        "ttft": plots.ttft_vs_prompt(ttft, folder / "ttft_vs_prompt.png"),
        "prefill": plots.prefill_vs_context(prefill, folder / "prefill_vs_context.png"),
        "agents": plots.agents_that_fit({v: a.get("agents_that_fit") or {} for v, a in data.short.items()},
                                        folder / "agents_that_fit.png"),
    }
    data.charts = {k: v for k, v in made.items() if v is not None}
    return data.charts


def _e(value: object) -> str:
    return html.escape(str(value))


def _img(path: Path, alt: str) -> str:
    encoded = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{_e(alt)}" src="data:image/png;base64,{encoded}">'


def _table(headers: list[str], rows: list[list[str]], *, left: int = 1, cls: str = "") -> str:
    head = "".join(f'<th class="{"l" if i < left else ""}">{_e(h)}</th>' for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><tr>{head}</tr>{body}</table>'


def _td(text: object, *, left: bool = False, cls: str = "", title: str = "") -> str:
    classes = " ".join(c for c in (cls, "l" if left else "") if c)
    title_attr = f' title="{_e(title)}"' if title else ""
    return f'<td class="{classes}"{title_attr}>{_e(text)}</td>'


def _heat(value: float, top: float) -> str:
    """Background from pale to deep green by share of the variant's best cell."""
    share = max(0.0, min(1.0, value / top)) if top > 0 else 0.0
    lightness = 95 - 45 * share
    colour = "#fff" if lightness < 60 else "#222"
    return f"background:hsl(140,45%,{lightness:.0f}%);color:{colour}"


def decode_heatmap(cells: dict[str, CellResult]) -> str:
    decode = [c for c in cells.values() if c.phase == "decode"]
    if not decode:
        return ""
    contexts = sorted({c.context_tokens for c in decode})
    concurrencies = sorted({c.concurrency for c in decode})
    by = {(c.context_tokens, c.concurrency): c for c in decode}
    top = max((c.total_tok_s or 0.0) for c in decode if c.status == "Valid") if any(
        c.status == "Valid" for c in decode) else 0.0
    rows = []
    for ctx in contexts:
        row = [_td(report.fmt_context(ctx), left=True)]
        for conc in concurrencies:
            cell = by.get((ctx, conc))
            if cell is None:
                row.append(_td(report.DASH))
            elif cell.status == "Over capacity":
                row.append(_td("Over capacity", cls="cell over", title="; ".join(cell.reasons)))
            elif cell.status != "Valid":
                row.append(_td(cell.status, cls="cell bad", title="; ".join(cell.reasons)))
            else:
                text = f"{report.fmt_num(cell.total_tok_s)} tok/s · {report.fmt_ms(cell.ttft_ms)} TTFT"
                row.append(f'<td class="cell" style="{_heat(cell.total_tok_s or 0.0, top)}" '
                           f'title="{_e(cell.label)}: {_e(text)}">{_e(text)}</td>')
        rows.append(row)
    headers = ["Context"] + [f"{c} ({'single-stream' if c == 1 else 'aggregate'})" for c in concurrencies]
    return ("<h3>Decode matrix: total tok/s across simultaneous requests, and median TTFT</h3>"
            + _table(headers, rows, cls="heat")
            + '<p class="note">Over capacity: not run, because this many requests at this context would exceed '
              "the server's KV cache. Hover a red cell for why it is not valid.</p>")


def _all_measurements(cells: dict[str, CellResult]) -> str:
    rows = []
    for c in sorted(cells.values(), key=lambda c: (c.phase != "prefill", c.context_tokens, c.concurrency)):
        rows.append([
            _td("Prefill" if c.phase == "prefill" else f"Decode ({c.spec.mode})", left=True),
            _td(report.fmt_context(c.context_tokens)), _td(c.concurrency), _td(c.label, left=True),
            _td(c.status, left=True, cls="" if c.status == "Valid" else "bad", title="; ".join(c.reasons)),
            _td(report.fmt_num(c.prompt_tok_s if c.phase == "prefill" else c.total_tok_s)),
            _td(report.fmt_num(c.per_request_tok_s)), _td(report.fmt_ms(c.ttft_ms)),
            _td(report.fmt_itl(c.itl_ms)), *[_td(text) for text in report.tail_columns(c)],
            _td(report.fmt_num(c.avg_active)),
            _td(report.fmt_num(c.completed)), _td(report.fmt_num(c.output_tokens)),
            _td(report.DASH if c.measured_s is None else f"{c.measured_s:.1f} s"),
            _td(f"{c.discarded_steps} ({c.discarded_tokens} tok)" if c.discarded_steps else "0"),
            _td(report.DASH if c.prefix_cache_hits is None else f"{c.prefix_cache_hits:.0f}"),
        ])
    speculative = any(c.spec_acceptance_rate is not None for c in cells.values())
    if speculative:
        ordered = sorted(cells.values(), key=lambda c: (c.phase != "prefill", c.context_tokens, c.concurrency))
        for row, c in zip(rows, ordered, strict=True):
            row.append(_td(report.DASH if c.spec_acceptance_rate is None else
                           f"{100 * c.spec_acceptance_rate:.1f}% / {report.fmt_num(c.spec_mean_acceptance_length, 2)}"))
    headers = [*report.ALL_HEADERS, "Prefix-cache hits"] + (["Spec. acceptance rate / length"] if speculative else [])
    return ("<h3>All measurements</h3>"
            + _table(headers, rows, left=1)
            + '<p class="note">TTFT and time between tokens are medians (per token); p99 and TPOT columns beside '
              'them. Prefill rows show prompt tok/s in the total column.</p>')


def _short(a: dict[str, Any]) -> str:
    rows = [[_td(question, left=True), _td(answer, left=True)] for question, answer in report.short_answers_rows(a)]
    notes = "".join(f'<p class="{"warn" if line.startswith("warning") else "note"}">{_e(line)}</p>'
                    for line in report.short_answers_notes(a))
    return "<h3>Short answers</h3>" + _table(["Question", "Answer"], rows, left=2) + notes


def _facts(variant: str, servers: list[dict[str, Any]]) -> str:
    rows = []
    for server in servers:
        if server.get("variant") != variant:
            continue
        if server.get("kind") == "failure":
            rows.append([_td(server["launch_dir"], left=True),
                         _td(f"FAILED TO START ({server['failure_kind']}): {server['message']}", left=True, cls="bad")])
            continue
        facts = server["facts"]
        summary = ", ".join(f"{k}={v}" for k, v in facts.items() if v is not None and k != "failure")
        rows.append([_td(server["launch_dir"], left=True), _td(summary, left=True)])
    return "<h3>What the server became (startup log, cross-checked with /metrics)</h3>" + _table(
        ["Launch", "Facts"], rows, left=2)


def _diff(diffs: list[compare.VariantDiff]) -> str:
    parts = []
    for d in diffs:
        rows = []
        for cell in d.cells:
            for m in cell.metrics:
                cls = {"better": "better", "worse": "worse", "inside noise": "noise"}.get(m.verdict, "")
                ci = report.DASH if m.ci95_pct is None else f"[{m.ci95_pct[0]:+.1f}%, {m.ci95_pct[1]:+.1f}%]"
                rows.append([_td(cell.key, left=True), _td(cell.label, left=True), _td(m.metric, left=True),
                             _td(report.fmt_num(m.baseline)), _td(report.fmt_num(m.variant)),
                             _td(report.DASH if m.change_pct is None else f"{m.change_pct:+.1f}%"), _td(ci),
                             _td(f"{m.n_baseline}/{m.n_variant}"), _td(m.verdict, left=True, cls=cls)])
        changes = "".join(f"<li>{_e(k)}: {_e(a)} → {_e(b)}</li>" for k, a, b in d.flag_changes)
        facts = "".join(f"<li>{_e(k)}: {_e(a)} → {_e(b)}{'' if p is None else f' ({p:+.1f}%)'}</li>"
                        for k, a, b, p in d.fact_changes)
        warning = "" if d.comparable else f'<p class="warn">Not comparable: {_e(d.not_comparable_reason)}</p>'
        parts.append(f"<h3>{_e(d.variant)} vs {_e(d.baseline)}</h3>" + warning
                     + f"<ul>{changes}{facts}</ul>"
                     + _table(["Cell", "Label", "Metric", "Baseline", "Variant", "Change", "95% CI", "n", "Verdict"],
                              rows, left=3)
                     + f"<p><b>Recommendation:</b> {_e(d.recommendation)}</p>")
    return "<h2>A/B: every variant against the baseline</h2>" + "".join(parts) if parts else ""


def _how(data: ReportData) -> str:
    cells = [c for cells in data.all_cells.values() for c in cells]
    discarded = sum(c.discarded_steps for c in cells)
    discarded_tokens = sum(c.discarded_tokens for c in cells)
    windows = sorted({c.spec.window_s for c in cells if c.phase == "decode" and c.spec.mode == "sustained"})
    outputs = sorted({c.max_tokens for c in cells if c.phase == "decode" and c.max_tokens})
    hits = sum(1 for c in cells if c.prefix_cache_hits)
    items = [
        f"Sustained decode windows: {', '.join(f'{w:g} s' for w in windows) or 'none'}; requests straddling a "
        "window's end are drained, and only tokens that arrived inside the window count.",
        f"Fixed output length: every decode request asked for exactly {', '.join(map(str, outputs)) or '—'} tokens "
        "(ignore_eos, min_tokens = max_tokens); replies cut short are flagged.",
        "Fresh prompts: every request, retries included, starts with tokens no other prompt has, so the prefix "
        "cache can never serve it.",
        f"Bracketing: the server's generated- and prompt-token counters were read around every step; {discarded} "
        f"step(s) with foreign traffic ({discarded_tokens} tokens) were discarded and rerun.",
        f"Prefix-cache checks: {hits} cell(s) saw cache hits in a step designed to share nothing (such cells are "
        "Invalid).",
        f"Drift: {data.drift.message}.",
    ]
    return "<h2>How this was measured</h2><ul>" + "".join(f"<li>{_e(i)}</li>" for i in items) + "</ul>"


def render_html(data: ReportData) -> str:
    manifest = data.manifest
    machine = manifest.get("machine", {})
    gpus = (machine.get("gpu") or {}).get("gpus") or []
    hardware = ", ".join(f"{g['name']} ({g['memory_total_mib'] // 1024} GiB)" for g in gpus) or \
        f"no GPU ({machine.get('cpu')}, {machine.get('cpu_count')} cores)"
    first_server = next((s for s in data.servers if s.get("kind") == "server"), None)
    version = first_server["facts"].get("vllm_version") if first_server else None
    command = " ".join(first_server["command"]) if first_server else "—"
    meta: list[tuple[str, object]] = [
        ("Campaign", manifest.get("campaign")), ("Measured", manifest.get("created_utc")),
        ("Hardware", hardware),
        ("Engine", f"{manifest.get('engine')} {version or ''}" + (
            f" — SIMULATED at a {manifest['time_scale']:g}x time scale: rates in the tables read that many times "
            "higher" if (manifest.get("time_scale") or 1.0) != 1.0 else "")),
        ("Model", manifest.get("profile", {}).get("raw", {}).get("model")),
        ("Launch command (secrets redacted)", command),
        ("Tool", f"vllm-campaign {manifest.get('tool', {}).get('version')} "
                 f"({(manifest.get('tool', {}).get('git_commit') or 'no git')[:12]})"),
    ]
    meta_rows = [[_td(k, left=True), _td(v, left=True, cls="cmd" if k.startswith("Launch") else "")] for k, v in meta]
    parts = [f"<h1>{_e(manifest.get('campaign'))}: speed, context and capacity</h1>",
             _table(["", ""], meta_rows, left=2, cls="meta")]
    variants = list(data.short) + sorted({str(s["variant"]) for s in data.servers} - set(data.short))
    for variant in variants:
        cells = data.latest.get(variant, {})
        parts.append(f"<h2>Variant: {_e(variant)}</h2>")
        if variant in data.short:
            parts.append(_short(data.short[variant]))
        parts.append(_facts(variant, data.servers))
        parts.append(decode_heatmap(cells))
        prefill = [c for c in cells.values() if c.phase == "prefill"]
        if prefill:
            rows = [[_td(report.fmt_context(c.context_tokens), left=True),
                     _td(report.fmt_num(c.prompt_tok_s) if c.status == "Valid" else c.status,
                         cls="" if c.status == "Valid" else "bad", title="; ".join(c.reasons)),
                     _td(report.fmt_ms(c.ttft_ms))] for c in sorted(prefill, key=lambda c: c.context_tokens)]
            parts.append("<h3>Prefill (single-stream)</h3>" + _table(["Context", "Prompt tok/s", "TTFT"], rows))
        if cells:
            parts.append(_all_measurements(cells))
    if data.experiments:
        rows = [[_td(i["variant"], left=True), _td(i["repeat"] + 1), _td(i["result"]["key"], left=True),
                 _td(i["result"]["status"], left=True, cls="" if i["result"]["status"] == "Valid" else "bad"),
                 _td(i["result"].get("verdict") or "; ".join(i["result"].get("reasons") or []), left=True)]
                for i in data.experiments]
        parts.append("<h2>The study's experiments</h2>"
                     + _table(["Variant", "Repeat", "Experiment", "Status", "Result"], rows, left=5))
    titles = {"throughput": "Aggregate and per-request tok/s against concurrency",
              "ttft": "Time to first token against prompt length", "prefill": "Prefill tok/s against context",
              "agents": "Agents that fit against context per agent"}
    if data.charts:
        parts.append("<h2>Charts</h2>" + "".join(f"<h3>{_e(titles[k])}</h3>{_img(p, titles[k])}"
                                                 for k, p in data.charts.items()))
    parts.append(_diff(data.diffs))
    parts.append(_how(data))
    body = "\n".join(p for p in parts if p)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(manifest.get("campaign"))} '
            f"report</title><style>{CSS}</style></head><body>\n{body}\n</body></html>\n")


def render_markdown(data: ReportData) -> str:
    parts = [f"# {data.manifest.get('campaign')} ({data.manifest.get('created_utc')})"]
    for variant, values in data.short.items():
        parts.append(f"## {variant}\n\n```\n{report.short_answers_text(variant, values)}\n```")
        cells = list(data.latest.get(variant, {}).values())
        if cells:
            parts.append("```\n" + report.cells_report(cells) + "\n```")
    if data.experiments:
        parts.append("## Experiments\n\n```\n" + report.experiments_text(data.experiments) + "\n```")
    parts.append("## A/B\n\n```\n" + report.diff_text(data.diffs) + f"\n\ndrift: {data.drift.message}\n```")
    return "\n\n".join(parts) + "\n"


def write(run: RunDir, *, fmt: str = "html", out: Path | None = None) -> list[Path]:
    """Write the report; returns the paths written. Charts go beside the report as PNG files too."""
    data = gather(run)
    folder = (out.parent if out is not None and fmt != "png" else out) or run.root / "report"
    charts = write_charts(data, folder if fmt != "png" else (out or run.root / "report"))
    if fmt == "png":
        return list(charts.values())
    if fmt == "md":
        path = out or folder / "report.md"
        path.write_text(render_markdown(data))
        return [path, *charts.values()]
    path = out or folder / "report.html"
    path.write_text(render_html(data))
    return [path, *charts.values()]
