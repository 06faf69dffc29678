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
