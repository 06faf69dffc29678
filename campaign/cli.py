"""The `campaign` command. Parses arguments, calls the modules, prints; errors cross here once."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from campaign.core import aio, secret
from campaign.core.errors import EXIT_INTERNAL, EXIT_SOME_FAILED, EXIT_USAGE, CampaignError, LaunchError
from campaign.http.endpoint import Timeouts
from campaign.report import text as report
from campaign.server import startup_log

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


def parse_tokens(text: str) -> int:
    """`8k` -> 8192, `6616` -> 6616, `1.5k` -> 1536."""
    value = text.strip().lower()
    scale = 1
    if value.endswith("k"):
        scale, value = 1024, value[:-1]
    elif value.endswith("m"):
        scale, value = 1024 * 1024, value[:-1]
    try:
        return int(float(value) * scale)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a token count (e.g. 8k, 6616)") from None


def parse_list(text: str | None, *, tokens: bool = False) -> list[int]:
    if not text:
        return []
    out = []
    for part in text.split(","):
        if part.strip():
            out.append(parse_tokens(part) if tokens else int(part))
    return out


# --- shared measurement options ------------------------------------------------------------------------
ContextsOpt = Annotated[str | None, typer.Option("--contexts", help="decode contexts, e.g. 8k,16k,512")]
ConcurrencyOpt = Annotated[str | None, typer.Option("--concurrency", help="simultaneous requests, e.g. 1,2,4")]
WindowOpt = Annotated[float, typer.Option(
    "--window", help="sustained-decode window in seconds (the hardware's, on a time-scaled simulator)",
    callback=_positive)]
PrefillOpt = Annotated[bool, typer.Option("--prefill", help="also measure prefill at each context")]
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", help="reply length of every decode request")]
ModeOpt = Annotated[str, typer.Option("--mode", help="sustained (fixed window) or fixed (N tokens each)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
PromptsOpt = Annotated[str, typer.Option(
    "--prompts", metavar="random|code|prose|FILE.jsonl",
    help="what the prompts are made of: random token ids, the standard library's code or its docstrings, or "
         "your own prompts; text is made exactly L tokens by the server's /tokenize")]
EndpointOpt = Annotated[str, typer.Option(
    "--endpoint", metavar="completions|chat",
    help="/v1/completions, or /v1/chat/completions through the chat template and the server's parsers")]
DEFAULT_TIMEOUTS = Timeouts()
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
DurationOpt = Annotated[float, typer.Option("--duration", help="seconds of arrivals per rate cell (and per probe "
                                                               "of --find-max-rate)", callback=_positive)]
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
FindMaxRateOpt = Annotated[bool, typer.Option(
    "--find-max-rate", help="search the highest rate (and concurrency) that holds --slo, at one context")]


@dataclass(frozen=True)
class RateAsk:
    """What --rate, --slo and --find-max-rate asked for."""

    rates: list[float | None]
    duration: float
    service: Any
    arrival: str
    burstiness: float
    max_concurrency: int | None
    find_max_rate: bool

    @property
    def any(self) -> bool:
        return bool(self.rates) or self.find_max_rate


def _rate_ask(rate: str | None, duration: float, slo_text: str | None, arrival: str, burstiness: float,
              max_concurrency: int | None, find_max_rate: bool) -> RateAsk:
    from campaign.measure import slo
    from campaign.measure.openloop import ARRIVALS, rate_value

    try:
        rates = [rate_value(part.strip()) for part in (rate or "").split(",") if part.strip()]
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--rate'") from None
    if None in rates and max_concurrency is None:
        raise typer.BadParameter("inf needs --max-concurrency N (the requests in flight at once)",
                                 param_hint="'--rate'")
    if arrival not in ARRIVALS:
        raise typer.BadParameter(f"{arrival!r}: expected {', '.join(ARRIVALS)}", param_hint="'--arrival'")
    try:
        service = slo.parse(slo_text) if slo_text else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--slo'") from None
    if find_max_rate and service is None:
        raise typer.BadParameter("needs --slo: the service level to find the highest rate for",
                                 param_hint="'--find-max-rate'")
    return RateAsk(rates, duration, service, arrival, burstiness, max_concurrency, find_max_rate)


def _rate_specs(contexts: list[int], ask: RateAsk, *, max_tokens: int, prompts: str, endpoint: str) -> list[Any]:
    from campaign.measure.cells import CellSpec

    return [CellSpec(phase="rate", context_tokens=ctx, max_tokens=max_tokens, request_rate=rate,
                     duration_s=ask.duration, arrival=ask.arrival, burstiness=ask.burstiness,
                     max_concurrency=ask.max_concurrency, slo=ask.service, prompts=prompts, endpoint=endpoint)
            for ctx in contexts for rate in ask.rates]


def _search_spec(contexts: list[int], ask: RateAsk, *, max_tokens: int, prompts: str, endpoint: str) -> Any:
    from campaign.measure.cells import CellSpec

    if len(contexts) != 1:
        raise typer.BadParameter("give one context with --find-max-rate (e.g. --contexts 8k)",
                                 param_hint="'--contexts'")
    # Its max_concurrency is the concurrency search's ceiling (the rate probes run uncapped).
    return CellSpec(phase="rate", context_tokens=contexts[0], max_tokens=max_tokens, request_rate=1.0,
                    duration_s=ask.duration, arrival=ask.arrival, burstiness=ask.burstiness, slo=ask.service,
                    max_concurrency=ask.max_concurrency, prompts=prompts, endpoint=endpoint)


def _timeouts(connect: float, first_byte: float, idle: float) -> Any:
    from campaign.http.endpoint import Timeouts

    return Timeouts(connect_s=connect, first_byte_s=first_byte, idle_s=idle)


def _note_proxy(endpoint: Any) -> None:
    from campaign.http.endpoint import proxy_notice

    notice = proxy_notice(endpoint)
    if notice:
        _err(f"note: {notice}")


def _cell_specs(contexts: list[int], concurrency: list[int], *, window: float, prefill: bool, max_tokens: int,
                mode: str, prompts: str = "random", endpoint: str = "completions") -> list[Any]:
    from campaign.measure.cells import CellSpec
    from campaign.measure.prompts import ENDPOINTS, prompt_source

    if mode not in {"sustained", "fixed"}:
        raise CampaignError(f"--mode {mode!r}: expected sustained or fixed")
    if endpoint not in ENDPOINTS:
        raise CampaignError(f"--endpoint {endpoint!r}: expected {' or '.join(ENDPOINTS)}")
    try:
        prompt_source(prompts)
    except ValueError as exc:
        raise CampaignError(f"--prompts: {exc}") from None
    text = {"prompts": prompts, "endpoint": endpoint}
    specs = []
    if prefill:
        specs += [CellSpec(phase="prefill", context_tokens=c, **text) for c in contexts]
    for ctx in contexts:
        for conc in concurrency or [1]:
            specs.append(CellSpec(phase="decode", context_tokens=ctx, concurrency=conc, mode=mode,
                                  max_tokens=max_tokens, window_s=window, **text))
    return specs


def _measure(target: Any, specs: list[Any], *, as_json: bool, search: Any = None) -> list[Any]:
    """Measure the cells, then (`search`: a rate cell's shape with its SLO) the capacity at that SLO."""
    from campaign.measure import capacity
    from campaign.measure.runner import Measurer

    measurer = Measurer(target, on_event=_err)

    async def run_all() -> tuple[list[Any], Any]:
        results = []
        for i, spec in enumerate(specs, 1):
            _err(f"cell {i}/{len(specs)}: {spec.key} ({spec.label})")
            results.append(await measurer.run_cell(spec))
        found = None
        if search is not None:
            _err(f"capacity at SLO ({search.slo.text}): searching")
            found = await capacity.slo_search(measurer, search, on_probe=_err)
        return results, found

    results, found = aio.run(run_all())
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
    return results


@app.command("parse-log")
def parse_log(
    file: Annotated[Path, typer.Argument(metavar="LOG", help="a vLLM startup log")],
    as_json: JsonOpt = False,
) -> None:
    """Read a vLLM startup log into facts: KV cache, block size, chunk size, the memory-utilisation note.

    Exit 0: a clean start; 3: the log shows a failure; 2: not a vLLM log (or empty)."""
    from campaign.core.errors import ConfigError

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
    engine: Annotated[str | None, typer.Option("--engine", help="vllm or sim (default: the profile's)")] = None,
    log: Annotated[Path | None, typer.Option("--log", help="server log file")] = None,
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
    as_json: JsonOpt = False,
    ca_bundle: CaBundleOpt = None,
    insecure: InsecureOpt = False,
    connect_timeout: ConnectTimeoutOpt = DEFAULT_TIMEOUTS.connect_s,
    first_byte_timeout: FirstByteTimeoutOpt = DEFAULT_TIMEOUTS.first_byte_s,
    idle_timeout: IdleTimeoutOpt = DEFAULT_TIMEOUTS.idle_s,
) -> None:
    """Launch vLLM from a profile, print what it became, optionally measure, and stop it cleanly."""
    from campaign.server.argv import parse_set
    from campaign.server.profiles import load_profile

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
    from campaign.night.orchestrate import preflight

    preflight(loaded, profile_path, engine, overrides=overrides)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    log_path = log or Path("runs") / "launch" / f"{stamp}-{loaded.served_name.replace('/', '_')}.log"
    ask = _rate_ask(rate, duration, slo_text, arrival, burstiness, max_concurrency, find_max_rate)
    specs, search = _what_to_measure(contexts, concurrency, ask, window=window, prefill=prefill,
                                     max_tokens=max_tokens, mode=mode, prompts=prompts,
                                     endpoint=endpoint_kind) if contexts or ask.any else ([], None)
    _err(f"launching {profile}; log: {log_path}")
    try:
        _launch_and_serve(loaded, log_path, overrides, engine=engine, once=once, specs=specs, as_json=as_json,
                          timeouts=timeouts, search=search)
    except KeyboardInterrupt:
        _err("interrupted: the server was stopped; everything measured so far was printed or kept")
        raise typer.Exit(130) from None


