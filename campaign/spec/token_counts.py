"""Token counts as a matrix writes them: `8k` is 8,192 tokens (a binary k, as the seeds' tables count contexts).
One reading for every key that takes a count (workload contexts, sessions, a search's objective)."""

from __future__ import annotations

from typing import Any


def tokens(value: Any) -> int:
    """8k -> 8192; 6616 -> 6616; '26.5k' -> 27136."""
    if isinstance(value, bool):
        raise ValueError("expected a token count")
    if isinstance(value, int):
        return value
    text = str(value).strip().lower()
    scale = 1024 if text.endswith("k") else 1
    number = float(text[:-1] if text.endswith("k") else text)
    return int(number * scale)


def session_tokens(value: Any) -> Any:
    """A sessions block as written (`{system_tokens: 6k, ...}`) with its token counts read; anything else as
    given (the model's own validation says what is wrong with it)."""
    if isinstance(value, dict):
        return {k: tokens(v) if k in ("system_tokens", "user_tokens") else v for k, v in value.items()}
    return value
