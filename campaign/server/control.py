"""Control-plane calls to a running server (/health, /version, /v1/models, /metrics).

These, and only these, are retried (tenacity): a measured request is never retried silently.
"""

from __future__ import annotations

import ssl
from typing import Any

import httpx
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

from campaign.core.errors import CampaignError
from campaign.http.endpoint import Endpoint
from campaign.server import metrics
from campaign.server.startup_log import StartupFacts


def _transient(exc: BaseException) -> bool:
    """Worth another try: a refused or dropped connection, a 5xx; never a certificate the CA does not sign."""
    if isinstance(exc, httpx.HTTPStatusError):
        return True
    return isinstance(exc, httpx.TransportError) and not isinstance(exc.__context__, ssl.SSLError)




class ControlClient:
    """Synchronous control-plane client; the API key (if any) goes in a header, never into a log."""

    def __init__(self, endpoint: Endpoint, *, timeout_s: float = 10.0, retry_s: float = 15.0) -> None:
        """`retry_s`: how long a refused connection or a 5xx is tried again. A server this tool just saw become
        ready gets 15 s; a URL the user typed gets little, so a wrong address fails in seconds."""
        self.endpoint = endpoint
        self.base_url = endpoint.root
        self._client = endpoint.control(timeout_s)
        self._version: str | None = None
        self._retrying = Retrying(retry=retry_if_exception(_transient), stop=stop_after_delay(retry_s),
                                  wait=wait_exponential(multiplier=0.1, max=2.0), reraise=True)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _get(self, path: str) -> httpx.Response:
        for attempt in self._retrying:
            with attempt:
                response = self._client.get(path)
                response.raise_for_status()
                return response
        raise AssertionError("unreachable: tenacity re-raises the last error")

    def version(self) -> str | None:
        if self._version is None:
            try:
                self._version = str(self._get("/version").json().get("version"))
            except (httpx.HTTPError, ValueError):
                return None
        return self._version

    def models(self) -> list[dict[str, Any]]:
        try:
            data = self._get("/v1/models").json()
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code == 401:
                raise CampaignError("the server refused /v1/models with 401 Unauthorized",
                                    hint="set the API key's environment variable (api_key_env / --api-key-env)"
                                    ) from None
            raise
        return list(data.get("data", []))

    def served_model(self) -> tuple[str, int | None]:
        """The first served model's id and its max_model_len."""
        models = self.models()
        if not models:
            raise CampaignError(f"{self.base_url}/v1/models lists no model")
        first = models[0]
        max_len = first.get("max_model_len")
        return str(first["id"]), int(max_len) if isinstance(max_len, int) else None

    def metrics(self) -> metrics.MetricsSnapshot:
        return metrics.parse(self._get("/metrics").text, server_version=self.version())


def cross_check(facts: StartupFacts, live: ControlClient) -> tuple[StartupFacts, list[str]]:
    """Fill what the log left null from the live server, and warn where the two disagree."""
    warnings: list[str] = []
    updates: dict[str, Any] = {}

    def reconcile(field: str, live_value: Any) -> None:
        if live_value is None:
            return
        logged = getattr(facts, field)
        if logged is None:
            updates[field] = live_value
        elif logged != live_value:
            warnings.append(f"{field}: the startup log says {logged}, the live server says {live_value}")

    reconcile("vllm_version", live.version())
    try:
        _, max_len = live.served_model()
        reconcile("max_model_len", max_len)
    except CampaignError as exc:
        warnings.append(str(exc))
    snapshot = live.metrics()
    info = snapshot.info(metrics.CACHE_CONFIG_INFO)
    if info is None:
        warnings.append(f"{metrics.CACHE_CONFIG_INFO} is not exported; block size comes from the log only")
    else:
        reconcile("block_size", _int_label(info, "block_size"))
        reconcile("kv_cache_tokens", _int_label(info, "kv_cache_size_tokens"))
    return facts.model_copy(update=updates), warnings


def _int_label(labels: dict[str, str], key: str) -> int | None:
    try:
        return int(float(labels[key]))
    except (KeyError, ValueError):
        return None
