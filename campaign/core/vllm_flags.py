"""One home for a flag of `vllm serve`: its names and aliases, which flags take JSON, the bounds vLLM holds its
numeric flags to and its reading of "8k", the flags the runner owns, the checks of a value, and the merge of a
launch's layers (profile, variant, `--set`) as the launch passes them. The launch (server.argv), the plan's
checks (server.profiles, plan.limits), the night, the analysis and the simulator, which refuses what vLLM
refuses, all read a flag through this module.

Names: read from the help of vLLM 0.32.0 (`python -m vllm.entrypoints.openai.api_server --help=all`). A flag
that is not listed and not close to one that is passes: a newer vLLM may have it, and its own argparse decides
(server.flag_list asks the launch host's own vLLM).

Values: vLLM parses a flag's value in two places: argparse (a JSON-valued flag is `json.loads`ed, an int is
`int`ed) and then the config dataclasses' pydantic fields (`vllm/config/*.py`): `CacheConfig.gpu_memory_utilization`
gt 0 and le 1, `block_size` gt 0; `SchedulerConfig.max_num_seqs` and `max_num_batched_tokens` ge 1;
`ParallelConfig` tensor/pipeline/data parallel size ge 1; `ModelConfig.max_model_len` ge -1 (-1 and `auto`: the
model's own window). vLLM reads max-num-batched-tokens and max-model-len with `human_readable_int`
(`vllm/utils/argparse_utils.py`). Both end the server before it serves, so the same rules here refuse a value
before the night, each with the key it is written under and what to write instead. A `${NAME}` reference is
left to vLLM (it names a secret the plan never reads), and `suggested` (gpu-memory-utilization) is checked once
vLLM has suggested (night.launch).

Aliases: vLLM's short options `-tp`, `-pp` and `-dp` are written `tp`, `pp`, `dp` in a profile or matrix; the
merge writes them under their long names, so a launch passes `--tensor-parallel-size` (vLLM knows no `--tp`)
and a variant's `tensor-parallel-size` replaces a profile's `tp`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

V = TypeVar("V")


def normalize_flag(name: str) -> str:
    """`max_num_seqs`, `--max-num-seqs` and `max-num-seqs` are one flag."""
    return name.strip().lstrip("-").replace("_", "-")


# vLLM's short options, by the long flag each stands for.
ALIASES = {"tp": "tensor-parallel-size", "pp": "pipeline-parallel-size", "dp": "data-parallel-size"}


def canonical_name(name: str) -> str:
    """A flag's one name however it was written: normalized, a short option under its long name."""
    flag = normalize_flag(name)
    return ALIASES.get(flag, flag)


def merge(*layers: Mapping[str, V]) -> dict[str, V]:
    """Flags merged as a launch passes them, under their canonical names, later layers winning whatever their
    spelling (`max_num_seqs`, `max-num-seqs`; `tp`, `tensor-parallel-size`)."""
    merged: dict[str, V] = {}
    for layer in layers:
        for key, value in layer.items():
            merged[canonical_name(key)] = value
    return merged


def value_of(flags: Mapping[str, V], name: str) -> V | None:
    """The value of flag `name` (canonical) in these flags however it was spelled; None when not given."""
    return merge(flags).get(name)


