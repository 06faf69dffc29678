"""The study's charts as PNG files (matplotlib, no display). Reads plain data only; every axis is labelled
single-stream or aggregate where it matters."""

from __future__ import annotations

import io
import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from campaign.measure import answers
from campaign.measure.cells import CellResult
from campaign.report import names

DPI = 110


def _subplots(*grid: int, figsize: tuple[float, float], squeeze: bool = True,
              height_ratios: Sequence[float] | None = None) -> tuple[Any, Any]:
    """A figure of its own (no pyplot: no display, no global figure registry to close) and its axes.
    matplotlib is imported here, when a chart is drawn: it is 0.4 s of every command's start otherwise."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    return fig, fig.subplots(*grid, squeeze=squeeze, height_ratios=height_ratios)


def _save(fig: Any, path: Path, *, bottom: float = 0.0) -> Path:
    """The figure as a 256-colour PNG: charts are flat colours and antialiased lines, and the palette keeps
    them as they look at a third of the bytes (a forest plot 64 -> 20 KB, the throughput chart 76 -> 22 KB),
    so a report of a dozen charts stays light enough to mail. Fast octree, unoptimised: 10 ms a chart against
    81 ms for median cut with zlib's optimise pass, and smaller (22 against 27 KB; measured side by side on
    the throughput chart); a report draws one per variant and experiment, and every night ends with one."""
    from PIL import Image

    fig.tight_layout(rect=(0.0, bottom, 1.0, 1.0))   # `bottom`: a share of the height kept for a footnote
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=DPI, format="png")
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(colors=256, method=Image.Quantize.FASTOCTREE).save(path)
    return path


def throughput_vs_concurrency(by_variant: Mapping[str, Sequence[CellResult]], short: dict[str, dict[str, Any]],
                              path: Path) -> Path | None:
    """Seed 000's table as a picture against concurrency: total tok/s with the knee; stream tok/s with the speed
    floors it is held to, and beside it, dotted, total ÷ streams (seed 000's "per request", prefill included),
    so the two per-stream figures are never read as one."""
    ladders = {v: answers.ladder_from_cells(cells) for v, cells in by_variant.items()}
    ladders = {v: ladder for v, ladder in ladders.items() if ladder}
    if not ladders:
        return None
    stream, share = names.name("per_request_tok_s"), names.name(names.TOTAL_OVER_STREAMS)
    fig, (ax_total, ax_each) = _subplots(1, 2, figsize=(11, 4.2))
    for variant, ladder in ladders.items():
        xs = [s.concurrency for s in ladder]
        ax_total.plot(xs, [s.total_tok_s for s in ladder], marker="o", label=variant)
        line = ax_each.plot(xs, [s.per_request_tok_s for s in ladder], marker="o", label=f"{variant}: {stream}")[0]
        shares = [names.total_over_streams("decode", s.total_tok_s, s.concurrency) for s in ladder]
        ax_each.plot(xs, [math.nan if v is None else v for v in shares], marker=".", linestyle=":",
                     color=line.get_color(), label=f"{variant}: {share}")
        knee = (short.get(variant) or {}).get("knee")
        if knee:
            ax_total.axvline(knee["concurrency"], linestyle=":", color="grey")
            ax_total.annotate(f"knee ({variant})", (knee["concurrency"], max(s.total_tok_s for s in ladder)),
                              fontsize=8, color="grey")
    for floor in answers.DEFAULT_FLOORS:
        ax_each.axhline(floor, linestyle="--", linewidth=0.8, color="tab:red")
        ax_each.annotate(f"{floor:g} {stream} floor", (1, floor), fontsize=8, color="tab:red", va="bottom")
    for ax, title, label in ((ax_total, "Aggregate (all requests together)", names.name("total_tok_s")),
                             (ax_each, f"Each stream: {stream} (solid), {share} (dotted)", "tok/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(label)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def frontier_points(by_variant: Mapping[str, Sequence[CellResult]], gpus: Mapping[str, int]
                    ) -> dict[str, list[tuple[int, float, float]]]:
    """Each variant's frontier: (streams, tok/s per user, tok/s per GPU) a rung of its decode ladder, the
    ladder's own figures (stream tok/s; total tok/s over the variant's GPUs)."""
    out = {}
    for variant, cells in by_variant.items():
        ladder = answers.ladder_from_cells(cells)
        count = max(1, gpus.get(variant, 1))
        if ladder:
            out[variant] = [(s.concurrency, s.per_request_tok_s, s.total_tok_s / count) for s in ladder]
    return out


def frontier(by_variant: Mapping[str, Sequence[CellResult]], gpus: Mapping[str, int], path: Path) -> Path | None:
    """The trade a server makes as streams are added, as vLLM's `bench sweep plot_pareto` and InferenceX draw
    it: tok/s per GPU (the operator's) against tok/s per user (a stream's), a point per concurrency of the
    decode ladder (answers.ladder_from_cells), one curve a variant; up and to the right is better, and a
    variant whose curve lies above another's everywhere serves more per GPU at every speed a user gets."""
    curves = frontier_points(by_variant, gpus)
    if not curves:
        return None
    fig, ax = _subplots(figsize=(7.5, 4.6))
    for variant, points in curves.items():
        count = max(1, gpus.get(variant, 1))
        line = ax.plot([p[1] for p in points], [p[2] for p in points], marker="o",
                       label=f"{variant} ({count} GPU{'s' if count > 1 else ''})")[0]
        for streams, x, y in points:
            ax.annotate(f"{streams}", (x, y), xytext=(3, 3), textcoords="offset points", fontsize=7,
                        color=line.get_color())
    ax.set_xlabel(f"tok/s per user ({names.name('per_request_tok_s')})")
    ax.set_ylabel("tok/s per GPU (total tok/s / GPUs)")
    ax.set_title("The frontier: throughput per GPU against speed per user (labels: streams)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


@dataclass(frozen=True)
class RatePoint:
    """One open-loop load of a variant (a rate or trace cell, a capacity search's probe): the rate offered, the
    rate achieved, the goodput at the SLO and the p90 TTFT; whether it held the SLO (None: no SLO asked)."""

    offered: float
    achieved: float | None
    goodput: float | None
    ttft_p90_ms: float | None
    passed: bool | None = None


Bracket = tuple[float | None, float | None]   # a capacity search's highest rate that held, lowest that failed


def goodput_vs_rate(points: Mapping[str, Sequence[RatePoint]], brackets: Mapping[str, Bracket],
                    path: Path) -> Path | None:
    """Open-loop loads as a service sees them, a colour a variant: left, the goodput at the SLO (solid) and the
    rate achieved (dotted) of the rate and trace cells against the rate offered, beside the line a server that
    keeps up would follow; a capacity search's probes as points (filled: held the SLO; a cross: failed) and
    its bracket as two lines with the band between (the highest rate that held, the lowest that failed);
    right, the p90 TTFT against the rate offered, where a queue shows as the bend upward."""
    points = {v: sorted(p, key=lambda r: r.offered) for v, p in points.items() if p}
    if not points:
        return None
    fig, (ax_rate, ax_ttft) = _subplots(1, 2, figsize=(11, 4.4))
    top = max(r.offered for p in points.values() for r in p)
    ax_rate.plot([0, top], [0, top], linestyle="--", color="lightgrey", linewidth=0.8, label="kept up (offered)")
    for variant, loads in points.items():
        cells = [r for r in loads if r.passed is None]
        probes = [r for r in loads if r.passed is not None]
        line = ax_rate.plot([r.offered for r in cells], [math.nan if r.goodput is None else r.goodput for r in cells],
                            marker="o", markersize=4, label=f"{variant}: goodput")[0]
        colour = line.get_color()
        ax_rate.plot([r.offered for r in cells], [math.nan if r.achieved is None else r.achieved for r in cells],
                     linestyle=":", color=colour, label=f"{variant}: achieved")
        for r in probes:
            ax_rate.plot([r.offered], [r.goodput or 0.0], marker="o" if r.passed else "x", color=colour,
                         markerfacecolor=colour if r.passed else "none", linestyle="")
        low, high = brackets.get(variant, (None, None))
        if low is not None or high is not None:
            for end in (low, high):
                if end is not None:
                    ax_rate.axvline(end, color=colour, linewidth=0.8, linestyle="-.")
            ax_rate.axvspan(low or 0.0, high if high is not None else top, color=colour, alpha=0.15,
                            label=f"{variant}: capacity {_rate(low)} held, {_rate(high)} failed")
        ttfts = [(r.offered, r.ttft_p90_ms / 1000) for r in cells if r.ttft_p90_ms is not None]
        if ttfts:
            ax_ttft.plot([x for x, _ in ttfts], [y for _, y in ttfts], marker="o", markersize=4, color=colour,
                         label=variant)
    ax_rate.set_xlabel("offered rate (requests/s)")
    ax_rate.set_ylabel("requests/s")
    ax_rate.set_title("Goodput at the SLO and rate achieved (points: the capacity search's probes)", fontsize=9)
    ax_ttft.set_xlabel("offered rate (requests/s)")
    ax_ttft.set_ylabel("TTFT p90 (s)")
    ax_ttft.set_title("The wait for a first token as the load grows", fontsize=9)
    for ax in (ax_rate, ax_ttft):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def _rate(value: float | None) -> str:
    return "none" if value is None else f"{value:.3g} req/s"


def _lines(points: dict[str, list[tuple[int, float]]], path: Path, *, xlabel: str, ylabel: str, title: str,
           y_factor: float = 1.0) -> Path | None:
    """One line per variant through (x, y) points; None when there is nothing to draw."""
    series_by_variant = {v: sorted(p) for v, p in points.items() if p}
    if not series_by_variant:
        return None
    fig, ax = _subplots(figsize=(6.5, 4))
    for variant, series in series_by_variant.items():
        ax.plot([x for x, _ in series], [y * y_factor for _, y in series], marker="o", label=variant)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def ttft_vs_prompt(points: dict[str, list[tuple[int, float]]], path: Path) -> Path | None:
    """Time to first token (points in ms) against prompt length: prefill cells and the long-context experiment."""
    return _lines(points, path, xlabel="prompt tokens", ylabel="time to first token (s), single-stream",
                  title="The wait before the first token grows with the prompt", y_factor=1 / 1000.0)


def prefill_vs_context(points: dict[str, list[tuple[int, float]]], path: Path) -> Path | None:
    return _lines(points, path, xlabel="context tokens", ylabel="prompt tok/s, single-stream",
                  title="Prompt processing by context length")


def agents_that_fit(all_fits: dict[str, dict[str, int | None]], path: Path) -> Path | None:
    fits = {v: {k: n for k, n in f.items() if n is not None} for v, f in all_fits.items()}
    fits = {v: f for v, f in fits.items() if f}
    if not fits:
        return None
    fig, ax = _subplots(figsize=(6.5, 4))
    for variant, fit in fits.items():
        xs = sorted(int(k) for k in fit)
        ax.plot(xs, [fit[str(x)] for x in xs], marker="o", label=variant)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context per agent (tokens)")
    ax.set_ylabel("agents that fit in the KV cache at once")
    ax.set_title("The window and the concurrency are one memory pool")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, path)


