"""Issue 34: production traces read in the formats people have (the shipped excerpts are others' files, byte for
byte: matrices/traces/SOURCES.md), sliced, and turned into prompts that share exactly what the trace shares.
Malformed input is a one-line error naming the file and the line."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fakes import builders, simulated
from typer.testing import CliRunner

from campaign.bench import truth
from campaign.cli import app, run_cli
from campaign.core.errors import ConfigError
from campaign.http.endpoint import Timeouts
from campaign.measure import slo, traces
from campaign.measure.cachestate import NOT_LAUNCHED, CacheState
from campaign.measure.cells import CellSpec, Reason
from campaign.measure.prompts import TOKEN_HIGH, TOKEN_LOW
from campaign.measure.runner import Measurer
from campaign.night.launcher import LaunchedServer
from campaign.report import names
from campaign.server.profiles import PROJECT_ROOT
from campaign.sim import truth as sim_truth
from campaign.spec.matrix import load_matrix
from campaign.stored import store

SHIPPED = PROJECT_ROOT / "matrices" / "traces"
MOONCAKE = SHIPPED / "mooncake-conversation-1k.jsonl"
AZURE_CONV = SHIPPED / "azure-conv-2023-1k.csv"
AZURE_CODE = SHIPPED / "azure-code-2023-1k.csv"


def test_the_shipped_excerpts_read_as_their_sources_describe_them() -> None:
    """SOURCES.md's figures: Mooncake's conversation trace, 1,001 requests over 330 s (milliseconds), 512-token
    blocks, mean prompt 13,793.9 tokens; Azure's 2023 traces (CRLF, seven fractional digits) 1,000 requests over
    216.0 s and 521.6 s. Times are re-based to the first request."""
    moon = traces.read(MOONCAKE)
    assert (moon.format, moon.block_size, len(moon.requests)) == ("mooncake", 512, 1001)
    assert moon.requests[0].at_s == 0.0 and moon.requests[-1].at_s == 330.0
    assert sum(r.input_tokens for r in moon.requests) / 1001 == pytest.approx(13793.9, abs=0.05)
    assert all(len(r.hash_ids) == -(-r.input_tokens // 512) for r in moon.requests)
    for path, span, mean_in in ((AZURE_CONV, 216.027, 1014.189), (AZURE_CODE, 521.589, 2122.354)):
        trace = traces.read(path)
        assert (trace.format, trace.block_size, len(trace.requests)) == ("azure", None, 1000)
        assert trace.requests[-1].at_s == pytest.approx(span, abs=1e-3)
        assert sum(r.input_tokens for r in trace.requests) / 1000 == pytest.approx(mean_in, abs=1e-3)
        assert all(not r.hash_ids for r in trace.requests)


def test_the_reuse_a_trace_implies_counts_leading_blocks_sent_before() -> None:
    """A hash id stands for its whole prefix: a request reuses its leading ids that an earlier one sent, as much
    of each block as was sent (a prompt that ended inside a block sent its start), less the last token, in the
    server's blocks. On the Mooncake excerpt 5,932 of 27,452 ids were sent before (SOURCES.md), all leading;
    the tokens they imply are those blocks less the partial ones and the last tokens."""
    a = traces.TraceRequest(0.0, 1000, 8, (1, 2))         # block 2 only 488 tokens long
    b = traces.TraceRequest(1.0, 1200, 8, (1, 2, 3))      # reuses 512 + 488
    c = traces.TraceRequest(2.0, 1024, 8, (1, 2))         # block 2 now 512 (b sent it whole): 1023 of 1024
    d = traces.TraceRequest(3.0, 600, 8, (9, 1))          # its first block is new: nothing, whatever follows
    assert traces.implied_hits([a, b, c, d], 512) == [0, 1000, 1023, 0]
    assert traces.implied_hits([a, b, c, d], 512, server_block=16) == [0, 992, 1008, 0]
    moon = traces.read(MOONCAKE).requests
    implied = sum(traces.implied_hits(moon, 512))
    assert 5900 * 512 < implied <= 5932 * 512


def test_prompts_share_exactly_the_blocks_their_hash_ids_share() -> None:
    """Shared ids are the same tokens in the same order; everything else differs, within a replay and from
    another replay's (a fresh salt each): no earlier run's cache serves it."""
    a = traces.TraceRequest(0.0, 1000, 8, (1, 2))
    b = traces.TraceRequest(1.0, 1200, 8, (1, 2, 3))
    e = traces.TraceRequest(2.0, 700, 8, (1, 5))
    lone = traces.TraceRequest(3.0, 300, 8)
    blocks = traces.BlockPrompts(512, salt=7)
    pa, pb, pe, pl = (blocks.prompt(r) for r in (a, b, e, lone))
    assert [len(p) for p in (pa, pb, pe, pl)] == [1000, 1200, 700, 300]
    assert pa == pb[:1000] and pa[:512] == pe[:512] and pa[512:700] != pe[512:700]
    assert pl[:6] != pa[:6] and len(set(pl) - set(range(TOKEN_LOW, TOKEN_HIGH))) == 0
    other = traces.BlockPrompts(512, salt=8).prompt(a)
    assert other[:16] != pa[:16]


def test_a_slice_is_a_window_of_the_traces_time_sped_up_sampled_and_scaled() -> None:
    moon = traces.read(MOONCAKE).requests
    window = traces.select(moon, start_s=30, duration_s=30)
    assert window[0].at_s == 0 and all(r.at_s < 30 for r in window)
    assert len(window) == sum(1 for r in moon if 30 <= r.at_s < 60)
    fast = traces.select(moon, start_s=30, duration_s=30, speed=3)
    assert [r.at_s * 3 for r in fast] == pytest.approx([r.at_s for r in window])
    scaled = traces.select(moon, max_requests=10, length_scale=0.1)
    assert len(scaled) == 10 and scaled[0].input_tokens == round(moon[0].input_tokens * 0.1)
    assert traces.block_tokens(512, 0.1) == 51
    half = traces.select(moon, sample=0.5, seed=1)
    assert half == traces.select(moon, sample=0.5, seed=1) and 400 < len(half) < 600


def test_a_campaign_trace_round_trips_and_says_its_version(tmp_path: Path) -> None:
    requests = traces.select(traces.read(MOONCAKE).requests, max_requests=20)
    path = tmp_path / "mine.jsonl"
    traces.write(path, requests, block_size=512, source="the Mooncake excerpt, first 20")
    back = traces.read(path)
    assert (back.format, back.block_size, back.requests) == ("campaign", 512, requests)
    header = json.loads(path.read_text().splitlines()[0])
    assert header["kind"] == "trace" and header["schema_version"] == traces.TRACE_SCHEMA_VERSION


@pytest.mark.parametrize(("name", "text", "says"), [
    ("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1, "input_length": 5\n',
     "line 2: not JSON"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 9, "output_length": 1}\n',
     "line 2: no input_length"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 0}\n', "line 1: output_length is 0"),
    ("m.jsonl", '{"timestamp": 0, "input_length": "many", "output_length": 3}\n',
     "line 1: input_length is 'many', not a token count"),
    ("m.jsonl", '{"timestamp": 9000, "input_length": 5, "output_length": 1}\n'
                '{"timestamp": 3000, "input_length": 5, "output_length": 1}\n',
     "line 2: arrives at 3 s, before the line above (9 s)"),
    ("m.jsonl", '{"timestamp": NaN, "input_length": 5, "output_length": 1}\n', "line 1: timestamp is nan"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, "x"]}\n',
     "line 1: hash_ids is not a list of whole numbers"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:15:46.6805900,374,44\r\n"
              "yesterday,10,10\r\n", "line 3: TIMESTAMP is 'yesterday'"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374\n", "line 2: has 2 fields"),
    ("b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
              "5,ChatGPT,472,18,490,Conversation log\n7,GPT-4,1020,0,1020,Conversation log\n",
     "line 3: Response tokens is 0"),
    ("b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n-1,x,1,1,2,y\n",
     "line 2: Timestamp is '-1'"),
    ("c.jsonl", '{"kind": "trace", "schema_version": 1, "block_size": 16}\n{"at_s": 0, "input_tokens": 4}\n',
     "line 2: output_tokens: Field required"),
    ("c.jsonl", '{"kind": "trace", "schema_version": 9}\n', "line 1: schema_version 9, this tool reads 1"),
    ("x.txt", "hello\n", "line 1: not a trace this tool reads"),
    ("e.jsonl", "", "not a trace this tool reads"),
])
def test_each_formats_malformed_input_is_one_line_naming_the_file_and_line(tmp_path: Path, name: str, text: str,
                                                                          says: str) -> None:
    path = tmp_path / name
    path.write_bytes(text.encode())
    with pytest.raises(ConfigError) as caught:
        traces.read(path)
    message = caught.value.message
    assert message.startswith(f"{path}: ") and says in message and "\n" not in message, message
    assert caught.value.hint


def test_a_bom_a_naive_timestamp_and_a_block_size_without_blocks_read_as_meant(tmp_path: Path) -> None:
    """A CSV saved with a byte-order mark still reads; Azure's timestamps (no zone) are read as UTC whatever
    this host's zone, so a daylight-saving change moves no gap; a block size given to a trace without hash ids
    is dropped (every prompt is unique: cache hits stay contamination, and the key names no blocks)."""
    path = tmp_path / "bom.csv"
    path.write_bytes("\ufeffTIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-03-26 00:59:59.0000000,10,2\r\n"
                     "2023-03-26 01:00:01.0000000,12,3\r\n".encode())
    trace = traces.read(path)
    assert trace.format == "azure" and [r.at_s for r in trace.requests] == [0.0, 2.0]
    sliced, _ = traces.plan(path, block_size=512)
    assert sliced.block_size is None and "-B" not in sliced.key and sliced.longest == (12, 3)
    assert traces.plan(MOONCAKE, block_size=64)[0].block_size == 64


def test_burstgpt_reads_its_documented_columns_and_names_its_failures(tmp_path: Path) -> None:
    """BurstGPT's CSV (columns as its README and readers give them; no excerpt ships: see SOURCES.md): seconds
    from the trace's start. A failed request is logged with 0 response tokens: the error says so."""
    path = tmp_path / "burst.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "5,ChatGPT,472,18,490,Conversation log\n7.5,GPT-4,1020,11,1031,API log\n")
    trace = traces.read(path)
    assert trace.format == "burstgpt" and trace.requests == [traces.TraceRequest(0.0, 472, 18),
                                                              traces.TraceRequest(2.5, 1020, 11)]


