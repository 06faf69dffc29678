"""One self-contained HTML report per run (inline CSS, charts embedded as PNG data), plus Markdown and PNGs.

Built from stored files only, so any run can be reported again later, on any machine, without a server.
No script, no font, no image is fetched from anywhere: the file opens offline in any browser.
"""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from campaign.analysis import recommend, summary, verdicts
from campaign.core.errors import CampaignError
from campaign.measure.cells import CellResult
from campaign.measure.judged import MIN_EFFECT
from campaign.measure.study import ExperimentResult
from campaign.report import calibration as calibration_report
from campaign.report import names, plots
from campaign.report import text as report
from campaign.report.tables import Cell, Table, md_escape, to_html, to_markdown
from campaign.stored.records import ExperimentRecord, FailureRecord, Manifest, ServerRecord
from campaign.stored.store import RunDir, replace_text

# The page's size budget: one self-contained file (every chart inlined) light enough to mail.
PAGE_BUDGET_BYTES = 1_000_000

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1200px;color:#222;
padding:0 1rem;line-height:1.45}
h1{margin-bottom:.2rem}h2{border-bottom:2px solid #ddd;padding-bottom:.2rem;margin-top:2.2rem}
table{border-collapse:collapse;margin:.6rem 0;font-size:.88rem;display:block;overflow-x:auto;max-width:100%}
th,td{border:1px solid #ccc;padding:.25rem .5rem;text-align:right;vertical-align:top}
th{background:#f3f3f3}td.l,th.l{text-align:left}
.meta td{text-align:left}.cmd{font-family:ui-monospace,monospace;font-size:.8rem;word-break:break-all}
.cell{min-width:6rem}.over{background:#e6e6e6;color:#555}.bad{background:#f8d7da}
.changed{background:#fff3cd}.better{background:#d4edda}.worse{background:#f8d7da}.noise{background:#f1f1f1}
.note{color:#555;font-size:.85rem}
.badge{display:inline-block;border-radius:1rem;padding:.2rem .7rem;margin:.2rem;border:1px solid #bbb}
.warn{color:#8a4b00}.recommendation{font-weight:600}
img{max-width:100%;border:1px solid #eee;margin:.5rem 0}
table.verdict{display:table}table.verdict td{text-align:left}
table.verdict td:nth-child(2){font-weight:600;white-space:nowrap}
@media (max-width:700px){body{margin:.8rem auto;padding:0 .5rem}th,td{padding:.2rem .3rem}
table.verdict td:nth-child(3){overflow-wrap:anywhere}table.verdict td:nth-child(2){white-space:normal}
table.stack,table.stack tr,table.stack td{display:block}table.stack tr:first-child{display:none}
table.stack tr{border-top:1px solid #ccc;padding:.3rem 0}table.stack td{border:none;text-align:left;
overflow-wrap:anywhere}table.stack td::before{content:attr(data-label) ": ";font-weight:600}}
@media print{body{max-width:none;margin:0}h2{break-after:avoid}table,img{break-inside:avoid}}
"""


@dataclass
class ReportData:
    run: RunDir
    manifest: Manifest
    servers: list[ServerRecord | FailureRecord]
    latest: dict[str, dict[str, CellResult]]          # variant -> cell key -> the latest repeat's result
    all_cells: dict[str, list[CellResult]]
    experiments: list[ExperimentRecord]
    short: dict[str, dict[str, Any]]
    diffs: list[verdicts.VariantDiff]
    drift: summary.Drift
    charts: dict[str, Path] = field(default_factory=dict)
    other: RunDir | None = None            # a second run of the same matrix, its variants named "<name>@B"
    other_drift: summary.Drift | None = None

    @property
    def drift_text(self) -> str:
        if self.other is None or self.other_drift is None:
            return self.drift.message
        return f"this run: {self.drift.message}; {self.other.root.name} (@B): {self.other_drift.message}"


OTHER = "@B"   # the suffix recommend.diff_run gives the other run's variants


def gather(run: RunDir, other: RunDir | None = None) -> ReportData:
    """A run's stored files for its report; with `other` (a run of the same matrix, last week's say), that
    run's variants beside this one's as "<name>@B", each diffed against this run's baseline."""
    stored = run.cells()
    servers: list[ServerRecord | FailureRecord] = list(run.servers())
    experiments = run.experiments()
    short = recommend.short_answers_by_variant(run)
    if other is not None:
        if other.manifest().campaign != run.manifest().campaign:

            raise CampaignError(f"{other.root} is a run of {other.manifest().campaign!r}, {run.root} of "
                                f"{run.manifest().campaign!r}: a report across runs compares runs of one matrix",
                                hint="campaign diff RUN_A RUN_B --force compares the cells of any two runs")
        stored += [replace(c, variant=c.variant + OTHER) for c in other.cells()]
        servers += [s.model_copy(update={"variant": s.variant + OTHER}) for s in other.servers()]
        experiments += [e.model_copy(update={"variant": e.variant + OTHER}) for e in other.experiments()]
        short |= {v + OTHER: a for v, a in recommend.short_answers_by_variant(other).items()}
    all_cells: dict[str, list[CellResult]] = {}
    for cell in sorted(stored, key=lambda s: s.repeat):
        all_cells.setdefault(cell.variant, []).append(cell.result)
    return ReportData(run=run, manifest=run.manifest(), servers=servers, latest=report.latest_cells(stored),
                      all_cells=all_cells, experiments=experiments, short=short,
                      diffs=recommend.diff_run(run, other=other), drift=summary.drift(run), other=other,
                      other_drift=summary.drift(other) if other is not None else None)


def gpu_counts(servers: list[ServerRecord | FailureRecord]) -> dict[str, int]:
    """Each variant's GPUs, as its first ready launch ran: tensor parallelism as its log said, else its flag."""
    out: dict[str, int] = {}
    for server in servers:
        if isinstance(server, ServerRecord) and server.variant not in out:
            out[server.variant] = server.tensor_parallel_size()
    return out


def rate_loads(data: ReportData) -> tuple[dict[str, list[plots.RatePoint]], dict[str, plots.Bracket]]:
    """Each variant's open-loop loads as stored (its latest rate and trace cells, its latest capacity search's
    probes) and that search's bracket on the rate axis (the highest rate that held, the lowest that failed)."""
    loads: dict[str, list[plots.RatePoint]] = {}
    for variant, cells in data.latest.items():
        for c in cells.values():
            if c.phase == "rate" and c.request_rate is not None and c.status == "Valid":
                loads.setdefault(variant, []).append(plots.RatePoint(c.request_rate, c.achieved_rate_rps,
                                                                     c.goodput_rps, c.ttft_p90_ms))
    brackets: dict[str, plots.Bracket] = {}
    for (variant, kind), result in _latest_experiments(data).items():
        if kind != "slo-search":
            continue
        search = result.details.get("slo_search") or {}
        brackets[variant] = (search.get("last_pass_rps"), search.get("first_fail_rps"))
        # The probes as stored in the search's details (a cell's fields, read by name: the figures drawn only).
        for probe in result.details.get("probes") or []:
            if probe.get("request_rate") is not None and probe.get("status") == "Valid":
                loads.setdefault(variant, []).append(plots.RatePoint(
                    probe["request_rate"], probe.get("achieved_rate_rps"), probe.get("goodput_rps"),
                    probe.get("ttft_p90_ms"), probe.get("slo_passed")))
    return loads, brackets


def write_charts(data: ReportData, folder: Path) -> dict[str, Path]:
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
        if item.result.kind == "long-context":
            for row in item.result.details.get("rows", []):
                if row.get("ttft_s"):
                    ttft.setdefault(item.variant, []).append((row["context_tokens"], 1000 * row["ttft_s"]))
    made = {
        "throughput": plots.throughput_vs_concurrency(data.all_cells, data.short, folder / "throughput.png"),
        "frontier": plots.frontier(data.all_cells, gpu_counts(data.servers), folder / "frontier.png"),
        "goodput": plots.goodput_vs_rate(*rate_loads(data), folder / "goodput_vs_rate.png"),
        "ttft": plots.ttft_vs_prompt(ttft, folder / "ttft_vs_prompt.png"),
        "prefill": plots.prefill_vs_context(prefill, folder / "prefill_vs_context.png"),
        "agents": plots.agents_that_fit({v: a.get("agents_that_fit") or {} for v, a in data.short.items()},
                                        folder / "agents_that_fit.png"),
    }
    latest = _latest_experiments(data)
    made["long-context"] = plots.long_context(
        {v: r.details.get("rows", []) for (v, kind), r in latest.items() if kind == "long-context"},
        folder / "long_context.png")
    made["overload"] = plots.overload_timeline(
        {v: {"requests": r.requests, "gauges": r.details.get("gauges"), "max_num_seqs": r.details.get("max_num_seqs")}
         for (v, kind), r in latest.items() if kind == "overload"}, folder / "overload.png")
    made["prefix-order"] = plots.prefix_order(
        {v: r.details.get("arms", {}) for (v, kind), r in latest.items() if kind == "prefix-order"},
        folder / "prefix_order.png")
    made["repeat"] = plots.bimodality(
        {v: r.details for (v, kind), r in latest.items() if kind == "repeat"}, folder / "bimodality.png")
    for d in data.diffs:
        made[FOREST + d.variant] = plots.forest(d, folder / f"forest-{_file_name(d.variant)}.png",
                                                noise_pct=100 * MIN_EFFECT)
    data.charts = {k: v for k, v in made.items() if v is not None}
    return data.charts


FOREST = "forest:"   # chart keys of the forest plots, one per variant
FOREST_ALT = "Change against the baseline with 95% intervals"


def _file_name(variant: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", variant)


def verdict(data: ReportData) -> Table:
    return report.verdict_table(data.diffs, drift=data.drift_text, latest=data.latest, servers=data.servers,
                                short=data.short)


def _forests(data: ReportData) -> list[tuple[str, Path]]:
    """(alt text, PNG) of each variant's forest plot, in the diffs' order."""
    return [(f"{FOREST_ALT}: {d.variant} vs {d.baseline}", data.charts[FOREST + d.variant]) for d in data.diffs
            if FOREST + d.variant in data.charts]


EXPERIMENTS = "The study's experiments"
EXPERIMENT_CHARTS = {"long-context": "Long prompts: time to first token and generation speed",
                     "overload": "Overload: requests generating and waiting over time",
                     "prefix-order": "Prefix order: wall time and cache hits of each arm",
                     "repeat": "Repeats of one cell: one mode or two"}
BADGES = {"refuses with 400": ("refused with 400", "better"), "clamps silently": ("silently clamped", "worse")}


def _latest_experiments(data: ReportData) -> dict[tuple[str, str], ExperimentResult]:
    """(variant, kind) -> the latest repeat's result (one picture per kind; the A/B weighs every repeat)."""
    latest: dict[tuple[str, str], ExperimentResult] = {}
    for item in sorted(data.experiments, key=lambda e: e.repeat):
        latest[(item.variant, item.result.kind)] = item.result
    return latest


def _experiments_html(data: ReportData) -> str:
    """The study's experiments as pictures: the context window as a badge per variant, the others as charts;
    their sentences are the pictures' hover text (the Markdown report keeps them as a table)."""
    latest = _latest_experiments(data)
    if not latest:
        return ""
    parts = [f"<h2>{_e(EXPERIMENTS)}</h2>"]
    windows = [(v, r) for (v, kind), r in latest.items() if kind == "context-window"]
    if windows:
        badges = []
        for variant, result in windows:
            behaviour = (result.details.get("over_total") or {}).get("behaviour") or result.status
            text, cls = BADGES.get(behaviour, (behaviour, "warn"))
            badges.append(f'<span class="badge {cls}" title="{_e(result.verdict)}">{_e(variant)}: '
                          f"{_e(text)}</span>")
        parts.append("<h3>Context window: a prompt and reply over it</h3><p>" + " ".join(badges) + "</p>")
    for kind, title in EXPERIMENT_CHARTS.items():
        if kind in data.charts:
            hover = " | ".join(f"{v}: {r.verdict}" for (v, k), r in latest.items() if k == kind)
            parts.append(f"<h3>{_e(title)}</h3>{_img(data.charts[kind], title, hover)}")
    # What has no picture (agents, capacity searches, a kind with nothing to draw) keeps its sentences here.
    pictured = {k for k in EXPERIMENT_CHARTS if k in data.charts} | {"context-window"}
    rest = report.experiments_table([e for e in data.experiments if e.result.kind not in pictured])
    if rest is not None:
        parts.append(to_html(replace(rest, title="Other experiments")))
    return "".join(parts)


def _e(value: object) -> str:
    return html.escape(str(value))


def _img(path: Path, alt: str, title: str | None = None) -> str:
    encoded = base64.b64encode(path.read_bytes()).decode()
    hover = f' title="{_e(title)}"' if title else ""
    return f'<img alt="{_e(alt)}"{hover} src="data:image/png;base64,{encoded}">'


def _variants(data: ReportData) -> list[str]:
    """Variants with short answers first (the run's order), then any whose every launch failed."""
    return list(data.short) + sorted({s.variant for s in data.servers} - set(data.short))


def variant_tables(data: ReportData, variant: str) -> list[Table]:
    """One variant's tables, the same objects for the HTML and the Markdown report."""
    cells = list(data.latest.get(variant, {}).values())
    out = [report.short_answers_table(variant, data.short[variant])] if variant in data.short else []
    out.append(report.facts_table(variant, data.servers))
    return out + (report.cells_tables(cells) if cells else [])


def side_by_side(data: ReportData) -> list[Table]:
    """The variants next to each other: short answers, what the servers became, the decode matrices."""
    baseline = data.diffs[0].baseline if data.diffs else None
    order = ([] if baseline is None else [baseline]) + [v for v in _variants(data) if v != baseline]
    made = [report.short_answers_side_by_side(order, data.short),
            report.facts_side_by_side(order, data.servers, baseline),
            report.decode_matrices_side_by_side(order, data.latest)]
    return [t for t in made if t is not None]


def tune_section(data: ReportData) -> tuple[str, list[Table]] | None:
    """A night `campaign tune` ran to confirm its search: its predictions beside what was measured."""
    record = data.run.tune()
    return None if record is None else ("campaign tune's evidence", [report.tune_table(record)])


def calibration_section(data: ReportData) -> tuple[str, list[Table]] | None:
    """The simulator fitted to this night (`campaign calibrate RUN`): each entry's latest fit, as its command
    printed it, every cell fitted or held out with its error."""
    tables = [replace(calibration_report.table(r.entry, iterations=r.iterations, unmeasured=r.unmeasured,
                                               skipped=r.skipped, settled=r.settled, determined=r.determined,
                                               kv_from=r.kv_from, leaned=r.leaned),
                      lead=[f"written {r.written_utc} to {r.path}"])
              for r in data.run.calibrations()]
    return ("campaign calibrate's fits to this night", tables) if tables else None


def sections(data: ReportData) -> list[tuple[str, list[Table]]]:
    """The report's sections before the charts and the A/B, as (heading, tables), for HTML and Markdown alike."""
    together = side_by_side(data)
    out = [found for found in (tune_section(data), calibration_section(data)) if found is not None]
    out += [("Side by side", together)] if len(_variants(data)) > 1 and together else []
    out += [(f"Variant: {variant}", variant_tables(data, variant)) for variant in _variants(data)]
    return out


def experiments_section(data: ReportData) -> tuple[str, list[Table]] | None:
    experiments = report.experiments_table(data.experiments)
    return None if experiments is None else (EXPERIMENTS, [replace(experiments, title="")])


def diff_tables(data: ReportData) -> list[Table]:
    return [report.diff_table(d) for d in data.diffs]


LEGEND = "The figures"


def legend() -> Table:
    """What every figure the report names is, and which speed the verdict judges (campaign.report.names)."""
    return replace(names.legend(), title="")


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
        f"Drift: {data.drift_text}.",
    ]
    return "<h2>How this was measured</h2><ul>" + "".join(f"<li>{_e(i)}</li>" for i in items) + "</ul>"


def render_html(data: ReportData) -> str:
    manifest = data.manifest
    machine = manifest.machine
    gpus = (machine.gpu or {}).get("gpus") or []
    hardware = ", ".join(f"{g['name']} ({g['memory_total_mib'] // 1024} GiB)" for g in gpus) or \
        f"no GPU ({machine.cpu}, {machine.cpu_count} cores)"
    first_server = next((s for s in data.servers if isinstance(s, ServerRecord)), None)
    version = first_server.facts.vllm_version if first_server else None
    command = " ".join(first_server.command) if first_server else "—"
    meta: list[tuple[str, object]] = [
        ("Campaign", manifest.campaign), ("Measured", manifest.created_utc),
        ("Hardware", hardware),
        ("Engine", f"{manifest.engine} {version or ''}" + (
            f" — SIMULATED at a {manifest.time_scale:g}x time scale: every figure is the simulated hardware's, "
            "converted from the faster wall clock" if manifest.time_scale != 1.0 else "") + (
            " — SIMULATED in simulated time (clock virtual): the engine replayed, no HTTP"
            if manifest.clock == "virtual" else "")),
        ("Model", manifest.profile.raw.get("model")),
        ("Launch command (secrets redacted)", command),
        ("Tool", f"vllm-campaign {manifest.tool.version} ({(manifest.tool.git_commit or 'no git')[:12]})"),
    ]
    if data.other is not None:
        meta.insert(2, ("Compared with (variants @B)", f"{data.other.root} (measured "
                                                         f"{data.other.manifest().created_utc})"))
    meta_table = Table(headers=["", ""], align="ll", cls="meta", rows=[
        [k, Cell(str(v), cls="cmd" if k.startswith("Launch") else None)] for k, v in meta])
    parts = [f"<h1>{_e(manifest.campaign)}: speed, context and capacity</h1>",
             '<section id="verdict"><h2>Verdict</h2>' + to_html(replace(verdict(data), title=""))
             + "".join(_img(path, alt) for alt, path in _forests(data)) + "</section>",
             to_html(meta_table)]
    for heading, tables in sections(data):
        parts += [f"<h2>{_e(heading)}</h2>", *map(to_html, tables)]
    parts.append(_experiments_html(data))
    titles = {"frontier": "The frontier: tok/s per GPU against tok/s per user",
              "goodput": "Goodput and the first token's wait against the rate offered, with the capacity bracket",
              "throughput": f"{names.header('total_tok_s')} and {names.name('per_request_tok_s')} against "
                            "concurrency",
              "ttft": "Time to first token against prompt length", "prefill": "Prefill tok/s against context",
              "agents": "Agents that fit against context per agent"}
    if any(k in titles for k in data.charts):
        parts.append("<h2>Charts</h2>" + "".join(f"<h3>{_e(titles[k])}</h3>{_img(p, titles[k])}"
                                                 for k, p in data.charts.items() if k in titles))
    if data.diffs:
        parts.append("<h2>A/B: every variant against the baseline</h2>"
                     + "".join(to_html(t) for t in diff_tables(data))
                     + f'<p class="note">{_e(report.JUDGED_SPEEDS)}</p>')
    parts.append(f"<h2>{_e(LEGEND)}</h2>" + to_html(legend()))
    parts.append(_how(data))
    body = "\n".join(p for p in parts if p)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(manifest.campaign)} '
            f"report</title><style>{CSS}</style></head><body>\n{body}\n</body></html>\n")


def render_markdown(data: ReportData) -> str:
    """The same tables as the HTML report, as Markdown tables (charts beside it as PNG files)."""
    parts = [f"# {md_escape(data.manifest.campaign)} ({data.manifest.created_utc})", "## Verdict",
             "\n".join(("  - " if line.startswith(report.WHY) else "- ") + md_escape(line)
                       for line in report.verdict_lines(verdict(data))),
             *(f"![{md_escape(alt)}]({path.name})" for alt, path in _forests(data))]
    for heading, tables in sections(data):
        parts += [f"## {md_escape(heading)}", *map(to_markdown, tables)]
    experiments = experiments_section(data)
    if experiments is not None:
        parts += [f"## {md_escape(experiments[0])}", *map(to_markdown, experiments[1])]
        parts += [f"![{md_escape(title)}]({data.charts[kind].name})" for kind, title in EXPERIMENT_CHARTS.items()
                  if kind in data.charts]
    parts.append("## A/B: every variant against the baseline")
    parts += [to_markdown(t) for t in diff_tables(data)] or [report.NOTHING_TO_COMPARE]
    if data.diffs:
        parts.append(md_escape(report.JUDGED_SPEEDS))
    parts.append(md_escape(f"drift: {data.drift_text}"))
    parts += [f"## {md_escape(LEGEND)}", to_markdown(legend())]
    return "\n\n".join(parts) + "\n"


def write(run: RunDir, *, fmt: str = "html", out: Path | None = None, other: RunDir | None = None) -> list[Path]:
    """Write the report (against `other`: in report/vs-<its folder>/ unless `out` says); returns the paths
    written. Charts go beside the report as PNG files too."""
    data = gather(run, other)
    default = run.root / "report" if other is None else run.root / "report" / f"vs-{other.root.name}"
    folder = (out.parent if out is not None and fmt != "png" else out) or default
    charts = write_charts(data, folder if fmt != "png" else (out or default))
    if fmt == "png":
        return list(charts.values())
    if fmt == "md":
        path = out or folder / "report.md"
        replace_text(path, render_markdown(data))
        return [path, *charts.values()]
    path = out or folder / "report.html"
    replace_text(path, render_html(data))
    return [path, *charts.values()]
