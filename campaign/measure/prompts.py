"""Prompts of exact length that the prefix cache can never serve, unless sharing is asked for.

Every prompt starts with six tokens that encode a per-run random salt plus a counter, so the first KV block
of every prompt differs from every other prompt's, in this run and in any earlier run against the same
server. A retried step calls the generator again and so always gets fresh prompts. In simulated time the
salts are drawn from the launch's own seed instead (`salted_by`, measure.simulated): a night there reads the
same every time it runs, as its engine does, while each launch still draws prompts of its own.

`Prompts` adds text: windows of a corpus (corpus.py) that the server's own tokenizer turned into tokens,
sent as token ids on /v1/completions (exactly L tokens by construction) or as a chat message on
/v1/chat/completions (L tokens with the chat template, counted by the server).
"""

from __future__ import annotations

import asyncio
import random
import secrets
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from campaign.core.errors import PromptError
from campaign.measure import corpus

# Ids 16..1999 exist in every vocabulary worth benchmarking (the tiny test model has 2,048) and are ordinary
# tokens, not the special ones (which sit at the ends of real vocabularies).
TOKEN_LOW = 16
TOKEN_HIGH = 2000
_BASE = TOKEN_HIGH - TOKEN_LOW
_HEAD = 6
HEAD_TOKENS = _HEAD
CHAT_FIT_TRIES = 20    # counts of one window's cuts
CHAT_FIT_WINDOWS = 4   # windows tried before a chat length is given up
TAG_LETTERS = 14       # 26^14 > 2^65: the salt's 60 bits and a counter
CHAT_BODIES = 4        # chat texts fitted per length before a step, used in turn under fresh tags
PAD_MAX = 8           # a chat prompt this many tokens short is padded, not cut again


# Where a new PromptSource's salt comes from when it is given no seed: None, the system's entropy (`secrets`).
_SALTS: ContextVar[random.Random | None] = ContextVar("campaign_prompt_salts", default=None)


@contextmanager
def salted_by(salts: random.Random) -> Iterator[None]:
    """Every PromptSource made inside the block (and in the tasks started there) without a seed draws its salt
    from `salts`: the same prompts, in the same order, each time the block's work runs in the same order."""
    token = _SALTS.set(salts)
    try:
        yield
    finally:
        _SALTS.reset(token)


class PromptSource:
    """Unique token-id prompts. Not thread-safe; one per measuring coroutine group is enough."""

    def __init__(self, *, seed: int | None = None) -> None:
        salts = _SALTS.get()
        self._salt = seed if seed is not None else salts.getrandbits(60) if salts else secrets.randbits(60)
        self._counter = 0
        self._filler = np.random.default_rng(self._salt)

    def _head(self) -> list[int]:
        value = self._salt + self._counter
        self._counter += 1
        head = []
        for _ in range(_HEAD):
            value, digit = divmod(value, _BASE)
            head.append(TOKEN_LOW + digit)
        return head

    def tag(self) -> str:
        """A text that no other prompt's starts with: the salt and counter that a head encodes, spelled as
        space-separated single letters (" q x f ..."), each one token in every word-splitting tokenizer, so that
        every tag is the same number of tokens and a prompt fitted once keeps its length under any tag."""
        value = self._salt + self._counter
        self._counter += 1
        letters = []
        for _ in range(TAG_LETTERS):
            value, digit = divmod(value, 26)
            letters.append(" " + chr(ord("a") + digit))
        return "#" + "".join(letters) + "\n"

    def unique(self, length: int) -> list[int]:
        """A prompt of exactly `length` tokens whose first tokens no other prompt shares."""
        if length < 1:
            raise ValueError("a prompt has at least one token")
        head = self._head()[:length]
        # Drawn by numpy: 65,536 ids in 2.4 ms against 8.1 by random.choices over the range (this machine), the
        # client's own time before a burst of long prompts goes out.
        body: list[int] = self._filler.integers(TOKEN_LOW, TOKEN_HIGH, length - len(head)).tolist()
        return head + body

    def shared_block(self, length: int) -> list[int]:
        """A block meant to be shared byte-identically across prompts (it still starts uniquely per call)."""
        return self.unique(length)


# --- text prompts ---------------------------------------------------------------------------------------
PROMPT_KINDS = ("random", "code", "prose")   # or a path ending in .jsonl


def prompt_source(value: str) -> str:
    """A `prompts` value as given, or ValueError (the one check behind the matrix, the cell spec and the CLI)."""
    if value not in PROMPT_KINDS and not value.endswith(".jsonl"):
        raise ValueError(f"{value!r} is not a prompt source: use {', '.join(PROMPT_KINDS)}, or a FILE.jsonl")
    return value
ENDPOINTS = ("completions", "chat")


@dataclass(frozen=True)
class Prompt:
    """One prompt as sent: token ids for /v1/completions, or chat messages for /v1/chat/completions, and its
    length in the server's tokens (the chat template included)."""

    tokens: int
    ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None