def test_a_trace_workload_is_a_rate_cell_of_the_slices_rate_and_a_bad_file_is_found_at_plan(tmp_path: Path) -> None:
    matrix = tmp_path / "m.yaml"
    body = ("name: t\nprofile: a5000-tp2\nbaseline: a\nvariants:\n  - name: a\nworkloads:\n  - kind: trace\n"
            f"    file: {MOONCAKE}\n    duration_s: 30\n    speeds: [1, 2]\n    length_scale: 0.1\n")
    matrix.write_text(body)
    loaded, _, _ = load_matrix(str(matrix))
    one, two = loaded.cells()
    assert one.trace is not None and two.trace is not None
    assert one.key.startswith("rate-Tmooncake_conversation_1k.0094fda6-D30") and "-x2" in two.key
    assert one.trace.requests == 87 and one.request_rate == pytest.approx(86 / 27)
    assert two.request_rate == pytest.approx(2 * 86 / 27) and one.shares_prefixes
    assert one.trace.block_tokens == 51
    # The window must hold its longest prompt and that prompt's reply, not its mean.
    assert one.lengths_range()[1] == one.trace.longest and one.trace.longest[0] > 6 * one.context_tokens
    # Relative to the matrix file; a malformed trace is found when the matrix is read, naming its line.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": oops}\n')
    matrix.write_text(body.replace(str(MOONCAKE), "bad.jsonl"))
    with pytest.raises(ConfigError, match=rf"^{bad}: line 2: not JSON"):
        load_matrix(str(matrix))
    matrix.write_text(body.replace(str(MOONCAKE), "nowhere.jsonl"))
    with pytest.raises(ConfigError, match=r"workloads\[0\]\.file: no such file"):
        load_matrix(str(matrix))
    matrix.write_text(body.replace("duration_s: 30", "duration_s: 1"))
    with pytest.raises(ConfigError, match=r"workloads\[0\]: the slice of mooncake-conversation-1k.jsonl has 10 "
                                          r"request\(s\) over 0 s"):
        load_matrix(str(matrix))
    with pytest.raises(ValueError, match="trace"):
        CellSpec(phase="rate", context_tokens=8, request_rate=1.0, trace=one.trace, sessions=None, range_ratio=0.5)