def _what_to_measure(contexts: str | None, concurrency: str | None, ask: RateAsk, *, window: float, prefill: bool,
                     max_tokens: int, mode: str, prompts: str, endpoint: str) -> tuple[list[Any], Any]:
    """The cells asked for, and the capacity search's shape: decode cells at --concurrency (1 unless only
    rates were asked for), prefill with --prefill, rate cells at --rate, a search with --find-max-rate."""
    lengths = parse_list(contexts or "1k", tokens=True)
    decode = concurrency is not None or not ask.any
    specs = _cell_specs(lengths, parse_list(concurrency or "1"), window=window, prefill=prefill,
                        max_tokens=max_tokens, mode=mode, prompts=prompts, endpoint=endpoint)
    if not decode:
        specs = [s for s in specs if s.phase == "prefill"]
    specs += _rate_specs(lengths, ask, max_tokens=max_tokens, prompts=prompts, endpoint=endpoint)
    search = _search_spec(lengths, ask, max_tokens=max_tokens, prompts=prompts, endpoint=endpoint) if (
        ask.find_max_rate) else None
    return specs, search


def _launch_and_serve(loaded: Any, log_path: Path, overrides: dict[str, Any], *, engine: str | None, once: bool,
                      specs: list[Any], as_json: bool, timeouts: Any, search: Any = None) -> None:
    from campaign.night.launcher import launched

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
    model: Annotated[str | None, typer.Option("--model", help="served model (default: from /v1/models)")] = None,
    api_key_env: Annotated[str | None, typer.Option("--api-key-env", help="env var holding the API key")] = None,
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
    as_json: JsonOpt = False,
    ca_bundle: CaBundleOpt = None,
    insecure: InsecureOpt = False,
    connect_timeout: ConnectTimeoutOpt = DEFAULT_TIMEOUTS.connect_s,
    first_byte_timeout: FirstByteTimeoutOpt = DEFAULT_TIMEOUTS.first_byte_s,
    idle_timeout: IdleTimeoutOpt = DEFAULT_TIMEOUTS.idle_s,
) -> None:
    """Measure an already running server (other traffic allowed: every step is bracketed)."""
    from campaign.http.endpoint import TLS, Endpoint
    from campaign.measure.runner import Target
    from campaign.server.argv import api_key_from
    from campaign.server.control import ControlClient

    ask = _rate_ask(rate, duration, slo_text, arrival, burstiness, max_concurrency, find_max_rate)
    specs, search = _what_to_measure(contexts, concurrency, ask, window=window, prefill=prefill,
                                     max_tokens=max_tokens, mode=mode, prompts=prompts, endpoint=endpoint_kind)
    api_key = api_key_from(api_key_env)
    endpoint = Endpoint.parse(url, api_key=api_key, tls=TLS(ca_bundle=ca_bundle, insecure=insecure),
                              timeouts=_timeouts(connect_timeout, first_byte_timeout, idle_timeout))
    _note_proxy(endpoint)
    import httpx

    try:
        with ControlClient(endpoint, retry_s=2.0) as control:
            served, max_len = control.served_model()
            version = control.version()
    except httpx.TransportError as exc:
        hint = ("give the server's CA with --ca-bundle FILE (or SSL_CERT_FILE), or --insecure"
                if "CERTIFICATE" in str(exc).upper() else "is the server running at that address?")
        raise CampaignError(f"cannot reach {endpoint.root}: {exc}", hint=hint) from None
    target = Target(endpoint=endpoint, model=model or served, max_model_len=max_len, server_version=version)
    _measure(target, specs, as_json=as_json, search=search)


