"""The bounds vLLM 0.32 holds its numeric serving flags to, and its reading of "8k": shared by the plan's checks
(server.flag_values) and the simulator, which refuses what vLLM refuses.

From the config dataclasses' pydantic fields (`vllm/config/*.py`): `CacheConfig.gpu_memory_utilization` gt 0
and le 1, `block_size` gt 0; `SchedulerConfig.max_num_seqs` and `max_num_batched_tokens` ge 1; `ParallelConfig`
tensor/pipeline/data parallel size ge 1; `ModelConfig.max_model_len` ge -1 (-1 and `auto`: the model's own
window). vLLM reads max-num-batched-tokens and max-model-len with `human_readable_int`
(`vllm/utils/argparse_utils.py`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

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
SHORT = {"tp": "tensor-parallel-size", "pp": "pipeline-parallel-size", "dp": "data-parallel-size"}


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