# --- replayed on the simulated A5000 pair -----------------------------------------------------------------
TIME_SCALE = 20.0
# An overloaded replay queues for minutes of the hardware's time: the client waits as long as the queue does.
PATIENT = Timeouts(first_byte_s=3600.0, idle_s=3600.0)


@pytest.fixture(scope="module")
def a5000(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LaunchedServer, Path]]:
    with simulated.with_truth(tmp_path_factory.mktemp("trace"), "a5000-tp2", {}, TIME_SCALE) as launch:
        yield launch


def _patient(server: LaunchedServer) -> Measurer:
    target = server.target()
    return Measurer(replace(target, endpoint=replace(target.endpoint, timeouts=PATIENT)))


def _trace_cell(path: Path, **slicing: Any) -> CellSpec:
    sliced, requests = traces.plan(path, **slicing)
    return CellSpec.from_trace(sliced, requests, slo=slo.parse("ttft_p99_ms=3600000"))


@pytest.mark.wall_timed
def test_the_mooncake_excerpt_replays_at_its_own_times_with_the_hits_the_simulator_records(
        a5000: tuple[LaunchedServer, Path]) -> None:
    """Issue 34's case: 15 s of the shipped Mooncake excerpt (from 140 s: 61 requests in bursts of up to 14 at
    one instant, as the trace has them; lengths a quarter, so the pair's prefill drains it in minutes) on the
    simulated A5000 pair: every request sent at its trace time within the schedule's tolerance, with its exact
    lengths; the prefix-cache hits the server's counters saw are the simulator's own records (within 1%), and
    no more than the trace implies; every figure of the cell beside the truth."""
    server, truth_path = a5000
    spec = _trace_cell(MOONCAKE, start_s=140, duration_s=15, length_scale=0.25)
    cell = asyncio.run(_patient(server).run_cell(spec))
    assert cell.status == "Valid", cell.reasons
    planned = spec.trace.load() if spec.trace else []
    records = cell.records
    assert len(records) == len(planned) == 61 and all(r.ok for r in records)
    # Each request as the trace has it (requests of one instant are sent in any order among themselves).
    first = min(r.scheduled_t or 0.0 for r in records)
    sent = sorted((round(((r.scheduled_t or 0.0) - first) * TIME_SCALE, 3), r.usage_prompt_tokens, r.tokens)
                  for r in records)
    assert sent == sorted((round(p.at_s, 3), p.input_tokens, p.output_tokens) for p in planned)
    assert cell.send_lag_p99_ms is not None and "schedule_behind" not in cell.reason_codes
    matched = truth.Matched(sim_truth.read(truth_path))
    figures = truth.rate_cell_figures(cell, matched, matched.delivery(cell.records, matched.of(cell.records)))
    wrong = [f for f in figures if f.kind != "latency" and not f.ok]
    assert not wrong, wrong
    (hits,) = [f for f in figures if f.name == "prefix_cache_hits"]
    assert hits.truth is not None and hits.tool == pytest.approx(hits.truth, rel=0.01)
    assert cell.trace_implied_hits == sum(traces.implied_hits(planned, 128, 800)) == 5600
    assert (cell.prefix_cache_hits or 0) <= cell.trace_implied_hits
    assert any(n.startswith("trace mooncake-conversation-1k.jsonl (mooncake): 61 of its slice's 61 requests")
               for n in cell.notes)
    # The cache was emptied before the step and the canary (two 800-token blocks and a token) proved it.
    state = cell.cache_state
    assert state is not None and state.method == "reset" and state.reset_answer and state.canary_hits == 0
    assert state.checked and state.canary_cached == 1600 and state.canary_tokens == 1601
    assert state.note() in cell.notes


