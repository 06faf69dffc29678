"""The recommendation for each variant of a stored run: diff_run puts together each variant's flag and fact
changes against its baseline (and whether the two are comparable at all) with its cells' verdicts
(verdicts.py), holds them to the family-wise error rate, and settles it with recommend: keep, revert, no
difference or not settled, in one plain sentence with the KV-cache, capacity and settle-it advice it rests on.
short_answers_by_variant gives the study's short answers per variant from the same stored files.

Long (about 510 lines): recommend's cases each say their sentence and their headline from one reading of the
diff; split, a case's two texts would be written apart.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, NamedTuple

from campaign.analysis.benefit import COST_REVERT_MIN_LAUNCHES, Figure, benefits_shown, fewest_launches, normalizable
from campaign.analysis.sentences import (
    capacity_texts,
    cost_revert_text,
    costs_of,
    fmt_value,
    kv_text,
    largest,
    listed,
    repeats_advice,
    settling_head,
    unsettled_head,
    unsettled_text,
    why_not_reverted,
)
from campaign.analysis.statistics import Look, MetricVerdict, sequential_alpha
from campaign.analysis.verdicts import (
    CellDiff,
    Outcome,
    VariantDiff,
    _cell_diffs,
    _experiment_diffs,
    family_wise,
)
from campaign.core.errors import CampaignError
from campaign.measure import answers
from campaign.measure.cells import CAVEATS, REASON_HINTS, Reason
from campaign.measure.judged import TAIL_METRICS
from campaign.spec.matrix import AUTO_FIRST_ROUNDS, AUTO_MAX_REPEATS, Matrix
from campaign.stored.records import Manifest
from campaign.stored.store import RunDir, StoredCell

THROUGHPUT_METRICS = {"total_tok_s", "per_request_tok_s", "prompt_tok_s", "goodput_rps"}
FACT_FIELDS = ("kv_cache_tokens", "max_concurrency", "block_size", "max_num_batched_tokens",
               "gpu_memory_utilization", "max_model_len")
KV_DECISIVE_PCT = 1.0    # a KV-cache change this large decides keep/revert like a measured one
# Experiment values that describe the server but should not decide keep or revert on their own (they are
# still tested, and Holm-adjusted, with the rest of the variant's family).
DIAGNOSTIC_METRICS = {"generation_tok_s_drop_pct", "speedup", "shared_first_hit_rate", "silence_s_per_1k_prompt_tokens",
                      "mean_total_tok_s", "peak_waiting", "peak_running", "completed", "queued",
                      "ran_concurrently"}


def _facts_by_variant(run: RunDir) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The first successful launch's facts and flags per variant."""
    facts: dict[str, dict[str, Any]] = {}
    flags: dict[str, dict[str, Any]] = {}
    for server in run.ready_servers():
        if server.variant not in facts:
            facts[server.variant] = server.facts.model_dump()
            flags[server.variant] = server.flags
    return facts, flags


def _suggested(run: RunDir, variant: str) -> dict[str, Any] | None:
    return next((s.suggested for s in run.ready_servers() if s.variant == variant), None)


def _pct(before: Any, after: Any) -> float | None:
    if isinstance(before, int | float) and isinstance(after, int | float) and before:
        return 100.0 * (after - before) / before
    return None


