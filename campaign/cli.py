"""The `campaign` command. Parses arguments, calls the modules, prints; errors cross here once.

Long (about 820 lines) for one reason: twelve commands declare their options here, with help texts (most of
its lines); what a command does lives in the layer that owns it (`measure.probe`, `night.orchestrate`,
`analysis.calibrate`, `tune.tuning`, `report.closing`, ...)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

from campaign.analysis import calibrate as calibration
from campaign.analysis import compare as comparing
from campaign.analysis import export_trace, recommend, summary
from campaign.core import aio, secret
from campaign.core.console import buffered_stdio
from campaign.core.errors import (
    EXIT_INTERNAL,
    EXIT_SOME_FAILED,
    EXIT_USAGE,
    CampaignError,
    ConfigError,
    LaunchError,
    request_stop,
)
from campaign.core.hardware import hardware_label
from campaign.core.progress import Progress
from campaign.http.endpoint import TLS, Endpoint, Timeouts, proxy_notice
from campaign.measure import probe as measuring
from campaign.measure.cells import CellSpec
from campaign.measure.runner import Target
from campaign.night import orchestrate
from campaign.night import simulate as simulating
from campaign.night.launcher import launched
from campaign.night.orchestrate import preflight
from campaign.plan import replay as sim_virtual
from campaign.plan.limits import raise_open_files
from campaign.plan.planning import left_out, make_plan
from campaign.report import calibration as calibration_report
from campaign.report import closing
from campaign.report import html as html_report
from campaign.report import text as report
from campaign.report import tune as tune_report
from campaign.report.tables import Table, to_markdown, to_text
from campaign.server import startup_log
from campaign.server.argv import api_key_from, parse_set
from campaign.server.control import ControlClient
from campaign.server.profiles import PROFILES_DIR, FlagValue, LaunchProfile, load_profile, parse_gpus
from campaign.spec.matrix import load_matrix
from campaign.stored import store
from campaign.stored.records import CalibrationRecord
from campaign.stored.store import latest_run
from campaign.tune import tuning

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    # Errors end in one `Error:` line (run_cli), never in a traceback that could show locals (API keys).
    pretty_exceptions_enable=False,
    # Plain help: typer's rich help labels every flag `<bool>`.
    rich_markup_mode=None,
    help="Launch vLLM with flag sets, measure it the way the study says, and diff the configurations.",
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"vllm-campaign {version('vllm-campaign')}")
        raise typer.Exit(0)


@app.callback()
def _root(
    _show_version: Annotated[bool, typer.Option(
        "--version", help="print the version and exit", is_eager=True, callback=_version)] = False,
) -> None:
    """Launch vLLM with flag sets, measure it the way the study says, and diff the configurations."""


def _positive(value: float | None) -> float | None:
    if value is not None and value <= 0:
        raise typer.BadParameter(f"{value:g}: must be more than 0")
    return value


def _err(message: str) -> None:
    typer.echo(message, err=True)


# --- shared measurement options ------------------------------------------------------------------------
ContextsOpt = Annotated[str | None, typer.Option("--contexts", metavar="L,L,...",
    help="decode contexts, e.g. 8k,16k,512")]
ConcurrencyOpt = Annotated[str | None, typer.Option("--concurrency", metavar="C,C,...",
    help="simultaneous requests, e.g. 1,2,4")]
WindowOpt = Annotated[float, typer.Option(
    "--window", help="sustained-decode window in seconds (the hardware's, on a time-scaled simulator)",
    callback=_positive)]
PrefillOpt = Annotated[bool, typer.Option("--prefill", help="also measure prefill at each context")]
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", help="reply length of every decode request")]
ModeOpt = Annotated[str, typer.Option("--mode", metavar="sustained|fixed",
    help="sustained (fixed window) or fixed (N tokens each)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
PromptsOpt = Annotated[str, typer.Option(
    "--prompts", metavar="random|code|prose|FILE.jsonl",
    help="what the prompts are made of: random token ids, the standard library's code or its docstrings, or "
         "your own prompts; text is made exactly L tokens by the server's /tokenize")]
EndpointOpt = Annotated[str, typer.Option(
    "--endpoint", metavar="completions|chat",
    help="/v1/completions, or /v1/chat/completions through the chat template and the server's parsers")]
DEFAULT_TIMEOUTS = Timeouts()
MEASURED_DIR = PROFILES_DIR / "measured"   # campaign calibrate's entries: `hardware: measured/<name>.yaml`
CaBundleOpt = Annotated[Path | None, typer.Option(
    "--ca-bundle", help="PEM file of the CA that signed an https server's certificate (default: system CAs, "
                        "or SSL_CERT_FILE)")]
InsecureOpt = Annotated[bool, typer.Option("--insecure", help="https without verifying the certificate")]
ConnectTimeoutOpt = Annotated[float, typer.Option("--connect-timeout", help="seconds to connect")]
FirstByteTimeoutOpt = Annotated[float, typer.Option(
    "--first-byte-timeout", help="seconds from sending a request to the first byte of its reply")]
IdleTimeoutOpt = Annotated[float, typer.Option(
    "--idle-timeout", help="seconds of silence allowed inside a reply (covers prefill and queueing)")]


RateOpt = Annotated[str | None, typer.Option(
    "--rate", metavar="R,R,...", help="open-loop request rates a second, e.g. 0.5,1,2,inf (inf: as fast as "
                                      "--max-concurrency allows); each is a rate cell at each context")]
DurationOpt = Annotated[float, typer.Option("--duration", help="seconds of arrivals per rate cell (and per rate "
                                                               "probe of --find-max-rate; its concurrency probes "
                                                               "are counts)", callback=_positive)]
SloOpt = Annotated[str | None, typer.Option(
    "--slo", metavar="BOUND=MS,...", help="service level, e.g. ttft_p99_ms=2000,tpot_p99_ms=50 (floor_tok_s=20 is "
                                          "tpot_p99_ms=50): goodput and whether each rate held it")]
ArrivalOpt = Annotated[str, typer.Option("--arrival", metavar="poisson|gamma|constant",
                                         help="how requests arrive at a rate")]
BurstinessOpt = Annotated[float, typer.Option(
    "--burstiness", help="gamma arrivals: the shape (1 is Poisson, below 1 burstier)", callback=_positive)]
MaxConcurrencyOpt = Annotated[int | None, typer.Option(
    "--max-concurrency", min=1, help="at most this many rate requests in flight (later arrivals wait for a slot); "
                                     "with --find-max-rate, the concurrency search's ceiling")]
TraceOpt = Annotated[Path | None, typer.Option(
    "--trace", metavar="FILE", help="replay a trace (Mooncake JSONL, Azure or BurstGPT CSV, a campaign trace) at its "
                                    "own times and lengths, one open-loop cell; slice it in a matrix "
                                    "(kind: trace, docs/traces.md)")]
TraceSpeedOpt = Annotated[float, typer.Option("--trace-speed", help="the trace's arrivals this many times faster",
                                              callback=_positive)]
FindMaxRateOpt = Annotated[bool, typer.Option(
    "--find-max-rate", help="search the highest rate (and concurrency) that holds --slo, at one context")]


def _timeouts(connect: float, first_byte: float, idle: float) -> Timeouts:
    return Timeouts(connect_s=connect, first_byte_s=first_byte, idle_s=idle)


def _note_proxy(endpoint: Endpoint) -> None:
    notice = proxy_notice(endpoint)
    if notice:
        _err(f"note: {notice}")


def _measure(target: Target, specs: list[CellSpec], *, as_json: bool, search: CellSpec | None = None) -> None:
    """Measure the cells (and the capacity at an SLO), then print them."""
    results, found = aio.run(measuring.measure(target, specs, search, _err))
    if as_json:
        out: dict[str, Any] = {"cells": [report.cell_json(r) for r in results]}
        if found is not None:
            out["slo_search"] = found.details["slo_search"] | {"status": found.status, "reasons": found.reasons,
                                                                "verdict": found.verdict}
            out["concurrency_search"] = found.details["concurrency_search"]
            out["slo"] = found.details["slo"]
        typer.echo(json.dumps(out, indent=1))
    else:
        if results:
            typer.echo(report.cells_report(results))
        if found is not None:
            typer.echo(f"{found.status}: {found.verdict}" + (f" ({'; '.join(found.reasons)})" if found.reasons
                                                              else ""))


@app.command("parse-log")
def parse_log(
    file: Annotated[Path, typer.Argument(metavar="LOG", help="a vLLM startup log")],
    as_json: JsonOpt = False,
) -> None:
    """Read a vLLM startup log into facts: KV cache, block size, chunk size, the memory-utilisation note.

    Exit 0: a clean start; 3: the log shows a failure; 2: not a vLLM log (or empty)."""
    try:
        text = file.read_text(errors="replace")
    except (FileNotFoundError, IsADirectoryError):
        raise ConfigError(str(file), "", "no such file") from None
    facts = startup_log.parse(text)
    if not startup_log.is_vllm_log(facts):
        raise ConfigError(str(file), "", "empty, or not a vLLM log: not one fact vLLM prints is in it",
                          hint="give the server's own output (stdout and stderr), from its first line")
    if as_json:
        typer.echo(facts.model_dump_json(indent=2))
    else:
        typer.echo("\n".join(startup_log.summary(facts)))
    if facts.failure is not None:
        raise typer.Exit(LaunchError.exit_code)


@app.command()
def launch(
    profile: Annotated[str, typer.Argument(
        metavar="PROFILE", help="launch profile name (launch_profiles/NAME.yaml) or path")],
    set_: Annotated[list[str] | None, typer.Option("--set", metavar="FLAG=VALUE",
                                                   help="override a flag (repeatable)")] = None,
    once: Annotated[bool, typer.Option("--once", help="launch, print the facts, stop")] = False,
    engine: Annotated[str | None, typer.Option("--engine", metavar="vllm|sim",
        help="vllm or sim (default: the profile's)")] = None,
    log: Annotated[Path | None, typer.Option("--log", help="server log file")] = None,
    tokenizer: Annotated[Path | None, typer.Option(
        "--tokenizer", metavar="PATH", help="the model's tokenizer (a Hugging Face folder or tokenizer.json): "
        "vLLM's --tokenizer; the simulator then counts prompts as the model does")] = None,
    contexts: ContextsOpt = None,
    concurrency: ConcurrencyOpt = None,
    window: WindowOpt = 30.0,
    prefill: PrefillOpt = False,
    max_tokens: MaxTokensOpt = 256,
    mode: ModeOpt = "sustained",
    prompts: PromptsOpt = "random",
    endpoint_kind: EndpointOpt = "completions",
    rate: RateOpt = None,
    duration: DurationOpt = 30.0,
    slo_text: SloOpt = None,
    arrival: ArrivalOpt = "poisson",
    burstiness: BurstinessOpt = 1.0,
    max_concurrency: MaxConcurrencyOpt = None,
    find_max_rate: FindMaxRateOpt = False,
    trace: TraceOpt = None,
    trace_speed: TraceSpeedOpt = 1.0,
    as_json: JsonOpt = False,
    ca_bundle: CaBundleOpt = None,
    insecure: InsecureOpt = False,
    connect_timeout: ConnectTimeoutOpt = DEFAULT_TIMEOUTS.connect_s,
    first_byte_timeout: FirstByteTimeoutOpt = DEFAULT_TIMEOUTS.first_byte_s,
    idle_timeout: IdleTimeoutOpt = DEFAULT_TIMEOUTS.idle_s,
) -> None:
    """Launch vLLM from a profile, print what it became, optionally measure, and stop it cleanly."""

    _check_engine(engine)
    loaded, profile_path = load_profile(profile)
    if ca_bundle is not None or insecure:
        if loaded.tls is None:
            raise CampaignError(f"--ca-bundle/--insecure: profile {profile} serves plain http",
                                hint="add `tls: {certfile: ..., keyfile: ...}` to the profile to serve https")
        loaded = loaded.model_copy(update={"tls": loaded.tls.model_copy(update={
            "ca_bundle": ca_bundle.resolve() if ca_bundle else loaded.tls.ca_bundle, "insecure": insecure})})
    timeouts = _timeouts(connect_timeout, first_byte_timeout, idle_timeout)
    overrides = parse_set(set_ or [])
    if tokenizer is not None:
        if not tokenizer.exists():
            raise CampaignError(f"--tokenizer {tokenizer}: no such file or folder",
                                hint="give the model's tokenizer folder (with tokenizer.json) or the file")
        overrides["tokenizer"] = str(tokenizer.resolve())
    for warning in preflight(loaded, profile_path, engine, overrides=overrides).warnings:
        _err(warning.line())
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    log_path = log or Path("runs") / "launch" / f"{stamp}-{loaded.served_name.replace('/', '_')}.log"
    ask = measuring.rate_ask(rate, duration, slo_text, arrival, burstiness, max_concurrency, find_max_rate,
                             trace, trace_speed)
    specs, search = measuring.what_to_measure(contexts, concurrency, ask, window=window, prefill=prefill,
                                     max_tokens=max_tokens, mode=mode, prompts=prompts,
                                     endpoint=endpoint_kind) if contexts or ask.any else ([], None)
    _err(f"launching {profile}; log: {log_path}")
    try:
        _launch_and_serve(loaded, log_path, overrides, engine=engine, once=once, specs=specs, as_json=as_json,
                          timeouts=timeouts, search=search)
    except KeyboardInterrupt:
        _err("interrupted: the server was stopped; everything measured so far was printed or kept")
        raise typer.Exit(130) from None


def _launch_and_serve(loaded: LaunchProfile, log_path: Path, overrides: dict[str, FlagValue], *, engine: str | None,
                      once: bool, specs: list[CellSpec], as_json: bool, timeouts: Timeouts,
                      search: CellSpec | None = None) -> None:
    with launched(loaded, log_path, overrides, engine=engine) as server:
        _err("command: " + " ".join(server.spec.redacted_argv()))
        _err(f"ready in {server.ready.ready_s:.1f} s at {server.spec.base_url} (pid {server.ready.pid})")
        _note_proxy(server.spec.endpoint())
        if as_json and not specs and search is None:
            typer.echo(server.facts.model_dump_json(indent=2))
        else:
            _err("\n".join(startup_log.summary(server.facts)))
        for warning in server.warnings:
            _err(f"warning: {warning}")
        if specs or search is not None:
            _measure(server.target(timeouts), specs, as_json=as_json, search=search)
        elif not once:
            _err("serving until Ctrl-C")
            while server.process.alive():
                time.sleep(1.0)
            _err("the server exited by itself")
    stop = server.process.stop_info
    if stop is not None:
        _err(f"stopped: {stop.mode}, exit code {stop.exit_code}, {stop.stop_s:.1f} s, "
             f"{stop.swept} stray process(es) swept, port {'free' if stop.port_free else 'STILL IN USE'}"
             + ("" if stop.gpu_memory_released is None
                else f", GPU memory {'released' if stop.gpu_memory_released else 'NOT released'}"))


@app.command()
def probe(
    url: Annotated[str, typer.Argument(metavar="URL", help="base URL of a running server, e.g. http://127.0.0.1:8000")],
    model: Annotated[str | None, typer.Option("--model", metavar="NAME",
        help="served model (default: from /v1/models)")] = None,
    api_key_env: Annotated[str | None, typer.Option("--api-key-env", metavar="NAME",
        help="env var holding the API key")] = None,
    contexts: ContextsOpt = "1k",
    concurrency: ConcurrencyOpt = None,
    window: WindowOpt = 30.0,
    prefill: PrefillOpt = False,
    max_tokens: MaxTokensOpt = 256,
    mode: ModeOpt = "sustained",
    prompts: PromptsOpt = "random",
    endpoint_kind: EndpointOpt = "completions",
    rate: RateOpt = None,
    duration: DurationOpt = 30.0,
    slo_text: SloOpt = None,
    arrival: ArrivalOpt = "poisson",
    burstiness: BurstinessOpt = 1.0,
    max_concurrency: MaxConcurrencyOpt = None,
    find_max_rate: FindMaxRateOpt = False,
    trace: TraceOpt = None,
    trace_speed: TraceSpeedOpt = 1.0,
    as_json: JsonOpt = False,
    ca_bundle: CaBundleOpt = None,
    insecure: InsecureOpt = False,
    connect_timeout: ConnectTimeoutOpt = DEFAULT_TIMEOUTS.connect_s,
    first_byte_timeout: FirstByteTimeoutOpt = DEFAULT_TIMEOUTS.first_byte_s,
    idle_timeout: IdleTimeoutOpt = DEFAULT_TIMEOUTS.idle_s,
    max_num_batched_tokens: Annotated[int | None, typer.Option(
        "--max-num-batched-tokens", min=1, metavar="N",
        help="the server's chunk, where it does not tell it (vLLM 0.32 tells it only in dev mode): explains a queue of "
             "replacements waiting for it; a value the server contradicts is an error")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(
        "--max-num-seqs", min=1, metavar="N",
        help="the server's scheduler cap, where it does not tell it; a value the server contradicts is an error")
    ] = None,
) -> None:
    """Measure an already running server (other traffic allowed: every step is bracketed)."""
    ask = measuring.rate_ask(rate, duration, slo_text, arrival, burstiness, max_concurrency, find_max_rate,
                             trace, trace_speed)
    specs, search = measuring.what_to_measure(contexts, concurrency, ask, window=window, prefill=prefill,
                                     max_tokens=max_tokens, mode=mode, prompts=prompts, endpoint=endpoint_kind)
    api_key = api_key_from(api_key_env)
    endpoint = Endpoint.parse(url, api_key=api_key, tls=TLS(ca_bundle=ca_bundle, insecure=insecure),
                              timeouts=_timeouts(connect_timeout, first_byte_timeout, idle_timeout))
    _note_proxy(endpoint)
    try:
        with ControlClient(endpoint, retry_s=2.0) as control:
            served, max_len = control.served_model()
            version = control.version()
            told = measuring.server_config(control)
    except httpx.TransportError as exc:
        hint = ("give the server's CA with --ca-bundle FILE (or SSL_CERT_FILE), or --insecure"
                if "CERTIFICATE" in str(exc).upper() else "is the server running at that address?")
        raise CampaignError(f"cannot reach {endpoint.root}: {exc}", hint=hint) from None
    target, lines = measuring.configured(
        Target(endpoint=endpoint, model=model or served, max_model_len=max_len, server_version=version), told,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
    for line in lines:
        _err(line)
    _measure(target, specs, as_json=as_json, search=search)


def _check_engine(engine: str | None) -> None:
    if engine is not None and engine not in {"vllm", "sim"}:
        raise typer.BadParameter(f"{engine!r}: expected vllm or sim", param_hint="'--engine'")


@app.command()
def plan(
    matrix: Annotated[str, typer.Argument(metavar="MATRIX", help="matrix name (matrices/NAME.yaml) or path")],
    profile: Annotated[str | None, typer.Option("--profile", metavar="NAME|FILE",
        help="launch profile (default: the matrix's)")] = None,
    window: Annotated[float | None, typer.Option("--window", help="override the decode window (s)",
                                                 callback=_positive)] = None,
    repeats: Annotated[int | None, typer.Option("--repeats", help="override the repeats", min=1)] = None,
    out: Annotated[Path, typer.Option("--out", help="where runs are stored")] = Path("runs"),
    engine: Annotated[str | None, typer.Option("--engine", metavar="vllm|sim",
        help="vllm or sim (default: the profile's engine)")
                      ] = None,
) -> None:
    """Print what a campaign will run: launches, cells per server, known over-capacity cells, duration."""
    loaded, matrix_path, prof, profile_path = orchestrate.load_night(matrix, profile, window, repeats)
    _check_engine(engine)
    checked = preflight(prof, profile_path, engine, loaded, matrix_path, will_launch=False)
    typer.echo(f"campaign {loaded.name} ({matrix_path}) on profile {profile_path.stem} "
               f"({engine or prof.engine}, serving {prof.served_name}); flags checked against {checked.source}")
    for warning in checked.warnings:
        typer.echo(warning.line())
    # Where no last run launched a variant, the simulator's memory model sizes its KV cache (a profile it can
    # simulate), so the plan can say which cells will not fit before the night.
    predicted = sim_virtual.predict_servers(loaded, prof, profile_path)
    planned = make_plan(loaded, prof, latest_run(out, loaded.name), predicted)
    typer.echo(report.text(report.plan_tables(planned, repeats=loaded.repeats)))
    for line in left_out(planned):   # the estimate covers what will run
        typer.echo(line)


@app.command()
def simulate(
    matrix: Annotated[str, typer.Argument(metavar="MATRIX", help="matrix name (matrices/NAME.yaml) or path")],
    variant: Annotated[str | None, typer.Option("--variant", metavar="VARIANT",
        help="whose flags (default: the baseline)")] = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="Markdown tables")] = False,
    out: Annotated[Path | None, typer.Option(
        "--out", help="keep the two runs here, as `campaign run` stores them (default: a temporary folder, "
                      "removed after)")] = None,
) -> None:
    """Measure one variant of the matrix in simulated time (seconds, the same every time): every cell kind and
    experiment, as `campaign run --clock virtual` measures them; the decode matrix with each cell's change under
    the other TTFT mode, the prefill row, the rate cells, the experiments. The launch profile must name
    simulated hardware."""

    loaded, matrix_path, _ = load_matrix(matrix)
    one = simulating.one_variant(loaded, variant)
    config = sim_virtual.profile_config(one.profile, one.variants[0].flags)
    hardware = hardware_label(config.hardware) if config.measured is None else (
        f"{config.measured.name} (measured: {config.hardware})")
    with contextlib.ExitStack() as stack:
        folder = out if out is not None else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="campaign-simulate-")))
        measured = simulating.simulate(one, matrix_path, folder, note=_err)
    if measured.failures:
        raise CampaignError(f"{loaded.name}: {measured.variant}: {report.failure_line(measured.failures[0])}",
                            hint="these flags do not start on the simulated hardware; see the line above")
    tables = report.virtual_tables(measured.cells, measured.flipped, measured.flipped_mode)
    tables += [t for t in (report.rate_table(measured.cells), report.open_loop_state_table(measured.cells),
                           report.experiments_table(measured.experiments)) if t]
    render = to_markdown if markdown else to_text
    typer.echo(f"{loaded.name} on the simulated {hardware}, in simulated time (figures are the hardware's)")
    noise = config.faults.launch_noise
    typer.echo(f"one launch of {measured.variant}" + (
        f", whose speed draws the profile's launch noise (sigma {noise:.0%}), as each launch of a night does"
        if noise else "") + "\n")
    typer.echo("\n\n".join(render(t) for t in tables))
    if out is not None:
        typer.echo("\nstored: " + ", ".join(str(r.root) for r in measured.runs))


@app.command()
def run(
    matrix: Annotated[str | None, typer.Argument(
        metavar="MATRIX", help="matrix name (matrices/NAME.yaml) or path")] = None,
    profile: Annotated[str | None, typer.Option("--profile", metavar="NAME|FILE",
        help="launch profile (default: the matrix's)")] = None,
    engine: Annotated[str | None, typer.Option("--engine", metavar="vllm|sim",
        help="vllm or sim (default: the profile's engine)")
                      ] = None,
    window: Annotated[float | None, typer.Option("--window", help="override the decode window (s)",
                                                 callback=_positive)] = None,
    repeats: Annotated[int | None, typer.Option(
        "--repeats", min=1,
        help="override the repeats (with --resume: raise them; new launches interleave as before)")] = None,
    out: Annotated[Path, typer.Option("--out", help="where runs are stored")] = Path("runs"),
    resume: Annotated[Path | None, typer.Option("--resume", help="continue this run directory")] = None,
    live: Annotated[bool | None, typer.Option("--live/--plain", help="progress display (default: on a TTY)")] = None,
    gpus: Annotated[str | None, typer.Option(
        "--gpus", metavar="LIST",
        help="a GPU pool, e.g. 0-7 or 0,1: launches run side by side, each on tp x pp of them (default: the "
             "profile's gpus, else one launch at a time)")] = None,
    mixed_gpus: Annotated[bool, typer.Option(
        "--mixed-gpus", help="allow a pool of different GPU models (their launches are then compared anyway)")
    ] = False,
    executor: Annotated[str | None, typer.Option(
        "--executor", metavar="local|ray",
        help="local (default: this host, serially or on --gpus) or ray (launches as Ray tasks on a cluster)")
    ] = None,
    ray_address: Annotated[str | None, typer.Option(
        "--ray-address", metavar="ADDR", help="the Ray cluster to join (default: RAY_ADDRESS, else a local Ray)")
    ] = None,
    clock: Annotated[str, typer.Option(
        "--clock", metavar="wall|virtual",
        help="wall (default): servers measured over HTTP; virtual (with --engine sim): the simulator's engine "
             "replayed in simulated time, in seconds, figures in the hardware's units")] = "wall",
    until_settled: Annotated[bool, typer.Option(
        "--until-settled",
        help="rounds until every variant's verdict is settled, as `repeats: auto` (the matrix's max_repeats, "
             "default 10, and budget)")] = False,
    with_report: Annotated[bool, typer.Option(
        "--report/--no-report",
        help="write the HTML report and its charts at the night's end (default; `campaign report RUN` writes "
             "them later)")] = True,
) -> None:
    """Run a campaign: launch each flag set, measure, stop; store everything; end with the diff."""

    _check_engine(engine)
    if executor not in {None, "local", "ray"}:
        raise CampaignError(f"--executor {executor!r}: expected local or ray", hint="e.g. --executor ray")
    on_ray = None if executor is None else executor == "ray"
    pool_gpus = parse_gpus(gpus) if gpus is not None else None
    if clock not in {"wall", "virtual"}:
        raise CampaignError(f"--clock {clock!r}: expected wall or virtual", hint="e.g. --clock virtual --engine sim")
    if resume is not None:
        night = orchestrate.resumed(resume, engine=engine, more_repeats=repeats, gpus=pool_gpus,
                                    mixed_gpus=mixed_gpus, ray=on_ray, ray_address=ray_address)
    elif matrix is None:
        raise CampaignError("name a matrix, or --resume a run directory", hint="e.g. campaign run demo")
    else:
        loaded, matrix_path, prof, profile_path = orchestrate.load_night(matrix, profile, window, repeats,
                                                                         until_settled=until_settled)
        night = orchestrate.started(loaded, matrix_path, prof, profile_path, engine=engine, out=out,
                                    gpus=pool_gpus, mixed_gpus=mixed_gpus, ray=bool(on_ray),
                                    ray_address=ray_address, clock="virtual" if clock == "virtual" else "wall")
    with night as tonight:
        for line in tonight.notices:
            _err(line)
        work = tonight.pending()
        if tonight.resumed and not work:
            _err(f"{tonight.run.root} is complete: nothing left to measure")
        with Progress(total_cells=sum(len(w.cells) for w in work), estimate_s=tonight.estimate_s(work),
                      live=live) as progress:
            try:
                tonight.execute(progress)
            except KeyboardInterrupt:
                progress.note(f"interrupted: every finished cell is stored in {tonight.run.root}; continue with\n"
                              f"  campaign run --resume {tonight.run.root}")
                raise typer.Exit(130) from None
        typer.echo(closing.night_end(tonight.run, with_report=with_report))
        _say_damaged(tonight.run)
        unfinished = tonight.unfinished()
    if unfinished:
        _err(f"finished, but not everything: {', '.join(unfinished)}")
        raise typer.Exit(EXIT_SOME_FAILED)


def _say_damaged(run_dir: store.RunDir) -> None:
    for message in run_dir.damaged:
        _err(f"warning: skipped {message}")


@app.command()
def diff(
    run_dir: Annotated[Path, typer.Argument(metavar="RUN_DIR", help="a run directory")],
    other: Annotated[Path | None, typer.Argument(
        metavar="OTHER_RUN", help="a second run directory to compare against the first")] = None,
    baseline: Annotated[str | None, typer.Option("--baseline", metavar="VARIANT",
        help="baseline variant (default: the matrix's)")
                        ] = None,
    force: Annotated[bool, typer.Option("--force", help="compare cells that are not comparable")] = False,
) -> None:
    """Diff every variant against the baseline: flags, facts, per-cell verdicts, recommendation."""
    first = store.RunDir(run_dir)
    diffs = recommend.diff_run(first, baseline=baseline, other=store.RunDir(other) if other else None, force=force)
    typer.echo(report.diff_text(diffs))
    typer.echo(f"\ndrift: {summary.drift(first).message}")
    effect = summary.gpu_effect(first)
    if effect.checked:
        typer.echo(f"GPU effect: {effect.message}")
    _say_damaged(first)


@app.command()
def compare(
    first: Annotated[Path, typer.Argument(metavar="RUN_A", help="the earlier night (a run directory)")],
    second: Annotated[Path, typer.Argument(metavar="RUN_B", help="the later night, each variant against A's of "
                                                                 "its name")],
) -> None:
    """Two nights side by side: each variant of RUN_B against RUN_A's variant of the same name, with the diff's
    statistics, the caveat that nights are not interleaved, and a verdict only where both nights' drift checks
    passed."""
    a, b = store.RunDir(first), store.RunDir(second)
    for run in (a, b):
        if not run.manifest_path.exists():
            raise CampaignError(f"{run.root}: not a run directory (no manifest.json)",
                                hint="name two directories under runs/ that `campaign run` wrote")
    typer.echo(report.compare_text(comparing.compare(a, b)))
    _say_damaged(a)
    _say_damaged(b)


@app.command("report")
def report_cmd(
    run_dir: Annotated[Path, typer.Argument(metavar="RUN_DIR", help="a run directory")],
    other: Annotated[Path | None, typer.Argument(
        metavar="OTHER_RUN", help="an earlier run of the same matrix: its variants beside these as <name>@B, "
                                  "each diffed against this run's baseline")] = None,
    fmt: Annotated[str, typer.Option("--format", metavar="html|md|png", help="html (default), md or png")] = "html",
    out: Annotated[Path | None, typer.Option("--out", help="report file (png: a folder)")] = None,
) -> None:
    """One self-contained HTML report (or Markdown, or the PNG charts) from a stored run, or from two."""

    if fmt not in {"html", "md", "png"}:
        raise CampaignError(f"--format {fmt!r}: expected html, md or png")
    stored = store.RunDir(run_dir)
    second = store.RunDir(other) if other is not None else None
    for path in html_report.write(stored, fmt=fmt, out=out, other=second):
        typer.echo(str(path))
    _say_damaged(stored)
    if second is not None:
        _say_damaged(second)


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(metavar="RUN_DIR", help="a run directory")],
    fmt: Annotated[str, typer.Option("--format", metavar="json|csv", help="json or csv")] = "json",
    out: Annotated[Path | None, typer.Option("--out", help="file to write (default: stdout)")] = None,
) -> None:
    """One row per cell, variant and repeat."""
    if fmt not in {"json", "csv"}:
        raise CampaignError(f"--format {fmt!r}: expected json or csv")
    stored = store.RunDir(run_dir)
    rows = report.export_rows(stored.cells())
    _say_damaged(stored)
    text = report.rows_json(rows) if fmt == "json" else report.rows_csv(rows)
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(secret.redact(text))
        _err(f"wrote {len(rows)} rows to {out}")


@app.command("export-trace")
def export_trace_cmd(
    run_dir: Annotated[Path, typer.Argument(metavar="RUN_DIR", help="a run directory")],
    out: Annotated[Path, typer.Option("--out", help="the trace file to write (JSONL, the campaign format)")],
    cell: Annotated[str | None, typer.Option("--cell", metavar="KEY",
                                             help="the cell's key (optional where the variant has one)")] = None,
    variant: Annotated[str | None, typer.Option("--variant", metavar="NAME",
                                                help="the variant (default: the baseline)")] = None,
    repeat: Annotated[int, typer.Option("--repeat", min=0, metavar="N", help="which repeat (from 0)")] = 0,
) -> None:
    """One stored cell's requests as a trace (arrivals, prompt and reply lengths) that a later run replays."""
    stored = store.RunDir(run_dir)
    picked, written = export_trace.export(stored, out, cell_key=cell, variant=variant, repeat=repeat)
    _say_damaged(stored)
    _err(f"wrote {written} requests of {picked.result.spec.key} ({picked.variant}, repeat {picked.repeat}) to {out}")


