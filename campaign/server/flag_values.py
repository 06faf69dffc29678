"""Flag values vLLM refuses, refused before the night instead of by a launch that spends minutes finding out.

vLLM parses a flag's value in two places: argparse (a JSON-valued flag is `json.loads`ed, an int is `int`ed)
and then the config dataclasses' pydantic fields (their bounds: core.vllm_bounds). Both end the server before
it serves. The same rules here, each with the key it is written under and what to write instead. A `${NAME}`
reference is left to vLLM (it names a secret the plan never reads), and `suggested` (gpu-memory-utilization)
is checked once vLLM has suggested (night.launch).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from campaign.core.vllm_bounds import BOUNDS, SHORT, human_int, number_of, out_of_bounds
from campaign.server.vllm_flags import JSON_FLAGS, JSON_OR_TEXT_FLAGS, normalize_flag

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
        name = normalize_flag(raw)
        name = SHORT.get(name, name)
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


def canonical(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Flags merged as a launch passes them, later layers winning whatever their spelling (`max_num_seqs`,
    `max-num-seqs`; `tp`, `tensor-parallel-size`)."""
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            name = normalize_flag(key)
            merged[SHORT.get(name, name)] = value
    return merged


def parallel_width(flags: Mapping[str, Any]) -> int | None:
    """GPUs one launch with these flags (canonical()) needs, tensor x pipeline x data parallel size; None
    where one of them is not yet a number (a reference, or a value value_problems refuses)."""
    width = 1
    for name in PARALLEL_SIZES:
        value = flags.get(name, 1)
        read = number_of(BOUNDS[name], value)
        if read is None or read < 1 or read != int(read):
            return None
        width *= int(read)
    return width
