"""The `campaign` command. Parses arguments, calls the modules, prints; errors cross here once."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from campaign import aio, report, startup_log
from campaign.endpoint import Timeouts
from campaign.errors import CampaignError, LaunchError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,  # locals can hold environments and API keys
    help="Launch vLLM with flag sets, measure it the way the study says, and diff the configurations.",
)


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
WindowOpt = Annotated[float, typer.Option("--window", help="sustained-decode window in seconds")]
PrefillOpt = Annotated[bool, typer.Option("--prefill", help="also measure prefill at each context")]
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", help="reply length of every decode request")]
ModeOpt = Annotated[str, typer.Option("--mode", help="sustained (fixed window) or fixed (N tokens each)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
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


def _timeouts(connect: float, first_byte: float, idle: float) -> Any:
    from campaign.endpoint import Timeouts

    return Timeouts(connect_s=connect, first_byte_s=first_byte, idle_s=idle)


def _note_proxy(endpoint: Any) -> None:
    from campaign.endpoint import proxy_notice

    notice = proxy_notice(endpoint)
    if notice:
        _err(f"note: {notice}")


def _cell_specs(contexts: list[int], concurrency: list[int], *, window: float, prefill: bool, max_tokens: int,
                mode: str) -> list[Any]:
    from campaign.cells import CellSpec

    if mode not in {"sustained", "fixed"}:
        raise CampaignError(f"--mode {mode!r}: expected sustained or fixed")
    specs = []
    if prefill:
        specs += [CellSpec(phase="prefill", context_tokens=c) for c in contexts]
    for ctx in contexts:
        for conc in concurrency or [1]:
            specs.append(CellSpec(phase="decode", context_tokens=ctx, concurrency=conc, mode=mode,
                                  max_tokens=max_tokens, window_s=window))
    return specs


def _measure(target: Any, specs: list[Any], *, as_json: bool) -> list[Any]:
    from campaign.measure import Measurer

    measurer = Measurer(target, on_event=_err)

    async def run_all() -> list[Any]:
        results = []
        for i, spec in enumerate(specs, 1):
            _err(f"cell {i}/{len(specs)}: {spec.key} ({spec.label})")
            results.append(await measurer.run_cell(spec))
        return results

    results = aio.run(run_all())
    if as_json:
        typer.echo(json.dumps({"cells": [report.cell_json(r) for r in results]}, indent=1))
    else:
        typer.echo(report.cells_report(results))
    return results


@app.command("parse-log")
def parse_log(
    file: Annotated[Path, typer.Argument(help="a vLLM startup log")],
    as_json: JsonOpt = False,
) -> None:
    """Read a vLLM startup log into facts: KV cache, block size, chunk size, the memory-utilisation note."""
    try:
        text = file.read_text(errors="replace")
    except FileNotFoundError:
        raise CampaignError(f"{file}: no such file") from None
    facts = startup_log.parse(text)
    if as_json:
        typer.echo(facts.model_dump_json(indent=2))
    else:
        typer.echo("\n".join(startup_log.summary(facts)))


@app.command()
def launch(
    profile: Annotated[str, typer.Argument(help="launch profile name (launch_profiles/NAME.yaml) or path")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="override a flag: key=value")] = None,
    once: Annotated[bool, typer.Option("--once", help="launch, print the facts, stop")] = False,
    engine: Annotated[str | None, typer.Option("--engine", help="vllm or sim (default: the profile's)")] = None,
    log: Annotated[Path | None, typer.Option("--log", help="server log file")] = None,
    contexts: ContextsOpt = None,
    concurrency: ConcurrencyOpt = None,
    window: WindowOpt = 30.0,
    prefill: PrefillOpt = False,
    max_tokens: MaxTokensOpt = 256,
    mode: ModeOpt = "sustained",
    as_json: JsonOpt = False,
    ca_bundle: CaBundleOpt = None,
    insecure: InsecureOpt = False,
    connect_timeout: ConnectTimeoutOpt = DEFAULT_TIMEOUTS.connect_s,
    first_byte_timeout: FirstByteTimeoutOpt = DEFAULT_TIMEOUTS.first_byte_s,
    idle_timeout: IdleTimeoutOpt = DEFAULT_TIMEOUTS.idle_s,
) -> None:
    """Launch vLLM from a profile, print what it became, optionally measure, and stop it cleanly."""
    from campaign.argv import parse_set
    from campaign.profiles import load_profile

    loaded, _ = load_profile(profile)
    if ca_bundle is not None or insecure:
        if loaded.tls is None:
            raise CampaignError(f"--ca-bundle/--insecure: profile {profile} serves plain http",
                                hint="add `tls: {certfile: ..., keyfile: ...}` to the profile to serve https")
        loaded = loaded.model_copy(update={"tls": loaded.tls.model_copy(update={
            "ca_bundle": ca_bundle.resolve() if ca_bundle else loaded.tls.ca_bundle, "insecure": insecure})})
    timeouts = _timeouts(connect_timeout, first_byte_timeout, idle_timeout)
    overrides = parse_set(set_ or [])
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    log_path = log or Path("runs") / "launch" / f"{stamp}-{loaded.served_name.replace('/', '_')}.log"
    specs = _cell_specs(parse_list(contexts, tokens=True), parse_list(concurrency), window=window,
                        prefill=prefill, max_tokens=max_tokens, mode=mode) if contexts else []
    _err(f"launching {profile}; log: {log_path}")
    try:
        _launch_and_serve(loaded, log_path, overrides, engine=engine, once=once, specs=specs, as_json=as_json,
                          timeouts=timeouts)
    except KeyboardInterrupt:
        _err("interrupted: the server was stopped; everything measured so far was printed or kept")
        raise typer.Exit(130) from None


def _launch_and_serve(loaded: Any, log_path: Path, overrides: dict[str, Any], *, engine: str | None, once: bool,
                      specs: list[Any], as_json: bool, timeouts: Any) -> None:
    from campaign.launcher import launched

    with launched(loaded, log_path, overrides, engine=engine) as server:
        _err("command: " + " ".join(server.spec.redacted_argv()))
        _err(f"ready in {server.ready.ready_s:.1f} s at {server.spec.base_url} (pid {server.ready.pid})")
        _note_proxy(server.spec.endpoint())
        if as_json and not specs:
            typer.echo(server.facts.model_dump_json(indent=2))
        else:
            _err("\n".join(startup_log.summary(server.facts)))
        for warning in server.warnings:
            _err(f"warning: {warning}")
        if specs:
            _measure(server.target(timeouts), specs, as_json=as_json)
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
    url: Annotated[str, typer.Argument(help="base URL of a running server, e.g. http://127.0.0.1:8000")],
    model: Annotated[str | None, typer.Option("--model", help="served model (default: from /v1/models)")] = None,
    api_key_env: Annotated[str | None, typer.Option("--api-key-env", help="env var holding the API key")] = None,
    contexts: ContextsOpt = "1k",
    concurrency: ConcurrencyOpt = "1",
    window: WindowOpt = 30.0,
    prefill: PrefillOpt = False,
    max_tokens: MaxTokensOpt = 256,
    mode: ModeOpt = "sustained",
    as_json: JsonOpt = False,
    ca_bundle: CaBundleOpt = None,
    insecure: InsecureOpt = False,
    connect_timeout: ConnectTimeoutOpt = DEFAULT_TIMEOUTS.connect_s,
    first_byte_timeout: FirstByteTimeoutOpt = DEFAULT_TIMEOUTS.first_byte_s,
    idle_timeout: IdleTimeoutOpt = DEFAULT_TIMEOUTS.idle_s,
) -> None:
    """Measure an already running server (other traffic allowed: every step is bracketed)."""
    from campaign.control import ControlClient
    from campaign.endpoint import TLS, Endpoint
    from campaign.measure import Target

    api_key = os.environ.get(api_key_env) if api_key_env else None
    endpoint = Endpoint.parse(url, api_key=api_key, tls=TLS(ca_bundle=ca_bundle, insecure=insecure),
                              timeouts=_timeouts(connect_timeout, first_byte_timeout, idle_timeout))
    _note_proxy(endpoint)
    import httpx

    try:
        with ControlClient(endpoint) as control:
            served, max_len = control.served_model()
            version = control.version()
    except httpx.TransportError as exc:
        hint = ("give the server's CA with --ca-bundle FILE (or SSL_CERT_FILE), or --insecure"
                if "CERTIFICATE" in str(exc).upper() else "is the server running at that address?")
        raise CampaignError(f"cannot reach {endpoint.root}: {exc}", hint=hint) from None
    target = Target(endpoint=endpoint, model=model or served, max_model_len=max_len, server_version=version)
    specs = _cell_specs(parse_list(contexts, tokens=True), parse_list(concurrency), window=window,
                        prefill=prefill, max_tokens=max_tokens, mode=mode)
    _measure(target, specs, as_json=as_json)


def _load_for_run(matrix_name: str, profile_name: str | None, window: float | None,
                  repeats: int | None) -> tuple[Any, Path, Any, Path]:
    from campaign.matrix import load_matrix
    from campaign.profiles import load_profile

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
    matrix: Annotated[str, typer.Argument(help="matrix name (matrices/NAME.yaml) or path")],
    profile: Annotated[str | None, typer.Option("--profile", help="launch profile (default: the matrix's)")] = None,
    window: Annotated[float | None, typer.Option("--window", help="override the decode window (s)")] = None,
    repeats: Annotated[int | None, typer.Option("--repeats", help="override the repeats")] = None,
    out: Annotated[Path, typer.Option("--out", help="where runs are stored")] = Path("runs"),
) -> None:
    """Print what a campaign will run: launches, cells per server, known over-capacity cells, duration."""
    from campaign.cells import over_capacity
    from campaign.matrix import schedule
    from campaign.orchestrate import LAUNCH_ESTIMATE_S, estimate_s
    from campaign.progress import fmt_duration
    from campaign.store import latest_run

    loaded, matrix_path, prof, _ = _load_for_run(matrix, profile, window, repeats)
    order = schedule(loaded)
    cells = loaded.cells()
    previous = latest_run(out, loaded.name)
    known: dict[str, dict[str, Any]] = {}
    ready: list[float] = []
    if previous is not None:
        for server in previous.servers():
            if server.get("kind") == "server":
                known.setdefault(server["variant"], server["facts"])
                ready.append(float(server["ready_s"]))
    typer.echo(f"campaign {loaded.name} ({matrix_path}) on profile {prof.served_name}")
    variants = []
    for variant in loaded.ordered_variants():
        facts = known.get(variant.name, {})
        skipped = [c.key for c in cells if c.phase == "decode" and over_capacity(
            context_tokens=c.context_tokens, output_tokens=c.max_tokens, concurrency=c.concurrency,
            kv_cache_tokens=facts.get("kv_cache_tokens"), block_size=facts.get("block_size"))]
        variants.append((variant.name, variant.flags, facts.get("kv_cache_tokens"), skipped))
    launch_s = sum(ready) / len(ready) if ready else LAUNCH_ESTIMATE_S
    typer.echo(report.text(report.plan_tables(
        launches=order, repeats=loaded.repeats, variants=variants,
        known_from=previous.root.name if previous else None, cells=[(c.key, c.label) for c in cells],
        experiments=[e.key for e in loaded.experiments()],
        duration=f"{fmt_duration(estimate_s(loaded, len(order), launch_s))} "
                 f"(launch ~{launch_s:.0f} s each{' from the last run' if ready else ', a guess'})")))


@app.command()
def run(
    matrix: Annotated[str | None, typer.Argument(help="matrix name (matrices/NAME.yaml) or path")] = None,
    profile: Annotated[str | None, typer.Option("--profile", help="launch profile (default: the matrix's)")] = None,
    engine: Annotated[str | None, typer.Option("--engine", help="vllm or sim (default: the profile's engine)")
                      ] = None,
    window: Annotated[float | None, typer.Option("--window", help="override the decode window (s)")] = None,
    repeats: Annotated[int | None, typer.Option(
        "--repeats", help="override the repeats (with --resume: raise them; new launches interleave as before)")
                       ] = None,
    out: Annotated[Path, typer.Option("--out", help="where runs are stored")] = Path("runs"),
    resume: Annotated[Path | None, typer.Option("--resume", help="continue this run directory")] = None,
    live: Annotated[bool | None, typer.Option("--live/--plain", help="progress display (default: on a TTY)")] = None,
) -> None:
    """Run a campaign: launch each flag set, measure, stop; store everything; end with the diff."""
    from campaign import store
    from campaign.matrix import Matrix, schedule
    from campaign.orchestrate import Campaign, Options, estimate_s, manifest
    from campaign.profiles import LaunchProfile
    from campaign.progress import Progress

    if engine is not None and engine not in {"vllm", "sim"}:
        raise CampaignError(f"--engine {engine!r}: expected vllm or sim")
    if resume is not None:
        run_dir = store.RunDir(resume)
        stored = run_dir.manifest()
        loaded = Matrix.model_validate(stored["matrix"]["raw"])
        loaded = loaded.model_copy(update={"repeats": run_dir.repeats(loaded.repeats, more=repeats)})
        prof = LaunchProfile.model_validate(stored["profile"]["raw"])
        engine = engine or stored.get("engine")
        _err(f"resuming {run_dir.root}: {len(run_dir.cells())} cells already stored")
    else:
        if matrix is None:
            raise CampaignError("name a matrix, or --resume a run directory", hint="e.g. campaign run demo")
        loaded, matrix_path, prof, profile_path = _load_for_run(matrix, profile, window, repeats)
        run_dir = store.RunDir.create(out, loaded.name)
        store.write_new(run_dir.manifest_path, manifest(loaded, matrix_path, prof, profile_path,
                                                        Options(engine=engine, max_attempts=loaded.max_attempts)))
        _err(f"run directory: {run_dir.root}")
    options = Options(engine=engine, max_attempts=loaded.max_attempts)
    order = schedule(loaded)
    total = sum(1 for v, r in order for c in loaded.cells() if not run_dir.done(v, c.key, r))
    with Progress(total_cells=total, estimate_s=estimate_s(loaded, len(order)), live=live) as progress:
        try:
            Campaign(run_dir, loaded, prof, options=options, progress=progress).execute()
        except KeyboardInterrupt:
            progress.note(f"interrupted: every finished cell is stored in {run_dir.root}; continue with\n"
                          f"  campaign run --resume {run_dir.root}")
            raise typer.Exit(130) from None
    _finish(run_dir)


def _finish(run_dir: Any) -> None:
    from campaign import compare, store

    drift = compare.drift(run_dir)
    diffs = compare.diff_run(run_dir)
    short = compare.short_answers_by_variant(run_dir)
    scale = float(run_dir.manifest().get("time_scale") or 1.0)
    if scale != 1.0:
        typer.echo(f"SIMULATED at a {scale:g}x time scale: rates in the cell tables read {scale:g}x higher and "
                   "latencies that much lower than on the simulated hardware.\n")
    typer.echo(report.cells_by_variant_text(run_dir.cells(), run_dir.servers()))
    typer.echo("")
    for variant, values in short.items():
        typer.echo(report.short_answers_text(variant, values) + "\n")
    experiments = report.experiments_text(run_dir.experiments())
    if experiments:
        typer.echo(experiments + "\n")
    typer.echo(report.diff_text(diffs))
    typer.echo("")
    typer.echo(f"drift: {drift.message}")
    summary_path = run_dir.root / "summary.json"
    if not summary_path.exists():
        store.write_new(summary_path, {
            "kind": "summary", "drift": drift.__dict__, "short_answers": short,
            "vllm_versions": sorted({str(s["facts"].get("vllm_version")) for s in run_dir.servers()
                                     if s.get("kind") == "server"}),
            "recommendations": {d.variant: d.recommendation for d in diffs},
            "outcomes": {d.variant: {"outcome": d.outcome, "provisional": d.provisional, "tests": d.tests,
                                     "family_wise_alpha": d.alpha, "aa": d.aa} for d in diffs},
        })
    from campaign import html_report

    written = html_report.write(run_dir)
    typer.echo(f"results: {run_dir.root}")
    typer.echo(f"report: {written[0]}")


@app.command()
def diff(
    run_dir: Annotated[Path, typer.Argument(help="a run directory")],
    other: Annotated[Path | None, typer.Argument(help="a second run directory to compare against the first")] = None,
    baseline: Annotated[str | None, typer.Option("--baseline", help="baseline variant (default: the matrix's)")
                        ] = None,
    force: Annotated[bool, typer.Option("--force", help="compare cells that are not comparable")] = False,
) -> None:
    """Diff every variant against the baseline: flags, facts, per-cell verdicts, recommendation."""
    from campaign import compare, store

    first = store.RunDir(run_dir)
    diffs = compare.diff_run(first, baseline=baseline, other=store.RunDir(other) if other else None, force=force)
    typer.echo(report.diff_text(diffs))
    typer.echo(f"\ndrift: {compare.drift(first).message}")


@app.command("report")
def report_cmd(
    run_dir: Annotated[Path, typer.Argument(help="a run directory")],
    fmt: Annotated[str, typer.Option("--format", help="html (default), md or png")] = "html",
    out: Annotated[Path | None, typer.Option("--out", help="report file (png: a folder)")] = None,
) -> None:
    """One self-contained HTML report (or Markdown, or the PNG charts) from a stored run."""
    from campaign import html_report, store

    if fmt not in {"html", "md", "png"}:
        raise CampaignError(f"--format {fmt!r}: expected html, md or png")
    for path in html_report.write(store.RunDir(run_dir), fmt=fmt, out=out):
        typer.echo(str(path))


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="a run directory")],
    fmt: Annotated[str, typer.Option("--format", help="json or csv")] = "json",
    out: Annotated[Path | None, typer.Option("--out", help="file to write (default: stdout)")] = None,
) -> None:
    """One row per cell, variant and repeat."""
    from campaign import store

    if fmt not in {"json", "csv"}:
        raise CampaignError(f"--format {fmt!r}: expected json or csv")
    rows = report.export_rows(store.RunDir(run_dir).cells())
    text = report.rows_json(rows) if fmt == "json" else report.rows_csv(rows)
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text)
        _err(f"wrote {len(rows)} rows to {out}")


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    # SIGTERM (e.g. from a job scheduler) unwinds like Ctrl-C, so servers are stopped and results kept.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        app()
    except LaunchError as exc:
        _err(f"Error: {exc.message} [{exc.kind}]")
        if exc.log_tail:
            _err("--- server log tail ---\n" + exc.log_tail + "\n---")
        if exc.hint:
            _err(f"hint: {exc.hint}")
        sys.exit(exc.exit_code)
    except CampaignError as exc:
        if os.environ.get("CAMPAIGN_DEBUG") == "1":
            raise
        _err(f"Error: {exc.message}")
        if exc.hint:
            _err(f"hint: {exc.hint}")
        sys.exit(exc.exit_code)