KNOWN_FLAGS: frozenset[str] = frozenset(
    """
    additional-config aggregate-engine-logging all2all-backend allow-credentials allow-deprecated-quantization
    allowed-headers allowed-local-media-path allowed-media-domains allowed-methods allowed-origins
    anthropic-disabled-thinking-effort api-key api-server-count async-scheduling attention-backend
    attention-config aux-output-config block-size chat-template chat-template-content-format code-revision
    cohere-format cohere-is-reasoning-model collect-detailed-traces compilation-config config config-format
    convert cp-kv-cache-interleave-size cpu-distributed-timeout-seconds cpu-offload-gb cpu-offload-params
    cudagraph-capture-sizes cudagraph-metrics custom-histogram-buckets data-parallel-address
    data-parallel-backend data-parallel-external-lb data-parallel-hybrid-lb
    data-parallel-multi-port-external-lb data-parallel-rank data-parallel-rpc-port data-parallel-size
    data-parallel-size-local data-parallel-start-rank data-parallel-supervisor-port dbo-decode-token-threshold
    dbo-prefill-token-threshold dcp-comm-backend dcp-kv-cache-interleave-size dcp-q-replicate
    decode-context-parallel-size default-chat-template-kwargs default-mm-loras device-ids diffusion-config
    disable-access-log-for-endpoints disable-cascade-attn disable-chunked-mm-input disable-custom-all-reduce
    disable-fastapi-docs disable-hybrid-kv-cache-manager disable-log-stats disable-nccl-for-dp-synchronization
    disable-sliding-window disable-uvicorn-access-log distributed-executor-backend distributed-timeout-seconds
    download-dir dp-supervisor-probe-failure-threshold dp-supervisor-probe-interval-s
    dp-supervisor-probe-timeout-s dp-sync-interval dtype ec-manager-config ec-transfer-config
    elastic-ep-max-dp-size enable-auto-tool-choice enable-batch-sharded-sampling enable-chunked-prefill
    enable-cumem-allocator enable-dbo enable-elastic-ep enable-ep-weight-filter enable-eplb
    enable-expert-parallel enable-fault-tolerance enable-flash-late-interaction enable-flashinfer-autotune
    enable-force-include-usage enable-hc-sp enable-layerwise-nvtx-tracing enable-log-deltas enable-log-outputs
    enable-log-requests enable-logging-iteration-details enable-lora enable-mamba-cache-stochastic-rounding
    enable-mamba-shared-prefix-checkpoint enable-mfu-metrics enable-mixed-moe-lora-format enable-mm-embeds
    enable-moe-shared-loras enable-nccl-comm-suspend enable-offline-docs enable-per-request-metrics
    enable-prefix-caching enable-prompt-embeds enable-prompt-tokens-details enable-request-id-headers
    enable-return-routed-experts enable-scale-out enable-server-load-tracking enable-shm-tensor-arena
    enable-sleep-mode enable-ssl-refresh enable-tokenizer-info-endpoint enable-tower-connector-lora
    enable-trace-replay enforce-eager engram-config eplb-config exclude-tools-when-tool-choice-none
    expert-placement-strategy fail-on-environ-validation fault-tolerance-config fingerprint-mode
    fingerprint-value fully-sharded-loras gdn-prefill-backend generation-config gpu-memory-utilization grpc
    grpc-port h11-max-header-count h11-max-incomplete-event-size headless hf-config-path hf-overrides hf-token
    host ignore-patterns interleave-mm-strings io-processor-plugin ir-op-priority jit-monitor-mode
    jit-monitor-verbose json-arg kda-decode-backend kda-prefill-backend kernel-config kv-cache-dtype
    kv-cache-dtype-skip-layers kv-cache-memory-bytes kv-cache-metrics kv-cache-metrics-sample kv-events-config
    kv-offloading-backend kv-offloading-size kv-sharing-fast-prefill kv-transfer-config language-model-only
    limit-mm-per-prompt linear-backend load-format log-config-file log-error-stack log-level logging-config
    logits-processors logprobs-mode long-prefill-token-threshold long-prefill-token-threshold-adaptive
    lora-dtype lora-modules lora-target-modules mamba-backend mamba-block-size mamba-cache-dtype
    mamba-cache-mode mamba-cache-philox-rounds mamba-ssm-cache-dtype mamba-ssu-algorithm master-addr
    master-port max-cpu-loras max-cudagraph-capture-size max-log-len max-logprobs max-lora-cls-labels
    max-lora-rank max-loras max-model-len max-num-active-seqs max-num-batched-tokens max-num-queued-reqs
    max-num-queued-tokens max-num-scheduled-tokens max-num-seqs max-parallel-loading-workers media-io-kwargs
    middleware mm-device-do-normalize mm-encoder-attn-backend mm-encoder-attn-dtype mm-encoder-fp8-scale-path
    mm-encoder-fp8-scale-save-margin mm-encoder-fp8-scale-save-path mm-encoder-only mm-encoder-tp-mode
    mm-hasher-algorithm mm-ipc-gpu-memory-gb mm-processor-cache-gb mm-processor-cache-type mm-processor-device
    mm-processor-kwargs mm-shm-cache-max-object-size-mb mm-tensor-ipc model model-class-overrides model-impl
    model-loader-extra-config moe-backend nnodes node-rank num-gpu-blocks-override numa-bind numa-bind-cpus
    numa-bind-nodes offload-backend offload-group-size offload-num-in-group offload-params
    offload-prefetch-step optimization-level otlp-traces-endpoint override-generation-config
    per-request-spec-decode-metrics performance-mode pipeline-parallel-size pooler-config port
    prefill-context-parallel-size prefill-schedule-interval prefix-cache-retention-interval
    prefix-caching-hash-algo prefix-match-unit profiler-config pt-load-map-location quantization
    quantization-config ray-workers-use-nsight reasoning-config reasoning-parser reasoning-parser-plugin
    renderer-num-workers replayssm-buffer-len response-role return-sampling-mask return-tokens-as-token-ids
    revision root-path runner safetensors-load-strategy safetensors-prefetch-block-size
    safetensors-prefetch-num-threads scheduler-cls scheduler-reserve-full-isl scheduling-policy seed
    served-model-name show-hidden-metrics-for-version shutdown-timeout skip-mm-profiling skip-tokenizer-init
    sleep-mode-offload-cudagraph sleep-preserve-parameter-names sparse-indexer-topk-backend spec-method
    spec-model spec-tokens specialize-active-lora speculative-config sse-keep-alive-interval ssl-ca-certs
    ssl-cert-reqs ssl-certfile ssl-ciphers ssl-keyfile stream-interval structured-outputs-config
    swa-bounded-replay tensor-parallel-size tokenizer tokenizer-mode tokenizer-revision tokens-only
    tool-call-parser tool-parser-plugin tool-server tool-strict-level trust-remote-code
    trust-request-chat-template trust-request-mm-kwargs ubatch-size uds use-fp64-gumbel use-replayssm
    use-tqdm-on-load uvicorn-log-level video-pruning-method video-pruning-rate watermark watermark-config
    weight-transfer-config worker-cls worker-extension-cls    """.split()
)

