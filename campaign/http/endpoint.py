"""Where a server is and how to reach it: one meaning of a URL for the control plane and the measured path.

- `http://host:port`, `https://host:port`, with an optional path prefix (`http://gateway/team-a`); a trailing
  `/v1` names the same server as the URL without it (users paste either).
- IPv6 literals (`http://[::1]:8000`) keep their brackets in the `Host` header.
- https verifies against the system CAs (OpenSSL's default paths, so `SSL_CERT_FILE` / `SSL_CERT_DIR` are
  honoured), or a given CA bundle, or not at all with `insecure`.
- Proxies: a proxy in the path would be measured along with the server, so both paths go direct to the target;
  `proxy_notice` says so when a proxy variable is set.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

import httpx
from prometheus_client.samples import Sample

from campaign.core import secret
from campaign.core.errors import CampaignError
from campaign.http.streams import Limits, Streams


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """Each fires at its value and names itself: connecting, the first byte of the reply, silence between reads.

    The idle timeout also covers the wait for the first token after the reply's headers (vLLM sends them
    before prefill), so it must exceed the longest prefill; queueing counts only while no other stream of the
    client gets data (http.streams.Liveness: a queue that moves is the server working)."""

    connect_s: float = 10.0
    first_byte_s: float = 300.0
    idle_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("connect_s", "first_byte_s", "idle_s"):
            if not getattr(self, name) > 0:
                raise CampaignError(f"timeout {name} must be above 0 s (got {getattr(self, name)})",
                                    hint="give a number of seconds, e.g. --idle-timeout 120")

    def at_speed(self, time_scale: float) -> Timeouts:
        """The wall-clock timeouts against a server whose clock runs `time_scale` times faster than the
        hardware's (the simulator): a reply's silences are the hardware's work, so they shrink with the clock;
        connecting is this host's own network, simulated by nothing, and keeps its limit. Neither reply limit
        shrinks below the connect limit (or its own value, if smaller): a stall of this host is not the
        hardware being slow, and at 100x a 300 s idle limit would be 3 wall seconds."""
        if time_scale == 1.0:
            return self

        def scaled(limit: float) -> float:
            return max(limit / time_scale, min(limit, self.connect_s))

        return Timeouts(connect_s=self.connect_s, first_byte_s=scaled(self.first_byte_s), idle_s=scaled(self.idle_s))


@dataclass(frozen=True, kw_only=True)
class TLS:
    """How https servers are verified: system CAs by default, a CA bundle file, or (insecure) not at all."""

    ca_bundle: Path | None = None
    insecure: bool = False

    def context(self) -> ssl.SSLContext:
        if self.insecure:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            return ctx
        if self.ca_bundle is not None:
            if not self.ca_bundle.is_file():
                raise CampaignError(f"--ca-bundle {self.ca_bundle}: no such file",
                                    hint="give the PEM file of the CA that signed the server's certificate")
            try:
                return ssl.create_default_context(cafile=str(self.ca_bundle))
            except ssl.SSLError as exc:
                raise CampaignError(f"--ca-bundle {self.ca_bundle}: not a PEM certificate bundle ({exc})") from None
        # load_default_certs -> OpenSSL's default verify paths, which honour SSL_CERT_FILE and SSL_CERT_DIR.
        return ssl.create_default_context()


class InProcess(Protocol):
    """A server in this process: it hands out a client of the measured path that needs no socket."""

    def streams(self, endpoint: Endpoint, limits: Limits | None) -> Streams: ...

    def samples(self, only: frozenset[str] | None) -> Iterable[Sample]:
        """Its /metrics as prometheus_client's samples, without the text (with `only`, those names' alone)."""
        ...


@dataclass(frozen=True, kw_only=True)
class Endpoint:
    scheme: str
    host: str            # without brackets, even for IPv6
    port: int
    prefix: str = ""     # "" or "/a/b": no trailing slash, no trailing /v1
    api_key: str | None = field(default=None, repr=False)
    tls: TLS = field(default_factory=TLS)
    timeouts: Timeouts = field(default_factory=Timeouts)
    # A Unix domain socket to connect to instead of host:port (vLLM's --uds; the simulator in process): the URL
    # still names the server in each request's Host header.
    uds: str | None = None
    # A server in this process that takes the measured requests without a socket (the simulator in simulated
    # time, measure.simulated): new_client asks it for the client; the control plane still goes over `uds`.
    in_process: InProcess | None = field(default=None, repr=False, compare=False)

    @classmethod
    def parse(cls, url: str, *, api_key: str | None = None, tls: TLS | None = None,
              timeouts: Timeouts | None = None) -> Endpoint:
        secret.declare(secret.url_password(url))
        shown = secret.display_url(url)  # every message below may be printed: never with the URL's password
        try:
            parts = urlsplit(url.strip())
            port = parts.port
        except ValueError as exc:
            raise CampaignError(f"{shown}: not a URL ({exc})", hint="e.g. http://127.0.0.1:8000") from None
        if parts.scheme not in {"http", "https"}:
            raise CampaignError(f"{shown}: unsupported URL scheme {parts.scheme or '(none)'!r}",
                                hint="use http:// or https://, e.g. http://127.0.0.1:8000")
        if not parts.hostname:
            raise CampaignError(f"{shown}: no host in the URL", hint="e.g. http://127.0.0.1:8000")
        if parts.query or parts.fragment:
            raise CampaignError(f"{shown}: a base URL has no ?query or #fragment",
                                hint="give scheme://host:port/prefix")
        if parts.username or parts.password:
            raise CampaignError(f"{shown}: credentials in the URL would reach logs",
                                hint="put the API key in an environment variable and pass --api-key-env NAME")
        prefix = parts.path.rstrip("/")
        if prefix.endswith("/v1"):
            prefix = prefix[: -len("/v1")]
        return cls(scheme=parts.scheme, host=parts.hostname, port=port or (443 if parts.scheme == "https" else 80),
                   prefix=prefix, api_key=api_key, tls=tls or TLS(), timeouts=timeouts or Timeouts())

    @property
    def is_tls(self) -> bool:
        return self.scheme == "https"

    @property
    def host_header(self) -> str:
        """`host:port`, with an IPv6 literal in brackets (RFC 9110 section 7.2)."""
        host = f"[{self.host}]" if _is_ipv6(self.host) else self.host
        return f"{host}:{self.port}"

    @property
    def root(self) -> str:
        """The base URL without /v1: `/metrics`, `/health` and `/v1/...` all hang off it."""
        return f"{self.scheme}://{self.host_header}{self.prefix}"

    def target(self, path: str) -> str:
        """The request-target for a server path such as `/v1/completions` or `/metrics`."""
        return self.prefix + (path if path.startswith("/") else "/" + path)

    def url(self, path: str) -> str:
        return f"{self.scheme}://{self.host_header}{self.target(path)}"

    def ssl_context(self) -> ssl.SSLContext | None:
        return self.tls.context() if self.is_tls else None

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _httpx_options(self, timeout_s: float) -> dict[str, object]:
        return {
            "base_url": self.root, "headers": self.auth_headers(),
            "timeout": httpx.Timeout(timeout_s, connect=self.timeouts.connect_s),
            # Direct to the target, like the measured path: a proxy in between would be measured too.
            # Plain HTTP needs no certificates: httpx would load the system's for every client (22 ms each,
            # one client a cell), and no TLS ever uses them.
            "trust_env": False, "verify": self.ssl_context() or False,
        }

    def control(self, timeout_s: float = 10.0) -> httpx.Client:
        """A synchronous httpx client for control-plane calls (relative paths: "/metrics")."""
        options = self._httpx_options(timeout_s)
        transport = None if self.uds is None else httpx.HTTPTransport(
            uds=self.uds, verify=options["verify"])  # type: ignore[arg-type]
        return httpx.Client(**options, transport=transport)  # type: ignore[arg-type]

    def async_control(self, timeout_s: float = 10.0) -> httpx.AsyncClient:
        options = self._httpx_options(timeout_s)
        transport = None if self.uds is None else httpx.AsyncHTTPTransport(
            uds=self.uds, verify=options["verify"])  # type: ignore[arg-type]
        return httpx.AsyncClient(**options, transport=transport)  # type: ignore[arg-type]


def _is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False


def proxy_notice(endpoint: Endpoint) -> str | None:
    """One line when a proxy variable would apply to this target: we go direct, and say so."""
    proxies = urllib.request.getproxies_environment()
    names = [n for n in (endpoint.scheme, "all") if proxies.get(n)]
    bypass = getattr(urllib.request, "proxy_bypass_environment")  # noqa: B009 (not in typeshed)
    if not names or bypass(endpoint.host, proxies):
        return None
    variables = [v for v in os.environ if v.lower() in {f"{n}_proxy" for n in names}]
    return (f"{', '.join(sorted(variables)) or 'a proxy variable'} is set: measuring {endpoint.root} directly, "
            "not through the proxy (a proxy in the path would be measured too)")
