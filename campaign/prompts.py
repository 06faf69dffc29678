"""Token-id prompts of exact length that the prefix cache can never serve, unless sharing is asked for.

Every prompt starts with six tokens that encode a per-run random salt plus a counter, so the first KV block
of every prompt differs from every other prompt's, in this run and in any earlier run against the same
server. A retried step calls the generator again and so always gets fresh prompts.
"""

from __future__ import annotations

import random
import secrets

# Ids 16..1999 exist in every vocabulary worth benchmarking (the tiny test model has 2,048) and are ordinary
# tokens, not the special ones (which sit at the ends of real vocabularies).
TOKEN_LOW = 16
TOKEN_HIGH = 2000
_BASE = TOKEN_HIGH - TOKEN_LOW
_HEAD = 6


class PromptSource:
    """Unique token-id prompts. Not thread-safe; one per measuring coroutine group is enough."""

    def __init__(self, *, seed: int | None = None) -> None:
        self._salt = secrets.randbits(60) if seed is None else seed
        self._counter = 0
        self._filler = random.Random(self._salt)

    def _head(self) -> list[int]:
        value = self._salt + self._counter
        self._counter += 1
        head = []
        for _ in range(_HEAD):
            value, digit = divmod(value, _BASE)
            head.append(TOKEN_LOW + digit)
        return head

    def unique(self, length: int) -> list[int]:
        """A prompt of exactly `length` tokens whose first tokens no other prompt shares."""
        if length < 1:
            raise ValueError("a prompt has at least one token")
        head = self._head()[:length]
        body = [self._filler.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(length - len(head))]
        return head + body

    def shared_block(self, length: int) -> list[int]:
        """A block meant to be shared byte-identically across prompts (it still starts uniquely per call)."""
        return self.unique(length)