def _check_engine(engine: str | None) -> None:
    if engine is not None and engine not in {"vllm", "sim"}:
        raise typer.BadParameter(f"{engine!r}: expected vllm or sim", param_hint="'--engine'")


def _load_for_run(matrix_name: str, profile_name: str | None, window: float | None,
                  repeats: int | None) -> tuple[Any, Path, Any, Path]:
    from campaign.night.matrix import load_matrix
    from campaign.server.profiles import load_profile

    matrix, matrix_path, _ = load_matrix(matrix_name)
    updates: dict[str, Any] = {}
    if window is not None:
        updates["window_s"] = window
        updates["workloads"] = [w.model_copy(update={"window_s": None}) if w.kind == "decode" else w
                                for w in matrix.workloads]
    if repeats is not None:
        updates["repeats"] = repeats
    if updates:
        matrix = matrix.model_copy(update=updates)
    profile, profile_path = load_profile(profile_name or matrix.profile)
    return matrix, matrix_path, profile, profile_path


@app.command()
def plan(
    matrix: Annotated[str, typer.Argument(metavar="MATRIX", help="matrix name (matrices/NAME.yaml) or path")],
    profile: Annotated[str | None, typer.Option("--profile", help="launch profile (default: the matrix's)")] = None,
    window: Annotated[float | None, typer.Option("--window", help="override the decode window (s)",
                                                 callback=_positive)] = None,
    repeats: Annotated[int | None, typer.Option("--repeats", help="override the repeats", min=1)] = None,
    out: Annotated[Path, typer.Option("--out", help="where runs are stored")] = Path("runs"),
    engine: Annotated[str | None, typer.Option("--engine", help="vllm or sim (default: the profile's engine)")
                      ] = None,
) -> None:
    """Print what a campaign will run: launches, cells per server, known over-capacity cells, duration."""
    from campaign.night.orchestrate import preflight
    from campaign.night.planning import make_plan
    from campaign.night.store import latest_run

    loaded, matrix_path, prof, profile_path = _load_for_run(matrix, profile, window, repeats)
    _check_engine(engine)
    flags_from = preflight(prof, profile_path, engine, loaded, matrix_path, will_launch=False)
    typer.echo(f"campaign {loaded.name} ({matrix_path}) on profile {profile_path.stem} "
               f"({engine or prof.engine}, serving {prof.served_name}); flags checked against {flags_from}")
    typer.echo(report.text(report.plan_tables(make_plan(loaded, prof, latest_run(out, loaded.name)),
                                              repeats=loaded.repeats)))


