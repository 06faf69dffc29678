"""The server lifecycle against small child programs: every failure ends with the right error and no process left."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from campaign.cli import run_cli
from campaign.core.errors import LaunchError
from campaign.core.hardware import LONG_MODEL_LEN_ENV
from campaign.measure.cells import CellSpec, past_model_window
from campaign.server.argv import LaunchSpec, free_port, port_is_free
from campaign.server.lifecycle import ServerProcess
from campaign.server.profiles import PROJECT_ROOT
from campaign.server.startup_log import classify_failure

CHILD = Path(__file__).parent / "fakes" / "child_server.py"


def spec_for(mode: str, *extra: str) -> LaunchSpec:
    port = free_port()
    return LaunchSpec(argv=[sys.executable, str(CHILD), mode, "--port", str(port), *extra], env_overrides={},
                      host="127.0.0.1", port=port, served_model_name="fake", flags={})


def server_for(spec: LaunchSpec, tmp_path: Path, **kwargs: float) -> ServerProcess:
    options = {"startup_timeout_s": 20.0, "grace_sigint_s": 2.0, "grace_sigterm_s": 2.0, "poll_s": 0.1}
    options.update(kwargs)
    return ServerProcess(spec, tmp_path / "server.log", **options)


def assert_gone(pids: set[int]) -> None:
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"processes left behind: {alive}"


def test_ready_then_clean_stop(tmp_path: Path) -> None:
    spec = spec_for("ready")
    with server_for(spec, tmp_path) as server:
        info = server.wait_ready()
        pid = info.pid
        assert info.ready_s > 0
    stop = server.stop_info
    assert stop is not None and stop.mode == "sigint" and stop.port_free
    assert stop.gpu_memory_released is None  # no NVML on this machine: nothing to check, not "True"
    assert_gone({pid})
    assert port_is_free(spec.host, spec.port)


def test_never_ready_hits_the_deadline(tmp_path: Path) -> None:
    spec = spec_for("never-ready")
    server = server_for(spec, tmp_path, startup_timeout_s=1.5)
    with pytest.raises(LaunchError) as caught, server:
        server.wait_ready()
    assert caught.value.kind == "deadline"
    assert "(deadline)" in caught.value.message
    assert "mode=never-ready" in caught.value.log_tail
    assert_gone({server.pid})


def test_exit_during_startup_says_it_exited(tmp_path: Path) -> None:
    server = server_for(spec_for("exit-early"), tmp_path)
    with pytest.raises(LaunchError) as caught, server:
        server.wait_ready()
    assert "exited with code 3" in caught.value.message
    assert "(exited)" in caught.value.message
    assert "something went wrong" in caught.value.log_tail
    assert server.stop_info is not None and server.stop_info.mode == "already_exited"


def test_fatal_log_line_ends_the_wait_early(tmp_path: Path) -> None:
    server = server_for(spec_for("fatal-line"), tmp_path, startup_timeout_s=30.0)
    began = time.monotonic()
    with pytest.raises(LaunchError) as caught, server:
        server.wait_ready()
    assert time.monotonic() - began < 15
    assert caught.value.kind == "kv_cache_insufficient"
    assert "(fatal_log_line)" in caught.value.message
    assert_gone({server.pid})


def test_server_ignoring_sigint_and_sigterm_is_killed(tmp_path: Path) -> None:
    spec = spec_for("ignore-signals")
    with server_for(spec, tmp_path, grace_sigint_s=0.5, grace_sigterm_s=0.5) as server:
        server.wait_ready()
    assert server.stop_info is not None
    assert server.stop_info.mode == "sigkill"
    assert server.stop_info.exit_code == -9
    assert_gone({server.pid})
    assert port_is_free(spec.host, spec.port)


def test_grandchild_that_left_the_group_is_swept(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    spec = spec_for("grandchild", "--pidfile", str(pidfile))
    with server_for(spec, tmp_path) as server:
        server.wait_ready()
        grandchild = int(pidfile.read_text())
        assert psutil.pid_exists(grandchild)
    assert server.stop_info is not None and server.stop_info.swept >= 1
    assert_gone({server.pid, grandchild})


def test_port_in_use_is_refused_before_launch(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        spec = LaunchSpec(argv=[sys.executable, str(CHILD), "ready", "--port", str(port)], env_overrides={},
                          host="127.0.0.1", port=port, served_model_name="fake", flags={})
        with pytest.raises(LaunchError) as caught:
            ServerProcess(spec, tmp_path / "log").start()
    assert caught.value.kind == "port_in_use"


def test_keyboard_interrupt_during_launch_still_tears_down(tmp_path: Path) -> None:
    server = server_for(spec_for("never-ready"), tmp_path)
    with pytest.raises(KeyboardInterrupt), server:
        time.sleep(0.3)
        raise KeyboardInterrupt
    assert server.stop_info is not None
    assert_gone({server.pid})


def test_an_interrupt_in_the_middle_of_a_stop_still_stops_and_records_it(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray cancels a task with a KeyboardInterrupt, and one landed while that task was stopping its server:
    the stop was left half done, with no stop record (a full run caught a launch without stop.json). Now the
    tree is killed outright, the stop recorded, and the interrupt raised after. The interrupt lands at a
    known point, the first wait of SIGINT's grace: a timer's `_thread.interrupt_main` (the first form of this
    test) was lost twice in full suites, swallowed where the main thread happened to be (a stop that then
    ran its whole 10 s of grace, interrupt never seen), so the place it lands is now the test's, not the host's."""
    spec = spec_for("ignore-signals")
    server = server_for(spec, tmp_path, grace_sigint_s=5.0, grace_sigterm_s=5.0)
    server.start()
    try:
        server.wait_ready()
        waits = server._wait_gone
        calls = []

        def interrupted(timeout_s: float) -> bool:
            calls.append(timeout_s)
            if len(calls) == 1:   # inside SIGINT's grace, the child still ignoring it
                time.sleep(0.5)
                raise KeyboardInterrupt
            return waits(timeout_s)

        monkeypatch.setattr(server, "_wait_gone", interrupted)
        began = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            server.stop()
        assert time.monotonic() - began < 4.0      # not the grace: killed at the interrupt
        assert calls[0] == 5.0 and server.stop_info is not None and server.stop_info.mode == "sigkill"
        assert_gone({server.pid})
        assert port_is_free(spec.host, spec.port)
    finally:
        server.stop()  # a no-op once stopped; a failed check above must not leave the child running