@app.command()
def calibrate(
    run_dir: Annotated[Path | None, typer.Argument(
        metavar="[RUN_DIR]", help="a run directory with prefill and decode cells, or rate cells")] = None,
    name: Annotated[str | None, typer.Option("--name", metavar="NAME",
                                             help="the entry's name (default: the run's profile's)")] = None,
    hold_out: Annotated[list[str] | None, typer.Option(
        "--hold-out", metavar="[VARIANT:]KEY|FILE",
        help="a cell (or an --export file) to predict rather than fit (repeatable)")] = None,
    export: Annotated[list[Path] | None, typer.Option(
        "--export", metavar="FILE", help="a peer's per-request export to fit to, instead of a run: vllm bench "
                                         "serve --save-result --save-detailed JSON, GuideLLM's benchmarks.json, "
                                         "AIPerf's profile_export.jsonl (repeatable; needs --profile)")] = None,
    profile: Annotated[str | None, typer.Option(
        "--profile", metavar="PROFILE", help="the launch profile of the server the exports measured (its "
                                             "flags and KV cache)")] = None,
    folder: Annotated[Path, typer.Option("--dir", metavar="DIR", help="where the entry is written")] = MEASURED_DIR,
    fit_experiments: Annotated[bool, typer.Option(
        "--fit-experiments", help="fit the run's long-context, overload and capacity-search requests too "
                                  "(default: its cells only; --hold-out takes their keys)")] = False,
) -> None:
    """Fit the simulator's step costs to a measured run (or a peer's per-request exports) and write a hardware
    entry a profile can name."""
    skipped: list[str] = []
    kv_from = "as its log said"
    stored: store.RunDir | None = None
    if export:
        if run_dir is not None:
            raise CampaignError(f"{run_dir} and --export: give one source to fit to, not both",
                                hint="calibrate a run (RUN_DIR) or a peer's exports (--export), one at a time")
        if profile is None:
            raise CampaignError("--export needs --profile PROFILE: the launch profile of the server the exports "
                                "measured (its flags and KV cache)",
                                hint="campaign calibrate --export bench.json --profile my-server --name my-card")
        loaded, profile_path = load_profile(profile)
        chosen = name or Path(profile).stem
        _check_entry_name(chosen)
        entry, fitted, skipped = calibration.calibrate_exports(
            export, sim_virtual.loaded_profile_config(loaded, profile_path), Path(profile).stem, chosen,
            [Path(h) for h in hold_out or []])
        kv_from = "as the simulator sizes the profile (an export has no startup log)"
    else:
        if run_dir is None:
            raise CampaignError("calibrate needs a RUN_DIR, or --export FILE with --profile PROFILE",
                                hint="campaign calibrate runs/demo/<time>, or campaign calibrate --export "
                                     "bench.json --profile my-server")
        if profile is not None:
            raise CampaignError("--profile names the server of --export files; a run directory knows its own",
                                hint="drop --profile, or give --export")
        stored = store.RunDir(run_dir)
        if not stored.manifest_path.exists():
            raise CampaignError(f"{run_dir}: not a run directory (no manifest.json)",
                                hint="name a directory under runs/ that `campaign run` wrote")
        chosen = name or Path(stored.manifest().matrix_model().profile).stem
        _check_entry_name(chosen)
        entry, fitted, cells = calibration.calibrate(stored, chosen, hold_out or [],
                                                     fit_experiments=fit_experiments)
        skipped = cells.skipped
        _, assumed = calibration.block_size(cells.baseline)
        kv_from += f", {assumed}" if assumed else ""
        _say_damaged(stored)
    skipped = [*skipped, *fitted.unreplayed]
    typer.echo(to_text(calibration_report.table(entry, iterations=fitted.iterations, unmeasured=fitted.unmeasured,
                                                skipped=skipped, settled=fitted.settled,
                                                determined=fitted.determined, kv_from=kv_from,
                                                leaned=fitted.leaned)))
    replaced = (folder / f"{chosen}.yaml").exists()
    path = calibration.write(entry, folder)
    if stored is not None:   # the run keeps the fit made from it: its report shows it (format 20)
        try:
            stored.write_calibration(CalibrationRecord(
                written_utc=entry.fitted_utc, path=str(path), entry=entry, iterations=fitted.iterations,
                settled=fitted.settled, determined=fitted.determined, unmeasured=list(fitted.unmeasured),
                skipped=skipped, kv_from=kv_from, leaned=fitted.leaned))
        except CampaignError as exc:   # a run on a read-only disk: the entry stands, the run's report lacks the fit
            _err(f"warning: the fit was not kept in the run ({exc.message}); {path} holds it")
    named = f"measured/{path.name}" if path.parent.resolve() == MEASURED_DIR.resolve() else str(path)
    said = "replaced" if replaced else "wrote"
    _err(f"{said} {path}; a profile names it as `hardware: {named}` (and no model_shape), and the simulator "
         "then runs on this machine's fitted costs")