# Flags whose value vLLM 0.32 parses as JSON: their `--help=all` text says "Should either be a valid JSON string
# or JSON keys passed individually" (config dataclasses and dicts), and speculative-config, watermark-config and
# diffusion-config, which vLLM reads with json.loads to validate later. A value that is not JSON ends the server.
JSON_FLAGS: frozenset[str] = frozenset(
    """
    attention-config aux-output-config compilation-config custom-histogram-buckets default-chat-template-kwargs
    default-mm-loras diffusion-config ec-manager-config ec-transfer-config engram-config eplb-config
    fault-tolerance-config ir-op-priority kernel-config kv-events-config kv-transfer-config limit-mm-per-prompt
    logging-config media-io-kwargs mm-processor-kwargs model-class-overrides override-generation-config
    pooler-config profiler-config quantization-config reasoning-config speculative-config
    structured-outputs-config watermark-config weight-transfer-config
    """.split()
)
# Flags that take a JSON object or text (vLLM's union_dict_and_str): a value written as an object, `{...}`,
# must be valid JSON; anything else is passed on as text.
JSON_OR_TEXT_FLAGS: frozenset[str] = frozenset({"hf-overrides", "model-loader-extra-config", "additional-config",
                                                  "pt-load-map-location"})


# Flags the runner sets itself: written in a profile or matrix they are refused, with where to say it instead.
RUNNER_OWNED_FLAGS = {
    "host": "set `host:` at the top of the profile; the runner picks the port",
    "port": "set `port:` at the top of the profile (a number, or auto)",
    "api-key": "set `api_key_env:` to the NAME of an environment variable holding the key",
    "model": "set `model:` at the top of the profile",
    "ssl-certfile": "set `tls: {certfile: ..., keyfile: ...}` in the profile, so the runner also speaks https",
    "ssl-keyfile": "set `tls: {certfile: ..., keyfile: ...}` in the profile, so the runner also speaks https",
}