@app.command()
def simulate(
    matrix: Annotated[str, typer.Argument(metavar="MATRIX", help="matrix name (matrices/NAME.yaml) or path")],
    variant: Annotated[str | None, typer.Option("--variant", help="whose flags (default: the baseline)")] = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="Markdown tables")] = False,
) -> None:
    """Replay the matrix's prefill and decode cells on the simulator in simulated time (seconds, the same
    every time): the decode matrix as the matrix says, each cell's change with the other TTFT mode, the prefill
    row. The launch profile must name simulated hardware."""
    from campaign.measure.cells import TTFTMode
    from campaign.night import replay as sim_virtual
    from campaign.night.matrix import load_matrix
    from campaign.report.tables import to_markdown, to_text

    loaded, _, _ = load_matrix(matrix)
    hardware = sim_virtual.config_for(loaded, variant).hardware
    cells = sim_virtual.run_matrix(loaded, variant=variant)
    modes = {c.spec.ttft for c in cells if c.spec.phase == "decode"}
    flipped: TTFTMode = "cold" if modes == {"warm"} else "warm"
    other = sim_virtual.run_matrix(loaded, variant=variant, ttft=flipped)
    render = to_markdown if markdown else to_text
    typer.echo(f"{loaded.name} on the simulated {hardware}, in simulated time (figures are the hardware's)\n")
    typer.echo("\n\n".join(render(t) for t in report.virtual_tables(cells, other, flipped)))