def _check_entry_name(chosen: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", chosen):
        raise CampaignError(f"--name {chosen!r}: not a file name", hint="letters, digits, '.', '_' and '-'")


@app.command()
def tune(
    matrix: Annotated[str, typer.Argument(metavar="MATRIX", help="a matrix with a search: block")],
    trials: Annotated[int | None, typer.Option("--trials", min=2, metavar="N",
                                               help="phase 1's evaluations (default: the matrix's)")] = None,
    confirm: Annotated[int | None, typer.Option("--confirm", min=0, metavar="N",
                                                help="candidates phase 2 launches (0: predict only)")] = None,
    exhaustive: Annotated[bool, typer.Option(
        "--exhaustive", help="also evaluate every configuration of the grid: the yardstick for the search")] = False,
    engine: Annotated[str | None, typer.Option("--engine", metavar="vllm|sim",
                                               help="phase 2's server (default: the profile's engine)")] = None,
    clock: Annotated[str, typer.Option("--clock", metavar="wall|virtual",
                                       help="phase 2's clock, as campaign run's")] = "wall",
    out: Annotated[Path, typer.Option("--out", help="where the tune's folder is made")] = Path("runs"),
    gpus: Annotated[str | None, typer.Option("--gpus", metavar="LIST",
                                             help="phase 2's GPU pool: launches side by side")] = None,
    executor: Annotated[str | None, typer.Option("--executor", metavar="local|ray",
                                                 help="phase 2's launches as Ray tasks (ray)")] = None,
    ray_address: Annotated[str | None, typer.Option("--ray-address", metavar="ADDR",
                                                    help="the Ray cluster to join")] = None,
    live: Annotated[bool | None, typer.Option("--live/--plain", help="progress display (default: on a TTY)")] = None,
) -> None:
    """Search a matrix's flags on the simulator, then prove the pick against the baseline on the real server."""
    _check_engine(engine)
    if clock not in {"wall", "virtual"}:
        raise CampaignError(f"--clock {clock!r}: expected wall or virtual", hint="e.g. --clock virtual --engine sim")
    if executor not in {None, "local", "ray"}:
        raise CampaignError(f"--executor {executor!r}: expected local or ray", hint="e.g. --executor ray")
    how = tuning.Launching(engine=engine, clock="virtual" if clock == "virtual" else "wall",
                           gpus=parse_gpus(gpus) if gpus is not None else None, ray=executor == "ray",
                           ray_address=ray_address, live=live)
    outcome = tuning.tune(matrix, out=out, how=how, trials=trials, confirm=confirm, exhaustive=exhaustive)
    head = f"campaign tune {outcome.matrix}: {outcome.objective}"
    typer.echo(head + "\n")
    every: list[Table] = []
    for index, step in enumerate(outcome.rounds):
        tables = [tune_report.search_table(step.number, step.basis, step.search, step.baseline,
                                           outcome.grid if index == 0 else None)]
        if index == 0 and outcome.exhaustive is not None:
            tables.append(tune_report.exhaustive_table(step.search, outcome.exhaustive))
        if step.load is not None and step.run is not None:
            tables.append(tune_report.confirmation_table(step.number, step.load, outcome.figure, str(step.run), [
                (m.variant, tune_report.flags_text(m.flags), m.predicted, m.measured, m.error, m.status,
                 m.outcome or "(baseline)") for m in step.measured], step.missed,
                where=tune_report.measured_where(store.RunDir(step.run).manifest())))
        typer.echo("\n\n".join(to_text(t) for t in tables) + "\n")
        every += tables
    typer.echo(f"tune: {outcome.verdict}")
    report_path = outcome.folder / "report.md"
    store.write_text_new(report_path, "\n\n".join([f"# {head}", *(to_markdown(t) for t in every),
                                                   f"**tune: {outcome.verdict}**"]) + "\n")
    _err(f"the evidence: {report_path}")


def _fail(message: str, hint: str | None, code: int) -> int:
    _err(f"Error: {message}")
    if hint:
        _err(f"hint: {hint}")
    return code


def run_cli(args: list[str] | None = None) -> int:
    """The whole command line: every way it can end is an exit code, and every error one `Error:` line."""
    # Everything it prints is redacted: a secret that reaches a message by a path nobody foresaw stays unshown.
    # On an exception (CAMPAIGN_DEBUG=1 re-raises) the streams stay redacting, for the traceback.
    stdout, stderr = secret.redact_stdio()
    code = _run_cli(args)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.stdout, sys.stderr = stdout, stderr
    return code


def _run_cli(args: list[str] | None) -> int:
    debug = os.environ.get("CAMPAIGN_DEBUG") == "1"
    argv = sys.argv[1:] if args is None else args
    try:
        code = app(args=argv or ["--help"], prog_name="campaign", standalone_mode=False)
        return code if isinstance(code, int) else 0
    except LaunchError as exc:
        if debug:
            raise
        if exc.log_tail:
            _err("--- server log tail ---\n" + exc.log_tail + "\n---")
        return _fail(f"{exc.message} [{exc.kind}]", exc.hint, exc.exit_code)
    except CampaignError as exc:
        if debug:
            raise
        return _fail(exc.message, exc.hint, exc.exit_code)
    except typer.TyperException as exc:  # the command line itself: an unknown option, a bad value
        ctx = getattr(exc, "ctx", None)
        command = ctx.command_path if ctx is not None else "campaign"
        return _fail(exc.format_message().rstrip("."), f"{command} --help", EXIT_USAGE)
    except typer.Abort:
        return _fail("aborted", None, 130)
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except OSError as exc:  # the machine said no (a folder that cannot be written, a full disk): not a bug
        if debug:
            raise
        where = f": {exc.filename}" if exc.filename else ""
        return _fail(f"{exc.strerror or exc}{where}", "check that path's permissions and free space", 1)
    except Exception as exc:  # noqa: BLE001 - the last boundary: a bug still ends in one line
        if debug:
            raise
        return _fail(f"unexpected {type(exc).__name__}: {exc}",
                     "this is a bug; CAMPAIGN_DEBUG=1 shows the traceback (please report it)", EXIT_INTERNAL)


def main() -> None:
    buffered_stdio()
    # SIGTERM (e.g. from a job scheduler) unwinds like Ctrl-C, so servers are stopped and results kept; both
    # also set a flag the runner checks between cells, in case the first raise lands where it is swallowed.
    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    raise_open_files()   # a socket a stream: the soft limit up to the hard one (the plan checks against that)
    sys.exit(run_cli())
