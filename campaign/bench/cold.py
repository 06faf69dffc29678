"""How large is the cold-server effect? A benchmark, not a test: `make bench-cold` (real vLLM CPU build).

Two fresh launches of the `cpu-tiny` profile. The first measures a 1,536-token prefill five times with no
warm-up; the second runs the campaign's warm-up first, then the same five prefills. The figure that matters
is the first reading against the median of the next four, beside the spread of those four (the noise): a
cold first cell is what the warm-up exists to remove.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from campaign.core import aio
from campaign.measure.cells import CellSpec
from campaign.measure.runner import Measurer
from campaign.night.launcher import launched
from campaign.server.profiles import load_profile

CONTEXT = 1536
READINGS = 5


def _prefills(warm: bool) -> list[float]:
    profile, _ = load_profile("cpu-tiny")
    spec = CellSpec(phase="prefill", context_tokens=CONTEXT)
    with tempfile.TemporaryDirectory() as folder, launched(profile, Path(folder) / "server.log") as server:
        measurer = Measurer(server.target())

        async def run() -> list[float]:
            if warm:
                await measurer.warm_up([spec, CellSpec(phase="decode", context_tokens=256, concurrency=4)])
            return [(await measurer.run_cell(spec)).prompt_tok_s or 0.0 for _ in range(READINGS)]

        return aio.run(run())


def main() -> None:
    rows = []
    for warm in (False, True):
        rates = _prefills(warm)
        later = statistics.median(rates[1:])
        spread = 100 * (max(rates[1:]) - min(rates[1:])) / later
        rows.append((warm, rates, 100 * (rates[0] - later) / later))
        print(f"{'with warm-up' if warm else 'cold (no warm-up)':<18} prompt tok/s at {CONTEXT:,}: "  # noqa: T201
              + ", ".join(f"{r:,.0f}" for r in rates)
              + f"  first vs median of the rest: {rows[-1][2]:+.1f}% (the rest spread {spread:.0f}%)")
    print(f"cold_first_pct={rows[0][2]:.1f} warm_first_pct={rows[1][2]:.1f}")  # noqa: T201


if __name__ == "__main__":
    main()
