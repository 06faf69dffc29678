"""Issue 52 item 5: `campaign calibrate --export` reads the per-request exports of the clients users already run:
GuideLLM's benchmarks.json and AIPerf's profile_export.jsonl, beside vLLM's bench serve JSON (its tests are in
test_calibrate_loads). The fixtures are the peers' own files, written by GuideLLM 0.8.1 and AIPerf 0.13.0
(Apache-2.0 both) against the simulated A5000 pair: an open loop at 2 requests a second, a closed loop of 2, and
one whose server crashed mid-run (tests/fixtures/peers/exports/, each folder's README has the command). The
truth for what the readers derive is each peer's own summary of the same run, in the same file or beside it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from campaign.analysis import exports
from campaign.analysis.arrivals import measured_figures
from campaign.cli import run_cli
from campaign.core.errors import CampaignError
from campaign.sim import measured as sim_measured

EXPORTS = Path(__file__).parent / "fixtures" / "peers" / "exports"
GUIDELLM = EXPORTS / "guidellm-0.8.1"
AIPERF = EXPORTS / "aiperf-0.13.0"


def _one(path: Path) -> exports.Export:
    (export,) = exports.read(path)
    return export


@pytest.mark.parametrize(("path", "tool", "served", "failed", "cap"), [
    (GUIDELLM / "constant-rate-2" / "benchmarks.json", "GuideLLM", 12, 0, None),
    (GUIDELLM / "concurrent-2" / "benchmarks.json", "GuideLLM", 8, 0, 2),
    (GUIDELLM / "concurrent-2-server-crash" / "benchmarks.json", "GuideLLM", 2, 4, 2),
    (AIPERF / "poisson-rate-2" / "profile_export.jsonl", "AIPerf", 12, 0, None),
    (AIPERF / "concurrency-2" / "profile_export.jsonl", "AIPerf", 8, 0, 2),
    (AIPERF / "concurrency-2-server-crash" / "profile_export.jsonl", "AIPerf", 2, 4, 2),
], ids=lambda v: v.parent.name if isinstance(v, Path) else None)
def test_a_peers_export_reads_back_as_its_load(path: Path, tool: str, served: int, failed: int,
                                               cap: int | None) -> None:
    """Each export is told by its content; its served requests come back in send order with the server's own
    prompt count (541: 512 tokens of text in the chat template) and every reply's 64 tokens; failures (the crash
    cut two streams and refused two connections) are counted, never replayed; a concurrency run is the closed
    loop it was."""
    export = _one(path)
    assert (export.tool, len(export.timed), export.failed, export.max_concurrency) == (tool, served, failed, cap)
    sends = [t.sent.at_s for t in export.timed]
    assert sends == sorted(sends) and export.notes == ()
    assert {(t.sent.prompt_tokens, t.sent.output_tokens) for t in export.timed} == {(541, 64)}
    assert all(0 < t.ttft_s < t.last_s for t in export.timed)


def test_the_figures_read_from_an_export_are_the_peers_own() -> None:
    """What calibrate fits to (mean TTFT, mean TPOT) equals what each peer published of the same requests:
    GuideLLM's metrics in the same file, AIPerf's summary beside it (to a microsecond: each rounds its own)."""
    for folder in ("constant-rate-2", "concurrent-2"):
        path = GUIDELLM / folder / "benchmarks.json"
        got = measured_figures(_one(path).timed)
        metrics = json.loads(path.read_text())["benchmarks"][0]["metrics"]
        assert 1000 * got["mean_ttft_s"] == pytest.approx(metrics["time_to_first_token_ms"]["successful"]["mean"],
                                                          abs=1e-3)
        # GuideLLM's ITL is a token-weighted mean; every reply here is 64 tokens, so it is the requests' mean.
        assert 1000 * got["mean_tpot_s"] == pytest.approx(metrics["inter_token_latency_ms"]["successful"]["mean"],
                                                          abs=1e-3)
    for folder in ("poisson-rate-2", "concurrency-2"):
        got = measured_figures(_one(AIPERF / folder / "profile_export.jsonl").timed)
        summary = json.loads((AIPERF / folder / exports.AIPERF_SUMMARY).read_text())
        assert 1000 * got["mean_ttft_s"] == pytest.approx(summary["time_to_first_token"]["avg"], abs=1e-3)
        assert 1000 * got["mean_tpot_s"] == pytest.approx(summary["inter_token_latency"]["avg"], abs=1e-3)


def test_an_aiperf_export_without_its_summary_is_replayed_as_sent_and_says_so(tmp_path: Path) -> None:
    lone = tmp_path / "profile_export.jsonl"
    shutil.copy(AIPERF / "concurrency-2" / "profile_export.jsonl", lone)
    export = _one(lone)
    assert export.max_concurrency is None and len(export.timed) == 8
    assert len(export.notes) == 1 and "replayed at their own send times" in export.notes[0]


def test_a_broken_export_is_one_line_naming_the_file_and_what_is_wrong(tmp_path: Path) -> None:
    aiperf_line = (AIPERF / "poisson-rate-2" / "profile_export.jsonl").read_text().splitlines()[0]
    record = json.loads(aiperf_line)
    weird = json.loads(aiperf_line)
    weird["metrics"]["time_to_first_token"]["unit"] = "fortnights"
    guidellm = json.loads((GUIDELLM / "concurrent-2" / "benchmarks.json").read_text())
    failed_only: dict[str, object] = {"benchmarks": [{"requests": {"successful": [], "errored": [{}, {}]}}]}
    cases = {
        "a.jsonl": (f"{aiperf_line}\n{{\"metadata\": {{}}}}\n", "line 2: no metadata and metrics"),
        "b.jsonl": (f"{aiperf_line}\n{json.dumps(weird)}\n", "line 2: time_to_first_token in unit 'fortnights'"),
        "c.jsonl": (f"{aiperf_line}\n{json.dumps({**record, 'error': {'type': 'x'}})}\n"
                    f"{json.dumps({**record, 'metrics': {}})}\n", "line 3: a time or length that is missing"),
        "d.json": (json.dumps({"benchmarks": [{"config": {}}]}), "benchmark 0 has no requests.successful"),
        "e.json": (json.dumps(failed_only), "none of its 2 requests succeeded"),
        "f.json": (json.dumps({**guidellm, "benchmarks": [{**guidellm["benchmarks"][0], "config": {
            "strategy": {"type_": "concurrent", "streams": 0}}}]}), "streams 0 is not a positive whole number"),
        "g.json": ("{not json", "cannot read it as JSON"),
    }
    for name, (content, said) in cases.items():
        bad = tmp_path / name
        bad.write_text(content)
        with pytest.raises(CampaignError, match=re.escape(said)) as caught:
            exports.read(bad)
        assert str(bad) in caught.value.args[0] and "\n" not in caught.value.args[0]


def test_calibrate_fits_a_guidellm_run_and_predicts_an_aiperf_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command for a user whose last benchmarks were GuideLLM's and AIPerf's: fit the simulated pair's
    profile to GuideLLM's two runs, hold out AIPerf's closed loop. The prior is the profile's tables, the
    costs the server ran with, so this checks the reading and the command end to end (the fit's own truth
    tests are test_calibrate_loads'): the held-out run is predicted within 5%, and the entry says whose
    exports it was fitted to."""
    rate, closed = GUIDELLM / "constant-rate-2" / "benchmarks.json", GUIDELLM / "concurrent-2" / "benchmarks.json"
    aiperf = AIPERF / "concurrency-2" / "profile_export.jsonl"
    out = tmp_path / "measured"
    code = run_cli(["calibrate", "--export", str(rate), "--export", str(closed), "--export", str(aiperf),
                    "--hold-out", str(aiperf), "--profile", "a5000-tp2", "--name", "pair-from-peers",
                    "--dir", str(out)])
    shown = capsys.readouterr()
    assert code == 0, shown.err
    assert "profile_export.jsonl" in shown.out and "held out: predicted" in shown.out
    # Both GuideLLM files are benchmarks.json: each is named with its folder.
    assert "constant-rate-2/benchmarks.json" in shown.out and "concurrent-2/benchmarks.json" in shown.out
    entry = sim_measured.load(out / "pair-from-peers.yaml")
    assert "export(s) of AIPerf, GuideLLM" in entry.description
    assert entry.held_out_error.cells >= 2 and entry.held_out_error.max_abs is not None
    assert entry.held_out_error.max_abs <= 0.05, entry.fit