class Tokenizing(Protocol):
    """The server's tokenizer, through vLLM's /tokenize and /detokenize."""

    async def tokenize(self, *, prompt: str | None = None,
                       messages: list[dict[str, Any]] | None = None) -> list[int]: ...

    async def detokenize(self, ids: list[int]) -> str: ...


class Prompts:
    """Prompts of exactly L tokens for one (source, endpoint): random ids, or windows of a corpus tokenized once
    by the server. Each starts uniquely (PromptSource's salted head: ids on /v1/completions, a marker of the
    same salt in the text on the chat endpoint), so the prefix cache never serves one from another."""

    def __init__(self, kind: str = "random", endpoint: str = "completions", *,
                 tokenizer: Tokenizing | None = None, seed: int | None = None) -> None:
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint {endpoint!r}: not one of {', '.join(ENDPOINTS)}")
        if (kind != "random" or endpoint == "chat") and tokenizer is None:
            raise ValueError("text prompts and the chat endpoint need the server's tokenizer")
        self.kind, self.endpoint = kind, endpoint
        self.ids = PromptSource(seed=seed)
        self._tokenizer = tokenizer
        self._corpus: list[int] | None = None
        self._offsets = random.Random(self.ids._salt)
        self._overhead: dict[int, int] = {}   # chat: template and tag tokens, learned per length
        self._bodies: dict[int, list[tuple[int, str]]] = {}   # chat: (count, text) fitted per length
        # Chat: how many tokens every templated prompt starts with whatever its message (a default system
        # prompt, a date header): the prefix cache serves those, and the cell must expect it.
        self.template_prefix = 0

    def use(self, tokenizer: Tokenizing) -> None:
        """Talk to the server through this tokenizer from now on (a new cell's client); the corpus is kept."""
        self._tokenizer = tokenizer

    async def prepare(self, length: int | None = None) -> None:
        """Tokenize the corpus, and fit the chat texts of this length, now, rather than inside a measured step."""
        if self.kind != "random":
            await self._text_ids()
        if length is not None and self.endpoint == "chat" and length not in self._bodies:
            self._bodies[length] = [await self._fit(length) for _ in range(CHAT_BODIES)]
        if self.endpoint == "chat" and not self.template_prefix:
            assert self._tokenizer is not None
            one = await self._tokenizer.tokenize(messages=[{"role": "user", "content": self.ids.tag() + "x"}])
            two = await self._tokenizer.tokenize(messages=[{"role": "user", "content": self.ids.tag() + "x"}])
            self.template_prefix = next((i for i, (a, b) in enumerate(zip(one, two, strict=False)) if a != b),
                                        min(len(one), len(two)))

    async def _text_ids(self) -> list[int]:
        if self._corpus is None:
            assert self._tokenizer is not None
            text = corpus.text("code" if self.kind == "random" else self.kind)
            self._corpus = await self._tokenizer.tokenize(prompt=text)
            if len(self._corpus) < 64:
                raise PromptError(f"prompts {self.kind}: only {len(self._corpus)} tokens of text",
                                  hint="give a prompts file with more text")
        return self._corpus

    async def _window(self, length: int) -> list[int]:
        ids = await self._text_ids()
        if length <= 0:
            return []
        start = self._offsets.randrange(len(ids))
        out: list[int] = []
        while len(out) < length:  # a corpus shorter than the prompt repeats
            out += ids[start:start + length - len(out)]
            start = 0
        return out

    async def next(self, length: int) -> Prompt:
        if self.endpoint == "completions":
            if self.kind == "random":
                return Prompt(tokens=length, ids=self.ids.unique(length))
            head = self.ids.unique(min(length, HEAD_TOKENS))
            return Prompt(tokens=length, ids=head + await self._window(length - len(head)))
        return await self._chat(length)

    async def _chat(self, length: int) -> Prompt:
        """A user message whose templated prompt is `length` tokens: a fresh tag and one of a few texts fitted
        to this length once (tags all take the same number of tokens). The server's usage counts every prompt
        again, and the cell says so if one came out at another length."""
        bodies = self._bodies.get(length)
        if bodies is None:
            bodies = self._bodies[length] = [await self._fit(length) for _ in range(CHAT_BODIES)]
        count, body = bodies[self.ids._counter % len(bodies)]
        return self._message(count, self.ids.tag() + body)

    async def _fit(self, length: int) -> tuple[int, str]:
        """Text that, after a tag, makes a `length`-token templated prompt, from one of a few windows: a window
        whose re-tokenized cuts all step over `length`, or whose padding merges, gives way to the next."""
        for _ in range(CHAT_FIT_WINDOWS):
            found = await self._fit_window(length)
            if found is not None:
                return found
        raise PromptError(f"could not make a {length:,}-token chat prompt from {self.kind} text "
                          f"in {CHAT_FIT_WINDOWS} windows",
                          hint="the server's chat template or tokenizer is unusual; use --endpoint completions")

    async def _fit_window(self, length: int) -> tuple[int, str] | None:
        """Cut one window of the corpus, counted by the server with the template, until the count is `length`.
        The cut is searched between a cut known to be short (`lo`) and one known to be long (`hi`), so the search
        ends even where the count does not grow one token per token (a cut between two tokens can merge when the
        text is tokenized again; a random id can come back as two or three tokens). Where the two meet a few
        tokens short, " a" (one token in every word-splitting tokenizer) pads the short text to the exact count."""
        assert self._tokenizer is not None
        marker = self.ids.tag()
        body = self.ids.unique(length) if self.kind == "random" else await self._window(length + 64)
        lo, hi = 0, None          # cuts whose count is under `length`, and over it
        under: tuple[int, str] | None = None   # the longest text found under `length`: (count, text)
        take = max(1, min(len(body), length - self._overhead.get(length, 24)))
        for attempt in range(CHAT_FIT_TRIES):
            while take > len(body):  # more text of the same kind: random ids stay random, never the code corpus
                more = take - len(body) + 64
                body += self.ids.unique(more) if self.kind == "random" else await self._window(more)
            text = await self._tokenizer.detokenize(body[:take])
            count = await self._count(marker + text)
            if count == length:
                self._overhead[length] = count - take
                return count, text
            if count < length:
                lo = take
                if under is None or count > under[0]:
                    under = (count, text)
            else:
                hi = take
            if hi is not None and hi - lo <= 1:
                break
            # The text's tokens per counted token so far, kept inside the bracket; every third try halves it,
            # so a guess that keeps landing on one side cannot stall the search.
            guess = take + round((length - count) * (take / max(1, count)))
            if hi is None:
                take = max(guess, lo + 1)
            else:
                take = (lo + hi) // 2 if attempt % 3 == 2 else min(max(guess, lo + 1), hi - 1)
        if under is None or length - under[0] > PAD_MAX:  # never more than a few tokens of filler
            return None
        pad = length - under[0]
        for _ in range(3):
            text = under[1] + " a" * pad
            count = await self._count(marker + text)
            if count == length:
                return count, text
            pad += length - count
            if pad <= 0 or pad > 2 * PAD_MAX:
                break
        return None

    async def _count(self, text: str) -> int:
        assert self._tokenizer is not None
        return len(await self._tokenizer.tokenize(messages=[{"role": "user", "content": text}]))

    @staticmethod
    def _message(count: int, text: str) -> Prompt:
        return Prompt(tokens=count, messages=[{"role": "user", "content": text}])