@pytest.mark.wall_timed
def test_a_reset_that_forgets_nothing_is_found_by_its_canary_and_the_cell_is_invalid(tmp_path: Path) -> None:
    """A server whose POST /reset_prefix_cache answers success and forgets nothing (the simulator's
    reset-keeps-cache fault): the canary sent before the reset is served from the cache after it, both its
    whole 800-token blocks, after each of three resets, so the trace cell is Invalid with cache_not_reset and the
    tokens served; never a silently warm cache."""
    path = tmp_path / "two.jsonl"
    traces.write(path, [traces.TraceRequest(0.0, 1024, 8), traces.TraceRequest(1.0, 1024, 8)], block_size=None,
                 source="two unique prompts a second apart")
    with simulated.with_truth(tmp_path, "a5000-tp2", {"fault": "reset-keeps-cache"}, TIME_SCALE) as (server, _):
        cell = asyncio.run(_patient(server).run_cell(_trace_cell(path)))
    assert cell.status == "Invalid" and cell.reason_codes == [Reason.CACHE_NOT_RESET], cell.reasons
    state = cell.cache_state
    assert state is not None and state.method == "reset" and state.reset_answer is True and state.reset_tries == 3
    assert state.canary_hits == 1600 and state.canary_tokens == 1601
    assert cell.reasons == ["the server said it reset its prefix cache (3 time(s)), but then served 1600 of 1601 "
                            "prompt tokens of a prompt sent before the reset from it"]
    assert len(cell.records) == 2 and all(r.ok for r in cell.records)   # measured all the same, never lost


