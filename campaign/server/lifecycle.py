"""One server process and its whole tree: start in its own session, wait until ready, stop in stages.

The runner owns everything the server spawns. Stop escalates SIGINT -> SIGTERM -> SIGKILL to the process
group with bounded waits, then sweeps any descendant that escaped the group (a grandchild that called
setsid), checks that the port is free, and on a GPU machine waits until the GPU memory is released.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal

import httpx
import psutil

from campaign.core import secret
from campaign.core.errors import LaunchError, LaunchFailureKind
from campaign.server import gpu
from campaign.server.argv import LaunchSpec, port_is_free
from campaign.server.startup_log import classify_failure

FailOutcome = Literal["exited", "fatal_log_line", "deadline", "interrupted"]
StopMode = Literal["sigint", "sigterm", "sigkill", "already_exited"]


FIRST_POLL_S = 0.02   # the first wait between two readiness polls; each later one doubles, up to poll_s


@dataclass(frozen=True, kw_only=True)
class ReadyInfo:
    ready_s: float
    pid: int


@dataclass(frozen=True, kw_only=True)
class StopInfo:
    mode: StopMode
    exit_code: int | None
    stop_s: float
    swept: int
    port_free: bool
    gpu_memory_released: bool | None  # None: no NVML here, nothing to check


def executable_missing(executable: str, *, where: str = "", detail: str = "", unusable: bool = False
                       ) -> LaunchError:
    """The likeliest first error on a fresh GPU box: the profile's `vllm` is not on this PATH. Said the same
    whether found before the night (orchestrate.preflight) or when the process is started."""
    what = ("cannot be executed" if unusable else "does not exist" if "/" in executable else "is not on the PATH")
    return LaunchError(f"{where}{executable!r} {what}{detail}", kind="executable_not_found",
                       hint="activate the environment that has vLLM, or give its full path as the profile's "
                            "`executable`")


def log_tail(path: Path, lines: int = 40) -> str:
    """The log's last lines, every known secret redacted."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 64_000))
            text = handle.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
    return secret.redact("\n".join(text.splitlines()[-lines:]))


