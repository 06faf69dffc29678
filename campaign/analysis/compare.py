"""`campaign compare RUN_A RUN_B`: two nights side by side, each variant of the second against the variant of
the same name in the first, with the statistics the within-night diff uses (recommend.diff_run, same_names).

A comparison across nights is weaker than one within a night, and says so: the nights were not interleaved, so
whatever changed between them (the driver, vLLM, the card's warmth, other load on the machine) is in every
difference beside the change meant. It gives a verdict only where each night's own drift check passed (its
baseline's first and last launches agree: each night describes one state of the machine) and both nights ran the
same model on the same GPUs; otherwise it shows the figures and withholds the verdict, saying why.
"""

from __future__ import annotations

from dataclasses import dataclass

from campaign.analysis import recommend, summary
from campaign.analysis.summary import Drift
from campaign.analysis.verdicts import VariantDiff
from campaign.stored.records import Manifest
from campaign.stored.store import RunDir

CAVEAT = ("the two nights were not interleaved: whatever changed between them (the driver, vLLM, the card's "
          "warmth, other load on the machine) is in every difference below, beside the change you meant; an A/B "
          "within one night (both as variants of one matrix) is the sound comparison")


@dataclass(frozen=True)
class Comparison:
    """Night B against night A, variant by variant."""

    first: RunDir
    second: RunDir
    diffs: list[VariantDiff]       # each variant of B (named <name>@B) against A's variant of that name
    drifts: tuple[Drift, Drift]    # each night's own drift check (summary.drift)
    differences: list[str]         # what differs between the nights beside the flags, in words
    withheld: str | None           # why no verdict is given; None: the verdicts stand
    unmatched: list[str]           # variants of one night with no namesake in the other, said as such


def _vllm_version(run: RunDir) -> str | None:
    return next((s.facts.vllm_version for s in run.ready_servers() if s.facts.vllm_version), None)


def _gpus(manifest: Manifest) -> tuple[list[str | None], str | None]:
    gpu = manifest.machine.gpu or {}
    return manifest.machine.gpu_names(), gpu.get("driver")


def differences(first: RunDir, second: RunDir) -> list[str]:
    """What the two nights' records say differs, beside the flags: when, the vLLM version, the model, the GPUs
    and their driver, the tool and the matrix."""
    a, b = first.manifest(), second.manifest()
    out = [f"measured {a.created_utc} -> {b.created_utc}"]
    pairs = [("vLLM", _vllm_version(first), _vllm_version(second)),
             ("model", a.profile_model().model, b.profile_model().model),
             ("GPUs", ", ".join(str(n) for n in _gpus(a)[0]) or "none",
              ", ".join(str(n) for n in _gpus(b)[0]) or "none"),
             ("GPU driver", _gpus(a)[1], _gpus(b)[1]),
             ("tool", f"{a.tool.version} ({(a.tool.git_commit or 'no git')[:12]})",
              f"{b.tool.version} ({(b.tool.git_commit or 'no git')[:12]})"),
             ("matrix", a.campaign, b.campaign)]
    out += [f"{what} {x} -> {y}" for what, x, y in pairs if x != y]
    return out


def compare(first: RunDir, second: RunDir) -> Comparison:
    """Night `second` against night `first`, each variant against its namesake."""
    diffs = recommend.diff_run(first, other=second, same_names=True, force=True)
    drifts = (summary.drift(first), summary.drift(second))
    withheld = []
    for name, drift in zip(("A", "B"), drifts, strict=True):
        if not drift.checked:
            withheld.append(f"night {name}'s drift was not checked (its baseline was launched once: run 2 repeats "
                            "or more)")
        elif drift.drifted:
            moved = f" {drift.median_change_pct:+.1f}%" if drift.median_change_pct is not None else ""
            withheld.append(f"night {name}'s baseline moved{moved} between its first and last launch "
                            f"({', '.join(drift.moved) or 'drifted'})")
    a, b = first.manifest(), second.manifest()
    if a.profile_model().model != b.profile_model().model:
        withheld.append(f"the nights served different models ({a.profile_model().model} and "
                        f"{b.profile_model().model})")
    if _gpus(a)[0] != _gpus(b)[0]:
        withheld.append("the nights ran on different GPUs")
    names = [{c.variant for c in run.cells()} | {s.variant for s in run.servers()} for run in (first, second)]
    unmatched = [f"{v} (night {night} only)" for night, mine, theirs in (("A", names[0], names[1]),
                                                                         ("B", names[1], names[0]))
                 for v in sorted(mine - theirs)]
    return Comparison(first=first, second=second, diffs=diffs, drifts=drifts, differences=differences(first, second),
                      withheld="; ".join(withheld) or None, unmatched=unmatched)