@pytest.mark.wall_timed
def test_a_trace_served_one_request_at_a_time_is_served_all_the_reuse_it_implies(
        a5000: tuple[LaunchedServer, Path], tmp_path: Path) -> None:
    """The implied reuse's truth: six 2,048-token prompts (four 512-token blocks each) 10 s apart, each served
    before the next arrives, on a cache that holds them all. The server serves exactly what the trace implies in
    its 800-token blocks: three shared blocks are 1,536 tokens (one block of 800), all four 2,047 (two, 1,600),
    a different first block nothing."""
    server, _ = a5000
    shapes = [(1, 2, 3, 4), (1, 2, 3, 5), (1, 2, 3, 4), (9, 2, 3, 4), (1, 2, 6, 7), (1, 2, 3, 5)]
    spread = [traces.TraceRequest(i * 10.0, 2048, 8, ids) for i, ids in enumerate(shapes)]
    assert traces.implied_hits(spread, 512, 800) == [0, 800, 1600, 0, 800, 1600]
    path = tmp_path / "spread.jsonl"
    traces.write(path, spread, block_size=512, source="six prompts sharing known blocks, 10 s apart")
    cell = asyncio.run(_patient(server).run_cell(_trace_cell(path)))
    assert cell.status == "Valid", cell.reasons
    assert cell.trace_implied_hits == 4800 and cell.prefix_cache_hits == 4800


