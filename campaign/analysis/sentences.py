"""The recommendation's words: a flag's value, the KV-cache and agents change, a list cut short, the launch
facts that are certainly worse (the costs), capacity at the SLO, why a variant is not settled and what would
settle it, and why a cost with no benefit shown is reverted. recommend.py decides; this says it.
"""

from __future__ import annotations

import math
from typing import Any

from campaign.analysis.benefit import COST_REVERT_MIN_LAUNCHES, NORMALIZE_MIN_CELLS, Figure, fewest_launches
from campaign.analysis.statistics import MAX_ADVISED_REPEATS, Look, MetricVerdict, settle_advice
from campaign.analysis.verdicts import CellDiff, VariantDiff
from campaign.measure.answers import agents_that_fit

AGENT_CONTEXT = 8000     # the seed's "agents at 8K context" row


def fmt_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def agents_at_8k(facts: dict[str, Any] | None) -> int | None:
    """How many agents at 8K context a launch's cache holds (None: its facts do not say)."""
    facts = facts or {}
    return agents_that_fit(facts.get("kv_cache_tokens"), AGENT_CONTEXT, facts.get("block_size"),
                           facts.get("max_model_len"))


def kv_text(base_facts: dict[str, Any] | None, facts: dict[str, Any], kv_change: float) -> str:
    text = f"KV cache {kv_change:+.1f}%"
    windows = [w for w in ((base_facts or {}).get("max_model_len"), facts.get("max_model_len")) if isinstance(w, int)]
    agents_a, agents_b = agents_at_8k(base_facts), agents_at_8k(facts)
    if windows and AGENT_CONTEXT > min(windows):
        text += f" (agents at 8K context: none, beyond the {min(windows):,}-token window)"
    elif agents_a is not None and agents_b is not None and agents_a != agents_b:
        text += f", agents at 8K context {agents_a} -> {agents_b}"
    return text


