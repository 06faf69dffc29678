"""Startup log text -> the facts the server became. Pure: no I/O, no guessed defaults.

Formats covered: vLLM 0.9 to 0.33 (as its source prints them and users paste them), one- or two-line KV
cache reports, thousands separators, the ASCII logo, `(EngineCore pid=N)` process prefixes or none, uvicorn
lines. Every pattern is matched with `re.search`, never anchored, because the prefix varies by version.
A fact the log does not state stays None; it is never a default and never 0.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

FailureKind = Literal[
    "kv_cache_insufficient", "out_of_memory", "bad_argument", "engine_init_failed", "crashed"
]


class Failure(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: FailureKind
    message: str
    hint: str


class StartupFacts(BaseModel):
    """What the startup log says. Field order and names are the `parse-log --json` contract."""

    model_config = ConfigDict(extra="forbid")

    vllm_version: str | None = None
    device: str | None = None
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    max_concurrency_tokens_per_request: int | None = None
    block_size: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    tensor_parallel_size: int | None = None
    gpu_memory_utilization: float | None = None
    gpu_memory_utilization_equivalent: float | None = None
    gpu_memory_utilization_suggested: float | None = None
    model_weights_gib: float | None = None
    available_kv_cache_gib: float | None = None
    engine_init_s: float | None = None
    speculative_method: str | None = None
    num_speculative_tokens: int | None = None
    failure: Failure | None = None


def _int(text: str) -> int:
    return int(text.replace(",", ""))


# --- single-value patterns: (field, regex, converter); the first match in the log wins -----------------
_NUM = r"([\d][\d,]*)"
_FLOAT = r"(\d+(?:\.\d+)?)"

_FIRST_MATCH: list[tuple[str, re.Pattern[str], Callable[[str], Any]]] = [
    # "GPU KV cache size: 1,234 tokens" (all versions since 0.9, one or two lines); "CPU", "XPU", "GPU + host".
    ("kv_cache_tokens", re.compile(r"\b[A-Z]{3}(?: \+ host)? KV cache size: " + _NUM + r" tokens"), _int),
    ("max_concurrency_tokens_per_request",
     re.compile(r"Maximum concurrency for " + _NUM + r" tokens per request: "), _int),
    ("max_concurrency", re.compile(r"Maximum concurrency for [\d,]+ tokens per request: " + _FLOAT + r"x"),
     float),
    ("model_weights_gib", re.compile(r"Model loading took " + _FLOAT + r" GiB"), float),
    ("available_kv_cache_gib", re.compile(r"Available KV cache memory: " + _FLOAT + r" GiB"), float),
    # CPU backend: "Auto set (1.0/23.4) GiB for KV cache" / "Explicitly set (1.0...) GiB for KV cache".
    ("available_kv_cache_gib", re.compile(r"(?:Auto|Explicitly) set \(" + _FLOAT + r"\b[^)]*\) GiB for KV cache"),
     float),
    # CPU backend (0.32): "KV cache memory bytes is set to 1.00 GiB" style lines are not relied upon.
    ("engine_init_s",
     re.compile(r"init engine \(profile, create kv cache, warmup model\) took " + _FLOAT + r" s"), float),
    # Hybrid models override the user's block size; so do backends that prefer another size.
    ("block_size", re.compile(r"Setting attention block size to " + _NUM + r" tokens"), _int),
    ("block_size", re.compile(r"Setting kv cache block size to " + _NUM + r" for"), _int),
    ("max_model_len", re.compile(r"Using max model len " + _NUM), _int),
    ("max_model_len", re.compile(r"\bmax_seq_len=" + _NUM), _int),
    ("max_num_batched_tokens",
     re.compile(r"Chunked prefill is enabled with max_num_batched_tokens=" + _NUM), _int),
    ("tensor_parallel_size", re.compile(r"\btensor_parallel_size=(\d+)"), int),
]

_VERSION_PATTERNS = [
    re.compile(r"vLLM server version (\S+?),? serving model"),        # 0.16+ without the logo
    re.compile(r"vLLM API server version (\S+)"),                      # <= 0.11
    re.compile(r"Initializing a V1 LLM engine \(v(\S+?)\) with config"),
    re.compile(r"Initializing an LLM engine \(v(\S+?)\) with config"),  # V0
    # The ASCII logo prints "version 0.32.0" on a line of its own, among box-drawing characters.
    re.compile(r"\bversion\s+v?(\d+\.\d+\.\d+[\w.+-]*)"),
]

_PLATFORM = re.compile(r"Automatically detected platform (\w+)\.")
_KV_DEVICE = re.compile(r"\b([A-Z]{3})(?: \+ host)? KV cache size: ")
_V0_BLOCKS = re.compile(r"# GPU blocks: (\d+)")

# CUDA-graph memory note (0.21+): the setting, what it is worth, and what vLLM suggests instead.
_CG_NOTE = re.compile(
    r"current --gpu-memory-utilization=" + _FLOAT + r" is equivalent to --gpu-memory-utilization="
    + _FLOAT + r" without CUDA graph memory profiling.*?increase --gpu-memory-utilization to " + _FLOAT
)
_CG_DISABLED = re.compile(
    r"increasing --gpu-memory-utilization from " + _FLOAT + r" to " + _FLOAT
)
_NON_DEFAULT_ARGS = re.compile(r"non-default args: (\{.*\})\s*$", re.MULTILINE)
_SPEC_CONFIG = re.compile(r"speculative_config=SpeculativeConfig\(([^)]*)\)")
_SPEC_METHOD = re.compile(r"method=['\"]?([\w-]+)")
_SPEC_TOKENS = re.compile(r"num_spec(?:ulative)?_tokens['\"]?\s*[:=]\s*(\d+)")

_PLATFORM_NAMES = {"cuda": "GPU", "rocm": "GPU", "cpu": "CPU", "xpu": "XPU", "tpu": "TPU"}

# --- failures, most specific first --------------------------------------------------------------------
_FAILURES: list[tuple[FailureKind, re.Pattern[str], str]] = [
    ("kv_cache_insufficient",
     re.compile(r"(To serve at least one request with the model's max seq len.*?estimated maximum model "
                r"length is \d+\.?)"),
     "Lower --max-model-len to the estimated maximum above, or raise --gpu-memory-utilization."),
    ("kv_cache_insufficient", re.compile(r"(No available memory for the cache blocks\.[^\n]*)"),
     "Raise --gpu-memory-utilization, or free GPU memory held by other processes."),
    ("bad_argument", re.compile(r"(error: (?:unrecognized arguments|argument [^\n]*|invalid choice)[^\n]*)"),
     "A flag in the launch profile or matrix is not accepted by this vLLM version; check its spelling "
     "with `vllm serve --help`."),
    ("out_of_memory",
     re.compile(r"((?:torch\.)?(?:cuda\.)?OutOfMemoryError[^\n]*|CUDA out of memory[^\n]*|"
                r"Failed to load model - not enough GPU memory[^\n]*)"),
     "Lower --gpu-memory-utilization, --max-num-batched-tokens or --max-model-len, or use more GPUs."),
    ("engine_init_failed", re.compile(r"(Engine core initialization failed[^\n]*)"),
     "The root cause is logged above this line; read the log tail."),
    ("crashed", re.compile(r"(EngineCore encountered an issue[^\n]*|EngineDeadError[^\n]*|"
                           r"Traceback \(most recent call last\):)"),
     "The server process crashed; read the log tail for the exception."),
]


def classify_failure(text: str) -> Failure | None:
    """The first failure signature in `text`, most specific kind first."""
    for kind, pattern, hint in _FAILURES:
        match = pattern.search(text)
        if match:
            message = " ".join(match.group(1).split())
            return Failure(kind=kind, message=message[:600], hint=hint)
    return None


_STRIP_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _non_default_args(text: str) -> dict[str, Any]:
    """The `non-default args: {...}` dict (a Python repr); {} if absent or unparseable."""
    match = _NON_DEFAULT_ARGS.search(text)
    if not match:
        return {}
    try:
        value = ast.literal_eval(match.group(1))
    except (ValueError, SyntaxError):
        return {}
    return value if isinstance(value, dict) else {}


def startup_part(text: str) -> str:
    """The log up to the first shutdown line: a clean SIGINT shutdown prints tracebacks that are not failures."""
    cut = text.find("[shutdown]")
    return text if cut < 0 else text[:cut]


def parse(text: str) -> StartupFacts:
    """Parse a startup log (stdout and stderr interleaved) into facts; text after shutdown began is ignored."""
    text = startup_part(_STRIP_ANSI.sub("", text))
    values: dict[str, Any] = {}
    for field, pattern, convert in _FIRST_MATCH:
        if field in values:
            continue
        match = pattern.search(text)
        if match:
            values[field] = convert(match.group(1))

    for pattern in _VERSION_PATTERNS:
        match = pattern.search(text)
        if match:
            values["vllm_version"] = match.group(1)
            break

    platform = _PLATFORM.search(text)
    kv_device = _KV_DEVICE.search(text)
    if platform:
        # 0.28's CPU backend printed "GPU KV cache size"; the platform line is the better witness.
        values["device"] = _PLATFORM_NAMES.get(platform.group(1).lower(), platform.group(1).upper())
    elif kv_device:
        values["device"] = kv_device.group(1)
    elif _V0_BLOCKS.search(text):
        values["device"] = "GPU"

    note = _CG_NOTE.search(text)
    if note:
        values["gpu_memory_utilization"] = float(note.group(1))
        values["gpu_memory_utilization_equivalent"] = float(note.group(2))
        values["gpu_memory_utilization_suggested"] = float(note.group(3))
    else:
        disabled = _CG_DISABLED.search(text)
        if disabled:
            values["gpu_memory_utilization"] = float(disabled.group(1))
            values["gpu_memory_utilization_suggested"] = float(disabled.group(2))

    args = _non_default_args(text)
    if isinstance(args.get("gpu_memory_utilization"), int | float):
        # The note rounds to 4 places; the argument as given (0.883643) is the exact setting.
        values["gpu_memory_utilization"] = float(args["gpu_memory_utilization"])
    for field, key, convert in (
        ("max_model_len", "max_model_len", int),
        ("max_num_batched_tokens", "max_num_batched_tokens", int),
        ("tensor_parallel_size", "tensor_parallel_size", int),
        ("block_size", "block_size", int),
    ):
        if field not in values and isinstance(args.get(key), int | float):
            values[field] = convert(args[key])

    spec = _SPEC_CONFIG.search(text)
    spec_text = spec.group(1) if spec else None
    if spec_text is None and isinstance(args.get("speculative_config"), dict):
        spec_text = repr(args["speculative_config"]).replace("'method': ", "method=")
    if spec_text:
        method = _SPEC_METHOD.search(spec_text)
        tokens = _SPEC_TOKENS.search(spec_text)
        values["speculative_method"] = method.group(1) if method else None
        values["num_speculative_tokens"] = int(tokens.group(1)) if tokens else None

    values["failure"] = classify_failure(text)
    return StartupFacts(**values)


def summary(facts: StartupFacts) -> list[str]:
    """A short human reading of the facts: what a person should notice before touching a flag."""
    lines: list[str] = []

    def add(label: str, value: object) -> None:
        lines.append(f"{label:<38}{'not stated in the log' if value is None else value}")

    add("vLLM version", facts.vllm_version)
    add("device", facts.device)
    add("KV cache", None if facts.kv_cache_tokens is None else f"{facts.kv_cache_tokens:,} tokens")
    if facts.max_concurrency is not None and facts.max_concurrency_tokens_per_request is not None:
        add("max concurrency at full context",
            f"{facts.max_concurrency:.2f}x at {facts.max_concurrency_tokens_per_request:,} tokens")
    else:
        add("max concurrency at full context", None)
    add("KV block size", None if facts.block_size is None else f"{facts.block_size} tokens")
    add("max model len", None if facts.max_model_len is None else f"{facts.max_model_len:,}")
    add("chunk size (max_num_batched_tokens)", facts.max_num_batched_tokens)
    add("tensor parallel size", facts.tensor_parallel_size)
    add("model weights", None if facts.model_weights_gib is None else f"{facts.model_weights_gib} GiB")
    add("memory for KV cache",
        None if facts.available_kv_cache_gib is None else f"{facts.available_kv_cache_gib} GiB")
    add("engine init", None if facts.engine_init_s is None else f"{facts.engine_init_s:.1f} s")
    if facts.speculative_method is not None:
        add("speculative decoding", f"{facts.speculative_method}, {facts.num_speculative_tokens} tokens")
    if facts.gpu_memory_utilization_suggested is not None:
        current = facts.gpu_memory_utilization
        equivalent = facts.gpu_memory_utilization_equivalent
        if current is not None and equivalent is not None:
            lines.append(
                f"memory note: {current:.2f} here is effectively {equivalent:.3f}; "
                f"vLLM suggests {facts.gpu_memory_utilization_suggested:.3f}"
            )
        else:
            lines.append(f"memory note: vLLM suggests --gpu-memory-utilization "
                         f"{facts.gpu_memory_utilization_suggested:.3f}")
    if facts.failure is not None:
        lines.append(f"FAILED ({facts.failure.kind}): {facts.failure.message}")
        lines.append(f"hint: {facts.failure.hint}")
    return lines