def scrub_log(path: Path) -> None:
    """The server log with every secret this process knows redacted, rewritten in place (atomically) when it
    held one. vLLM redacts --api-key and --hf-token in its own args line but prints the rest as given (a JSON
    flag's credentials, a URL's password); the server writes the file itself, so it is scrubbed once the server
    has stopped, by whoever stopped it."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return
    clean = secret.redact(text)
    if clean != text:
        tmp = path.with_name(f".{path.name}.scrub")
        tmp.write_text(clean)
        os.replace(tmp, path)


class ServerProcess:
    """Context manager: `with ServerProcess(spec, log) as server: server.wait_ready()`; always stopped."""

    def __init__(
        self,
        spec: LaunchSpec,
        log_path: Path,
        *,
        startup_timeout_s: float = 900.0,
        grace_sigint_s: float = 20.0,
        grace_sigterm_s: float = 10.0,
        poll_s: float = 0.5,
    ) -> None:
        self.spec = spec
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.grace_sigint_s = grace_sigint_s
        self.grace_sigterm_s = grace_sigterm_s
        self.poll_s = poll_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None
        self.stop_info: StopInfo | None = None
        self._stop_mode: StopMode = "already_exited"   # how far a stop has gone (kept if it is interrupted)
        # Every descendant ever seen: a grandchild that leaves the group is still ours to stop.
        self._seen: dict[int, psutil.Process] = {}

    # --- start -----------------------------------------------------------------------------------------
    def start(self) -> None:
        if not port_is_free(self.spec.host, self.spec.port):
            raise LaunchError(f"port {self.spec.port} on {self.spec.host} is already in use", kind="port_in_use",
                              hint="another server is running there; stop it or use `port: auto`")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            argv, env = self.spec.spawn_argv(), self.spec.child_env()
        except secret.UnsetReferenceError as exc:
            raise LaunchError(f"${{{exc.names[0]}}} is not set in the environment that launches the server",
                              kind="unresolved_flag",
                              hint=f"export {exc.names[0]} there (on Ray: on every node); the profile or matrix "
                                   "refers to it") from None
        log = self.log_path.open("ab")
        try:
            # One log file for both streams: vLLM logs to stdout, uvicorn to stderr.
            self.proc = subprocess.Popen(  # noqa: S603 - argv list, no shell
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        except (FileNotFoundError, PermissionError) as exc:
            raise executable_missing(self.spec.argv[0], detail=f" ({exc.strerror})",
                                     unusable=isinstance(exc, PermissionError)) from None
        except OSError as exc:  # out of memory or processes at fork, not an executable format
            raise LaunchError(f"{self.spec.argv[0]!r} could not be started: {exc.strerror or exc}", kind="exited",
                              hint="check the machine's free memory and process limits") from None
        finally:
            log.close()
        self.started_at = time.monotonic()
        self._remember_tree()

    @property
    def pid(self) -> int:
        assert self.proc is not None, "server not started"
        return self.proc.pid

    def _remember_tree(self) -> None:
        if self.proc is None:
            return
        try:
            root = psutil.Process(self.proc.pid)
            self._seen.setdefault(root.pid, root)
            for child in root.children(recursive=True):
                self._seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            # Anything still in the group counts too (the root may be gone while workers live on).
            pgid = self.proc.pid
            for proc in psutil.process_iter(["pid"]):
                with contextlib.suppress(psutil.Error):
                    if os.getpgid(proc.pid) == pgid:
                        self._seen.setdefault(proc.pid, proc)

    # --- ready -----------------------------------------------------------------------------------------
    def wait_ready(self) -> ReadyInfo:
        """Block until GET /health is 200. Raises LaunchError saying which of exit / fatal line / deadline won."""
        assert self.proc is not None and self.started_at is not None, "call start() first"
        deadline = self.started_at + self.startup_timeout_s
        url = "/health"
        scanned = 0
        # The first polls come quickly and then slow to poll_s: a server ready in half a second (the simulator)
        # is not kept waiting for a whole poll, and a real one's minute of start costs about five more requests.
        wait_s = FIRST_POLL_S
        with self.spec.endpoint().control(timeout_s=2.0) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    self._fail("exited", f"server exited with code {code} before it was ready")
                text, scanned = self._new_log_text(scanned)
                failure = classify_failure(text) if text else None
                if failure is not None and failure.kind != "crashed":
                    self._fail("fatal_log_line", f"{failure.kind}: {failure.message}", failure.kind,
                               failure.hint)
                try:
                    if client.get(url).status_code == 200:
                        self._remember_tree()
                        return ReadyInfo(ready_s=time.monotonic() - self.started_at, pid=self.proc.pid)
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    self._fail("deadline", f"server not ready after {self.startup_timeout_s:.0f} s",
                               hint="raise startup_timeout_s in the launch profile if the model is large")
                self._remember_tree()
                time.sleep(min(wait_s, self.poll_s))
                wait_s *= 2

    def _new_log_text(self, offset: int) -> tuple[str, int]:
        """The log's whole lines from `offset` on, and the offset just past the last of them: a line still being
        written is read whole on a later call (a WARNING line cut before its level would read as a line no
        logger levelled, and a fatal line cut in two would match in neither half)."""
        try:
            with self.log_path.open("rb") as handle:
                handle.seek(offset)
                data = handle.read()
        except FileNotFoundError:
            return "", offset
        whole = data.rfind(b"\n") + 1
        return data[:whole].decode("utf-8", "replace"), offset + whole

    def _fail(self, outcome: FailOutcome, message: str, kind: LaunchFailureKind | None = None,
              hint: str | None = None) -> None:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        failure = classify_failure(text)
        kind = kind or (failure.kind if failure else outcome)
        if failure is not None and hint is None:
            hint = failure.hint
        if failure is not None and failure.message not in message:
            message = f"{message}: {failure.message}"
        tail = log_tail(self.log_path)
        raise LaunchError(f"{message} ({outcome})", kind=kind, log_tail=tail, hint=hint)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # --- stop ------------------------------------------------------------------------------------------
    def stop(self) -> StopInfo:
        """Stop the whole tree. Safe to call twice; the second call returns the first result. An interrupt
        in the middle (a second Ctrl-C, or Ray cancelling the task that owns the server as it was stopping
        it) never leaves the stop half done and unrecorded: the tree is killed outright, the stop recorded,
        and the interrupt raised after."""
        if self.stop_info is not None:
            return self.stop_info
        assert self.proc is not None, "server not started"
        began = time.monotonic()
        try:
            self._signal_until_gone()
            return self._finish_stop(self._stop_mode, began)
        except KeyboardInterrupt:
            self._remember_tree()
            if self.proc.poll() is None or self._group_alive():
                self._stop_mode = "sigkill"
                self._signal_group(signal.SIGKILL)
                self._wait_gone(10.0)
            self._finish_stop(self._stop_mode, began)
            raise

    def _signal_until_gone(self) -> None:
        """SIGINT, then SIGTERM, then SIGKILL to the group, each after the last's grace; `_stop_mode` says
        how far it went, also when interrupted."""
        assert self.proc is not None
        self._remember_tree()
        if self.proc.poll() is None or self._group_alive():
            for sig, grace, name in (
                (signal.SIGINT, self.grace_sigint_s, "sigint"),
                (signal.SIGTERM, self.grace_sigterm_s, "sigterm"),
                (signal.SIGKILL, 10.0, "sigkill"),
            ):
                self._stop_mode = name  # type: ignore[assignment]
                self._signal_group(sig)
                if self._wait_gone(grace):
                    break

    def _finish_stop(self, mode: StopMode, began: float) -> StopInfo:
        """Reap, sweep what left the group, wait for the port and the GPU memory; record how it stopped."""
        assert self.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        swept = self._sweep()
        port_free = self._wait_port_free(10.0)
        gpu_released = gpu.wait_released({p for p in self._seen}, timeout_s=30.0)
        scrub_log(self.log_path)
        self.stop_info = StopInfo(
            mode=mode, exit_code=self.proc.returncode, stop_s=time.monotonic() - began, swept=swept,
            port_free=port_free, gpu_memory_released=gpu_released,
        )
        return self.stop_info

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)
        if sig == signal.SIGKILL:
            for proc in self._seen.values():
                with contextlib.suppress(psutil.Error):
                    proc.kill()

    def _group_alive(self) -> bool:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        # Zombies of the group (reaped by nobody yet) still answer signal 0; only living ones count.
        return any(_running(p) for p in self._seen.values() if _pgid(p) == self.proc.pid)

    def _wait_gone(self, timeout_s: float) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.proc.poll()  # reap the root so it does not linger as a zombie
            self._remember_tree()
            if not self._group_alive():
                return True
            time.sleep(0.1)
        return not self._group_alive()

    def _sweep(self) -> int:
        """Kill every remembered descendant still running (e.g. one that left the group). Returns how many."""
        survivors = [p for p in self._seen.values() if _running(p)]
        for proc in survivors:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(survivors, timeout=5)
        return len(survivors)

    def _wait_port_free(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not port_is_free(self.spec.host, self.spec.port):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    # --- context manager -------------------------------------------------------------------------------
    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Also on KeyboardInterrupt: Ctrl-C during a launch still tears the server down.
        if self.proc is not None:
            self.stop()


def _die_with_parent() -> None:
    """In the child before exec: if the controller is killed outright (SIGKILL, OOM), the server gets
    SIGTERM instead of living on unowned in its own session. Linux only; elsewhere a no-op. Also the stop
    signals as a fresh process has them: a blocked or ignored signal survives exec, and a Ray worker blocks
    SIGINT, so every server it launched sat out the 20 s SIGINT grace and was stopped by SIGTERM."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    parent_death_signal()


def parent_death_signal(sig: signal.Signals = signal.SIGTERM) -> None:
    """Ask the kernel for `sig` when this process's parent dies (Linux's PR_SET_PDEATHSIG; elsewhere a no-op)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, sig)
    except (OSError, AttributeError):
        pass


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _pgid(proc: psutil.Process) -> int | None:
    try:
        return os.getpgid(proc.pid)
    except (ProcessLookupError, PermissionError):
        return None
