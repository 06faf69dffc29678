"""The `campaign` command. Parses arguments, calls the modules, prints; errors cross here once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from campaign import report, startup_log
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

    results = asyncio.run(run_all())
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
) -> None:
    """Launch vLLM from a profile, print what it became, optionally measure, and stop it cleanly."""
    from campaign.argv import parse_set
    from campaign.profiles import load_profile

    loaded, _ = load_profile(profile)
    overrides = parse_set(set_ or [])
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    log_path = log or Path("runs") / "launch" / f"{stamp}-{loaded.served_name.replace('/', '_')}.log"
    specs = _cell_specs(parse_list(contexts, tokens=True), parse_list(concurrency), window=window,
                        prefill=prefill, max_tokens=max_tokens, mode=mode) if contexts else []
    _err(f"launching {profile}; log: {log_path}")
    try:
        _launch_and_serve(loaded, log_path, overrides, engine=engine, once=once, specs=specs, as_json=as_json)
    except KeyboardInterrupt:
        _err("interrupted: the server was stopped; everything measured so far was printed or kept")
        raise typer.Exit(130) from None


def _launch_and_serve(loaded: Any, log_path: Path, overrides: dict[str, Any], *, engine: str | None, once: bool,
                      specs: list[Any], as_json: bool) -> None:
    from campaign.launcher import launched
    from campaign.measure import Target

    with launched(loaded, log_path, overrides, engine=engine) as server:
        _err("command: " + " ".join(server.spec.redacted_argv()))
        _err(f"ready in {server.ready.ready_s:.1f} s at {server.spec.base_url} (pid {server.ready.pid})")
        if as_json and not specs:
            typer.echo(server.facts.model_dump_json(indent=2))
        else:
            _err("\n".join(startup_log.summary(server.facts)))
        for warning in server.warnings:
            _err(f"warning: {warning}")
        if specs:
            target = Target(base_url=server.spec.base_url, model=server.spec.served_model_name,
                            api_key=server.spec.api_key, kv_cache_tokens=server.facts.kv_cache_tokens,
                            block_size=server.facts.block_size, max_model_len=server.facts.max_model_len,
                            server_version=server.facts.vllm_version)
            _measure(target, specs, as_json=as_json)
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
) -> None:
    """Measure an already running server (other traffic allowed: every step is bracketed)."""
    from campaign.control import ControlClient
    from campaign.measure import Target

    api_key = os.environ.get(api_key_env) if api_key_env else None
    with ControlClient(url, api_key=api_key) as control:
        served, max_len = control.served_model()
        version = control.version()
    target = Target(base_url=url.rstrip("/"), model=model or served, api_key=api_key, max_model_len=max_len,
                    server_version=version)
    specs = _cell_specs(parse_list(contexts, tokens=True), parse_list(concurrency), window=window,
                        prefill=prefill, max_tokens=max_tokens, mode=mode)
    _measure(target, specs, as_json=as_json)


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