VERDICT_COLOURS = {"better": "tab:green", "worse": "tab:red", "no difference": "tab:blue", "not settled": "dimgrey"}


AXIS_CAP_PCT = 100.0   # an undecided change beyond this is an arrow at the edge, its value printed


@dataclass(frozen=True)
class ForestRow:
    """One figure's point on the forest plot: its change, its 95% interval as drawn (within the axis), and
    what was cut at the axis' edge, printed where it was cut."""

    label: str
    verdict: str
    change_pct: float          # as drawn: at the edge where the change is beyond it
    interval: tuple[float, float] | None   # as drawn; None: no interval (one measurement a side)
    cut: tuple[str | None, str | None] = (None, None)   # the low and high ends' real values, where cut
    change_cut: str | None = None   # the change's real value, where it is beyond the edge (an arrow there)


@dataclass(frozen=True)
class ForestLayout:
    """What a variant's forest plot shows: the figures drawn, the axis' half-width, the launch facts (exact
    changes, their own panel) and the figures with nothing to compare, listed under the plot, never drawn."""

    rows: list[ForestRow]
    edge: float
    facts: list[tuple[str, float]]
    nothing: list[str]


def forest_layout(diff: Any, *, noise_pct: float) -> ForestLayout:
    """The forest plot's content (verdicts.VariantDiff). The axis fits every decided change (better, worse, no
    difference) and, up to AXIS_CAP_PCT, the undecided ones, so one noisy figure's +700% does not flatten the
    rest; a change or interval end beyond it is cut to an arrow at the edge with its value printed there."""
    found = [(f"{c.key}  {names.name(m.metric)}", m) for c in diff.cells for m in c.metrics]
    missing: dict[str, list[str]] = {}
    for c in diff.cells:
        for m in c.metrics:
            if m.change_pct is None:
                missing.setdefault(c.key, []).append(names.name(m.metric))
        if not c.metrics and c.status_note:
            missing.setdefault(c.key, []).append("not valid")
    nothing = [f"{key} ({', '.join(figures)})" for key, figures in missing.items()]
    measured = [(label, m) for label, m in found if m.change_pct is not None]
    facts = [(f"{key}", pct) for key, _, _, pct in diff.fact_changes if pct is not None]
    decided = [abs(m.change_pct) for _, m in measured if m.verdict in {"better", "worse", "no difference"}]
    seen = [abs(m.change_pct) for _, m in measured]
    edge = max(10.0, 2 * noise_pct, 1.25 * max(decided, default=0.0), min(1.25 * max(seen, default=0.0),
                                                                           AXIS_CAP_PCT))
    rows = []
    for label, m in measured:
        verdict = m.verdict if diff.comparable else "not comparable"
        change = max(-edge, min(edge, m.change_pct))
        beyond = f"{m.change_pct:+.0f}%" if change != m.change_pct else None
        if m.ci95_pct is None:
            rows.append(ForestRow(label, verdict, change, None, change_cut=beyond))
            continue
        low, high = m.ci95_pct
        cut = (f"{low:+.0f}%" if low < -edge else None, f"{high:+.0f}%" if high > edge else None)
        rows.append(ForestRow(label, verdict, change, (max(low, -edge), min(high, edge)), cut, change_cut=beyond))
    return ForestLayout(rows, edge, facts, nothing)


