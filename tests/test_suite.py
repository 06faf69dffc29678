"""The suite's own rules: what keeps a wall-timed test from being measured beside a heavy start (conftest)."""

from __future__ import annotations

import fcntl
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import cpu_share, file_seconds, heavy_without_its_mark, in_lock_order

HOLD = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from conftest import cpu_share
with cpu_share({kind!r}, Path({path!r})):
    print("held", flush=True)
    sys.stdin.readline()
"""


def _can_take(path: Path, kind: int) -> bool:
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, kind | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True


@pytest.mark.parametrize("kind", ["exclusive", "shared"])
def test_a_heavy_test_excludes_timed_ones_and_timed_ones_share(tmp_path: Path, kind: str) -> None:
    """Another worker holding the lock as a heavy test does keeps every other test out; holding it as a timed
    test lets other timed tests in and keeps heavy ones out; released, it lets anyone in."""
    path = tmp_path / "cpu.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD.format(tests=str(Path(__file__).parent), kind=kind,
                                                                  path=str(path))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert _can_take(path, fcntl.LOCK_SH) is (kind == "shared")
        assert not _can_take(path, fcntl.LOCK_EX)
    finally:
        holder.communicate("\n", timeout=60)
    assert _can_take(path, fcntl.LOCK_EX)


def test_without_xdist_or_inside_a_held_lock_nothing_more_is_taken(tmp_path: Path) -> None:
    path = tmp_path / "cpu.lock"
    with cpu_share("exclusive", path):
        with cpu_share("shared", path):   # a heavy module's own test: no second lock, no self-deadlock
            assert not _can_take(path, fcntl.LOCK_SH)
    assert _can_take(path, fcntl.LOCK_EX)


class _Item:
    """What the collection check reads of a test: its marks and its function."""

    def __init__(self, function: Callable[[], None], *marks: str) -> None:
        self.function, self.marks = function, marks

    def get_closest_marker(self, name: str) -> str | None:
        return name if name in self.marks else None


def _real_build() -> None:
    pass


def _ray_cluster() -> None:
    Cluster = dict   # noqa: N806 -- a stand-in: the check reads the code, it never runs it
    Cluster(initialize_head=True)


def test_a_test_that_starts_vllm_or_ray_must_say_it_is_heavy() -> None:
    """Collection refuses a test that starts the real build (marked vllm, and not one_process) or a Ray cluster
    unless it is marked cpu_heavy."""
    assert heavy_without_its_mark(_Item(_real_build, "vllm"))  # type: ignore[arg-type]
    assert heavy_without_its_mark(_Item(_ray_cluster))  # type: ignore[arg-type]
    assert not heavy_without_its_mark(_Item(_ray_cluster, "cpu_heavy"))  # type: ignore[arg-type]
    assert not heavy_without_its_mark(_Item(_real_build, "vllm", "cpu_heavy"))  # type: ignore[arg-type]
    assert not heavy_without_its_mark(_Item(_real_build))  # type: ignore[arg-type]
    # The build's CLI run once (its flag list), no server: as heavy as any CPU-bound test.
    assert not heavy_without_its_mark(_Item(_real_build, "vllm", "one_process"))  # type: ignore[arg-type]


def test_every_test_file_has_its_seconds_for_the_order_the_workers_take(request: pytest.FixtureRequest) -> None:
    """tests/file_seconds.json names every test file (a new one counts 5 s until it is measured: add its line
    from a run's --durations=0), and the collection is in lock order: the real server's module first, no
    heavy file among the first ones, every test collected once."""
    items = request.session.items
    files = {item.nodeid.split("::")[0].removeprefix("tests/") for item in items}
    if len(files) < 10:
        pytest.skip("a partial collection (a file or -k): the whole suite's order is not there to check")
    missing = sorted(files - set(file_seconds()))
    assert not missing, f"add to tests/file_seconds.json: {missing}"
    order = list(dict.fromkeys(item.nodeid.split("::")[0] for item in items))
    assert order[0] == "tests/test_vllm_integration.py"
    assert "tests/test_ray.py" not in order[:3]
    assert sorted(item.nodeid for item in in_lock_order(items)) == sorted(item.nodeid for item in items)
