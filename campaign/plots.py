"""The study's charts as PNG files (matplotlib, no display). Reads plain data only; every axis is labelled
single-stream or aggregate where it matters."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on servers and CI

import matplotlib.pyplot as plt  # noqa: E402

from campaign import answers  # noqa: E402
from campaign.cells import CellResult  # noqa: E402

DPI = 110


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def throughput_vs_concurrency(by_variant: Mapping[str, Sequence[CellResult]], short: dict[str, dict[str, Any]],
                              path: Path) -> Path | None:
    """Seed 000's table as a picture: aggregate and per-request tok/s against concurrency, knee and floors."""
    ladders = {v: answers.ladder_from_cells(cells) for v, cells in by_variant.items()}
    ladders = {v: ladder for v, ladder in ladders.items() if ladder}
    if not ladders:
        return None
    fig, (ax_total, ax_each) = plt.subplots(1, 2, figsize=(11, 4.2))
    for variant, ladder in ladders.items():
        xs = [s.concurrency for s in ladder]
        ax_total.plot(xs, [s.total_tok_s for s in ladder], marker="o", label=variant)
        ax_each.plot(xs, [s.per_request_tok_s for s in ladder], marker="o", label=variant)
        knee = (short.get(variant) or {}).get("knee")
        if knee:
            ax_total.axvline(knee["concurrency"], linestyle=":", color="grey")
            ax_total.annotate(f"knee ({variant})", (knee["concurrency"], max(s.total_tok_s for s in ladder)),
                              fontsize=8, color="grey")
    for floor in answers.DEFAULT_FLOORS:
        ax_each.axhline(floor, linestyle="--", linewidth=0.8, color="tab:red")
        ax_each.annotate(f"{floor:g} tok/s floor", (1, floor), fontsize=8, color="tab:red", va="bottom")
    for ax, title, label in ((ax_total, "Aggregate (all requests together)", "total tok/s"),
                             (ax_each, "Per request (what each user feels)", "tok/s per request")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(label)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def _lines(points: dict[str, list[tuple[int, float]]], path: Path, *, xlabel: str, ylabel: str, title: str,
           y_factor: float = 1.0) -> Path | None:
    """One line per variant through (x, y) points; None when there is nothing to draw."""
    series_by_variant = {v: sorted(p) for v, p in points.items() if p}
    if not series_by_variant:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
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
    fig, ax = plt.subplots(figsize=(6.5, 4))
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


VERDICT_COLOURS = {"better": "tab:green", "worse": "tab:red", "inside noise": "dimgrey"}


def forest(diff: Any, path: Path, *, noise_pct: float) -> Path | None:
    """The A/B at a glance (compare.VariantDiff): every cell and metric's change against the baseline as a point
    with its 95% interval on one % axis, the band inside which a change is noise shaded, better green, worse
    red, inside noise grey; a change without an interval (one measurement a side) a hollow point, a cell or
    metric with nothing to compare an x at 0, and a variant that is not comparable says so in the title."""
    rows: list[tuple[str, Any]] = [(f"{c.key}  {m.metric}", m) for c in diff.cells for m in c.metrics]
    rows += [(f"{c.key}  (not valid)", None) for c in diff.cells if not c.metrics and c.status_note]
    # The launch facts' changes are exact (no interval): the KV cache's often decides the verdict.
    facts = [(f"launch fact  {key}", pct) for key, _, _, pct in diff.fact_changes if pct is not None]
    if not rows and not facts:
        return None
    # The axis fits the changes, not the widest interval (one noisy TTFT's +-8000% would flatten the rest):
    # an interval beyond it ends in an arrow at the edge.
    changes = [abs(m.change_pct) for _, m in rows if m is not None and m.change_pct is not None]
    edge = max(10.0, 2 * noise_pct, 1.25 * max(changes + [abs(p) for _, p in facts], default=0.0))
    fig, ax = plt.subplots(figsize=(8.5, 1.1 + 0.24 * (len(rows) + len(facts))))
    ax.axvspan(-noise_pct, noise_pct, color="#eeeeee", zorder=0, label=f"noise (±{noise_pct:g}%)")
    ax.axvline(0, color="grey", linewidth=0.8, zorder=1)
    for y, (_, m) in enumerate(rows):
        if m is None or m.change_pct is None:
            ax.plot([0], [y], marker="x", color="darkorange", zorder=3)
            continue
        colour = VERDICT_COLOURS.get(m.verdict, "grey") if diff.comparable else "grey"
        if m.ci95_pct is None:
            ax.plot([m.change_pct], [y], marker="o", markerfacecolor="white", color=colour, zorder=3)
            continue
        low, high = max(m.ci95_pct[0], -edge), min(m.ci95_pct[1], edge)
        ax.plot([low, high], [y, y], color=colour, linewidth=1.2, zorder=2)
        ax.plot([m.change_pct], [y], marker="o", markersize=4, color=colour, zorder=3)
        for end, clipped, arrow in ((low, m.ci95_pct[0] < -edge, "<"), (high, m.ci95_pct[1] > edge, ">")):
            ax.plot([end], [y], marker=arrow if clipped else "|", color=colour, markersize=5, zorder=3)
    for y, (_, pct) in enumerate(facts, start=len(rows)):
        ax.plot([pct], [y], marker="D", markersize=5, color="black", zorder=3)
    ax.set_xlim(-edge, edge)
    ax.set_yticks(range(len(rows) + len(facts)), [label for label, _ in rows + facts], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("change against the baseline (%), 95% interval")
    title = f"{diff.variant} vs {diff.baseline}"
    if not diff.comparable:
        title += f": NOT COMPARABLE ({diff.not_comparable_reason})"
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path)