@app.command()
def run(
    matrix: Annotated[str | None, typer.Argument(
        metavar="MATRIX", help="matrix name (matrices/NAME.yaml) or path")] = None,
    profile: Annotated[str | None, typer.Option("--profile", help="launch profile (default: the matrix's)")] = None,
    engine: Annotated[str | None, typer.Option("--engine", help="vllm or sim (default: the profile's engine)")
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
) -> None:
    """Run a campaign: launch each flag set, measure, stop; store everything; end with the diff."""
    from campaign.night import orchestrate, pool
    from campaign.night.progress import Progress

    _check_engine(engine)
    if executor not in {None, "local", "ray"}:
        raise CampaignError(f"--executor {executor!r}: expected local or ray", hint="e.g. --executor ray")
    on_ray = None if executor is None else executor == "ray"
    pool_gpus = pool.parse_gpus(gpus) if gpus is not None else None
    if clock not in {"wall", "virtual"}:
        raise CampaignError(f"--clock {clock!r}: expected wall or virtual", hint="e.g. --clock virtual --engine sim")
    if resume is not None:
        night = orchestrate.resumed(resume, engine=engine, more_repeats=repeats, gpus=pool_gpus,
                                    mixed_gpus=mixed_gpus, ray=on_ray, ray_address=ray_address)
    elif matrix is None:
        raise CampaignError("name a matrix, or --resume a run directory", hint="e.g. campaign run demo")
    else:
        loaded, matrix_path, prof, profile_path = _load_for_run(matrix, profile, window, repeats)
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
        _finish(tonight.run)
        unfinished = tonight.unfinished()
    if unfinished:
        _err(f"finished, but not everything: {', '.join(unfinished)}")
        raise typer.Exit(EXIT_SOME_FAILED)


def _say_damaged(run_dir: Any) -> None:
    for message in run_dir.damaged:
        _err(f"warning: skipped {message}")


def _finish(run_dir: Any) -> None:
    from campaign.analysis import compare
    from campaign.report import html as html_report

    drift = compare.drift(run_dir)
    diffs = compare.diff_run(run_dir)
    short = compare.short_answers_by_variant(run_dir)
    stored_manifest = run_dir.manifest()
    scale = stored_manifest.time_scale
    if scale != 1.0:
        typer.echo(f"SIMULATED at a {scale:g}x time scale: every figure is the simulated hardware's, converted "
                   f"from a wall clock {scale:g}x faster.\n")
    if stored_manifest.clock == "virtual":
        left = "; ".join(stored_manifest.not_replayed)
        typer.echo("SIMULATED in simulated time: the engine replayed, figures in the hardware's units"
                   + (f"; not replayed: {left}" if left else "") + "\n")
    stored, servers = run_dir.cells(), run_dir.servers()   # read once: the tables and the verdict share them
    typer.echo(report.cells_by_variant_text(stored, servers))
    typer.echo("")
    for variant, values in short.items():
        typer.echo(report.short_answers_text(variant, values) + "\n")
    experiments = report.experiments_text(run_dir.experiments())
    if experiments:
        typer.echo(experiments + "\n")
    typer.echo(report.diff_text(diffs))
    typer.echo("")
    typer.echo(f"drift: {drift.message}")
    effect = compare.gpu_effect(run_dir)
    if effect.checked:
        typer.echo(f"GPU effect: {effect.message}")
    run_dir.write_summary(compare.summary_record(run_dir, drift_=drift, diffs=diffs, short=short))
    written = html_report.write(run_dir)
    # The answer last, where the eye lands (the reports open with the same lines).
    verdict = report.verdict_table(diffs, drift=drift.message, latest=report.latest_cells(stored),
                                   servers=servers, short=short)
    typer.echo("\n== Verdict ==\n" + "\n".join(report.verdict_lines(verdict)))
    _say_damaged(run_dir)
    typer.echo(f"results: {run_dir.root}")
    typer.echo(f"report: {written[0]}")


@app.command()
def diff(
    run_dir: Annotated[Path, typer.Argument(metavar="RUN_DIR", help="a run directory")],
    other: Annotated[Path | None, typer.Argument(
        metavar="OTHER_RUN", help="a second run directory to compare against the first")] = None,
    baseline: Annotated[str | None, typer.Option("--baseline", help="baseline variant (default: the matrix's)")
                        ] = None,
    force: Annotated[bool, typer.Option("--force", help="compare cells that are not comparable")] = False,
) -> None:
    """Diff every variant against the baseline: flags, facts, per-cell verdicts, recommendation."""
    from campaign.analysis import compare
    from campaign.night import store

    first = store.RunDir(run_dir)
    diffs = compare.diff_run(first, baseline=baseline, other=store.RunDir(other) if other else None, force=force)
    typer.echo(report.diff_text(diffs))
    typer.echo(f"\ndrift: {compare.drift(first).message}")
    effect = compare.gpu_effect(first)
    if effect.checked:
        typer.echo(f"GPU effect: {effect.message}")
    _say_damaged(first)


@app.command("report")
def report_cmd(
    run_dir: Annotated[Path, typer.Argument(metavar="RUN_DIR", help="a run directory")],
    other: Annotated[Path | None, typer.Argument(
        metavar="OTHER_RUN", help="an earlier run of the same matrix: its variants beside these as <name>@B, "
                                  "each diffed against this run's baseline")] = None,
    fmt: Annotated[str, typer.Option("--format", help="html (default), md or png")] = "html",
    out: Annotated[Path | None, typer.Option("--out", help="report file (png: a folder)")] = None,
) -> None:
    """One self-contained HTML report (or Markdown, or the PNG charts) from a stored run, or from two."""
    from campaign.night import store
    from campaign.report import html as html_report

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
    fmt: Annotated[str, typer.Option("--format", help="json or csv")] = "json",
    out: Annotated[Path | None, typer.Option("--out", help="file to write (default: stdout)")] = None,
) -> None:
    """One row per cell, variant and repeat."""
    from campaign.night import store

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


def buffered_stdio() -> None:
    """Give stdout and stderr a buffered layer where PYTHONUNBUFFERED (usual in containers, set on CI) left
    the text layer straight on the file descriptor: that layer drops the rest of a short write, and after
    uvloop has run the kernel returned one: `probe --json` (175 KB) to a pipe read late arrived cut at
    64 KiB, with exit 0. A buffered writer goes on writing after a short write; line buffering keeps every
    line as prompt as unbuffered output."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, io.TextIOWrapper) and isinstance(stream.buffer, io.RawIOBase):
            raw = io.FileIO(stream.fileno(), "w", closefd=False)
            setattr(sys, name, io.TextIOWrapper(io.BufferedWriter(raw), encoding=stream.encoding,
                                                errors=stream.errors, line_buffering=True))


def main() -> None:
    buffered_stdio()
    # SIGTERM (e.g. from a job scheduler) unwinds like Ctrl-C, so servers are stopped and results kept; both
    # also set a flag the runner checks between cells, in case the first raise lands where it is swallowed.
    from campaign.core.errors import request_stop

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    sys.exit(run_cli())
