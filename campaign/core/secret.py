"""One rule for secrets: which values are secret, how a matrix or profile refers to one, and the redaction
that every writer (stored records, server logs, reports, exports, the console) applies.

A value is secret when
- it is a flag's or an environment variable's, or a key's inside a JSON-valued flag, whose name says so
  (`hf-token`, `api-key`, `HF_TOKEN`, `AWS_SECRET_ACCESS_KEY`, `s3_secret_access_key`, `authToken`): the
  name's last word is token, key, secret, password, passphrase, credential(s), auth or apikey, or any word
  of it is secret, password or passphrase; numbers and booleans (`1`, `true`) are settings, not secrets
  (`allow-credentials: true`, `long-prefill-token-threshold: 512`);
- it is the API key the runner sends (the profile's `api_key_env`, `--api-key-env`);
- it is the password of a URL (`http://user:PASSWORD@host`), in a flag, an environment value or a command
  line argument.

A secret is never written inline: a matrix or profile refers to it as `${NAME}`, an environment variable of
the process that launches the server, expanded only into the server's own environment and argv at spawn.
What is stored is the reference. The values this process knows to be secret (declared where they are read,
and the environment's own secret-named variables) are replaced by `<redacted>` in everything written.

Pure: the standard library only, so every layer can import it.
"""

from __future__ import annotations

import html
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TextIO
from urllib.parse import urlsplit

REDACTED = "<redacted>"
HIDDEN = "***"  # a URL's password where the URL is shown (display_url)

_LAST_WORDS = frozenset({"token", "key", "secret", "password", "passwd", "passphrase", "credential",
                         "credentials", "auth", "apikey"})
_ANY_WORDS = frozenset({"secret", "password", "passwd", "passphrase"})
# A name's words: `hf-token`, `HF_TOKEN`, `authToken` and `s3_secret_access_key` alike.
_WORD = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")
REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_SETTING = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?|true|false|yes|no|on|off|none|null)?\s*$",
                      re.IGNORECASE)
# `scheme://user:PASSWORD@`: a password in any URL a text quotes (not a `${NAME}` reference, which says nothing).
_URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^\s/@:]*:)([^\s/@]+)@")
# An environment variable's value is taken as a secret without being declared only from this length on: a
# credential is long, and `VLLM_API_KEY=EMPTY` (the OpenAI client's placeholder) is not worth garbling logs.
AMBIENT_MIN_LEN = 8

HOW_TO_PASS = ("refer to an environment variable instead, e.g. `${HF_TOKEN}` (expanded when the server starts; "
               "the run stores the reference, never the value); docs/results.md, Secrets")


def name_words(name: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(name)]


def is_secret_name(name: str) -> bool:
    """True for names that say they hold a secret (`hf-token`, `VLLM_API_KEY`, `clientSecret`)."""
    words = name_words(name)
    return bool(words) and (words[-1] in _LAST_WORDS or words[-1].endswith(("token", "apikey"))
                            or any(w in _ANY_WORDS for w in words))


def is_setting(value: str) -> bool:
    """A number, a boolean word or nothing: a setting (`HF_HUB_DISABLE_IMPLICIT_TOKEN: 1`), not a secret."""
    return bool(_SETTING.match(value))


def url_password(text: str) -> str | None:
    """The password of a URL's userinfo (`scheme://user:PASSWORD@host`); None when there is none."""
    if "://" not in text or "@" not in text:
        return None
    try:
        return urlsplit(text.strip()).password or None
    except ValueError:
        return None


def display_url(url: str) -> str:
    """The URL as it may be shown: a password in its userinfo replaced by `***`."""
    password = url_password(url)
    return url if password is None else url.replace(f":{password}@", f":{HIDDEN}@", 1)


def _as_json(text: str) -> Any:
    """A JSON object or array written as a string (`'{"method": "ngram"}'`), else None."""
    if not text.lstrip().startswith(("{", "[")):
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def inline(key: str, value: Any, name: str | None = None) -> Iterator[str]:
    """The key paths under `key` where a secret is written inline: a secret-named string that refers to no
    `${VARIABLE}`, or a URL with a password that is not such a reference. Mappings and lists are walked
    (also a JSON object written as a string), each item under its parent's name."""
    name = key.rsplit(".", 1)[-1] if name is None else name
    if isinstance(value, Mapping):
        for sub, item in value.items():
            yield from inline(f"{key}.{sub}", item, str(sub))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from inline(f"{key}[{index}]", item, name)
    elif isinstance(value, str):
        parsed = _as_json(value)
        if parsed is not None:
            yield from inline(key, parsed, name)
            return
        password = url_password(value)
        if password is not None and not REFERENCE.fullmatch(password):
            yield key
        elif password is None and is_secret_name(name) and not is_setting(value) and not REFERENCE.search(value):
            yield key


