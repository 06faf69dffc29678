"""Every stored file is a typed, versioned record: described key by key, documented, migrated from older
formats, refused from newer ones."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from campaign.core.errors import ResultFormatError
from campaign.stored import records, store

ROOT = Path(__file__).resolve().parent.parent
FORMAT_1_RUN = ROOT / "tests" / "fixtures" / "runs" / "cpu-demo"


def test_the_results_format_document_is_generated_from_the_models() -> None:
    assert (ROOT / "docs" / "results-format.md").read_text() == records.document(), \
        "docs/results-format.md is stale: python -m campaign.stored.records > docs/results-format.md"


@pytest.mark.parametrize("kind", sorted(records.RECORDS))
def test_every_key_of_every_record_says_what_it_is(kind: str) -> None:
    model = records.RECORDS[kind]
    assert model.__doc__ and kind in records.FILES
    missing = [name for name, field in model.model_fields.items() if not field.description]
    assert missing == []


def test_every_older_version_has_an_explicit_migration_step() -> None:
    assert sorted(records.MIGRATIONS) == list(range(1, records.SCHEMA_VERSION))


def test_a_format_1_run_written_by_vllm_campaign_0_1_reads_whole(tmp_path: Path) -> None:
    files = sorted(FORMAT_1_RUN.rglob("*.json"))
    assert len(files) > 40
    for path in files:
        record = records.parse(store.read(path))
        assert record.schema_version == records.SCHEMA_VERSION, path  # migrated on read
    run = store.RunDir(FORMAT_1_RUN)
    manifest = run.manifest()
    assert manifest.time_scale == 1.0 and manifest.estimate is None  # what format 1 did not store
    assert manifest.matrix_model().baseline == "baseline"
    assert len(run.ready_servers()) == 6 and all(s.suggested is None for s in run.ready_servers())
    assert {e.result.kind for e in run.experiments()} == {"context-window", "long-context", "overload",
                                                          "prefix-order"}
    stop = run.stop(run.ready_servers()[0].launch_dir or "")
    assert stop is not None and stop.stopped_utc is None and stop.mode == "sigint"
    assert run.damaged == []


def test_a_record_round_trips_and_its_read_only_fields_are_not_stored(tmp_path: Path) -> None:
    run = store.RunDir(FORMAT_1_RUN)
    server = run.ready_servers()[0]
    assert server.launch_dir == "variants/baseline/launch-1"
    path = store.write_new(tmp_path / "server.json", server)
    assert "launch_dir" not in path.read_text()
    again = store.read_record(path, records.ServerRecord)
    assert again == server.model_copy(update={"launch_dir": None})


def test_a_record_of_the_wrong_shape_is_a_clear_error(tmp_path: Path) -> None:
    path = store.write_new(tmp_path / "server.json", {"kind": "server", "variant": "a"})
    with pytest.raises(ResultFormatError) as caught:
        store.read_record(path, records.ServerRecord)
    assert "server.json: repeat: Field required; not a ServerRecord this version can read" in str(caught.value)


@pytest.mark.parametrize("version, kind, lacking", [
    (2, "server", "suggested"),  # came inside format 2 without a version of its own
    (3, "summary", "outcomes"),  # came inside format 3
    (2, "summary", "short_answers"),  # the first summaries had no short answers
    (4, "manifest", "time_scale"),
])
def test_keys_that_came_without_a_version_of_their_own_are_not_required(tmp_path: Path, version: int, kind: str,
                                                                       lacking: str) -> None:
    run = store.RunDir(FORMAT_1_RUN)
    source = {"server": run.ready_servers()[0].launch_dir + "/server.json", "summary": "summary.json",
              "manifest": "manifest.json"}[kind]
    data = json.loads((FORMAT_1_RUN / source).read_text())
    data.pop(lacking, None)
    data["schema_version"] = version
    path = tmp_path / "f.json"
    path.write_text(json.dumps(data))
    record = records.parse(store.read(path))
    assert record.schema_version == records.SCHEMA_VERSION


def test_a_damaged_repeats_file_still_counts(tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "run"
    shutil.copytree(FORMAT_1_RUN, root)
    run = store.RunDir(root)
    assert run.repeats(2, more=3) == 3
    (root / "repeats-3.json").write_text("{trunc")
    assert run.set_aside_damaged() == []  # its count is its name: it stays where repeats() reads it
    assert store.RunDir(root).repeats(2) == 3


def test_a_format_9_time_scaled_runs_experiments_read_in_the_hardwares_units(tmp_path: Path) -> None:
    """Format 10 stores the hardware's figures; a format-9 run at 5x stored the wall clock's, and reads
    converted by its manifest's scale: long-context rates and silence, overload's and prefix-order's walls,
    repeat's runs. A run at scale 1 (vLLM) is left as it is."""
    from fakes import builders

    from campaign.measure import study

    wall = {
        "long-context": study.ExperimentResult(
            kind="long-context", key="long-context", status="Valid",
            values={"prompt_tok_s": 5000.0, "silence_s_per_1k_prompt_tokens": 0.2, "generation_tok_s_drop_pct": 4.0},
            details={"rows": [{"context_tokens": 8192, "ttft_s": 1.6384, "generation_tok_s": 740.0,
                               "prompt_tok_s": 5000.0, "error": None}]}),
        "overload": study.ExperimentResult(kind="overload", key="overload-x1.25", status="Valid",
                                           values={"queued": 64.0}, details={"wall_s": 10.0}),
        "prefix-order": study.ExperimentResult(
            kind="prefix-order", key="prefix-order-K4", status="Valid",
            values={"shared_first_wall_s": 2.0, "shared_first_hit_rate": 0.6, "speedup": 1.8},
            details={"arms": {"shared-first": {"wall_s": 2.0}, "unrelated": {"wall_s": 3.6}}}),
        "repeat": study.ExperimentResult(kind="repeat", key="repeat-x", status="Valid",
                                         values={"mean_total_tok_s": 500.0},
                                         details={"runs": [500.0, 500.0], "low": None, "high": None}),
    }
    read: dict[float, dict[str, study.ExperimentResult]] = {}
    for scale in (1.0, 5.0):
        run = store.RunDir.create(tmp_path / f"x{scale:g}", "t")
        builders.manifest(run, baseline="a", engine="sim", time_scale=scale)
        for result in wall.values():
            path = run.write_experiment("a", 0, result.key, result, launch="launch-1")
            path.write_text(json.dumps(json.loads(path.read_text()) | {"schema_version": 9}))
        read[scale] = {e.result.kind: e.result for e in run.experiments()}
    assert read[1.0] == {kind: r.model_copy(update={"key": r.key}) for kind, r in wall.items()}
    fast = read[5.0]
    assert fast["long-context"].values == {"prompt_tok_s": 1000.0, "silence_s_per_1k_prompt_tokens": 1.0,
                                           "generation_tok_s_drop_pct": 4.0}
    assert fast["long-context"].details["rows"][0] | {"ttft_s": pytest.approx(8.192)} == {
        "context_tokens": 8192, "ttft_s": 8.192, "generation_tok_s": 148.0, "prompt_tok_s": 1000.0, "error": None}
    assert fast["overload"].details["wall_s"] == 50.0 and fast["overload"].values == {"queued": 64.0}
    assert fast["prefix-order"].values == {"shared_first_wall_s": 10.0, "shared_first_hit_rate": 0.6, "speedup": 1.8}
    assert fast["prefix-order"].details["arms"]["unrelated"]["wall_s"] == 18.0
    assert fast["repeat"].values["mean_total_tok_s"] == 100.0 and fast["repeat"].details["runs"] == [100.0, 100.0]
    assert all(r.details["time_scale"] == 5.0 for r in fast.values())


def test_a_record_is_written_as_the_standard_librarys_json_would_read_it() -> None:
    """store._dumps (pydantic-core's serializer, 7x faster indented) writes what json.dumps(indent=1) wrote, as
    json reads it: keys in order, NaN and Infinity as Python writes them, non-ASCII escaped (the file stays
    ASCII, whatever the locale that reads it), a stored cell's floats exact."""
    data = {"z": 1, "a": [1.5, 2.8529387116479927e-06, math.inf, -math.inf, 1e300, -0.0, 10**20],
            "text": "é, 😀 and \x00", "none": None, "nested": {"b": [True, False, {}], "a": []}}
    text = store._dumps(data)
    assert text.isascii() and text.endswith("}\n")
    assert text.replace("e-6", "e-06") == json.dumps(data, indent=1) + "\n"
    back = json.loads(text)
    assert math.isnan(json.loads(store._dumps({"n": math.nan}))["n"])
    assert back == data and list(back) == list(data)
    for path in (Path(__file__).parent / "fixtures").rglob("rep-*.json"):   # stored cells, as written before
        stored = json.loads(path.read_text())
        assert json.loads(store._dumps(stored)) == stored, path
