"""The simulator's text side: a tokenizer, a chat template, and how predictable a prompt is to a drafter.

- With `--tokenizer PATH` (a Hugging Face tokenizer folder or its tokenizer.json), the model's own tokenizer
  counts, encodes and decodes (the `tokenizers` package; nothing from the hub), and the folder's chat template
  (chat_template.jinja, or tokenizer_config.json's `chat_template`) renders chat requests with Jinja in a
  sandbox, as transformers does. A client that sized its prompts with the model's tokenizer (vLLM's `bench
  serve`, GuideLLM) then gets the prompt lengths it asked for.
- Without one, the built-in approximation below stands in, and the start-up log and /v1/models say so:
  the built-in tokenizer splits text into words with their leading space, single punctuation marks and runs of
  whitespace (roughly what a BPE vocabulary does to English and code, at a similar tokens-per-character rate)
  and numbers each piece by a stable hash. Like a real tokenizer it does not round-trip at arbitrary cuts:
  `detokenize(ids[a:b])` tokenized again may merge across the cut, which is what the client's exact-length
  prompts must cope with on a real server too.
- The chat template is ChatML (the Qwen family's): `<|im_start|>{role}\n{content}<|im_end|>\n` per message,
  and `<|im_start|>assistant\n` for the generation prompt, each marker one special token.
- Predictability is how often prompt lookup would have guessed the prompt's own next token from an earlier
  occurrence of the two before it: the n-gram drafter's chance in the prompt, and a proxy for how well a
  trained draft head does on the text (code repeats itself, prose less, random token ids never).
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from jinja2 import Template, TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HfTokenizerFile

VOCAB = 151_936               # the Qwen family's vocabulary size
SPECIAL = {"<|im_start|>": 151_644, "<|im_end|>": 151_645, "<|endoftext|>": 151_643}
_FIRST = 2_000                # text pieces get ids from here: below are the random prompts' ids (16..1999)
_SPAN = min(SPECIAL.values()) - _FIRST   # text pieces' ids: _FIRST up to the first special token
_PIECES = re.compile(r"<\|im_start\|>|<\|im_end\|>|<\|endoftext\|>| ?[A-Za-z_]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9_]|\s+")


APPROXIMATION = "the simulator's built-in approximation (words and punctuation, not the model's tokenizer)"


class TextSide(Protocol):
    """What the server needs of a tokenizer: counting, encoding and decoding text, rendering chat, and the text
    of a reply of n tokens (one token each, so a client that re-tokenizes the reply counts n)."""

    description: str

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def chat(self, messages: list[dict[str, object]], *, add_generation_prompt: bool = True,
             **kwargs: object) -> str: ...

    def reply(self, tokens: int) -> str: ...


class Tokenizer:
    """Stable ids for text pieces (a hash, so two pieces can share an id: the first one seen is what that id
    decodes to); `decode` gives back the text of the ids it made, and a word of its own for any other id."""

    description = APPROXIMATION

    def __init__(self) -> None:
        self._text: dict[int, str] = {v: k for k, v in SPECIAL.items()}
        self._ids = _PieceIds(self._text)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if len(self._ids) > _MAX_KEPT_PIECES:   # a server fed endless distinct pieces keeps a bounded table
            self._ids = _PieceIds(self._text)
        return list(map(self._ids.__getitem__, _PIECES.findall(text)))

    def decode(self, ids: list[int]) -> str:
        # An id this tokenizer never made (a random prompt's) reads as a word of its own, as random ids come
        # back from a real tokenizer as unrelated word pieces, not as one repeated placeholder.
        return "".join(self._text.get(i) or _word(i) for i in ids)

    def chat(self, messages: list[dict[str, object]], *, add_generation_prompt: bool = True,
             **kwargs: object) -> str:
        return chat_prompt(messages, add_generation_prompt=add_generation_prompt)

    def reply(self, tokens: int) -> str:
        return " tok" * tokens


# Distinct pieces whose ids are kept (a word and its number, about 100 bytes each): text corpora hold far fewer.
_MAX_KEPT_PIECES = 1_000_000


class _PieceIds(dict[str, int]):
    """A text piece's id, worked out at its first sight and looked up after: encoding a 32K-token prompt piece
    by piece (a hash and a table check each) took 10 ms, and the simulator encodes every text prompt it
    serves, a chat request's whole conversation each turn. `known` (id -> the piece it decodes to) keeps the
    first piece seen for each id."""

    def __init__(self, known: dict[int, str]) -> None:
        super().__init__(SPECIAL)
        self.known = known

    def __missing__(self, piece: str) -> int:
        token = self[piece] = _FIRST + zlib.crc32(piece.encode()) % _SPAN
        self.known.setdefault(token, piece)
        return token


class ModelTokenizer:
    """The model's own tokenizer (tokenizer.json, read by the `tokenizers` package) and chat template.
    ValueError, naming the path, where it cannot be read."""

    def __init__(self, path: str) -> None:
        given = Path(path)
        folder = given if given.is_dir() else given.parent
        file = given / "tokenizer.json" if given.is_dir() else given
        try:
            self._tokenizer = HfTokenizerFile.from_file(str(file))
        except Exception as exc:   # the tokenizers package raises its own Exception subclass for a bad file
            raise ValueError(f"--tokenizer {path}: cannot read {file} as a Hugging Face tokenizer ({exc}); give a "
                             "folder with tokenizer.json, or the file itself") from None
        config = _json(folder / "tokenizer_config.json")
        self.template_file = folder / "chat_template.jinja"
        template = self.template_file.read_text() if self.template_file.is_file() else config.get("chat_template")
        if isinstance(template, list):   # named templates: the default one, as transformers picks it
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        self.template = template if isinstance(template, str) else None
        self._compiled: Template | None = None
        # A special token is a string, or (older configs) an AddedToken dict whose text is its `content`.
        self.special = {k: v if isinstance(v, str) else v["content"] for k, v in config.items()
                        if k.endswith("_token") and (isinstance(v, str) or (
                            isinstance(v, dict) and isinstance(v.get("content"), str)))}
        self.description = f"{file} (the model's own, Hugging Face tokenizers)" + (
            "" if self.template else "; no chat template")
        self._reply_token = self._single_token_word()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=False))

    def chat(self, messages: list[dict[str, object]], *, add_generation_prompt: bool = True,
             **kwargs: object) -> str:
        """The chat template rendered as transformers renders it (a sandboxed Jinja environment, blocks
        trimmed); content given as a list of parts is its text parts joined by newlines, as vLLM does for a
        template that takes a string. ValueError: no template, or the template raised."""
        if self.template is None:
            raise ValueError("this tokenizer has no chat template, so chat requests cannot be rendered (vLLM "
                             "answers them with an error too); give one with chat_template.jinja")
        flat = [{**m, "content": _text_of(m.get("content"))} for m in messages]
        try:
            if self._compiled is None:   # once: compiling costs about 0.65 ms, on the engine's event loop
                self._compiled = _environment().from_string(self.template)
            return self._compiled.render(
                {**self.special, **kwargs, "messages": flat, "add_generation_prompt": add_generation_prompt})
        except TemplateError as exc:
            raise ValueError(f"the chat template failed: {exc}") from None

    def reply(self, tokens: int) -> str:
        return self._reply_token * tokens

    def _single_token_word(self) -> str:
        """A word that is one token alone and one token each when repeated, so a reply of n of them counts n
        when the client tokenizes it again."""
        for word in (" the", " a", " and", " of", " tok", "."):
            if len(self.encode(word * 3, add_special_tokens=False)) == 3:
                return word
        return " the"


class _Generation(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` tag (it marks the assistant's tokens for
    training masks): rendered as its body, as transformers renders it outside mask tracking."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Macro) -> str:
        return str(caller())


def _tojson(x: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' tojson: no HTML escaping (Jinja's own escapes <, > and &, which changes the token count)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    """The Jinja environment transformers renders chat templates in (transformers 5's chat_template_utils):
    sandboxed, blocks trimmed, loop controls ({% break %}, {% continue %}), the generation tag, its tojson,
    raise_exception and strftime_now."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _text_of(content: object) -> str:
    """A message's content as vLLM gives it to a string template: a string, or the text parts joined by
    newlines; None and an empty list read as empty."""
    if isinstance(content, list):
        texts = [_part_text(p) for p in content]
        return "\n".join(t for t in texts if t)   # vLLM skips a part with no text
    return "" if content is None else str(content)


def _part_text(part: object) -> str | None:
    """A content part's text as vLLM 0.32 reads it: `text` for text parts, `refusal` and `thinking` for those
    types; None for a part that is not text-like (an image)."""
    if not isinstance(part, dict):
        raise ValueError(f"a content part must be an object, got {part!r}")   # vLLM's validation refuses it
    kind = part.get("type", "text")
    if kind not in TEXT_PARTS:
        return None
    value = part.get(kind if kind in {"refusal", "thinking"} else "text")
    return None if value is None else str(value)


TEXT_PARTS = {"text", "input_text", "output_text", "refusal", "thinking"}   # vLLM 0.32's text-like part types


def tokenizer_for(path: str | None) -> TextSide:
    """The model's tokenizer at `path`, or the built-in approximation where none is given."""
    return Tokenizer() if path is None else ModelTokenizer(path)


def _word(token: int) -> str:
    letters = []
    while True:
        token, digit = divmod(token, 26)
        letters.append(chr(ord("a") + digit))
        if not token:
            return " " + "".join(letters)


def chat_prompt(messages: list[dict[str, object]], *, add_generation_prompt: bool = True) -> str:
    """ChatML, as the model's chat template would render these messages."""
    out = []
    for message in messages:
        content = _text_of(message.get("content"))   # OpenAI's content parts: the text ones, as vLLM joins them
        out.append(f"<|im_start|>{message.get('role', 'user')}\n{content}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def predictability(ids: list[int], *, limit: int = 16_384) -> float:
    """The share of positions (of the last `limit`) whose token prompt lookup would have proposed: the two
    tokens before it occurred earlier and were followed by it there. 0 for random ids, highest for code."""
    try:
        tail = np.asarray(ids[-limit:], dtype=np.int64)
    except OverflowError:  # an id past 64 bits: relabelled densely, since only equality matters here
        labels: dict[int, int] = {}
        tail = np.asarray([labels.setdefault(t, len(labels)) for t in ids[-limit:]], dtype=np.int64)
    tries = len(tail) - 2
    if tries <= 0:
        return 0.0
    # Position i's previous occurrence of its two-token key is its neighbour in a stable sort by key: that
    # neighbour is the last earlier i with the key, the one a lookup table would hold. (A Python loop over
    # 16K positions per request cost the simulated H200 7 s of a 37 s profile of seed 004's matrix.)
    first, second, follow = tail[:-2], tail[1:-1], tail[2:]
    order = np.lexsort((np.arange(tries), second, first))
    same = (first[order][1:] == first[order][:-1]) & (second[order][1:] == second[order][:-1])
    hits = int(np.count_nonzero(same & (follow[order][1:] == follow[order][:-1])))
    return hits / tries


@dataclass(frozen=True)
class Acceptance:
    """Per-draft-position acceptance of one method, from unpredictable prompts (`low`) to prompts as
    predictable as source code (`high`, reached at `saturate` predictability), and the chance a draft is
    proposed at all (an n-gram drafter proposes nothing where the context has no match)."""

    low: float
    high: float
    saturate: float = 0.35
    proposes_always: bool = True

    def rate(self, score: float) -> float:
        return self.low + (self.high - self.low) * min(1.0, score / self.saturate)

    def proposal_chance(self, score: float) -> float:
        return 1.0 if self.proposes_always else min(1.0, score / self.saturate)


# Calibration, from public figures:
# - MTP: DeepSeek-V3's technical report (arXiv 2412.19437, section 5.4.3) reports 85-90% acceptance of the
#   second-token prediction "across various generation topics": `high`. Its acceptance length is higher on
#   code and maths than on chat (the fine-tuned DeepSeek-V3 MTP head's model card, nebius/MTP-DeepSeek-V3-0324,
#   lists 4.64 on HumanEval against 3.88 on MT-Bench at 7 draft tokens). `low` is the simulator's calibration
#   of seed 004 (0.7 per position at two MTP tokens), whose prompts the seed does not describe: the simulator
#   reads that speed test as run on unpredictable filler, the kind such scripts send.
# - EAGLE heads: like MTP, a little lower on noise (they are trained on chat data, not with the model).
# - A separate drafter model: lower than a head trained on the model's own hidden states.
# - n-gram (prompt lookup): proposes only where the last tokens occurred before in the context, and is then
#   right most of the time; on random ids it proposes nothing. vLLM's documentation ranks it among the
#   methods with "modest speedups".
ACCEPTANCE: dict[str, Acceptance] = {
    "mtp": Acceptance(low=0.70, high=0.90),
    "eagle": Acceptance(low=0.55, high=0.85),
    "draft_model": Acceptance(low=0.45, high=0.80),
    "ngram": Acceptance(low=0.55, high=0.85, proposes_always=False),
}
# vLLM's method names for the same families.
ALIASES = {"deepseek_mtp": "mtp", "qwen3_next_mtp": "mtp", "mimo_mtp": "mtp", "glm4_moe_mtp": "mtp",
           "ernie_mtp": "mtp", "eagle3": "eagle", "medusa": "eagle", "draft": "draft_model",
           "suffix": "ngram", "ngram_gpu": "ngram"}


def acceptance_for(method: str | None) -> Acceptance:
    name = (method or "draft_model").lower()
    return ACCEPTANCE.get(ALIASES.get(name, name), ACCEPTANCE["draft_model"])