# --- values ----------------------------------------------------------------------------------------------------
# vLLM's human_readable_int (vllm/utils/argparse_utils.py): "8k" is 8,000, "8K" 8,192, "25.6k" 25,600.
_HUMAN = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


@dataclass(frozen=True)
class Bound:
    """A numeric flag's type and bounds as vLLM's config states them."""

    kind: type
    low: float
    low_open: bool = False       # True: the value must be above `low`, not equal to it
    high: float | None = None
    human: bool = False          # vLLM reads "8k"/"8K" for it
    auto: tuple[str, ...] = ()   # words it takes besides numbers


BOUNDS: dict[str, Bound] = {
    "gpu-memory-utilization": Bound(float, 0.0, low_open=True, high=1.0),
    "tensor-parallel-size": Bound(int, 1),
    "pipeline-parallel-size": Bound(int, 1),
    "data-parallel-size": Bound(int, 1),
    "max-num-seqs": Bound(int, 1),
    "max-num-batched-tokens": Bound(int, 1, human=True),
    "block-size": Bound(int, 1),
    "max-model-len": Bound(int, -1, human=True, auto=("auto",)),
}


def human_int(text: str) -> int | None:
    """vLLM's reading of an integer flag written "8192", "8k" (8,000) or "8K" (8,192); None: not one."""
    text = text.strip()
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    match = _HUMAN.fullmatch(text)
    if match is None:
        return None
    number, suffix = match.groups()
    if suffix in _BINARY:
        return int(number) * _BINARY[suffix] if number.isdigit() else None   # vLLM refuses "1.5K"
    return int(float(number) * _DECIMAL[suffix])


def number_of(spec: Bound, value: object) -> float | None:
    """A flag's value as the number vLLM reads from it; None where vLLM would not read one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return float(value)
    if isinstance(value, float):
        return value if spec.kind is float else None   # argv writes 2.0, and vLLM's int() refuses it
    if isinstance(value, str):
        if spec.human:
            parsed = human_int(value)
            return None if parsed is None else float(parsed)
        try:
            return float(int(value.strip()) if spec.kind is int else float(value.strip()))
        except ValueError:
            return None
    return None


def out_of_bounds(name: str, value: object) -> tuple[str, str | None] | None:
    """(problem, hint) where vLLM refuses `value` for flag `name` (normalized, one of BOUNDS); None: it takes it."""
    spec = BOUNDS[name]
    shown = repr(value) if isinstance(value, str) else str(value)
    if isinstance(value, str) and value.strip().lower() in spec.auto:
        return None
    read = number_of(spec, value)
    kind = "a number" if spec.kind is float else "a whole number"
    if read is None or not math.isfinite(read) or (spec.kind is int and read != int(read)):
        return f"{shown} is not {kind}", f"vLLM reads {name} as {kind}" + (
            " (8k is 8,000; 8K is 8,192)" if spec.human else "")
    low_ok = read > spec.low if spec.low_open else read >= spec.low
    if low_ok and (spec.high is None or read <= spec.high):
        return None
    bounds = (f"{'above' if spec.low_open else 'at least'} {spec.low:g}"
              + (f" and at most {spec.high:g}" if spec.high is not None else ""))
    return f"{shown} is out of range: vLLM requires {bounds}", _range_hint(name)


def _range_hint(name: str) -> str | None:
    if name == "gpu-memory-utilization":
        return "a share of each GPU's memory, e.g. 0.9 (or `suggested` to take vLLM's own advice)"
    if name == "max-model-len":
        return "tokens of context, e.g. 32768 or 32k, or auto for the model's own window"
    return None


Problem = tuple[str, str, str | None]   # (key, problem, hint), as profiles.flag_problems gives them
_JSON_HINT = ("write it as a YAML mapping (e.g. speculative-config: {method: ngram, num_speculative_tokens: 3}), "
              "or as complete JSON inside quotes")


# vLLM's reading of a JSON flag's text (vllm/engine/arg_utils.py): bare numbers written "80m" or "1k" outside
# strings are expanded first (_expand_json_human_readable_numbers), and an object-or-text flag is JSON only
# when the whole value is an object (union_dict_and_str).
_QUOTED = re.compile(r'("(?:[^"\\]|\\.)*")')
_BARE_HUMAN = re.compile(r"\b\d+(?:\.\d+)?[kKmMgGtT]\b")
_OBJECT = re.compile(r"(?s)^\s*{.*}\s*$")
# The flags whose product is a launch's width in GPUs (parallel_width), canonical names.
PARALLEL_SIZES = ("tensor-parallel-size", "pipeline-parallel-size", "data-parallel-size")


def _expanded(text: str) -> str:
    parts = _QUOTED.split(text)
    for i in range(0, len(parts), 2):   # even parts lie outside strings
        parts[i] = _BARE_HUMAN.sub(lambda m: str(human_int(m.group()) or m.group()), parts[i])
    return "".join(parts)


def _deferred(name: str, value: object) -> bool:
    """A value only the launch can check: a `${NAME}` reference, or vLLM's own suggestion (memory only)."""
    return isinstance(value, str) and ("${" in value or (
        name == "gpu-memory-utilization" and value.strip().startswith("suggested")))


