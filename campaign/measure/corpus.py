"""Text to make prompts of, from what every Python install already holds: nothing downloaded, nothing shipped.

- `code`: the standard library's own sources (`*.py` under `sysconfig`'s stdlib path), whole files in a
  fixed order.
- `prose`: the standard library's documentation strings (modules, classes, functions), paragraphs of English.
- `FILE.jsonl`: the user's own prompts or conversations, one JSON object a line, `{"prompt": "..."}` or
  `{"messages": [{"role": ..., "content": ...}, ...]}`; their texts, in file order, are the corpus.

A corpus is text, not tokens: the server's own tokenizer (`/tokenize`) turns it into tokens, so a prompt of
L tokens is L tokens for the model being measured, whatever its vocabulary.
"""

from __future__ import annotations

import ast
import functools
import json
import sysconfig
from pathlib import Path

from campaign.core.errors import PromptError

BUILT_IN = ("code", "prose")
DEFAULT_CHARS = 1_500_000     # about 400K tokens of code: windows for any context up to 256K, at many offsets
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__", "turtledemo"}


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])]
    if not files:
        raise PromptError(f"no Python sources under {root} for the `code` and `prose` prompts",
                          hint="use --prompts random, or a FILE.jsonl of your own prompts")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


@functools.cache   # the standard library does not change under a running process: read it once
def code(chars: int = DEFAULT_CHARS) -> str:
    parts: list[str] = []
    size = 0
    for path in _stdlib_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        size += len(text)
        if size >= chars:
            break
    return "\n\n".join(parts)


@functools.cache
def prose(chars: int = DEFAULT_CHARS) -> str:
    parts: list[str] = []
    size = 0
    for path in _stdlib_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 200:  # one-liners are labels, not prose
                    parts.append(doc)
                    size += len(doc)
        if size >= chars:
            break
    return "\n\n".join(parts)


def jsonl(path: Path) -> str:
    """The texts of a prompts file; a line that is not one of the two shapes is an error naming it."""
    if not path.is_file():
        raise PromptError(f"prompts file {path}: no such file",
                          hint='give a .jsonl file, one {"prompt": "..."} or {"messages": [...]} a line')
    texts: list[str] = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError as exc:
                raise PromptError(f"prompts file {path}, line {number}: not JSON ({exc})",
                                  hint='each line is one JSON object: {"prompt": "..."} or {"messages": [...]}'
                                  ) from None
            text = _text_of(item)
            if text is None:
                raise PromptError(f"prompts file {path}, line {number}: no \"prompt\" string and no "
                                  "\"messages\" list of {\"role\", \"content\"}",
                                  hint='each line is {"prompt": "..."} or {"messages": [{"role": "user", '
                                       '"content": "..."}]}')
            texts.append(text)
    if not texts:
        raise PromptError(f"prompts file {path}: no prompts in it", hint="one JSON object a line")
    return "\n\n".join(texts)


def _text_of(item: object) -> str | None:
    if not isinstance(item, dict):
        return None
    if isinstance(item.get("prompt"), str):
        return str(item["prompt"])
    messages = item.get("messages")
    if isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
        return "\n".join(str(m["content"]) for m in messages)
    return None


def text(kind: str) -> str:
    """The corpus a `--prompts` value names (not `random`, which is token ids, not text)."""
    if kind == "code":
        return code()
    if kind == "prose":
        return prose()
    if kind.endswith(".jsonl"):
        return jsonl(Path(kind))
    raise PromptError(f"prompts {kind!r}: not a prompt source",
                      hint="use random, code, prose, or a FILE.jsonl of your own prompts")
