"""Nights that run until their verdicts settle (issue 32): `repeats: auto` on the simulator in simulated time,
with launch-to-launch noise (the `launch-noise` fault) and a true effect a variant carries (`prefill-speed`)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from test_sim_night import campaign

from campaign.analysis.recommend import diff_run
from campaign.core.progress import Progress
from campaign.night import orchestrate
from campaign.server.profiles import load_profile
from campaign.spec.matrix import load_matrix
from campaign.stored import store

MATRIX = """\
name: settle
profile: h200
baseline: base
repeats: auto
max_repeats: {max_repeats}
aa: true
warmup: false
variants:
  - {{name: base, flags: {{max-model-len: 16384}}}}
  - {{name: slow-prefill, flags: {{max-model-len: 16384, fault: "prefill-speed:0.8"}}}}
workloads:
  - {{kind: prefill, contexts: [2048, 8192]}}
"""


def _night(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_repeats: int = 10, extra: str = "") -> store.RunDir:
    path = tmp_path / "settle.yaml"
    path.write_text(MATRIX.format(max_repeats=max_repeats) + extra)
    monkeypatch.setenv("CAMPAIGN_SIM_FAULTS", "launch-noise:0.1")
    ran = campaign("run", "--no-report", str(path), "--engine", "sim", "--clock", "virtual", "--out",
                   str(tmp_path / "runs"),
                   "--plain")
    assert ran.returncode == 0, ran.stderr[-3000:]
    (root,) = (tmp_path / "runs" / "settle").iterdir()
    return store.RunDir(root)


def test_a_night_until_settled_calls_a_true_20_percent_prefill_drop_worse_and_leaves_the_aa_open(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Done when (issue 32): a time-scaled `repeats: auto` campaign on the simulator with 10% launch noise
    settles a true -20% prefill change (revert, its prompt tok/s worse) within its rounds, and the A/A gets no
    verdict (never keep or revert). The settled variant is launched no more once retired; the baseline and
    the A/A run on; every look is recorded and the diff says which round decided."""
    run = _night(tmp_path, monkeypatch)
    settled = run.settled()
    assert settled["slow-prefill"].outcome == "revert", settled["slow-prefill"].recommendation
    rounds = settled["slow-prefill"].rounds
    assert 2 <= rounds < 10
    launches = {name: len({c.repeat for c in run.cells() if c.variant == name})
                for name in ("base", "base-aa", "slow-prefill")}
    assert launches["slow-prefill"] == rounds          # retired: no later round launched it
    assert launches["base-aa"] == 10 and launches["base"] >= 10
    diffs = {d.variant: d for d in diff_run(run)}
    slow = diffs["slow-prefill"]
    assert slow.outcome == "revert" and any(m.verdict == "worse" and m.metric == "prompt_tok_s"
                                            for c in slow.cells for m in c.metrics)
    assert slow.family_line.startswith(f"settled after {rounds} round(s): revert; ")
    assert f"round {rounds} of at most 10 (O'Brien-Fleming boundary" in slow.family_line
    aa = diffs["base-aa"]
    assert aa.outcome in {"not settled", "no difference"} and "base-aa" not in settled
    assert aa.family_line.startswith("max_repeats reached after 10 round(s): not settled; ")
    assert not [m for c in aa.cells for m in c.metrics if m.verdict in {"better", "worse"}]