def listed(items: list[str], limit: int = 3) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def repeats_advice(diff: VariantDiff) -> str:
    """How many launches a side would settle it, from the noise seen on the cells' primary metrics: the
    fewest that would either confirm the change seen or show none (each metric's own advice is in its row)."""
    needed = sorted(m.repeats_needed for c in diff.cells for m in c.metrics
                    if m.repeats_needed is not None and m.metric in {"total_tok_s", "prompt_tok_s"})
    if not needed:
        if any(m.metric in {"total_tok_s", "prompt_tok_s"} and "not reachable at this noise" in m.note
               for c in diff.cells for m in c.metrics):
            return (f"more launches would not settle it at this noise (over {MAX_ADVISED_REPEATS} a side for "
                    "either answer): a quieter rig, or a larger min_effect")
        return "run at least 2 repeats a side to know the noise (campaign run --resume RUN --repeats 2)"
    typical = needed[len(needed) // 2]
    return (f"run {typical} repeats (campaign run --resume RUN --repeats {typical}, or `repeats: auto`; at this "
            f"noise {typical} a side settle the typical figure)")


CAPACITY_UNITS = {"max_rate_rps": "req/s", "max_concurrency": "streams"}


def capacity_texts(diff: VariantDiff) -> list[str]:
    """Capacity at the SLO, baseline -> variant, from the slo-search experiments: for a service, the line that
    matters ("capacity at SLO 6.1 -> 7.4 req/s"), with what the test said of it."""
    out = []
    for cell in diff.cells:
        for m in cell.metrics:
            unit = CAPACITY_UNITS.get(m.metric)
            if unit is None or m.baseline is None or m.variant is None:
                continue
            what = "capacity at SLO" if m.metric == "max_rate_rps" else "concurrency at SLO"
            out.append(f"{what} {m.baseline:.3g} -> {m.variant:.3g} {unit} ({m.verdict})")
    return out


def costs_of(base_facts: dict[str, Any] | None, facts: dict[str, Any], kv_change: float | None) -> list[str]:
    """The launch facts that are certainly worse: exact from the startup log, with no noise to rule out (a
    slower startup varies by launch; a figure shown worse is a harm and reverts on its own)."""
    base = base_facts or {}
    out = []
    if kv_change is not None and kv_change <= -0.05:
        out.append(f"{-kv_change:.1f}% KV cache")
    before, after = base.get("max_concurrency"), facts.get("max_concurrency")
    # Only where the cache's size is not known: otherwise the concurrency follows from it.
    if kv_change is None and isinstance(before, int | float) and isinstance(after, int | float) and after < before:
        out.append(f"max concurrency {before:g} -> {after:g}")
    agents = (agents_at_8k(base), agents_at_8k(facts))
    # Only with a cache loss past rounding: whole agents drop by one for a few tokens less.
    if out and agents[0] is not None and agents[1] is not None and agents[1] < agents[0]:
        out.append(f"agents at 8K context {agents[0]} -> {agents[1]}")
    return out


def why_not_reverted(figures: list[Figure] | None) -> str:
    """Why a cost with no benefit shown is not reverted yet (the conditions the promised rates rest on)."""
    if figures is None:
        return "a figure's values by launch are missing, so a benefit there could not be looked for"
    if fewest_launches(figures) < COST_REVERT_MIN_LAUNCHES:
        return (f"a cost with no benefit shown is reverted only from {COST_REVERT_MIN_LAUNCHES} launches a side "
                f"(this has {fewest_launches(figures)})")
    cells = len({f.cell for f in figures})
    return (f"with {cells} cells a launch's shared speed cannot be told from a benefit: a cost with no benefit "
            f"shown is reverted from {NORMALIZE_MIN_CELLS + 1} cells")


def cost_revert_text(costs: list[str], unsettled: list[tuple[CellDiff, MetricVerdict]], diff: VariantDiff) -> str:
    """Why a cost with no benefit shown is reverted: the cost, that nothing was better, the largest benefit the
    figures' own 95% intervals still allow, and how many launches a side would show no difference."""
    within = f"+-{100 * diff.look.min_effect:g}%"
    text = (f"revert (a cost with no benefit shown: it costs {listed(costs)}; no figure better in {diff.tests} "
            f"tests, nor on its own once each launch's shared speed is taken out")

    def allowed(item: tuple[CellDiff, MetricVerdict]) -> float:
        m = item[1]
        if m.ci95_pct is None:
            return -math.inf
        return m.ci95_pct[1] if m.direction > 0 else -m.ci95_pct[0]

    cell, widest = max(unsettled, key=allowed)
    if allowed((cell, widest)) > 0:
        text += (f"; the largest benefit still possible: {widest.metric} at {cell.key}, up to "
                 f"{allowed((cell, widest)):.1f}%")
    needed = [m.equivalence_repeats for _, m in unsettled]
    if needed and all(n is not None for n in needed):
        text += f"; {max(n or 0 for n in needed)} launches a side would show no difference within {within})"
    else:
        text += (f"; no difference within {within} is not reachable at this noise in {MAX_ADVISED_REPEATS} launches "
                 "a side)")
    return text


def unsettled_head(unsettled: list[tuple[CellDiff, MetricVerdict]], look: Look) -> str:
    """How many deciding figures are open, and the widest interval: where it is and which side is noisy."""
    def width(item: tuple[CellDiff, MetricVerdict]) -> float:
        ci = item[1].verdict_ci_pct
        return ci[1] - ci[0] if ci is not None else 0.0

    cell, widest = max(unsettled, key=width)
    text = (f"not settled: {len(unsettled)} deciding figure(s) neither shown different nor within "
            f"+-{100 * look.min_effect:g}%")
    if widest.verdict_ci_pct is not None and widest.change_pct is not None:
        lo, hi = widest.verdict_ci_pct
        text += (f"; the widest, {widest.metric} at {cell.key}, {widest.change_pct:+.1f}% in [{lo:+.1f}%, "
                 f"{hi:+.1f}%]")
        if widest.spread_pct is not None:
            text += f" ({noisy_side(widest.spread_pct)})"
    return text


def closest_to_settling(unsettled: list[tuple[CellDiff, MetricVerdict]]) -> list[tuple[CellDiff, MetricVerdict]]:
    """The open figures by what would settle them soonest: first the changes fewest launches would confirm,
    then the largest."""
    return sorted(unsettled, key=lambda item: (item[1].confirm_repeats is None, item[1].confirm_repeats or 0,
                                               -abs(item[1].change_pct or 0.0)))


def unsettled_text(unsettled: list[tuple[CellDiff, MetricVerdict]], diff: VariantDiff) -> str:
    """Why a variant is not settled and what would settle it: the widest interval, where it is and which side
    is noisy; then, for the largest changes seen, the launches a side that would confirm each if it is real and
    that would show no difference if it is not."""
    look = diff.look
    text = unsettled_head(unsettled, look)
    for cell, m in closest_to_settling(unsettled)[:2]:
        have = min(m.n_baseline, m.n_variant)
        text += (f"; {m.metric} at {cell.key} {m.change_pct or 0.0:+.1f}%: "
                 + settle_advice((m.change_pct or 0.0) / 100, m.confirm_repeats, m.equivalence_repeats, have,
                                 look.min_effect))
    return text


def noisy_side(spread_pct: tuple[float, float]) -> str:
    base, variant = spread_pct
    text = f"one launch varies {variant:.1f}% on the variant's side, {base:.1f}% on the baseline's"
    if max(base, variant) > 2 * max(min(base, variant), 1e-9):
        text += f": the {'variant' if variant > base else 'baseline'} is the noisy side"
    return text


# --- the verdict in one sentence (the report's first line a variant; the whole reasoning stays the sentence) ---

def change_text(cell: CellDiff, m: MetricVerdict) -> str:
    """`prompt_tok_s at prefill-L1536 -67.5%`: a figure's change seen."""
    return f"{m.metric} at {cell.key} {m.change_pct or 0.0:+.1f}%"


def largest(found: list[tuple[CellDiff, MetricVerdict]], limit: int = 2) -> str:
    """The `limit` largest changes of these figures, the largest first."""
    ranked = sorted(found, key=lambda item: -abs(item[1].change_pct or 0.0))
    return listed([change_text(c, m) for c, m in ranked], limit)


def settling_head(unsettled: list[tuple[CellDiff, MetricVerdict]], look: Look) -> str:
    """The open change nearest to settling, and what would settle it: `prompt_tok_s at prefill-L1536 -67.5%
    seen, not yet shown: 1 more launch a side would confirm it`."""
    cell, m = closest_to_settling(unsettled)[0]
    have = min(m.n_baseline, m.n_variant)

    def more(n: int | None, then: str, out_of_reach: str) -> str:
        if n is None:
            return f"{out_of_reach} is out of reach at this noise (over {MAX_ADVISED_REPEATS} launches a side)"
        n = max(1, n - have)
        return f"{n} more launch{'es' if n > 1 else ''} a side would {then}"

    if abs(m.change_pct or 0.0) >= 100 * look.min_effect:
        return (f"{change_text(cell, m)} seen, not yet shown: "
                f"{more(m.confirm_repeats, 'confirm it', 'confirming it')}")
    return (f"{change_text(cell, m)} seen, under the +-{100 * look.min_effect:g}% that counts: "
            f"{more(m.equivalence_repeats, 'show no difference', 'showing no difference')}")