def test_a_window_past_the_models_launches_when_vllm_is_told_to_allow_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Seed 004's H200 profile with max-model-len 300,000, past Qwen3.5-27B's 262,144: with
    VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 in the profile's env the simulated vLLM 0.32 warns, in the words of the
    error it raises without it, and serves; the launch reads the warning as what it is. (The real CPU build
    does the same: tests/fixtures/logs/cpu_v0.32_tiny_long_window_allowed.log, and the n-gram night of
    test_vllm_integration launches it so.)"""
    data = yaml.safe_load((PROJECT_ROOT / "launch_profiles" / "h200.yaml").read_text())
    data["env"][LONG_MODEL_LEN_ENV] = "1"
    data["flags"]["max-model-len"] = 300_000
    profile = tmp_path / "h200-long.yaml"
    profile.write_text(yaml.safe_dump(data))
    log = tmp_path / "server.log"
    capsys.readouterr()
    assert run_cli(["launch", str(profile), "--engine", "sim", "--once", "--log", str(log)]) == 0, \
        capsys.readouterr().err
    out, err = capsys.readouterr()
    assert "max model len                         300,000" in out + err, out + err
    warned = [line for line in log.read_text().splitlines() if "User-specified max_model_len (300000)" in line]
    assert len(warned) == 1 and " WARNING " in warned[0]


def test_a_cell_past_the_models_own_window_says_so_when_the_server_dies_there() -> None:
    """The failed cell's reason names the model's window (the startup log's model_window) where its longest
    request reaches past it, and says nothing of it where it does not or the window is unknown."""
    long_cell = CellSpec(phase="decode", context_tokens=270_000, concurrency=1, max_tokens=256, mode="fixed")
    short_cell = long_cell.model_copy(update={"context_tokens": 8192})
    said = past_model_window(long_cell, 262_144)
    assert said == ("; its longest request (prompt 270,000 + reply 256 tokens) reaches past the model's own window "
                    "of 262,144 tokens, which max-model-len stretches with VLLM_ALLOW_LONG_MAX_MODEL_LEN: positions "
                    "past it can crash the engine")
    assert past_model_window(short_cell, 262_144) == "" and past_model_window(long_cell, None) == ""


def test_the_log_is_read_in_whole_lines_however_its_writes_fall(tmp_path: Path) -> None:
    """wait_ready reads what the server logged since its last look. A line still being written is read whole
    later: a WARNING cut before its level would read as unlevelled, and a fatal line longer than any overlap
    (vLLM's pydantic ValueError runs to kilobytes) cut in two would match in neither half."""
    server = server_for(spec_for("ready"), tmp_path)
    log = tmp_path / "server.log"
    warning = ("(APIServer pid=7) WARNING 12-06 01:16:17 [model.py:2660] User-specified max_model_len (40960) is "
               "greater than the derived max_model_len (max_position_embeddings=32768.0 or model_max_length=None "
               "in model's config.json).\n")
    fatal = ("Value error, User-specified max_model_len (40960) is greater than the derived max_model_len "
             "(max_position_embeddings=32768.0 or model_max_length=None in model's config.json). "
             + "x" * 4200 + "\n")
    text, seen = "", 0
    for piece in (warning[:30], warning[30:] + fatal[:4250], fatal[4250:]):
        with log.open("a") as handle:
            handle.write(piece)
        new, seen = server._new_log_text(seen)
        assert new.endswith("\n") or new == ""   # whole lines only
        assert not new or classify_failure(new) is None or new.startswith("Value error")
        text += new
    assert text == warning + fatal and seen == len((warning + fatal).encode())
    failure = classify_failure(fatal)
    assert failure is not None and failure.kind == "bad_argument"
