"""`campaign compare RUN_A RUN_B` (issue 53, item 5): two nights side by side, each variant of the second against
the first's variant of the same name, with the within-night diff's statistics, the caveat that nights are not
interleaved first, and a verdict only where both nights' drift checks passed.

- Two copies of the demo's stored run (the real CPU build; its baseline drifted 8.6% through the night): the
  figures side by side, and no verdict, saying why.
- Two nights in simulated time on the simulated A5000 pair, three launches a side each with 2% launch noise,
  night B's decode made 20% slower (a driver that cost speed, as a user would see it): its decode figures are
  shown worse and its variant reverted, the prefill (untouched) not shown different.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from campaign.analysis import compare
from campaign.cli import run_cli
from campaign.stored import store

DEMO = Path(__file__).parent / "fixtures" / "runs" / "cpu-demo"


def test_two_demo_nights_side_by_side_with_the_caveat_and_no_verdict_past_their_drift(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "monday", tmp_path / "tuesday"
    shutil.copytree(DEMO, a)
    shutil.copytree(DEMO, b)
    assert run_cli(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"night B ({b}) against night A ({a}): each variant against its namesake"
    assert lines[1] == f"caveat: {compare.CAVEAT}"
    assert lines[2].startswith("between the nights: measured 2026-11-30T11:36:48")
    assert "== baseline@B vs baseline ==" in out and "== small-chunk@B vs small-chunk ==" in out
    assert "not compared" not in out   # the same variants on both nights
    verdicts = out.split("== Across the nights ==\n", 1)[1].splitlines()
    assert [line.split(":", 1)[0] for line in verdicts] == ["baseline", "small-cache", "small-chunk"]
    assert all(line.split(": ", 1)[1].startswith("no verdict (night A's baseline moved +8.6% between its first and "
                                                 "last launch (throughput); night B's") for line in verdicts)
    # A variant only one night ran is said, not silently left out.
    shutil.rmtree(b / "variants" / "small-cache")
    assert run_cli(["compare", str(a), str(b)]) == 0
    assert "not compared (no variant of that name in the other night): small-cache (night A only)" in \
        capsys.readouterr().out
    # Not a run directory: one Error line naming it.
    assert run_cli(["compare", str(a), str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert err.count("Error:") == 1 and f"{tmp_path}: not a run directory" in err


def _night(tmp_path: Path, name: str, fault: str) -> Path:
    matrix = {"schema_version": 1, "name": "nightly", "profile": "a5000-tp2", "baseline": "baseline",
              "variants": [{"name": "baseline", "flags": {"gpu-memory-utilization": 0.9, "fault": fault}}],
              "workloads": [{"kind": "prefill", "contexts": [2048]},
                            {"kind": "decode", "mode": "fixed", "contexts": [128], "concurrency": [4],
                             "max_tokens": 128}],
              "repeats": 3, "warmup": False}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(matrix))
    out = tmp_path / name
    assert run_cli(["run", "--no-report", str(path), "--engine", "sim", "--clock", "virtual", "--out", str(out),
                    "--plain"]) == 0
    (run,) = (out / "nightly").iterdir()
    return run


def test_a_slower_second_night_is_shown_worse_where_it_is_and_only_there(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _night(tmp_path, "a", "launch-noise:0.01")
    b = _night(tmp_path, "b", "launch-noise:0.01,decode-speed:0.8")
    compared = compare.compare(store.RunDir(a), store.RunDir(b))
    assert compared.withheld is None and compared.unmatched == [], compared.drifts
    (diff,) = compared.diffs
    assert (diff.variant, diff.baseline) == ("baseline@B", "baseline") and diff.outcome == "revert"
    verdicts = {(c.key, m.metric): m for c in diff.cells for m in c.metrics}
    decode = verdicts[("decode-fixed-L128-C4-N128", "total_tok_s")]
    # Short prompts: the count's time is nearly all decode, so the total follows the decode's 20%.
    assert decode.verdict == "worse" and decode.change_pct is not None and -21 < decode.change_pct < -17
    assert verdicts[("prefill-L2048", "prompt_tok_s")].verdict != "worse"
    capsys.readouterr()
    assert run_cli(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    last = out.splitlines()[-1]
    assert last.startswith("baseline: revert: ") and "stream tok/s at decode-fixed-L128-C4-N128 -20.0%" in last, last