def diff_run(run: RunDir, *, baseline: str | None = None, other: RunDir | None = None,
             force: bool = False, same_names: bool = False) -> list[VariantDiff]:
    """Every variant against the baseline (in one run), or every variant of `other` against `run`'s baseline;
    with `same_names`, only each variant of `other` against this run's variant of the same name (campaign
    compare: last night's memory variant against tonight's)."""
    manifest = run.manifest()
    planned = manifest.matrix_model()
    base_name = baseline or planned.baseline
    # Per-variant references (compare_to) apply when no baseline is forced on the command line.
    references = {} if baseline else {v.name: v.compare_to for v in planned.variants if v.compare_to}
    cells = run.cells()
    facts, flags = _facts_by_variant(run)
    mine = {c.variant for c in cells} | set(facts)
    if other is not None:
        other_cells = other.cells()
        other_facts, other_flags = _facts_by_variant(other)
        # Name the other run's variants apart so the same names can be compared across runs.
        cells += [StoredCell(f"{c.variant}@B", c.repeat, c.result, c.path, c.launch) for c in other_cells]
        facts.update({f"{k}@B": v for k, v in other_facts.items()})
        flags.update({f"{k}@B": v for k, v in other_flags.items()})
        if same_names:
            references = {f"{v}@B": v for v in {c.variant for c in other_cells} | set(other_facts) if v in mine}
    by_variant: dict[str, list[StoredCell]] = defaultdict(list)
    for cell in cells:
        by_variant[cell.variant].append(cell)
    experiments: dict[str, list[dict[str, Any]]] = defaultdict(list)
    # Each with its repeat: the launch it was measured on, for taking each launch's shared speed out.
    for stored in run.experiments():
        experiments[stored.variant].append(stored.result.model_dump() | {"repeat": stored.repeat})
    if other is not None:
        for stored in other.experiments():
            experiments[f"{stored.variant}@B"].append(stored.result.model_dump() | {"repeat": stored.repeat})
    if base_name not in by_variant and base_name not in facts:
        raise CampaignError(f"baseline {base_name!r} has no measurements in {run.root}",
                            hint=f"variants measured: {', '.join(sorted(by_variant)) or 'none'}")
    diffs = []
    settled = run.settled()
    default_base = base_name
    models = _gpu_models(run) | ({f"{k}@B": v for k, v in _gpu_models(other).items()} if other is not None else {})
    # A variant that never became ready has failure records only: its start-up failure is a result too.
    failed = {s.variant for s in run.failures()} - set(facts)
    for name in failed:
        flags.setdefault(name, next((dict(v.flags) for v in planned.variants if v.name == name), {}))
    for variant in sorted(set(by_variant) | set(facts) | failed):
        base_name = references.get(variant) or default_base
        if variant == base_name or (variant == default_base and variant not in references):
            continue
        reason = _incomparable(facts.get(base_name), facts.get(variant), manifest,
                               other.manifest() if other is not None and variant.endswith("@B") else manifest)
        reason = reason or _gpu_models_differ(models.get(base_name), models.get(variant))
        comparable = force or not reason
        look = _look(planned, by_variant.get(variant, []))
        base_cells = by_variant.get(base_name, [])
        if planned.until_settled and not variant.endswith("@B"):
            # Rounds: the variant is judged against the baseline launches of the rounds it ran in, as it was
            # when the night judged it (the baseline runs on in rounds after a variant is retired).
            rounds = {c.repeat for c in by_variant.get(variant, [])}
            base_cells = [c for c in base_cells if c.repeat in rounds]
        diff = VariantDiff(
            variant=variant, baseline=base_name,
            flag_changes=_flag_changes(flags.get(base_name, {}), flags.get(variant, {})),
            fact_changes=[(f, (facts.get(base_name) or {}).get(f), (facts.get(variant) or {}).get(f),
                           _pct((facts.get(base_name) or {}).get(f), (facts.get(variant) or {}).get(f)))
                          for f in FACT_FIELDS
                          if (facts.get(base_name) or {}).get(f) != (facts.get(variant) or {}).get(f)],
            # Another run's repeat r is no round of this run's: nothing to pair it with.
            cells=_cell_diffs(base_cells, by_variant.get(variant, []), comparable, paired=not variant.endswith("@B"))
            + _experiment_diffs(experiments.get(base_name, []), experiments.get(variant, []), comparable),
            comparable=comparable, not_comparable_reason=reason, look=look,
        )
        diff.suggested = _suggested(other if other is not None and variant.endswith("@B") else run,
                                    variant.removesuffix("@B"))
        diff.tests = family_wise(diff.cells, look) if comparable else 0
        if planned.until_settled and not variant.endswith("@B"):
            record = settled.get(variant)
            diff.rounds_note = _rounds_note(record.rounds if record else None, record.outcome if record else None,
                                            look)
        diff.outcome, diff.provisional, diff.recommendation, diff.headline = recommend(
            diff, facts.get(base_name), facts.get(variant))
        diffs.append(diff)
    if same_names:
        return [d for d in diffs if references.get(d.variant) == d.baseline]
    return diffs


