"""Pure pieces of the measured path: SSE split at any byte boundary, and one meaning of a base URL.

The wire-level cases (framing, 1xx, HTTP/1.0, TLS, timeouts, limits) are in test_http_conformance.py."""

from __future__ import annotations

import random

import pytest

from campaign.core.errors import CampaignError
from campaign.http.endpoint import Endpoint, proxy_notice
from campaign.http.streamclient import SSEDecoder, StreamError


def _decode(wire: bytes, cuts: list[int]) -> list[bytes]:
    seen: list[bytes] = []
    decoder = SSEDecoder(lambda now, data: seen.append(data))
    pos = 0
    for cut in [*cuts, len(wire)]:
        decoder.feed(wire[pos:cut], float(pos))
        pos = cut
    return seen


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"])
@pytest.mark.parametrize("seed", range(8))
def test_events_survive_any_read_boundaries(ending: bytes, seed: int) -> None:
    events = [b'{"usage":{"completion_tokens":%d}}' % i for i in range(1, 30)] + [b"[DONE]"]
    wire = b"".join(b"data: " + e + ending + ending for e in events)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(wire)), 25))
    assert _decode(wire, cuts) == events


def test_cr_ending_one_read_and_lf_starting_the_next_is_one_line_end() -> None:
    wire = b"data: a\r\n\r\ndata: b\r\n\r\n"
    for cut in range(1, len(wire)):
        assert _decode(wire, [cut]) == [b"a", b"b"], cut


def test_multiline_data_comments_and_other_fields() -> None:
    wire = b": ping\nevent: message\nid: 7\nretry: 100\ndata: one\ndata:two\n\ndata\n\nunknown: x\n\n"
    assert _decode(wire, []) == [b"one\ntwo", b""]


def test_an_event_over_the_limit_is_an_error_not_a_slow_reparse() -> None:
    decoder = SSEDecoder(lambda now, data: None, max_event_bytes=1000)
    decoder.feed(b"data: " + b"x" * 900, 0.0)
    with pytest.raises(StreamError) as caught:
        decoder.feed(b"x" * 200, 0.0)
    assert caught.value.kind == "limit"


@pytest.mark.parametrize(("url", "root", "target"), [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000", "/v1/completions"),
    ("http://127.0.0.1:8000/", "http://127.0.0.1:8000", "/v1/completions"),
    ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000", "/v1/completions"),
    ("http://gw.local/team-a/v1/", "http://gw.local:80/team-a", "/team-a/v1/completions"),
    ("https://gw.local/team-a", "https://gw.local:443/team-a", "/team-a/v1/completions"),
    ("http://[::1]:8000/p", "http://[::1]:8000/p", "/p/v1/completions"),
])
def test_base_urls_mean_the_same_server_on_both_paths(url: str, root: str, target: str) -> None:
    endpoint = Endpoint.parse(url)
    assert endpoint.root == root
    assert endpoint.target("/v1/completions") == target
    assert endpoint.url("/metrics") == root + "/metrics"


def test_ipv6_host_header_is_bracketed() -> None:
    assert Endpoint.parse("http://[::1]:8000").host_header == "[::1]:8000"


@pytest.mark.parametrize("url", ["ftp://h/", "127.0.0.1:8000", "http://user:pw@h/", "http://h/?q=1", "http://:80"])
def test_unsupported_urls_are_one_clear_error(url: str) -> None:
    with pytest.raises(CampaignError):
        Endpoint.parse(url)


def test_a_proxy_variable_is_noted_once_and_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY", "no_proxy",
                 "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    endpoint = Endpoint.parse("http://10.1.2.3:8000")
    assert proxy_notice(endpoint) is None
    monkeypatch.setenv("HTTP_PROXY", "http://proxy:3128")
    notice = proxy_notice(endpoint)
    assert notice is not None and "HTTP_PROXY" in notice and "directly" in notice
    monkeypatch.setenv("NO_PROXY", "10.1.2.3")
    assert proxy_notice(endpoint) is None
    client = endpoint.control()
    try:
        assert not client._trust_env  # the control plane goes direct too
    finally:
        client.close()


def test_an_empty_read_keeps_a_pending_cr() -> None:
    # A decompressor can yield b"" between a CR and its LF: still one line end, one event.
    assert _decode(b"data: a\r" + b"\ndata: b\r\n\r\n", [8, 8]) == [b"a\nb"]