class SessionShape(Protocol):
    """What SessionTurns needs of cells.Sessions (which imports this module)."""

    @property
    def system_tokens(self) -> int: ...

    @property
    def user_tokens(self) -> int: ...

    @property
    def turns(self) -> int: ...

    def turn(self, index: int) -> tuple[int, int]: ...

    def length(self, turn: int, reply_tokens: int) -> int: ...


class SessionTurns:
    """The prompts of open-loop agent sessions (cells.Sessions), token ids for /v1/completions: one system
    prompt for the whole step, then per session its turns' parts (user message, reply standing in for the
    model's, user message, ...), every part a fresh prompt of its length from `part` (so each starts uniquely
    and nothing is served from an earlier step or run). Turn k of a session is the system prompt and the
    session's first 2k + 1 parts: it extends turn k - 1's prompt, as a conversation's history does. Prompts are
    made one at a time in the order asked (a closed loop asks from many streams at once), and a session is
    forgotten after its last turn, so a long closed loop holds only the live ones."""

    def __init__(self, shape: SessionShape, *, reply_tokens: int,
                 part: Callable[[int], Awaitable[Prompt]]) -> None:
        self.shape, self.reply_tokens = shape, reply_tokens
        self._part = part
        self._system: list[int] | None = None
        self._parts: dict[int, list[list[int]]] = {}
        self._lock = asyncio.Lock()

    def length(self, index: int) -> int:
        return self.shape.length(self.shape.turn(index)[1], self.reply_tokens)

    async def _ids(self, length: int) -> list[int]:
        ids = (await self._part(length)).ids
        if ids is None or len(ids) != length:
            raise PromptError("agent sessions are token ids of exact lengths",
                              hint="use the completions endpoint for a rate cell with sessions")
        return ids

    async def prompt(self, index: int) -> Prompt:
        session, turn = self.shape.turn(index)
        async with self._lock:
            if self._system is None:
                self._system = await self._ids(self.shape.system_tokens)
            parts = self._parts.setdefault(session, [])
            while len(parts) < 2 * turn + 1:
                parts.append(await self._ids(self.shape.user_tokens if len(parts) % 2 == 0 else self.reply_tokens))
            ids = self._system + [t for p in parts[:2 * turn + 1] for t in p]
            if turn == self.shape.turns - 1:
                del self._parts[session]
        return Prompt(tokens=len(ids), ids=ids)
