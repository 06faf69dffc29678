"""Every stored file is a typed, versioned record: described key by key, documented, migrated from older
formats, refused from newer ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from campaign import records, store
from campaign.errors import ResultFormatError

ROOT = Path(__file__).resolve().parent.parent
FORMAT_1_RUN = ROOT / "tests" / "fixtures" / "runs" / "cpu-demo"


def test_the_results_format_document_is_generated_from_the_models() -> None:
    assert (ROOT / "docs" / "results-format.md").read_text() == records.document(), \
        "docs/results-format.md is stale: python -m campaign.records > docs/results-format.md"


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