def _json_problem(name: str, value: object) -> tuple[str, str | None] | None:
    if isinstance(value, (dict, list)):
        return None   # a YAML mapping: argv writes it as JSON
    if not isinstance(value, str):
        return (f"expects a JSON object, not {value!r}", _JSON_HINT) if name in JSON_FLAGS else None
    text = value.strip()
    if name in JSON_OR_TEXT_FLAGS and not _OBJECT.match(value):
        return None   # vLLM takes anything but a whole object as text
    try:
        json.loads(_expanded(text))
    except json.JSONDecodeError as exc:
        before = text[max(0, exc.pos - 24):exc.pos]
        at = "at its end (cut short?)" if exc.pos >= len(text) else f"at character {exc.pos + 1} of {len(text)}"
        return (f"not valid JSON: {exc.msg.lower()} {at}" + (f", after {before!r}" if before else ""),
                _JSON_HINT)
    return None


def value_problems(key_prefix: str, flags: Mapping[str, Any], *, grid: bool = False) -> list[Problem]:
    """(key, problem, hint) for each flag value vLLM would refuse; a grid's values are lists, each checked."""
    problems: list[Problem] = []
    for raw, given in flags.items():
        name = canonical_name(raw)
        values = given if grid and isinstance(given, list) else [given]
        for index, value in enumerate(values):
            key = f"{key_prefix}.{raw}" + (f"[{index}]" if grid and isinstance(given, list) else "")
            if isinstance(value, str) and value.strip().startswith("suggested") and name != "gpu-memory-utilization":
                problems.append((key, "only gpu-memory-utilization can be `suggested`", None))
                continue
            if _deferred(name, value) or value is None:
                continue
            found: tuple[str, str | None] | None = None
            if name in JSON_FLAGS or name in JSON_OR_TEXT_FLAGS:
                found = _json_problem(name, value)
            elif name in BOUNDS:
                found = out_of_bounds(name, value)
            if found is not None:
                problems.append((key, *found))
    return problems


def parallel_width(flags: Mapping[str, Any]) -> int | None:
    """GPUs one launch with these flags (merge()) needs, tensor x pipeline x data parallel size; None
    where one of them is not yet a number (a reference, or a value value_problems refuses)."""
    width = 1
    for name in PARALLEL_SIZES:
        value = flags.get(name, 1)
        read = number_of(BOUNDS[name], value)
        if read is None or read < 1 or read != int(read):
            return None
        width *= int(read)
    return width