def _rounds_note(settled_after: int | None, outcome: str | None, look: Look) -> str:
    """When a night run until settled settled this variant, or why it is still open."""
    if settled_after is not None:
        return f"settled after {settled_after} round(s): {outcome}"
    if look.rounds is not None and look.max_rounds is not None and look.rounds >= look.max_rounds:
        return f"max_repeats reached after {look.rounds} round(s): not settled"
    return (f"still open after {look.rounds} round(s) of at most {look.max_rounds} (the budget or an interruption "
            "stopped the night; campaign run --resume RUN continues it)")


def _look(matrix: Matrix, cells: list[StoredCell]) -> Look:
    """The level a variant is judged at: the whole family alpha after a night of fixed repeats; after a night
    run until settled, the nominal level of its last look (after the rounds it was measured in)."""
    if not matrix.until_settled:
        return Look(min_effect=matrix.min_effect)
    rounds = len({c.repeat for c in cells})
    most = max(matrix.max_repeats or AUTO_MAX_REPEATS, rounds)
    return Look(alpha=sequential_alpha(rounds, most, first=AUTO_FIRST_ROUNDS), min_effect=matrix.min_effect,
                rounds=rounds, max_rounds=most)


def _incomparable(base: dict[str, Any] | None, other: dict[str, Any] | None, manifest_a: Manifest,
                  manifest_b: Manifest) -> str:
    if base is None or other is None:
        return ""
    for key, label in (("vllm_version", "vLLM version"), ("device", "device")):
        if base.get(key) != other.get(key):
            return f"different {label}: {base.get(key)} vs {other.get(key)}"
    model_a = manifest_a.profile_model().model
    model_b = manifest_b.profile_model().model
    if model_a != model_b:
        return f"different model: {model_a} vs {model_b}"
    gpus_a = manifest_a.machine.gpu_names()
    gpus_b = manifest_b.machine.gpu_names()
    if gpus_a != gpus_b:
        return f"different GPUs: {gpus_a} vs {gpus_b}"
    return ""


def _gpu_models(run: RunDir) -> dict[str, frozenset[str]]:
    """The GPU models (NVML names) each variant's launches ran on, from their placements (pool runs)."""
    out: dict[str, set[str]] = defaultdict(set)
    for _, placed in run.placements():
        out[placed.variant].update(g.name for g in placed.gpus or [] if g.name)
    return {variant: frozenset(names) for variant, names in out.items() if names}


def _gpu_models_differ(base: frozenset[str] | None, other: frozenset[str] | None) -> str:
    if not base or not other or base == other:
        return ""
    return f"different GPUs: {', '.join(sorted(base))} vs {', '.join(sorted(other))}"