@pytest.mark.wall_timed
def test_probe_replays_a_trace_file_given_on_the_command_line(
        a5000: tuple[LaunchedServer, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`campaign probe URL --trace FILE --trace-speed 2`: one open-loop cell of the whole trace, at twice its
    rate, its lengths exact; the server was not launched by the probe, so its prefix cache is never reset (its
    cache is its users'), and the cell says so; a malformed trace is one `Error:` line naming the file and line."""
    server, _ = a5000
    first = traces.read(AZURE_CONV).requests[:6]
    path = tmp_path / "six.jsonl"
    traces.write(path, [traces.TraceRequest(i * 2.0, r.input_tokens, 4) for i, r in enumerate(first)],
                 block_size=None, source="the Azure conversation excerpt's first 6, 2 s apart")
    env = {"A5000_KEY": server.spec.api_key or ""}
    out = CliRunner().invoke(app, ["probe", server.spec.base_url, "--api-key-env", "A5000_KEY", "--json",
                                   "--trace", str(path), "--trace-speed", "2"], env=env)
    assert out.exit_code == 0, out.stderr[-2000:]
    (cell,) = json.loads(out.stdout)["cells"]
    assert cell["request_rate"] == pytest.approx(2 * 5 / 10) and cell["trace_implied_hits"] is None
    assert any(n.startswith("trace six.jsonl (campaign): 6 of its slice's 6 requests") for n in cell["notes"])
    assert sorted(r["prompt_tokens"] for r in cell["requests"]) == sorted(r.input_tokens for r in first)
    assert cell["cache_state"] == {**CacheState(method="unique-prompts", why_not_reset=NOT_LAUNCHED).model_dump()}
    assert any("prefix cache not reset (a server this tool did not launch" in n for n in cell["notes"])
    path.write_text('{"kind": "trace", "schema_version": 1}\n{"at_s": 0, "input_tokens": 0, "output_tokens": 4}\n')
    monkeypatch.setenv("A5000_KEY", server.spec.api_key or "")
    capsys.readouterr()
    code = run_cli(["probe", server.spec.base_url, "--api-key-env", "A5000_KEY", "--trace", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"Error: {path}: line 2: input_tokens: Input should be greater than 0\n")


@pytest.mark.wall_timed
def test_a_campaign_replays_a_trace_on_each_variant_and_the_diff_judges_it(
        a5000: tuple[LaunchedServer, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`campaign run` of a matrix with a trace workload on the simulated A5000 pair, two variants (seed 000's
    memory change) at two launches each: the trace cell is stored for every launch with its trace, and the
    diff judges its goodput and throughput from both launches a side, as it judges any rate cell. What one
    launch sent, exported with `campaign export-trace`, is a trace of the same arrivals and lengths, and a later
    replay of it over HTTP sends exactly those requests again. The night runs in simulated time (the same
    Measurer; test_two_clocks shows a trace cell reads the same over HTTP), 30 s of trace a launch."""
    matrix = tmp_path / "trace.yaml"
    matrix.write_text(
        "name: trace-sim\nprofile: a5000-tp2\nbaseline: baseline\nrepeats: 2\nwarmup: false\nwindow_s: 2\n"
        "variants:\n  - {name: baseline, flags: {gpu-memory-utilization: 0.90}}\n"
        "  - {name: memory, flags: {gpu-memory-utilization: 0.95}}\n"
        "slo: {ttft_p90_ms: 30000, tpot_p90_ms: 200}\n"
        f"workloads:\n  - {{kind: trace, file: {AZURE_CONV}, duration_s: 30, sample: 0.1}}\n")
    monkeypatch.delenv("CAMPAIGN_SIM_TRUTH", raising=False)   # the module's server's truth file
    capsys.readouterr()
    code = run_cli(["run", "--no-report", str(matrix), "--engine", "sim", "--clock", "virtual", "--out",
                    str(tmp_path / "runs"),
                    "--plain"])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr[-3000:]
    (run_dir,) = (tmp_path / "runs" / "trace-sim").iterdir()
    run = store.RunDir(run_dir)
    stored = run.cells()
    assert len(stored) == 4 and all(c.result.spec.trace is not None and c.result.status == "Valid" for c in stored)
    rows = [line for line in stdout.splitlines() if line.startswith("rate-Tazure_conv_2023_1k.")]
    for metric in ("goodput_rps", "total_tok_s"):
        # Judged from both launches a side, as any rate cell: a change with its interval and a verdict (with
        # four requests a launch, "no difference" or "not settled": which one is the host's noise). The diff
        # names each figure by its display name (report/names.py).
        shown = names.FIGURES[metric].name
        row = next((line for line in rows if re.search(rf"\s{re.escape(shown)}\s", line)), "")
        assert " 2/2 " in row and "no data" not in row and re.search(r"[+-]\d+\.\d%\s+\[", row), rows
        assert "no difference (shown within" in row or "not settled" in row, row

    # What the memory variant's first launch sent, as a trace, replayed.
    sent = next(c.result for c in stored if c.variant == "memory" and c.repeat == 0)
    exported = tmp_path / "sent.jsonl"
    capsys.readouterr()
    assert run_cli(["export-trace", str(run_dir), "--variant", "memory", "--out", str(exported)]) == 0
    assert capsys.readouterr().err == (f"wrote {len(sent.records)} requests of {sent.spec.key} (memory, repeat 0) "
                                       f"to {exported}\n")
    again = traces.read(exported)
    assert again.format == "campaign" and again.block_size is None
    assert sent.spec.trace is not None
    planned = sent.spec.trace.load()
    assert [(round(r.at_s, 3), r.input_tokens, r.output_tokens) for r in again.requests] == sorted(
        (round(p.at_s, 3), p.input_tokens, p.output_tokens) for p in planned)
    server, _ = a5000
    replayed = asyncio.run(_patient(server).run_cell(_trace_cell(exported)))
    assert replayed.status == "Valid" and len(replayed.records) == len(planned), replayed.reasons
    assert sorted((r.usage_prompt_tokens, r.max_tokens) for r in replayed.records) == sorted(
        (p.input_tokens, p.output_tokens) for p in planned)
    assert replayed.request_rate == pytest.approx(sent.request_rate)
    # A cell the run does not hold is one line naming what it does hold.
    assert run_cli(["export-trace", str(run_dir), "--cell", "nope", "--out", str(exported)]) == 1
    assert capsys.readouterr().err == (f"Error: {run_dir}: variant 'baseline' has no cell 'nope'\n"
                                       f"hint: --cell one of: {sent.spec.key}\n")
    nowhere = tmp_path / "no" / "sent.jsonl"
    assert run_cli(["export-trace", str(run_dir), "--out", str(nowhere)]) == 1
    assert capsys.readouterr().err.startswith(f"Error: cannot write {nowhere}: No such file or directory\nhint: ")


def test_a_resume_after_the_trace_was_edited_is_refused_naming_the_file(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A run resumed replays the traces it began with: its manifest's trace cells carry their file's digest, and a
    file edited since (other requests under other keys) stops the resume with one line naming it."""
    trace = tmp_path / "sent.jsonl"
    two = [traces.TraceRequest(0.0, 64, 8), traces.TraceRequest(1.0, 64, 8)]
    traces.write(trace, two, block_size=None, source="two requests")
    sliced, _ = traces.plan(trace)
    run = store.RunDir.create(tmp_path / "runs", "t")
    builders.manifest(run, baseline="a", cells=[{"key": "rate-x", "trace": sliced.model_dump()}])
    traces.write(trace, [*two, traces.TraceRequest(2.0, 64, 8)], block_size=None, source="three requests")
    now = traces.digest_of(trace)
    capsys.readouterr()
    assert run_cli(["run", "--resume", str(run.root)]) == 2
    assert capsys.readouterr().err == (
        f"Error: {trace}: the trace changed since the run began (digest {sliced.digest}, now {now}): a resume "
        "would replay other requests\nhint: restore the file, or start a new run\n")
    assert not list(run.root.glob("variants/*"))   # nothing launched
