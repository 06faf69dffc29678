"""One launch of a run, in its own process: what a GPU pool's controller starts for each slot.

`python -m campaign.night.worker RUN_DIR VARIANT REPEAT --gpus 0,1 [--cores 0,1] [--engine sim]` rebuilds the run
from its manifest (as --resume does), launches the variant on those GPUs (CUDA_VISIBLE_DEVICES, a port of
its own), measures what of that launch is not stored yet, stops the server, and exits. Progress goes to
stdout as JSON lines ({"event": "note" | "cell" | "status", "text": ...}) for the controller to relay. The
controller holds the run's lock; every file a worker writes has a name no other launch uses.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from campaign.core import secret
from campaign.core.console import buffered_stdio
from campaign.core.errors import CampaignError, request_stop
from campaign.core.progress import Progress
from campaign.night.launch import Campaign, Options, pending_launches
from campaign.server.lifecycle import parent_death_signal
from campaign.stored import store


class RelayProgress(Progress):
    """Progress as JSON lines on stdout, for the controller's display."""

    def __init__(self, prefix: str) -> None:
        super().__init__(total_cells=0, estimate_s=0.0, live=False)
        self.prefix = prefix

    def _emit(self, event: str, text: str) -> None:
        sys.stdout.write(json.dumps({"event": event, "text": f"{self.prefix}{text}"}) + "\n")
        sys.stdout.flush()

    def status(self, message: str) -> None:
        self._emit("status", message)

    def note(self, message: str) -> None:
        self._emit("note", message)

    def cell_done(self, message: str) -> None:
        self._emit("cell", message)


def _interrupt_once(signum: int, frame: object) -> None:
    """Ctrl-C reaches a worker twice (from the terminal's process group, and from the controller stopping
    its workers); SIGTERM comes when the controller dies (its parent-death signal). The first starts the
    launch's clean-up, as in the serial runner; a second must not cut the server's stop short."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    request_stop(signum, frame)


def _indices(text: str | None) -> list[int] | None:
    return None if not text else [int(part) for part in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="campaign.night.worker")
    parser.add_argument("root")
    parser.add_argument("variant")
    parser.add_argument("repeat", type=int)
    parser.add_argument("--gpus", required=True)
    parser.add_argument("--cores")
    parser.add_argument("--engine")
    parser.add_argument("--parent", type=int, help="the controller's pid: this worker stops when it dies")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, _interrupt_once)
    signal.signal(signal.SIGTERM, _interrupt_once)
    if args.parent is not None:
        # A controller killed outright takes its workers along (each then stops its server and records it),
        # so no orphan goes on measuring into a run that a resume writes again. Asked for here, not in a
        # preexec_fn (unsafe beside the controller's reader threads); a parent already gone is checked after.
        parent_death_signal()
        if os.getppid() != args.parent:
            return 1
    gpus = _indices(args.gpus)
    progress = RelayProgress(f"[GPU {args.gpus}] ")
    try:
        run = store.RunDir(Path(args.root))
        stored = run.manifest()
        matrix = stored.matrix_model()
        matrix = matrix.model_copy(update={"repeats": run.repeats(matrix.repeats)})
        work = next((w for w in pending_launches(run, matrix)
                     if w.variant == args.variant and w.repeat == args.repeat), None)
        if work is None:
            return 0  # stored already (a resume raced ahead of the plan): nothing to do
        options = Options(engine=args.engine or stored.engine, max_attempts=matrix.max_attempts, gpus=gpus,
                          executor="pool", client_cores=_indices(args.cores))
        Campaign(run, matrix, stored.profile_model(), options=options, progress=progress).serve(work)
    except KeyboardInterrupt:
        return 130
    except CampaignError as exc:
        if os.environ.get("CAMPAIGN_DEBUG") == "1":
            raise
        progress.note(f"{args.variant} r{args.repeat + 1}: Error: {exc.message}")
        return 1
    return 0


if __name__ == "__main__":
    buffered_stdio()   # its progress lines go to the controller through a pipe, as probe --json does
    secret.redact_stdio()   # what it expands (a `${NAME}`) it redacts from its lines before they leave
    sys.exit(main())
