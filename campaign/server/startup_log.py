"""Startup log text -> the facts the server became. Pure: no I/O, no guessed defaults.

Formats covered: vLLM 0.3 to 0.33, V0 and V1 (as its source prints them and as users paste them in public
issue threads: tests/fixtures/logs/public), one- or two-line KV cache reports, `# GPU/cuda/CUDA blocks`,
the V0 memory-profiling lines, thousands separators, negative sizes, the ASCII logo, process prefixes
(`(EngineCore_DP0 pid=N)`, `(Worker_PP6 pid=N)`, `(VllmWorkerProcess pid=N)`), docker-compose and CI
prefixes and timestamps, uvicorn lines. Every pattern is matched with `re.search`, never anchored, because
the prefix varies by version and by whoever captured the log. A fact the log does not state stays None;
it is never a default and never 0. The one exception is V0's KV cache when the log prints only `# GPU blocks: N`:
N x 16 (vLLM's default block size), with the assumption stated in words in `assumed`.
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
    gpu_blocks: int | None = None
    max_num_seqs: int | None = None
    # True: the non-default args carry it (yours); False: they do not, so vLLM chose it by card size (256 on
    # cards under 70 GiB, 1024 on H100/H200-class ones, 128 per CPU worker); None: the log has no such line.
    max_num_seqs_set: bool | None = None
    # The model's own window (max_position_embeddings, or the config key vLLM derived it from) where the log
    # states it: vLLM does when max-model-len was asked past it, warning (VLLM_ALLOW_LONG_MAX_MODEL_LEN set) or
    # refusing. Positions past it can crash the engine (format 16); None: the log does not say.
    model_window: int | None = None
    # What a fact above rests on that the log does not print, in words (V0's "# GPU blocks: N" without a block
    # size: the KV cache is N x 16, vLLM's default); None: nothing was assumed, every fact is as printed.
    assumed: list[str] | None = None
    failure: Failure | None = None


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def _phrase(words: str) -> str:
    """A fixed phrase whose spaces may be any whitespace: pasted error messages are often wrapped."""
    return r"\s+".join(re.escape(word) for word in words.split())


# --- single-value patterns: (field, regex, converter); the first match in the log wins -----------------
_NUM = r"([\d][\d,]*)"
_FLOAT = r"(\d+(?:\.\d+)?)"
_SIGNED = r"(-?\d+(?:\.\d+)?)"  # memory left for the KV cache can be printed negative

_FIRST_MATCH: list[tuple[str, re.Pattern[str], Callable[[str], Any]]] = [
    # "GPU KV cache size: 1,234 tokens" (all versions since 0.9, one or two lines); "CPU", "XPU", "GPU + host".
    ("kv_cache_tokens", re.compile(r"\b[A-Z]{3}(?: \+ host)? KV cache size: " + _NUM + r" tokens"), _int),
    # V0 (0.2 to 0.10, every worker: GPU, CPU, TPU, HPU, XPU, OpenVINO) states it only when it does not fit:
    # "The model's max seq len (N) is larger than the maximum number of tokens that can be stored in KV
    # cache (M)." M = block_size x num_gpu_blocks (vllm/worker/worker.py raise_if_cache_size_invalid).
    ("kv_cache_tokens", re.compile(_phrase("maximum number of tokens that can be stored in KV cache")
                                   + r"\s*\(" + _NUM + r"\)"), _int),
    ("max_concurrency_tokens_per_request",
     re.compile(r"Maximum concurrency for " + _NUM + r" tokens per request: "), _int),
    ("max_concurrency", re.compile(r"Maximum concurrency for [\d,]+ tokens per request: " + _FLOAT + r"x"),
     float),
    # "GiB" since 0.8; V0 and early V1 printed the same GiB figure labelled "GB".
    ("model_weights_gib", re.compile(r"Model loading took " + _FLOAT + r" Gi?B\b"), float),
    ("model_weights_gib", re.compile(r"Loading model weights took " + _FLOAT + r" GB"), float),
    ("model_weights_gib", re.compile(r"model weights take " + _FLOAT + r" ?GiB"), float),  # V0 profiling
    ("available_kv_cache_gib", re.compile(r"Available KV cache memory: " + _SIGNED + r" GiB"), float),
    # V0 profiling: "... the rest of the memory reserved for KV Cache is -1.05GiB." / "kv_cache_size=2.89GiB".
    ("available_kv_cache_gib", re.compile(r"the rest of the memory reserved for KV Cache is " + _SIGNED + r" ?GiB"),
     float),
    ("available_kv_cache_gib", re.compile(r"\bkv_cache_size=" + _SIGNED + r"GiB"), float),
    # Stated only inside the V1 does-not-fit error: "... larger than the available KV cache memory (5.44 GiB)".
    ("available_kv_cache_gib", re.compile(r"available KV cache memory \(" + _SIGNED + r" GiB\)"), float),
    # V0: "# GPU blocks: 1478, # CPU blocks: 2048" (0.7/0.8 print the platform's name: cuda, CUDA); V1 logs
    # the cache config's "num_gpu_blocks is: 15745".
    ("gpu_blocks", re.compile(r"# (?:GPU|cuda|CUDA) blocks: " + _NUM), _int),
    ("gpu_blocks", re.compile(r"num_gpu_blocks is: " + _NUM), _int),
    # CPU backend: "Auto set (1.0/23.4) GiB for KV cache" / "Explicitly set (1.0...) GiB for KV cache".
    ("available_kv_cache_gib", re.compile(r"(?:Auto|Explicitly) set \(" + _FLOAT + r"\b[^)]*\) GiB for KV cache"),
     float),
    # CPU backend (0.32): "KV cache memory bytes is set to 1.00 GiB" style lines are not relied upon.
    ("engine_init_s",
     re.compile(r"init engine \(profile, create kv cache, warmup model\) took " + _FLOAT + r" s"), float),
    # Hybrid models override the user's block size; so do backends that prefer another size.
    ("block_size", re.compile(r"Setting attention block size to " + _NUM + r" tokens"), _int),
    ("block_size", re.compile(r"Setting kv cache block size to " + _NUM + r" for"), _int),
    # MLA backends (V0 0.7.3+ and V1): "Forcing kv cache block size to 64 for FlashMLA backend."
    ("block_size", re.compile(r"Forcing kv cache block size to " + _NUM + r" for"), _int),
    # As configured, where a line prints it: the api server's "args: Namespace(..., block_size=16, ...)" (older
    # versions print the default 16 there, later ones None until the platform picks it), or an engine config
    # line (upstream V0's, vllm/engine/llm_engine.py, has no block_size; forks' may).
    ("block_size", re.compile(r"(?:with config: |args: Namespace\().*?\bblock_size=(\d+)"), int),
    ("max_model_len", re.compile(r"Using max model len " + _NUM), _int),
    ("max_model_len", re.compile(r"\bmax_seq_len=" + _NUM), _int),
    # The does-not-fit errors name it: V0 "The model's max seq len (N) is larger than ...", V1 "with the
    # model's max seq len (N)" (printed "models's" in some versions).
    ("max_model_len", re.compile(r"\bmodels?'s\s+max\s+seq\s+len\s+\(" + _NUM + r"\)"), _int),
    ("max_num_batched_tokens",
     re.compile(r"Chunked prefill is enabled with max_num_batched_tokens=" + _NUM), _int),
    ("tensor_parallel_size", re.compile(r"\btensor_parallel_size=(\d+)"), int),
]

_VERSION_PATTERNS = [
    re.compile(r"vLLM server version (\S+?),? serving model"),        # 0.16+ without the logo
    re.compile(r"vLLM API server version (\S+)"),                      # <= 0.11
    re.compile(r"Initializing an? (?:V[01] )?LLM engine \(v(\S+?)\) with config"),  # V0 and V1 wordings
    # The ASCII logo prints "version 0.32.0" on a line of its own, among box-drawing characters.
    re.compile(r"\bversion\s+v?(\d+\.\d+\.\d+[\w.+-]*)"),
]

_PLATFORM = re.compile(r"Automatically detected platform (\w+)\.")
_KV_DEVICE = re.compile(r"\b([A-Z]{3})(?: \+ host)? KV cache size: ")
_V0_BLOCKS = re.compile(r"# (?:GPU|cuda|CUDA) blocks: (\d+)")
# V0 profiling states the setting: "total_gpu_memory (8.00GiB) x gpu_memory_utilization (0.70)" (0.7/0.8) or
# "... gpu_memory_utilization=0.90" at the end of the one-line "Memory profiling results" (0.6).
_V0_UTILIZATION = re.compile(r"gpu_memory_utilization(?: \(" + _FLOAT + r"\)|=" + _FLOAT + r"\s*$)", re.MULTILINE)

# CUDA-graph memory note (0.21+): the setting, what it is worth, and what vLLM suggests instead.
_CG_NOTE = re.compile(
    r"current --gpu-memory-utilization=" + _FLOAT + r" is equivalent to --gpu-memory-utilization="
    + _FLOAT + r" without CUDA graph memory profiling.*?increase --gpu-memory-utilization to " + _FLOAT
)
_CG_DISABLED = re.compile(
    r"increas(?:e|ing) --gpu-memory-utilization from " + _FLOAT + r" to " + _FLOAT
)
# vllm/config/model.py: "User-specified max_model_len (N) is greater than the derived max_model_len
# (max_position_embeddings=32768.0 or model_max_length=None in model's config.json)" (0.4 to 0.33 alike).
_MODEL_WINDOW = re.compile(r"is greater than the derived max_model_len \((\w+)=(\d+)(?:\.0)?\b")
_NON_DEFAULT_ARGS = re.compile(r"non-default args: (\{.*\})\s*$", re.MULTILINE)
_SPEC_CONFIG = re.compile(r"speculative_config=SpeculativeConfig\(([^)]*)\)")
_SPEC_METHOD = re.compile(r"method=['\"]?([\w-]+)")
_SPEC_TOKENS = re.compile(r"num_spec(?:ulative)?_tokens['\"]?\s*[:=]\s*(\d+)")

_PLATFORM_NAMES = {"cuda": "GPU", "rocm": "GPU", "cpu": "CPU", "xpu": "XPU", "tpu": "TPU"}

# --- failures, most specific first --------------------------------------------------------------------
_FAILURES: list[tuple[FailureKind, re.Pattern[str], str]] = [
    ("kv_cache_insufficient",
     re.compile(r"(To serve at least one request with the models?'s max seq len.*?estimated maximum model "
                r"length is \d+\.?)"),
     "Lower --max-model-len to the estimated maximum above, or raise --gpu-memory-utilization."),
    ("kv_cache_insufficient",  # without the estimate (older V1 wording, or a cut line)
     re.compile(r"(To serve at least one request with the models?'s max seq len \(\d+\)[^\n]*)"),
     "Lower --max-model-len, or raise --gpu-memory-utilization."),
    ("kv_cache_insufficient",  # V0 (0.2 to 0.10), on one line or wrapped
     re.compile(r"(The models?'s\s+max\s+seq\s+len\s+\(\d+\)\s+" + _phrase(
         "is larger than the maximum number of tokens that can be stored in KV cache") + r"\s*\([\d,]+\)[^\n]*)"),
     "Lower --max-model-len to the KV cache's token count above, or raise --gpu-memory-utilization."),
    ("kv_cache_insufficient", re.compile(r"(No available memory for the cache blocks\.[^\n]*)"),
     "Raise --gpu-memory-utilization, or free GPU memory held by other processes."),
    ("bad_argument",  # vllm/config/model.py (_get_and_verify_max_len): the window longer than the model's
     re.compile(r"(User-specified max_model_len \(\d+\) is greater than the derived max_model_len \([^)]*\))"),
     "Lower --max-model-len to the model's window above (max_position_embeddings or seq_length), or set "
     "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 in the profile's env where the model's RoPE scaling allows it."),
    ("bad_argument", re.compile(r"(error: (?:unrecognized arguments|argument [^\n]*|invalid choice)[^\n]*)"),
     "A flag in the launch profile or matrix is not accepted by this vLLM version; check its spelling "
     "with `vllm serve --help`."),
    ("out_of_memory",
     re.compile(r"((?:torch\.)?(?:cuda\.)?OutOfMemoryError[^\n]*|CUDA out of memory[^\n]*|"
                r"CUDA error: out of memory[^\n]*|HIP out of memory[^\n]*|"
                r"Failed to load model - not enough GPU memory[^\n]*)"),
     "Lower --gpu-memory-utilization, --max-num-batched-tokens or --max-model-len, or use more GPUs."),
    ("engine_init_failed", re.compile(r"(Engine core initialization failed[^\n]*|EngineCore failed to start[^\n]*)"),
     "The root cause is logged above this line; read the log tail."),
    ("crashed", re.compile(r"(EngineCore encountered an issue[^\n]*|EngineDeadError[^\n]*|"
                           r"Traceback \(most recent call last\):)"),
     "The server process crashed; read the log tail for the exception."),
]


_STRIP_ANSI = re.compile(r"\x1b\[[0-9;]*m")

# A log line vLLM wrote at a level below ERROR: `LEVEL MM-DD HH:MM:SS` after whatever prefix the process, a
# container runtime or a CI runner put before it. What such a line says is never a failure: vLLM 0.32 warns
# "User-specified max_model_len (N) is greater than the derived max_model_len ..." in the very words of the
# ValueError it raises without VLLM_ALLOW_LONG_MAX_MODEL_LEN, and then serves (vllm/config/model.py).
_BELOW_ERROR = re.compile(r"^.{0,160}?(?<![A-Za-z])(?:DEBUG|INFO|WARNING|WARN) +\d{1,2}-\d{1,2} \d{1,2}:\d{2}:\d{2}")


def failure_text(text: str) -> str:
    """`text` without the lines vLLM logged below ERROR (and without colour codes): where failures are read."""
    lines = _STRIP_ANSI.sub("", text).splitlines(keepends=True)
    return "".join(line for line in lines if not _BELOW_ERROR.match(line))


def classify_failure(text: str) -> Failure | None:
    """The first failure signature in `text`, most specific kind first: from an exception's text, an ERROR line
    or a line no logger levelled, never from an INFO or WARNING line (see `_BELOW_ERROR`)."""
    text = failure_text(text)
    for kind, pattern, hint in _FAILURES:
        match = pattern.search(text)
        if match:
            message = " ".join(match.group(1).split())
            return Failure(kind=kind, message=message[:600], hint=hint)
    return None


# A quoted string (left as it is), or a JSON literal outside quotes (made Python's).
_JSON_LITERAL = re.compile(r"""('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")|\b(null|true|false)\b""")
_PYTHON = {"null": "None", "true": "True", "false": "False"}


_MAX_NUM_SEQS_ARG = re.compile(r"'max_num_seqs': (\d+)")


def _non_default_args(text: str) -> tuple[dict[str, Any], bool] | None:
    """The `non-default args: {...}` dict (a Python repr, in which a config given on the command line can
    appear as raw JSON with null/true/false) and whether it could be read whole; None: no such line."""
    match = _NON_DEFAULT_ARGS.search(text)
    if not match:
        return None
    raw = match.group(1)
    for attempt in (raw, _JSON_LITERAL.sub(lambda m: m.group(1) or _PYTHON[m.group(2)], raw)):
        try:
            value = ast.literal_eval(attempt)
        except (ValueError, SyntaxError):
            continue
        return (value, True) if isinstance(value, dict) else ({}, False)
    # Not a literal (an object's repr inside, such as CompilationConfig(...)): the flags that matter most
    # are still read one by one; whether one is absent cannot be said.
    seqs = _MAX_NUM_SEQS_ARG.search(raw)
    return ({"max_num_seqs": int(seqs.group(1))} if seqs else {}), False


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

    if "gpu_memory_utilization" not in values:
        v0 = _V0_UTILIZATION.search(text)
        if v0:
            values["gpu_memory_utilization"] = float(v0.group(1) or v0.group(2))

    found_args = _non_default_args(text)
    args, whole = found_args or ({}, False)
    seqs = args.get("max_num_seqs")
    if isinstance(seqs, int):
        values["max_num_seqs"], values["max_num_seqs_set"] = seqs, True
    elif found_args is not None and whole:
        values["max_num_seqs_set"] = False  # the whole dict was read, and it is not there: vLLM's default
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

    _kv_from_v0_blocks(text, values)
    window = _MODEL_WINDOW.search(text)
    if window:
        values["model_window"] = int(window.group(2))

    spec = _SPEC_CONFIG.search(text)
    spec_text = spec.group(1) if spec else None
    if spec_text is None and isinstance(args.get("speculative_config"), dict):
        spec_text = repr(args["speculative_config"]).replace("'method': ", "method=")
    if spec_text:
        method = _SPEC_METHOD.search(spec_text)
        tokens = _SPEC_TOKENS.search(spec_text)
        values["speculative_method"] = method.group(1) if method else None
        values["num_speculative_tokens"] = int(tokens.group(1)) if tokens else None

    failure = classify_failure(text)
    if failure is None or failure.kind in {"crashed", "engine_init_failed"}:
        # V0 went on after profiling left no room (negative memory, 0 blocks) and died later of something
        # that names no cause; the sizes it printed are the cause.
        kv = values.get("available_kv_cache_gib")
        if (kv is not None and kv < 0) or values.get("gpu_blocks") == 0:
            failure = Failure(kind="kv_cache_insufficient",
                              message=f"no memory left for the KV cache ({_no_room(values)})",
                              hint="Raise --gpu-memory-utilization, lower --max-model-len, or free GPU memory.")
    if failure is not None and not _looks_like_vllm(text, values):
        failure = None  # another program's argparse error or traceback is not a vLLM failure
    values["failure"] = failure
    return StartupFacts(**values)


# V0's --block-size default on CUDA and ROCm (and early V1's); the KV cache is num_gpu_blocks x block size.
_DEFAULT_BLOCK_SIZE = 16


def _kv_from_v0_blocks(text: str, values: dict[str, Any]) -> None:
    """V0 prints "# GPU blocks: N" and, unless it does not fit, no KV size in tokens: N x the block size, which
    is the printed one, or else vLLM's default 16, stated in `assumed`. A printed KV size is never replaced."""
    blocks = values.get("gpu_blocks")
    if values.get("kv_cache_tokens") is not None or not blocks or not _V0_BLOCKS.search(text):
        return  # stated already, or no V0 block count; 0 blocks is no cache whatever the block size
    if values.get("block_size") is not None:
        values["kv_cache_tokens"] = blocks * values["block_size"]
        return
    if values.get("device") != "GPU":
        return  # the default of 16 is CUDA's and ROCm's; other platforms chose their own
    tokens = blocks * _DEFAULT_BLOCK_SIZE
    # V0 also prints N x block size / max_model_len to two places; a line that disagrees with 16 refutes it.
    concurrency, per_request = values.get("max_concurrency"), values.get("max_concurrency_tokens_per_request")
    if concurrency is not None and per_request and abs(tokens / per_request - concurrency) > 0.005 + 1e-9:
        return
    values["kv_cache_tokens"], values["block_size"] = tokens, _DEFAULT_BLOCK_SIZE
    values["assumed"] = [f"block size {_DEFAULT_BLOCK_SIZE} tokens (vLLM's CUDA default; the log prints none): "
                         f"KV cache = {blocks:,} blocks x {_DEFAULT_BLOCK_SIZE} = {tokens:,} tokens"]


def _no_room(values: dict[str, Any]) -> str:
    parts = []
    if values.get("available_kv_cache_gib") is not None:
        parts.append(f"{values['available_kv_cache_gib']} GiB available for it")
    if values.get("gpu_blocks") is not None:
        parts.append(f"{values['gpu_blocks']} GPU blocks")
    return ", ".join(parts)


# Words only vLLM's logs carry: its name, its engine's process names, its own report lines.
_VLLM_MARKERS = re.compile(r"vllm|EngineCore|VllmWorker|KV cache|max seq len|# (?:GPU|cuda|CUDA) blocks|"
                           r"Automatically detected platform|model weights|usage: api_server\.py|"
                           r"--gpu-memory-utilization|derived max_model_len", re.IGNORECASE)


def _looks_like_vllm(text: str, values: dict[str, Any]) -> bool:
    return any(v is not None for k, v in values.items() if k != "failure") or bool(_VLLM_MARKERS.search(text))


def is_vllm_log(facts: StartupFacts) -> bool:
    """Whether the parse found anything of vLLM's: a fact, or a failure vLLM printed."""
    return any(v is not None for v in facts.model_dump().values())


def summary(facts: StartupFacts) -> list[str]:
    """A short human reading of the facts: what a person should notice before touching a flag."""
    lines: list[str] = []

    def add(label: str, value: object) -> None:
        lines.append(f"{label:<38}{'not stated in the log' if value is None else value}")

    add("vLLM version", facts.vllm_version)
    add("device", facts.device)
    add("KV cache", None if facts.kv_cache_tokens is None
        else f"{facts.kv_cache_tokens:,} tokens{' (assumed: see below)' if facts.assumed else ''}")
    if facts.max_concurrency is not None and facts.max_concurrency_tokens_per_request is not None:
        add("max concurrency at full context",
            f"{facts.max_concurrency:.2f}x at {facts.max_concurrency_tokens_per_request:,} tokens")
    else:
        add("max concurrency at full context", None)
    add("KV block size", None if facts.block_size is None else f"{facts.block_size} tokens")
    lines += [f"assumed: {assumption}" for assumption in facts.assumed or []]
    add("max model len", None if facts.max_model_len is None else f"{facts.max_model_len:,}")
    add("chunk size (max_num_batched_tokens)", facts.max_num_batched_tokens)
    add("tensor parallel size", facts.tensor_parallel_size)
    add("model weights", None if facts.model_weights_gib is None else f"{facts.model_weights_gib} GiB")
    add("memory for KV cache",
        None if facts.available_kv_cache_gib is None else f"{facts.available_kv_cache_gib} GiB")
    add("engine init", None if facts.engine_init_s is None else f"{facts.engine_init_s:.1f} s")
    if facts.gpu_blocks is not None:
        add("GPU blocks", f"{facts.gpu_blocks:,}")
    # Seed 000: "whether the scheduler limit was ever yours to begin with".
    if facts.max_num_seqs_set:
        add("max-num-seqs (scheduler cap)", f"{facts.max_num_seqs} (set by you)")
    elif facts.max_num_seqs_set is False:
        add("max-num-seqs (scheduler cap)", "not set: vLLM chose it by card size (256 under 70 GiB, 1,024 on "
                                            "H100/H200-class cards, 128 per CPU worker)")
    else:
        add("max-num-seqs (scheduler cap)", None)
    if facts.speculative_method is not None:
        add("speculative decoding", f"{facts.speculative_method}, {facts.num_speculative_tokens} tokens")
    if facts.gpu_memory_utilization_suggested is not None:
        current = facts.gpu_memory_utilization
        equivalent = facts.gpu_memory_utilization_equivalent
        if current is not None and equivalent is not None:
            lines.append(
                f"memory note: {_setting(current)} here is effectively {equivalent:.3f}; "
                f"vLLM suggests {facts.gpu_memory_utilization_suggested:.3f}"
            )
        else:
            lines.append(f"memory note: vLLM suggests --gpu-memory-utilization "
                         f"{facts.gpu_memory_utilization_suggested:.3f}")
    if facts.failure is not None:
        lines.append(f"FAILED ({facts.failure.kind}): {facts.failure.message}")
        lines.append(f"hint: {facts.failure.hint}")
    return lines


def _setting(value: float) -> str:
    """A configured value as configured: 0.9 -> 0.90, 0.883643 -> 0.883643 (never rounded to 0.88)."""
    return f"{value:.2f}" if round(value, 2) == value else f"{value:g}"
