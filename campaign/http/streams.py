"""What the measured path's clients share: a reply, the limits on it, the failures it can end in, and the
interface a client has (`Streams`): StreamClient over HTTP (streamclient), or a server in this process that
needs no socket (measure.simulated). Apart from streamclient, so that an Endpoint can name that interface."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class StreamError(Exception):
    """One request's failure. `kind`: connect, timeout, tls, protocol, limit, closed, encoding, not-event-stream."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class StreamTimeout(StreamError):
    """A timeout: `which` is connect, first_byte or idle; `after_s` is how long it waited."""

    def __init__(self, which: str, after_s: float, message: str) -> None:
        super().__init__("timeout", message)
        self.which = which
        self.after_s = after_s


@dataclass(frozen=True)
class Limits:
    header_bytes: int = 64 * 1024
    event_bytes: int = 4 * 1024 * 1024
    error_body_bytes: int = 64 * 1024


@dataclass
class Reply:
    status: int
    content_type: str | None
    body: bytes          # the body of a non-200 reply (bounded); empty for an event stream
    events: int          # SSE events dispatched
    http_version: str
    keep_alive: bool
    sent_t: float        # core.clock when the request's bytes went to the socket (connected, encoded)


class Liveness:
    """When any stream of one client last got data: a request waiting for its first token in a server's queue
    is not idle while the server is visibly working on the client's other streams (tokens flowing, the queue
    moving); the idle limit ends it only once the whole server has been silent that long (a server that
    stopped), not a queue the user asked to see."""

    def __init__(self) -> None:
        self.last = float("-inf")

    def touch(self, now: float) -> None:
        self.last = max(self.last, now)

    def silent_since(self, own: float) -> float:
        """Since when neither this stream (its own last data `own`) nor any other of the client got any."""
        return max(own, self.last)

    def idle(self, own: float, now: float, events: int, limit: float) -> float | StreamTimeout:
        """The idle limit of a stream whose own last data came at `own`, after `events` events: the seconds
        left before it is reached, or the timeout once it is (the one rule of both clients' timers)."""
        waited = now - self.silent_since(own)
        if waited < limit:
            return limit - waited
        return idle_timeout(now - own, events, limit, others_s=waited if self.last > own else None)


def idle_timeout(waited: float, events: int, limit: float, *, others_s: float | None = None) -> StreamTimeout:
    """The idle limit reached: `waited` seconds without data after `events` events; `others_s`: how long the
    client's other streams had been silent too, where one of them got data after this one did."""
    others = "" if others_s is None else f", and none on the client's other streams for {others_s:.1f} s"
    return StreamTimeout("idle", waited, f"idle timeout: no data for {waited:.1f} s after {events} event(s)"
                                         f"{others} (limit {limit:g} s)")


class Streams(Protocol):
    """What the measured path needs of a client: StreamClient over HTTP, or a server in this process that
    takes requests without a socket (measure.simulated)."""

    connections_opened: int

    async def post_stream(self, path: str, body: dict[str, Any],
                          on_event: Callable[[float, bytes], None]) -> Reply: ...

    async def open_idle(self, count: int) -> None: ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Streams: ...

    async def __aexit__(self, *exc: object) -> None: ...