def test_the_night_says_what_is_open_and_why_and_a_resume_continues_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Capped at 3 rounds: the progress says which variants are still open and why after each round, and
    that the cap was reached; the manifest keeps `repeats: auto`, so `--resume` with a higher cap is not
    needed to see the run as one of rounds: the diff reads it at its last look."""
    run = _night(tmp_path, monkeypatch, max_repeats=3)
    matrix = run.manifest().matrix_model()
    assert matrix.until_settled and matrix.max_repeats == 3 and matrix.repeats == 2
    assert sorted(p.name for p in run.root.glob("repeats-*.json")) == ["repeats-3.json"]
    diffs = {d.variant: d for d in diff_run(run)}
    for diff in diffs.values():
        assert re.match(r"(settled after \d round\(s\)|max_repeats reached after 3 round\(s\): not settled)",
                        diff.family_line), diff.family_line


def test_until_settled_from_the_command_line_and_a_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`campaign run --until-settled` is `repeats: auto` for a matrix of fixed repeats; `budget: 1s` stops a
    night after the round that would overrun it and says so."""
    path = tmp_path / "fixed.yaml"
    path.write_text(MATRIX.replace("repeats: auto\nmax_repeats: {max_repeats}\n", "").format())
    monkeypatch.setenv("CAMPAIGN_SIM_FAULTS", "launch-noise:0.1")
    ran = campaign("run", "--no-report", str(path), "--engine", "sim", "--clock", "virtual", "--out",
                   str(tmp_path / "a"),
                   "--plain", "--until-settled")
    assert ran.returncode == 0, ran.stderr[-3000:]
    (root,) = (tmp_path / "a" / "settle").iterdir()
    assert store.RunDir(root).manifest().matrix_model().until_settled
    assert "round 3 of at most 10: still open: " in ran.stderr
    budget = tmp_path / "budget.yaml"
    budget.write_text(MATRIX.format(max_repeats=10) + "budget: 0.001s\n")
    ran = campaign("run", "--no-report", str(budget), "--engine", "sim", "--clock", "virtual", "--out",
                   str(tmp_path / "b"),
                   "--plain")
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "budget spent (" in ran.stderr and "still not settled: " in ran.stderr
    (root,) = (tmp_path / "b" / "settle").iterdir()
    assert not list(root.glob("repeats-*.json"))   # no round beyond the first look's two


def test_repeats_auto_is_validated_with_the_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(MATRIX.replace("repeats: auto\n", "").format(max_repeats=4))
    with pytest.raises(Exception, match="max_repeats and budget apply to `repeats: auto`"):
        load_matrix(str(path))


def test_a_night_stopped_by_its_budget_is_continued_by_a_resume(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget is this invocation's wall clock (a clock the test owns here: every reading an hour later):
    the first night stops after its first look; `--resume` continues the rounds with the budget afresh and
    settles the -20% variant, leaving what it stored before as it was."""
    path = tmp_path / "budget.yaml"
    path.write_text(MATRIX.format(max_repeats=10) + "budget: 2h\n")
    monkeypatch.setenv("CAMPAIGN_SIM_FAULTS", "launch-noise:0.1")
    matrix, matrix_path, _ = load_matrix(str(path))
    profile, profile_path = load_profile(matrix.profile)
    hours = itertools.count(step=3600.0)
    with orchestrate.started(matrix, matrix_path, profile, profile_path, engine="sim", out=tmp_path / "runs",
                             clock="virtual") as tonight, Progress(total_cells=0, estimate_s=0, live=False) as p:
        tonight.execute(p, clock=lambda: next(hours))
    run = tonight.run
    assert not list(run.root.glob("repeats-*.json")) and not run.settled()
    before = {c.path: c.path.read_bytes() for c in run.cells()}
    (stopped,) = [d for d in diff_run(run) if d.variant == "slow-prefill"]
    assert stopped.family_line.startswith("still open after 2 round(s) of at most 10 (the budget or an "
                                          "interruption stopped the night; campaign run --resume RUN continues it)")
    ran = campaign("run", "--no-report", "--resume", str(run.root), "--plain")
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert run.settled()["slow-prefill"].outcome == "revert"
    assert all(path.read_bytes() == data for path, data in before.items())


def test_a_night_whose_baseline_never_starts_stops_its_rounds_and_says_why(tmp_path: Path) -> None:
    """Nothing can be judged without the baseline: the night says so after its first look and runs no more
    rounds; the launch failures are recorded and the exit code says a launch failed."""
    path = tmp_path / "broken.yaml"
    broken = "{name: base, flags: {max-model-len: 16384, fault: start-oom}}"
    path.write_text(MATRIX.format(max_repeats=10).replace("{name: base, flags: {max-model-len: 16384}}", broken))
    ran = campaign("run", "--no-report", str(path), "--engine", "sim", "--clock", "virtual", "--out",
                   str(tmp_path / "runs"),
                   "--plain")
    assert ran.returncode != 0
    assert "round 2: the variants cannot be judged (baseline 'base' has no measurements in " in ran.stderr
    assert "; no more rounds" in ran.stderr
    (root,) = (tmp_path / "runs" / "settle").iterdir()
    assert not list(root.glob("repeats-*.json"))
