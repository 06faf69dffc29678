"""Flag values vLLM refuses, refused before the night instead of by a launch that spends minutes finding out.

vLLM parses a flag's value in two places: argparse (a JSON-valued flag is `json.loads`ed, an int is `int`ed)
and then the config dataclasses' pydantic fields (their bounds: core.vllm_bounds). Both end the server before
it serves. The same rules here, each with the key it is written under and what to write instead. A `${NAME}`
reference is left to vLLM (it names a secret the plan never reads), and `suggested` (gpu-memory-utilization)
is checked once vLLM has suggested (night.launch).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from campaign.core.vllm_bounds import BOUNDS, SHORT, number_of, out_of_bounds
from campaign.server.vllm_flags import JSON_FLAGS, JSON_OR_TEXT_FLAGS, normalize_flag

Problem = tuple[str, str, str | None]   # (key, problem, hint), as profiles.flag_problems gives them
_JSON_HINT = ("write it as a YAML mapping (e.g. speculative-config: {method: ngram, num_speculative_tokens: 3}), "
              "or as complete JSON inside quotes")


def _deferred(value: object) -> bool:
    """A value only the launch can check: a `${NAME}` reference, or vLLM's own suggestion."""
    return isinstance(value, str) and ("${" in value or value.strip().startswith("suggested"))


def _json_problem(name: str, value: object) -> tuple[str, str | None] | None:
    if isinstance(value, (dict, list)):
        return None   # a YAML mapping: argv writes it as JSON
    if not isinstance(value, str):
        return (f"expects a JSON object, not {value!r}", _JSON_HINT) if name in JSON_FLAGS else None
    text = value.strip()
    if name in JSON_OR_TEXT_FLAGS and not text.startswith("{"):
        return None   # vLLM takes anything but an object as text
    try:
        json.loads(text)
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
        name = normalize_flag(raw)
        name = SHORT.get(name, name)
        values = given if grid and isinstance(given, list) else [given]
        for index, value in enumerate(values):
            key = f"{key_prefix}.{raw}" + (f"[{index}]" if grid and isinstance(given, list) else "")
            if _deferred(value) or value is None:
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
    """GPUs one launch with these (normalized) flags needs, tensor x pipeline x data parallel size; None where
    one of them is not yet a number (a reference, or a value value_problems refuses)."""
    width = 1
    for name in ("tensor-parallel-size", "pipeline-parallel-size", "data-parallel-size"):
        value = next((v for k, v in flags.items() if SHORT.get(normalize_flag(k), normalize_flag(k)) == name), 1)
        read = number_of(BOUNDS[name], value)
        if read is None or read < 1 or read != int(read):
            return None
        width *= int(read)
    return width