def _flag_changes(base: dict[str, Any], other: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    keys = sorted(set(base) | set(other))
    return [(k, base.get(k), other.get(k)) for k in keys if base.get(k) != other.get(k)]


# A cell neither side could measure for a reason other than capacity leaves the comparison open.
_UNJUDGED = {"Invalid", "Contaminated", "Failed"}


class Recommendation(NamedTuple):
    """A variant's verdict: the outcome, whether it rests on launch facts alone, the whole sentence (the flags
    changed, every figure and fact that moved, the verdict and why) and its headline (what decided it, or the
    change nearest to settling and what would settle it, and the price: one sentence)."""

    outcome: Outcome
    provisional: bool
    sentence: str
    headline: str


def recommend(diff: VariantDiff, base_facts: dict[str, Any] | None,
              facts: dict[str, Any] | None) -> Recommendation:
    """Keep, revert, no difference or not settled, for the variant as a whole, in one plain sentence.

    Better/worse verdicts are family-wise (Holm) already. Revert needs evidence of harm (a metric worse, the KV
    cache 1% or more smaller, cells newly over capacity) or of cost without benefit (a smaller KV loss and
    nothing better: seed 000 reverted a chunk change whose only effect was -0.8% of cache); keep needs a
    benefit and no harm; harm and benefit together are a trade-off, unless the only benefit is a latency tail
    and the harm is not (a tail does not buy back throughput or capacity: revert); a speculative-decoding
    change is not judged on the speed of random-id cells at all; cells that could not be measured leave it
    not settled; an A/A comes out "no difference" (shown) or "not settled", never keep or revert; a variant
    is "no difference" only where every deciding figure is shown within +-the minimum effect, and "not
    settled" (with what would settle it) where any is neither, unless the variant has a certain cost (a smaller
    cache, fewer agents) and no benefit shown even once each launch's shared speed is taken out (benefit.py):
    from three launches a side that is a revert (issue 54). With one measurement a side nothing measured is
    judged, and the launch facts decide provisionally. Returns the outcome with its whole sentence and its
    headline (what decided it, in one sentence)."""
    changes = ", ".join(f"{k} {fmt_value(a)} -> {fmt_value(b)}" for k, a, b in diff.flag_changes) or (
        "no flag change" + (" (A/A)" if diff.aa else ""))
    if not diff.comparable:
        return Recommendation("not settled", False,
                              f"{changes}: not comparable ({diff.not_comparable_reason}): not settled",
                              f"not comparable: {diff.not_comparable_reason}")
    if facts is None:
        if base_facts is None:
            return Recommendation("not settled", False, f"{changes}: neither server became ready; nothing to "
                                  "compare: not settled", "neither server became ready")
        return Recommendation("revert", False, f"{changes}: the server never became ready with these flags: revert",
                              "the server never became ready with these flags")
    # A change of speculative decoding measured on random token ids: their speed says nothing of text, so those
    # cells decide nothing (other changes on a speculative server are measured like any other).
    random_spec = _random_spec_cells(diff)
    decisive = _deciding(diff, random_spec)
    text_judged = any(m.p_value is not None for c, m in decisive if c.phase == "decode")
    # A cell whose throughput is worse is not better because one of its latency tails is: a faster p99 gap
    # where tokens per second fell is the same change seen through a percentile, not a second benefit.
    slower = {c.key for c, m in decisive if m.metric in THROUGHPUT_METRICS and m.verdict == "worse"}
    shown_better = [(c, m) for c, m in decisive if m.verdict == "better"
                    and not (m.metric in TAIL_METRICS and c.key in slower)]
    shown_worse = [(c, m) for c, m in decisive if m.verdict == "worse"]
    better = [f"{m.metric} at {c.key}" for c, m in shown_better]
    worse = [f"{m.metric} at {c.key}" for c, m in shown_worse]
    judged = any(m.p_value is not None for c in diff.cells for m in c.metrics)
    one_measurement = any(m.verdict == "not judged" and m.n_baseline and m.n_variant
                          for c in diff.cells for m in c.metrics)
    # Over capacity is exact without repeats: a cell the baseline ran and the variant cannot is lost capacity.
    lost = [c.key for c in diff.cells if "Over capacity" in c.variant_statuses and "Over capacity" not in
            c.baseline_statuses]
    gained = [c.key for c in diff.cells if "Over capacity" in c.baseline_statuses and "Over capacity" not in
              c.variant_statuses]
    unjudged = [c for c in diff.cells if _UNJUDGED & set(c.variant_statuses + c.baseline_statuses)
                and c.phase != "experiment"]
    # An experiment not Valid on a side is not judged there (a burst the client did not send at once); said,
    # but it holds up no verdict: the study's experiments describe the server, the cells decide.
    unread = [c for c in diff.cells if _UNJUDGED & set(c.variant_statuses + c.baseline_statuses)
              and c.phase == "experiment"]
    # Judged like every cell, but said: their averages span two regimes of the window.
    unsteady = [c.key for c in diff.cells if Reason.NOT_STEADY in c.variant_reasons + c.baseline_reasons]
    # Judged too (the same path on both sides), but said: those TTFTs are the client's path's, not the server's.
    proxied = [c.key for c in diff.cells if Reason.CLIENT_TTFT_OVER_SERVER in c.variant_reasons + c.baseline_reasons]
    kv_change = _pct((base_facts or {}).get("kv_cache_tokens"), facts.get("kv_cache_tokens"))
    kv_gain = kv_change is not None and kv_change >= KV_DECISIVE_PCT
    kv_loss = kv_change is not None and kv_change <= -KV_DECISIVE_PCT

    parts: list[str] = []
    if better:
        parts.append(f"better: {listed(better)}")
    if worse:
        parts.append(f"worse: {listed(worse)}")
    if kv_change is not None and abs(kv_change) >= 0.05:
        parts.append(kv_text(base_facts, facts, kv_change))
    if lost:
        parts.append(f"over capacity now in {listed(lost)}")
    if gained:
        parts.append(f"no longer over capacity in {listed(gained)}")
    parts += capacity_texts(diff)
    if random_spec:
        parts.append(f"speculative decoding measured on random prompts in {listed(random_spec)}, not judged on "
                     f"speed ({REASON_HINTS[Reason.SPEC_RANDOM_PROMPTS]})")
    if unsteady:
        parts.append(f"not steady in {listed(unsteady)} (its averages span two regimes of the window: "
                     f"{REASON_HINTS[Reason.NOT_STEADY]})")
    if proxied:
        parts.append(f"the client's TTFT past the server's own in {listed(proxied)} "
                     f"({REASON_HINTS[Reason.CLIENT_TTFT_OVER_SERVER]})")
    for kind, found in (("cell", unjudged), ("experiment", unread)):
        if found:
            codes = sorted({code for c in found for code in c.variant_reasons + c.baseline_reasons} - CAVEATS)
            why = "; ".join(f"{code.value}: {REASON_HINTS[code]}" for code in codes) or f"see the {kind}s' reasons"
            parts.append(f"{len(found)} {kind}(s) not valid ({listed([c.key for c in found])}; {why})")

    def sentence(verdict: str) -> str:
        return f"{changes}: {'; '.join(parts)}: {verdict}" if parts else f"{changes}: {verdict}"

    # The headline's parts: what was shown, and the launch facts that are exact.
    kv = [kv_text(base_facts, facts, kv_change)] if kv_change is not None else []
    exact_gain = (kv if kv_gain else []) + ([f"no longer over capacity in {listed(gained, 1)}"] if gained else [])
    exact_loss = (kv if kv_loss else []) + ([f"over capacity now in {listed(lost, 1)}"] if lost else [])
    gains = "; ".join(([largest(shown_better)] if shown_better else []) + ([", ".join(exact_gain)] if exact_gain
                                                                            else []))
    losses = "; ".join(([largest(shown_worse)] if shown_worse else []) + ([", ".join(exact_loss)] if exact_loss
                                                                          else []))

    def said(outcome: Outcome, verdict: str, headline: str, provisional: bool = False) -> Recommendation:
        return Recommendation(outcome, provisional, sentence(verdict), headline)

    gain, loss = kv_gain or bool(gained), kv_loss or bool(lost)
    if diff.aa and (better or worse or gain or loss):
        return said("not settled", "not settled: an A/A cannot differ, so these are false positives or "
                    "launch-to-launch variation (noise this rig's intervals do not capture)",
                    f"an A/A read a difference ({gains or losses}): noise this rig's intervals do not capture")
    if not judged:
        # Issue 20: one measurement a side is not evidence (nor are cells never Valid on both sides); only the
        # launch facts are exact, so they decide, provisionally.
        why = "one measurement" if one_measurement else "no cell measured on both sides"
        advice = repeats_advice(diff)
        if gain and not loss:
            return said("keep", f"keep, provisionally ({why}: {advice} to confirm)",
                        f"{gains}, from the launch facts alone ({why}: repeats would confirm it)", True)
        if loss and not gain:
            return said("revert", f"revert, provisionally ({why}: {advice} to confirm)",
                        f"{losses}, from the launch facts alone ({why}: repeats would confirm it)", True)
        if one_measurement:
            return said("not settled", f"not settled (one measurement a side: {advice} to settle it)",
                        "one measurement a side: repeats would settle it")
    # 1% or more of the KV cache counts like a faster or slower cell; a smaller loss is still a cost.
    harm = bool(worse) or kv_loss or bool(lost)
    benefit = bool(better) or kv_gain or bool(gained)
    # A faster latency tail alone does not buy back lost throughput or capacity: only a rate, a first-token
    # time or more cache can stand against a harm (issue 15: a drafter model, p99 gaps shorter at 8 streams,
    # the cache cut 5x and 64 streams no longer served).
    rate_benefit = kv_gain or bool(gained) or any(
        m.verdict == "better" and m.metric not in TAIL_METRICS for _, m in decisive)
    rate_harm = kv_loss or bool(lost) or any(m.verdict == "worse" and m.metric not in TAIL_METRICS
                                             for _, m in decisive)
    # Streams the baseline served that the variant cannot hold at all (over capacity now, and a smaller cache)
    # are not weighed against a faster cell elsewhere: seed 000 reverted a drafter that cut the cache 5x.
    if lost and kv_loss and not gained and not kv_gain:
        return said("revert", "revert (it can no longer serve what the baseline served)",
                    f"it can no longer serve what the baseline served: {losses}")
    if harm and (rate_benefit or (benefit and not rate_harm)):
        return said("not settled", "not settled: a trade-off, decide by which matters more",
                    f"a trade-off: {gains} against {losses}")
    if harm and benefit:
        return said("revert", "revert (a better latency tail does not buy back what was lost)",
                    f"{losses}; a better latency tail ({gains}) does not buy it back")
    if harm:
        return said("revert", "revert", losses)
    if random_spec and not text_judged:
        return said("not settled", "not settled: speculative decoding cannot be judged on random prompts alone",
                    "speculative decoding measured on random prompts only: measure it on text")
    if unjudged:
        return said("not settled", "not settled until those cells are measured",
                    f"{len(unjudged)} cell(s) not measured on both sides ({listed([c.key for c in unjudged], 1)}): "
                    "not settled until they are")
    if benefit:
        costs_kept = [] if diff.aa else costs_of(base_facts, facts, kv_change)
        return said("keep", "keep", gains + (f"; at a price: {listed(costs_kept)}" if costs_kept else ""))
    if not judged:
        return said("not settled", "not settled: no comparable measurements", "no comparable measurements")
    within = f"+-{100 * diff.look.min_effect:g}%"
    unsettled = [(c, m) for c, m in decisive if m.verdict == "not settled"]
    costs = [] if diff.aa else costs_of(base_facts, facts, kv_change)
    figures = _figures(decisive)
    if (unsettled and costs and figures is not None and fewest_launches(figures) >= COST_REVERT_MIN_LAUNCHES
            and normalizable(figures)):
        # Issue 54: a certain cost with no benefit shown is reverted on the evidence so far, unless a benefit
        # shows on its own once each launch's shared speed is taken out (benefit.py; verdict-check's rates).
        shown = benefits_shown(figures, diff.look.min_effect)
        if not shown:
            return said("revert", cost_revert_text(costs, unsettled, diff),
                        f"it costs {listed(costs)} and showed no benefit in {diff.tests} tests")
        best = max(shown, key=lambda b: b.change_pct)
        return said("not settled",
                    f"{unsettled_text(unsettled, diff)}; it costs {listed(costs)}, but {best.figure} is better by "
                    f"{best.change_pct:.1f}% on its own once each launch's shared speed is taken out (one-sided "
                    f"p={best.p_value:.3f}): a revert could throw a real benefit away",
                    f"it costs {listed(costs)}, but {best.figure} may be {best.change_pct:.1f}% better")
    if unsettled and costs:
        # Why the cost alone did not revert it, and what would let it.
        return said("not settled", f"{unsettled_text(unsettled, diff)}; it costs {listed(costs)}, "
                                   f"but {why_not_reverted(figures)}",
                    f"it costs {listed(costs)}; {settling_head(unsettled, diff.look)}")
    if unsettled:
        return said("not settled", unsettled_text(unsettled, diff), settling_head(unsettled, diff.look))
    if costs:
        return said("revert", f"revert (a cost with no benefit: every deciding figure is shown within {within})",
                    f"it costs {listed(costs)}, and every deciding figure is shown within {within}")
    noise = (f"no difference: every deciding figure shown within {within} ({diff.tests} tests at "
             f"{diff.look.describe()})")
    # Values that describe the server but do not decide (DIAGNOSTIC_METRICS) may still have moved: saying
    # "no difference" over a 250% longer queue at overload without naming it would be a plausible wrong sentence.
    moved = [f"{m.metric} at {c.key} {m.verdict}" for c in diff.cells for m in c.metrics
             if m.metric in DIAGNOSTIC_METRICS and m.verdict in {"better", "worse"}]
    if moved:
        noise += f"; moved, but describing the server rather than deciding: {listed(moved)}"
    return said("no difference", noise, f"every deciding figure shown within {within} ({diff.tests} tests)")


def _figures(decisive: list[tuple[CellDiff, MetricVerdict]]) -> list[Figure] | None:
    """The tested deciding figures by launch, for benefit.py; None where one of them lacks its values by
    launch (not kept, or fewer launches than measurements: a benefit there could not be looked for, so its
    absence is no evidence)."""
    out = []
    for c, m in decisive:
        if m.p_value is None:
            continue
        if m.by_launch is None or len(m.by_launch[0]) < m.n_baseline or len(m.by_launch[1]) < m.n_variant:
            return None
        out.append(Figure(f"{m.metric} at {c.key}", c.key, m.direction, *m.by_launch))
    return out or None


def _random_spec_cells(diff: VariantDiff) -> list[str]:
    """A change of speculative decoding measured on random token ids: their speed says nothing of text, so
    those cells decide nothing (other changes on a speculative server are measured like any other)."""
    spec_changed = any(k.replace("_", "-").lstrip("-") == "speculative-config" for k, _, _ in diff.flag_changes)
    return [c.key for c in diff.cells if spec_changed
            and Reason.SPEC_RANDOM_PROMPTS in c.variant_reasons + c.baseline_reasons]


def _deciding(diff: VariantDiff, random_spec: list[str]) -> list[tuple[CellDiff, MetricVerdict]]:
    """The cells' metrics that decide the variant: not the diagnostic values, not random-id speculative cells."""
    return [(c, m) for c in diff.cells for m in c.metrics
            if m.metric not in DIAGNOSTIC_METRICS and c.key not in random_spec]


@dataclass(frozen=True)
class Judged:
    """One variant's verdict at a look: what a night run until settled reads after each round."""

    outcome: str             # keep, revert, no difference or not settled
    sentence: str            # the recommendation
    why: str = ""            # not settled: why, in a few words (the progress line's)
    settleable: bool = True  # False: more rounds cannot settle it (not comparable)


def judged(run: RunDir) -> dict[str, Judged]:
    """Every variant's outcome at this look, for a night run until settled (orchestrate.Night.execute), with
    why an open one is open; more rounds cannot settle a variant that is not comparable. (A baseline that
    never started leaves nothing to judge: diff_run refuses it.)"""
    out = {}
    for d in diff_run(run):
        unsettled = [(c, m) for c, m in _deciding(d, _random_spec_cells(d)) if m.verdict == "not settled"]
        # Otherwise the sentence's end says why (cells not valid, a trade-off, an A/A's false positive).
        tail = d.recommendation if len(d.recommendation) <= 200 else "..." + d.recommendation[-200:]
        why = unsettled_head(unsettled, d.look) if unsettled else tail
        out[d.variant] = Judged(d.outcome, d.recommendation, why=why, settleable=d.comparable)
    return out


def short_answers_by_variant(run: RunDir) -> dict[str, dict[str, Any]]:
    """The study's short answers per variant, from stored files only (measured variants first)."""
    facts, flags = _facts_by_variant(run)
    cells: dict[str, list[Any]] = defaultdict(list)
    for stored in run.cells():
        cells[stored.variant].append(stored.result)
    manifest = run.manifest()
    profile = manifest.profile_model()
    floors = manifest.matrix_model().floors or answers.DEFAULT_FLOORS
    searches: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in run.experiments():
        if record.result.kind == "slo-search":
            searches[record.variant].append(record.result.model_dump(mode="json"))
    # In the matrix's order (a set's order moved with the interpreter's string hashing, so two runs of one
    # night printed their short answers in different orders).
    order = {variant.name: index for index, variant in enumerate(manifest.matrix_model().variants)}
    return {v: answers.short_answers(cells=cells.get(v, []), facts=facts.get(v), flags=flags.get(v, {}),
                                     floors=floors, hardware=profile.hardware,
                                     model_shape=profile.shape_name, time_scale=manifest.time_scale,
                                     searches=searches.get(v, []))
            for v in sorted(set(facts) | set(cells), key=lambda name: (name not in cells,
                                                                        order.get(name, len(order)), name))}

