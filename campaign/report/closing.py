"""The night's last words: the stored run analysed (drift, the diff, the short answers, the GPU effect), the
summary and the HTML report written beside it, and the text the console shows, the verdict last where the eye
lands. It reads the stored run only; `campaign run` prints what it returns."""

from __future__ import annotations

from campaign.analysis import recommend, summary
from campaign.report import html as html_report
from campaign.report import text as report
from campaign.stored.store import RunDir


def night_end(run_dir: RunDir, *, with_report: bool = True) -> str:
    """Analyse the finished run, write summary.json and (`with_report`) the report, and return the console's
    text."""
    lines: list[str] = []
    say = lines.append
    drift = summary.drift(run_dir)
    diffs = recommend.diff_run(run_dir)
    short = recommend.short_answers_by_variant(run_dir)
    stored_manifest = run_dir.manifest()
    scale = stored_manifest.time_scale
    if scale != 1.0:
        say(f"SIMULATED at a {scale:g}x time scale: every figure is the simulated hardware's, converted "
            f"from a wall clock {scale:g}x faster.\n")
    if stored_manifest.clock == "virtual":
        left = "; ".join(stored_manifest.not_replayed)
        say("SIMULATED in simulated time: the engine replayed, figures in the hardware's units"
            + (f"; not replayed: {left}" if left else "") + "\n")
    stored, servers = run_dir.cells(), run_dir.servers()   # read once: the tables and the verdict share them
    say(report.cells_by_variant_text(stored, servers))
    say("")
    for variant, values in short.items():
        say(report.short_answers_text(variant, values) + "\n")
    experiments = report.experiments_text(run_dir.experiments())
    if experiments:
        say(experiments + "\n")
    say(report.diff_text(diffs))
    say("")
    say(f"drift: {drift.message}")
    effect = summary.gpu_effect(run_dir)
    if effect.checked:
        say(f"GPU effect: {effect.message}")
    run_dir.write_summary(summary.summary_record(run_dir, drift_=drift, diffs=diffs, short=short))
    written = html_report.write(run_dir) if with_report else None
    # The answer last, where the eye lands (the reports open with the same lines).
    verdict = report.verdict_table(diffs, drift=drift.message, latest=report.latest_cells(stored),
                                   servers=servers, short=short)
    say("\n== Verdict ==\n" + "\n".join(report.verdict_lines(verdict)))
    say(f"results: {run_dir.root}")
    say(f"report: {written[0]}" if written else f"report: not written (--no-report); campaign report {run_dir.root}")
    return "\n".join(lines)