def references(value: Any) -> Iterator[str]:
    """The `${NAME}` variables a value (a string, or a mapping or list of them) refers to."""
    if isinstance(value, Mapping | list):
        for item in value.values() if isinstance(value, Mapping) else value:
            yield from references(item)
    elif isinstance(value, str):
        yield from REFERENCE.findall(value)


def _map_strings(value: Any, change: Callable[[str], str], *, keys: bool = False) -> Any:
    """Every string of a JSON-like value (and its keys, with `keys`) changed, its structure kept."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, Mapping):
        return {change(str(k)) if keys else k: _map_strings(v, change, keys=keys) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_map_strings(v, change, keys=keys) for v in value]
    return value


def unset(value: Any, environ: Mapping[str, str] | None = None) -> list[str]:
    """The variables a value refers to that are not set (in `environ`, default: this process's)."""
    environ = os.environ if environ is None else environ
    return sorted({name for name in references(value) if name not in environ})


class UnsetReferenceError(Exception):
    """A `${NAME}` whose variable is not set where the server is launched."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(", ".join(names))
        self.names = names


def expand(value: Any, environ: Mapping[str, str] | None = None) -> Any:
    """`${NAME}` replaced by that variable's value, in a string or in every string of a mapping or list. A
    reference is how a secret is passed, so every value one brings in is declared secret (numbers and booleans
    aside), and is redacted wherever it shows up later. Raises UnsetReferenceError."""
    environ = os.environ if environ is None else environ

    def one(text: str) -> str:
        if "${" not in text:
            return text
        missing = unset(text, environ)
        if missing:
            raise UnsetReferenceError(missing)
        declare_references(text, environ)
        return REFERENCE.sub(lambda match: environ[match.group(1)], text)

    return _map_strings(value, one)


def declare_references(value: Any, environ: Mapping[str, str] | None = None) -> None:
    """Declare the values of the variables `value` refers to (those that are set): what a controller does
    before a night whose servers it may never spawn itself (a pool's worker, a Ray task does)."""
    environ = os.environ if environ is None else environ
    for name in references(value):
        found = environ.get(name)
        if found is not None and not is_setting(found):
            declare(found)


# --- what this process knows to be secret ------------------------------------------------------------------
_declared: set[str] = set()


def declare(value: str | None) -> None:
    """A value this process now knows to be secret (an API key read, a reference expanded, a URL's password)."""
    if value and value.strip():
        _declared.add(value.strip())


def forget() -> None:
    """Forget every declared value: for a process that goes on to another run (a test session)."""
    _declared.clear()


def _ambient() -> Iterator[str]:
    """The environment's own secret-named variables: a launched server inherits them, and may print them."""
    for name, value in os.environ.items():
        value = value.strip()
        if len(value) >= AMBIENT_MIN_LEN and is_secret_name(name) and not is_setting(value):
            yield value


def known() -> list[str]:
    """Every secret value known here, longest first (so that one that contains another goes whole)."""
    return sorted(_declared | set(_ambient()), key=len, reverse=True)


def _forms(secret: str) -> list[str]:
    """How a value can appear in what is written: as it is, inside a JSON string, escaped in HTML."""
    return list(dict.fromkeys([secret, json.dumps(secret)[1:-1], html.escape(secret)]))


def redact(text: str, secrets: list[str] | None = None) -> str:
    """The text with every known secret value (or those of `secrets`, from known()), and any URL's password,
    replaced by `<redacted>`."""
    for secret in known() if secrets is None else secrets:
        for form in _forms(secret):
            if form in text:
                text = text.replace(form, REDACTED)
    if "://" in text and "@" in text:
        text = _URL_PASSWORD.sub(lambda m: m.group(0) if m.group(2) in {HIDDEN, REDACTED} or REFERENCE.fullmatch(
            m.group(2)) else f"{m.group(1)}{REDACTED}@", text)
    return text


def redact_value(value: Any) -> Any:
    """`redact` over every string of a JSON-like value (keys too), keeping its structure; the known secrets are
    gathered once, not once a string."""
    secrets = known()
    return _map_strings(value, lambda text: redact(text, secrets), keys=True)


class RedactingStream:
    """A text stream whose writes are redacted: stdout and stderr of the command line, so that a secret that
    reaches a message by a path nobody foresaw (an exception's text, a server's log line) is not shown."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        # Bytes (click probes a stream with b"") go through as they are, and fail as they would.
        self._stream.write(redact(text) if isinstance(text, str) else text)
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def redact_stdio() -> tuple[TextIO, TextIO]:
    """Redact sys.stdout and sys.stderr from now on; returns the streams they were, to restore."""
    before = sys.stdout, sys.stderr
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, RedactingStream):
            setattr(sys, name, RedactingStream(stream))
    return before