def forest(diff: Any, path: Path, *, noise_pct: float) -> Path | None:
    """The A/B at a glance (verdicts.VariantDiff, laid out by forest_layout): every figure's change against the
    baseline as a point with its 95% interval on one % axis, the band of the minimum effect shaded, better
    green, worse red, no difference blue, not settled grey; a change without an interval (one measurement a
    side) a hollow point; what the axis cut, an arrow with its value; the launch facts (exact) in a panel of
    their own; the figures with nothing to compare listed under the plot; a variant that is not comparable says
    so in the title."""
    layout = forest_layout(diff, noise_pct=noise_pct)
    if not layout.rows and not layout.facts:
        return None
    from matplotlib.lines import Line2D

    panels = [n for n in (len(layout.rows), len(layout.facts)) if n]
    listed = textwrap.wrap(f"nothing to compare (not drawn): {'; '.join(layout.nothing)}", 150) if layout.nothing \
        else []
    fig, grid = _subplots(len(panels), 1, squeeze=False, height_ratios=[n + 1.5 for n in panels], figsize=(
        8.5, 1.3 + 0.24 * sum(panels) + 0.6 * (len(panels) - 1) + 0.14 * len(listed)))
    axes = list(grid[:, 0])
    ax = axes[0] if layout.rows else None
    if ax is not None:
        edge = layout.edge
        ax.axvspan(-noise_pct, noise_pct, color="#eeeeee", zorder=0, label=f"noise (±{noise_pct:g}%)")
        ax.axvline(0, color="grey", linewidth=0.8, zorder=1)
        for y, row in enumerate(layout.rows):
            colour = VERDICT_COLOURS.get(row.verdict, "grey")
            if row.interval is not None:
                ax.plot(row.interval, [y, y], color=colour, linewidth=1.2, zorder=2)
                for end, value, arrow, side in ((row.interval[0], row.cut[0], "<", 1),
                                                (row.interval[1], row.cut[1], ">", -1)):
                    ax.plot([end], [y], marker=arrow if value else "|", color=colour, markersize=5, zorder=3)
                    if value:
                        ax.annotate(value, (end, y), xytext=(4 * side, 2), textcoords="offset points", fontsize=6,
                                    color=colour, ha="left" if side > 0 else "right", va="bottom")
            if row.change_cut:
                ax.plot([row.change_pct], [y], marker=">" if row.change_pct > 0 else "<", markersize=7,
                        color=colour, zorder=3)
                ax.annotate(f"change {row.change_cut}", (row.change_pct, y), xytext=(-6 if row.change_pct > 0 else 6,
                                                                                    -3),
                            textcoords="offset points", fontsize=6, fontweight="bold", color=colour,
                            ha="right" if row.change_pct > 0 else "left", va="top")
            else:
                hollow = row.interval is None
                ax.plot([row.change_pct], [y], marker="o", markersize=5 if hollow else 4, color=colour,
                        markerfacecolor="white" if hollow else colour, zorder=3)
        ax.set_xlim(-edge, edge)
        ax.set_yticks(range(len(layout.rows)), [row.label for row in layout.rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("change against the baseline (%), 95% interval", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
        keys = [Line2D([], [], marker="o", linestyle="", color=c, label=v) for v, c in VERDICT_COLOURS.items()
                if any(r.verdict == v for r in layout.rows)]
        if any(r.interval is None for r in layout.rows):
            keys.append(Line2D([], [], marker="o", linestyle="", color="grey", markerfacecolor="white",
                               label="not judged (no interval)"))
        handles, _ = ax.get_legend_handles_labels()
        ax.legend(handles=handles + keys, fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if layout.facts:
        fax = axes[-1]
        reach = max(10.0, 1.25 * max(abs(p) for _, p in layout.facts))
        fax.axvline(0, color="grey", linewidth=0.8, zorder=1)
        for y, (_, pct) in enumerate(layout.facts):
            fax.plot([pct], [y], marker="D", markersize=5, color="black", zorder=3)
            fax.annotate(f"{pct:+.1f}%", (pct, y), xytext=(6, -2), textcoords="offset points", fontsize=6)
        fax.set_xlim(-reach, reach)
        fax.set_ylim(len(layout.facts) - 0.5, -0.5)
        fax.set_yticks(range(len(layout.facts)), [label for label, _ in layout.facts], fontsize=7)
        fax.set_xlabel("launch facts: exact change from the startup log (%)", fontsize=8)
        fax.grid(axis="x", alpha=0.3)
    title = f"{diff.variant} vs {diff.baseline}"
    if not diff.comparable:
        title += f": NOT COMPARABLE ({diff.not_comparable_reason})"
    axes[0].set_title(title, fontsize=9)
    if listed:
        fig.text(0.01, 0.005, "\n".join(listed), fontsize=6, color="dimgrey", va="bottom")
        fig.subplots_adjust(bottom=0.0)
    return _save(fig, path, bottom=0.14 * len(listed) / fig.get_figheight())


# --- the study's experiments as pictures (issue 18) ------------------------------------------------------------
def long_context(rows: dict[str, list[dict[str, Any]]], path: Path) -> Path | None:
    """The long-context experiment: the wait before the first token and the generation speed after it,
    against the prompt's length, a line per variant."""
    series = {v: sorted((r for r in rs if r.get("ttft_s") is not None), key=lambda r: r["context_tokens"])
              for v, rs in rows.items()}
    series = {v: rs for v, rs in series.items() if rs}
    if not series:
        return None
    fig, (ax_wait, ax_speed) = _subplots(1, 2, figsize=(10, 3.8))
    for variant, rs in series.items():
        xs = [r["context_tokens"] for r in rs]
        ax_wait.plot(xs, [r["ttft_s"] for r in rs], marker="o", label=variant)
        speeds = [(r["context_tokens"], r["generation_tok_s"]) for r in rs if r.get("generation_tok_s")]
        ax_speed.plot([x for x, _ in speeds], [y for _, y in speeds], marker="o", label=variant)
    for ax, label, title in ((ax_wait, "time to first token (s)", "The wait grows with the prompt"),
                             (ax_speed, "generation tok/s (single-stream)", "Generation after a long prompt")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def _occupancy(requests: list[dict[str, Any]], start: float) -> tuple[list[float], list[int], list[int]]:
    """From the raw request records: at each event, the requests sent and still without a first token (queued
    or prefilling) and those between their first and last token (generating)."""
    events: list[tuple[float, int, int]] = []
    for r in requests:
        chunks = r.get("chunk_t") or []
        if r.get("send_t") is None or not chunks:
            continue
        events += [(r["send_t"] - start, 1, 0), (chunks[0] - start, -1, 1), (chunks[-1] - start, 0, -1)]
    times, waiting, generating = [0.0], [0], [0]
    for t, dw, dg in sorted(events):
        times.append(t)
        waiting.append(waiting[-1] + dw)
        generating.append(generating[-1] + dg)
    return times, waiting, generating


def overload_timeline(bursts: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """The overload experiment over time, a panel per variant: from the client's own records the requests
    generating and those still waiting for a first token, the max-num-seqs line, and the server's sampled
    running and waiting gauges as points."""
    bursts = {v: b for v, b in bursts.items() if any(r.get("chunk_t") for r in b["requests"])}
    if not bursts:
        return None
    fig, axes = _subplots(1, len(bursts), figsize=(min(5.0 * len(bursts), 15), 3.6), squeeze=False)
    for ax, (variant, burst) in zip(axes[0], bursts.items(), strict=True):
        start = min(r["send_t"] for r in burst["requests"] if r.get("send_t") is not None)
        times, waiting, generating = _occupancy(burst["requests"], start)
        ax.step(times, generating, where="post", label="generating (client)", color="tab:blue")
        ax.step(times, waiting, where="post", label="waiting for a first token (client)", color="tab:orange")
        gauges = burst.get("gauges") or []
        if gauges:
            ax.plot([g[0] - start for g in gauges], [g[1] for g in gauges], "o", color="tab:blue", markersize=3,
                    label="running (server gauge)")
            ax.plot([g[0] - start for g in gauges], [g[2] for g in gauges], "o", color="tab:orange",
                    markersize=3, label="waiting (server gauge)")
        if burst.get("max_num_seqs"):
            ax.axhline(burst["max_num_seqs"], linestyle="--", color="grey", linewidth=0.8)
            ax.annotate("max-num-seqs", (0, burst["max_num_seqs"]), fontsize=7, color="grey", va="bottom")
        ax.set_xlabel("seconds from the burst's first send")
        ax.set_ylabel("requests")
        ax.set_title(variant, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="upper right")
    return _save(fig, path)


PREFIX_ARMS = ("shared-first", "task-first", "unrelated")


def prefix_order(arms: dict[str, dict[str, dict[str, Any]]], path: Path) -> Path | None:
    """The prefix-order experiment: each arm's wall time, a bar group per variant, its cache hit rate on the
    bar."""
    arms = {v: a for v, a in arms.items() if any(a.get(arm, {}).get("wall_s") is not None for arm in PREFIX_ARMS)}
    if not arms:
        return None
    fig, ax = _subplots(figsize=(max(5.0, 1.9 * len(arms) + 2), 3.8))
    width = 0.8 / len(PREFIX_ARMS)
    for i, arm in enumerate(PREFIX_ARMS):
        xs = [k + (i - 1) * width for k in range(len(arms))]
        walls = [(a.get(arm) or {}).get("wall_s") or 0.0 for a in arms.values()]
        bars = ax.bar(xs, walls, width, label=arm)
        for bar, a in zip(bars, arms.values(), strict=True):
            rate = (a.get(arm) or {}).get("hit_rate")
            if rate is not None:
                ax.annotate(f"{100 * rate:.0f}% hits", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(arms)), list(arms))
    ax.set_ylabel("wall time of the arm (s)")
    ax.set_title("Shared block first, task first, unrelated: wall time and prefix-cache hits", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def bimodality(repeats: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """The repeat experiment: one cell measured N times, a histogram per variant, with its two modes marked
    when there are two (never their average)."""
    repeats = {v: r for v, r in repeats.items() if r.get("runs")}
    if not repeats:
        return None
    fig, ax = _subplots(figsize=(6.5, 3.8))
    for variant, r in repeats.items():
        ax.hist(r["runs"], bins=max(4, min(20, len(r["runs"]))), alpha=0.6, label=variant)
        if r.get("bimodal"):
            for mode in (r.get("low"), r.get("high")):
                if mode is not None:
                    ax.axvline(mode, linestyle="--", color="black", linewidth=0.8)
                    ax.annotate(f"mode {mode:,.0f}", (mode, 0), fontsize=7, rotation=90, va="bottom")
    ax.set_xlabel("total tok/s of one repetition")
    ax.set_ylabel("repetitions")
    ax.set_title("One cell, measured again and again", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
