"""Reports from stored run directories: HTML opened in a real headless Chromium, Markdown, PNG charts."""

from __future__ import annotations

import html
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml
from fakes import builders
from PIL import Image

from campaign.cli import run_cli
from campaign.measure.cells import CellResult, CellSpec
from campaign.plan import planning
from campaign.report import closing, names, tables
from campaign.report import html as html_report
from campaign.report import text as report
from campaign.stored import store

FIXTURE_RUN = Path(__file__).parent / "fixtures" / "runs" / "cpu-demo"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture()
def run_dir(tmp_path: Path) -> store.RunDir:
    """A real demo run of the CPU build (request records trimmed), plus a variant with an over-capacity cell,
    a failed cell and a launch that never became ready, written the way the runner writes them."""
    root = tmp_path / "run"
    shutil.copytree(FIXTURE_RUN, root)
    run = store.RunDir(root)
    launch = run.new_launch_dir("tight")
    builders.server(launch, variant="tight", flags={"kv-cache-memory-bytes": "4M"}, ready_s=40.0,
                    facts={"vllm_version": "0.32.0", "device": "CPU", "kv_cache_tokens": 8192, "block_size": 128})
    over = CellSpec(phase="decode", context_tokens=512, concurrency=4, max_tokens=64, window_s=4, warmup_s=0.5)
    failed = CellSpec(phase="decode", context_tokens=512, concurrency=1, max_tokens=64, window_s=4, warmup_s=0.5)
    for spec, status, reason in ((over, "Over capacity", "not run: 4 x (512 + 64) tokens exceed 8,192"),
                                 (failed, "Failed", "1 of 1 requests failed: EngineCore encountered an issue")):
        run.write_cell("tight", 0, CellResult(spec=spec, phase="decode", context_tokens=512,
                                              concurrency=spec.concurrency, label=spec.label, status=status,
                                              reasons=[reason]), launch=launch.name, telemetry=None)
    broken = run.new_launch_dir("broken")
    builders.failure(broken, variant="broken", kind="bad_argument", message="unrecognized arguments",
                     log_tail="error: unrecognized arguments")
    return run


def stored_valid_cell(run: store.RunDir) -> CellResult:
    """The baseline's latest stored decode cell: the one the report's matrix shows."""
    cells = [s for s in run.cells() if s.variant == "baseline" and s.result.phase == "decode"]
    return max(cells, key=lambda s: s.repeat).result


@pytest.mark.browser
def test_html_report_in_a_real_browser(run_dir: store.RunDir, tmp_path: Path) -> None:
    if CHROMIUM is None:
        pytest.fail("Chromium is not installed: run `make chromium` (Debian's package)")
    from playwright.sync_api import sync_playwright

    from campaign.report import plots

    paths = html_report.write(run_dir)
    page_path = paths[0]
    assert page_path.name == "report.html" and all(p.exists() for p in paths)
    text = page_path.read_text()
    assert "http://" not in text.replace("http://127.0.0.1", "") and "https://" not in text  # nothing to fetch
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1300, "height": 2000})
        errors: list[str] = []
        requests: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: requests.append(r.url))
        page.goto(page_path.as_uri())
        page.wait_for_load_state("load")
        assert errors == []
        assert [r for r in requests if not r.startswith(("file://", "data:"))] == []
        # The matrix cells show the stored numbers.
        cell = stored_valid_cell(run_dir)
        texts = page.locator("table.heat td.cell").all_inner_texts()
        assert any(t.startswith(f"{cell.total_tok_s:,.1f} tok/s") for t in texts), texts
        assert "Over capacity" in texts and "Failed" in texts
        reason = page.locator("td.bad", has_text="Failed").first.get_attribute("title")
        assert reason is not None and "EngineCore encountered an issue" in reason
        assert page.locator("text=FAILED TO START (bad_argument)").count() >= 1
        assert page.locator("img").count() >= 3
        # Every image loads and says what it shows; the frontier is among them (issue 53).
        assert page.evaluate("[...document.images].every(i => i.complete && i.naturalWidth > 0 && i.alt)")
        assert page.locator('img[alt="The frontier: tok/s per GPU against tok/s per user"]').count() == 1
        assert page.locator("text=How this was measured").count() == 1
        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=True)
        # Issue 18: at a desktop's and a phone's width the Verdict is the first thing below the title, in view
        # without scrolling, with a forest plot per variant, and nothing wider than the screen but the tables'
        # own scrolling.
        diffs = html_report.gather(run_dir).diffs
        for width, height in ((1280, 900), (390, 844)):
            small = browser.new_page(viewport={"width": width, "height": height})
            small.goto(page_path.as_uri())
            small.wait_for_load_state("load")
            first = small.evaluate("document.querySelector('h1').nextElementSibling.id")
            assert first == "verdict", width
            assert small.locator("#verdict h2").inner_text() == "Verdict"
            top = small.evaluate("document.querySelector('#verdict table').getBoundingClientRect().top")
            assert 0 < top < height / 2, (width, top)
            # Each forest plot draws only what has something to compare (the rest is listed under it).
            assert all(row.change_pct is not None for d in diffs
                       for row in plots.forest_layout(d, noise_pct=3.0).rows)
            alts = small.locator("#verdict img").evaluate_all("els => els.map(e => e.alt)")
            # A variant that never started has nothing to draw (its figures are listed, never drawn at 0).
            assert alts == [f"Change against the baseline with 95% intervals: {d.variant} vs {d.baseline}"
                            for d in diffs if d.variant != "broken"] and len(alts) == 3, alts
            assert small.evaluate("document.documentElement.scrollWidth") <= width, width
            verdicts = small.locator("#verdict table td:nth-child(2)").all_inner_texts()
            assert verdicts == [d.outcome + (", provisionally" if d.provisional else "") for d in diffs]
            # Issue 53: each verdict in one sentence, the whole reasoning one click away, and the verdict
            # table needs no sideways scroll.
            said = small.locator("#verdict table td:nth-child(3)")
            assert said.evaluate_all("els => els.map(e => e.firstChild.textContent)") == [
                names.named(d.headline) for d in diffs]
            folded = small.locator("#verdict table td:nth-child(3) details")
            assert folded.count() == len(diffs) and not folded.first.evaluate("e => e.open")
            assert folded.evaluate_all("els => els.map(e => e.lastChild.textContent)") == [
                names.named(d.recommendation) for d in diffs]
            table = small.locator("#verdict table")
            assert table.evaluate("t => t.scrollWidth <= t.clientWidth && t.getBoundingClientRect().right") <= width
            # What the verdict rests on, the diff's per-cell verdicts, needs no sideways scroll either (a card a
            # row on a phone); at a desktop's width no table does.
            scrolled = small.evaluate("""[...document.querySelectorAll(
                'table')].filter(t => t.scrollWidth > t.clientWidth + 1).map(t => t.className)""")
            assert "stack" not in scrolled and (width < 700 or scrolled == []), (width, scrolled)
            small.screenshot(path=str(tmp_path / f"report-{width}.png"))
            assert (tmp_path / f"report-{width}.png").stat().st_size > 20_000
            small.close()
        browser.close()
    assert shot.stat().st_size > 50_000
    assert page_path.stat().st_size < html_report.PAGE_BUDGET_BYTES


def test_png_charts_are_non_trivial(run_dir: store.RunDir, tmp_path: Path) -> None:
    paths = html_report.write(run_dir, fmt="png", out=tmp_path / "charts")
    names = {p.name for p in paths}
    assert {"throughput.png", "prefill_vs_context.png", "agents_that_fit.png", "frontier.png"} <= names
    for path in paths:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        with Image.open(path) as image:   # a chart, not a blank: wide, and drawn in many colours
            assert image.width >= 500 and len(image.getcolors(256) or []) >= 16, path.name


def test_markdown_has_the_same_tables(run_dir: store.RunDir, tmp_path: Path) -> None:
    path = html_report.write(run_dir, fmt="md", out=tmp_path / "report.md")[0]
    text = path.read_text()
    assert "Short answers: baseline" in text and "Over capacity" in text
    assert "recommendation:" in text and "single-stream" in text and "aggregate" in text
    assert "```" not in text  # real Markdown tables, not text in code fences
    assert "| Context | 1 (single-stream) | 4 (aggregate) |\n|---|---:|---:|" in text
    assert "| TTFT p99 | ITL p99 | TPOT | E2E p99 |" in text


def test_the_verdict_opens_the_markdown_and_ends_the_console_in_the_same_words(
        run_dir: store.RunDir, tmp_path: Path) -> None:
    """One line per variant (keep, revert, no difference, not settled, and why) and the run's health: the
    Markdown report opens with them, right below its title, and `campaign run` ends with them."""
    data = html_report.gather(run_dir)
    lines = report.verdict_lines(html_report.verdict(data))
    by_variant = {d.variant: d for d in data.diffs}
    floors = {v: report.floor_capacity(data.short.get(d.baseline), data.short.get(v)) for v, d in by_variant.items()}
    assert floors == {"broken": "—", "small-cache": "4 -> 4 at 40 stream tok/s",
                      "small-chunk": "4 -> 4 at 40 stream tok/s", "tight": "—"}
    # The stored sentence names fields; the verdict shows them by their names (campaign.report.names).
    # A line a variant with its verdict in one sentence, and the whole reasoning on an indented line under it.
    assert lines[:8:2] == [f"{v}: {d.outcome}{', provisionally' if d.provisional else ''}: "
                           f"{names.named(d.headline)}"
                           + ("" if floors[v] == "—" else f" [streams at the floor: {floors[v]}]")
                           for v, d in by_variant.items()]
    assert lines[1:8:2] == [f"  why: {names.named(d.recommendation)}" for d in by_variant.values()]
    assert lines[2] == ("small-cache: revert: KV cache -93.8% (agents at 8K context: none, beyond the 2,048-token "
                        "window) [streams at the floor: 4 -> 4 at 40 stream tok/s]")
    assert lines[3].startswith("  why: kv-cache-memory-bytes 1G -> 64M: KV cache -93.8%")
    assert lines[6].startswith("tight: revert, provisionally: ")
    assert lines[8].startswith("drift: baseline moved +8.6%")
    assert lines[9] == ("cells not Valid: 2 of 11 (1 Failed; 1 Over capacity); where: tight "
                        "decode-sustained-L512-C1-N64-W4, tight decode-sustained-L512-C4-N64-W4")
    assert lines[10] == "launch failed: broken: FAILED TO START (bad_argument): unrecognized arguments"
    path = html_report.write(run_dir, fmt="md", out=tmp_path / "report.md")[0]
    head = path.read_text().split("\n\n")
    assert head[1] == "## Verdict"
    assert head[2].splitlines() == [("  - " if line.startswith("  why: ") else "- ") + tables.md_escape(line)
                                    for line in lines]
    assert head[3].startswith("![Change against the baseline with 95% intervals: small-cache vs baseline](forest-")
    assert all((tmp_path / f"forest-{d}.png").stat().st_size > 5_000 for d in by_variant if d != "broken")
    assert not (tmp_path / "forest-broken.png").exists()
    out = closing.night_end(run_dir)
    assert out.split("== Verdict ==\n", 1)[1].splitlines()[:len(lines)] == lines
    assert out.splitlines()[-1] == f"report: {run_dir.root / 'report' / 'report.html'}"
    assert (run_dir.root / "report" / "report.html").exists()
    # `campaign run --no-report`: the same verdict and summary, no report and its charts, and how to write them.
    shutil.rmtree(run_dir.root / "report")
    (run_dir.root / "summary.json").unlink()
    bare = closing.night_end(run_dir, with_report=False)
    assert bare.splitlines()[:-1] == out.splitlines()[:-1]
    assert bare.splitlines()[-1] == f"report: not written (--no-report); campaign report {run_dir.root}"
    assert (run_dir.root / "summary.json").exists() and not (run_dir.root / "report").exists()


def test_a_forest_plot_needs_something_to_show_and_says_when_it_cannot_compare(tmp_path: Path) -> None:
    from campaign.analysis.statistics import MetricVerdict
    from campaign.analysis.verdicts import CellDiff, VariantDiff
    from campaign.report import plots

    empty = VariantDiff(variant="v", baseline="b", flag_changes=[], fact_changes=[], cells=[],
                        comparable=True)
    assert plots.forest(empty, tmp_path / "none.png", noise_pct=3.0) is None
    metric = MetricVerdict(metric="total_tok_s", baseline=100.0, variant=90.0, change_pct=-10.0,
                           ci95_pct=(-900.0, 880.0), n_baseline=3, n_variant=3, verdict="not comparable")
    cell = CellDiff(key="decode-x", phase="decode", context_tokens=512, concurrency=1, label="single-stream",
                    metrics=[metric])
    apart = VariantDiff(variant="v", baseline="b", flag_changes=[], fact_changes=[("kv_cache_tokens", 1, 2,
                                                                                  100.0)],
                        cells=[cell], comparable=False, not_comparable_reason="different GPU models")
    path = plots.forest(apart, tmp_path / "apart.png", noise_pct=3.0)
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_forest_plot_fits_what_was_decided_cuts_noise_at_its_edge_and_lists_what_has_nothing_to_compare(
        ) -> None:
    """Issue 53: a figure with nothing to compare is listed under the plot, never drawn at 0 (where the eye
    reads "no change"); the axis fits every decided change but cuts an undecided one (a noisy TTFT's +760%) at
    100%, its value printed where it was cut, so a real -67% is not a dot near zero; launch facts (exact) are
    a panel of their own."""
    from campaign.analysis.statistics import MetricVerdict
    from campaign.analysis.verdicts import CellDiff, VariantDiff
    from campaign.report import plots

    def metric(name: str, change: float | None, ci: tuple[float, float] | None, verdict: str) -> MetricVerdict:
        return MetricVerdict(metric=name, baseline=1.0, variant=None if change is None else 1 + change / 100,
                             change_pct=change, ci95_pct=ci, n_baseline=2, n_variant=2 if change is not None else 0,
                             verdict=verdict)  # type: ignore[arg-type]

    prefill = CellDiff(key="prefill-L1536", phase="prefill", context_tokens=1536, concurrency=1, label="prefill",
                       metrics=[metric("prompt_tok_s", -67.5, (-91.0, -44.0), "worse"),
                                metric("ttft_ms", 760.0, (-7944.0, 9473.0), "not settled")])
    burst = CellDiff(key="overload-x1.25", phase="experiment", context_tokens=0, concurrency=0, label="experiment",
                     metrics=[metric("errored", None, None, "not judged")])
    diff = VariantDiff(variant="v", baseline="b", flag_changes=[], cells=[prefill, burst], comparable=True,
                       fact_changes=[("max_num_batched_tokens", 2048, 64, -96.9)])
    layout = plots.forest_layout(diff, noise_pct=3.0)
    assert layout.edge == 100.0 and layout.nothing == ["overload-x1.25 (errored)"]
    assert layout.facts == [("max_num_batched_tokens", -96.9)]
    worse, ttft = layout.rows
    assert (worse.change_pct, worse.interval, worse.cut, worse.change_cut) == (-67.5, (-91.0, -44.0), (None, None),
                                                                               None)
    assert (ttft.change_pct, ttft.interval, ttft.cut, ttft.change_cut) == (100.0, (-100.0, 100.0),
                                                                           ("-7944%", "+9473%"), "+760%")
    # A decided change is never cut: the axis reaches it.
    prefill.metrics[1] = metric("ttft_ms", 150.0, (120.0, 180.0), "worse")
    decided = plots.forest_layout(diff, noise_pct=3.0)
    assert decided.edge == pytest.approx(187.5) and decided.rows[1].cut == (None, None)


def test_the_experiments_are_pictures_with_their_sentences_as_hover_text(run_dir: store.RunDir) -> None:
    """The context window as a badge per variant (refused with 400 / silently clamped), long context, overload
    (from the requests' own records and the server's sampled gauges), prefix order and repeats as charts; each
    picture's hover text is its experiments' sentences, which the Markdown report keeps as a table."""
    data = html_report.gather(run_dir)
    html_report.write_charts(data, run_dir.root / "charts")
    assert {"long-context", "overload", "prefix-order"} <= set(data.charts)   # the demo has no repeat experiment
    page = html_report.render_html(data)
    section = page.split("<h2>The study&#x27;s experiments</h2>", 1)[1].split("<h2>", 1)[0]
    window = next(e.result for e in data.experiments if e.result.kind == "context-window")
    assert re.search(r'<span class="badge worse" title="[^"]*silently clamps the reply[^"]*">baseline: silently '
                     r"clamped</span>", section)
    assert "<table" not in section   # the sentences left the cells: every experiment here has its picture
    agents = store.RunDir(run_dir.root)
    kept = html_report.gather(agents)
    kept.experiments = [e.model_copy(update={"result": e.result.model_copy(update={"kind": "agents"})})
                        if e.result.kind == "prefix-order" else e for e in kept.experiments]
    html_report.write_charts(kept, run_dir.root / "charts-2")
    other = html_report.render_html(kept).split("<h2>The study&#x27;s experiments</h2>", 1)[1].split("<h2>", 1)[0]
    assert "Other experiments" in other and "prefix-order-K4" in other   # no picture: its sentence stays
    overload = html_report._latest_experiments(data)[("baseline", "overload")]
    assert html.escape(f"baseline: {overload.verdict}") in section
    assert 'alt="Overload: requests generating and waiting over time"' in section
    assert window.verdict and "| context-window |" in html_report.render_markdown(data).replace("\\", "")
    # The overload picture's client view comes from the raw records: every request waits, then generates.
    from campaign.report import plots

    times, waiting, generating = plots._occupancy(overload.requests, min(r["send_t"] for r in overload.requests))
    assert max(waiting) >= 1 and max(generating) >= 1 and waiting[-1] == generating[-1] == 0
    assert times == sorted(times)


def test_a_repeated_cell_is_a_histogram_with_its_modes_marked(tmp_path: Path) -> None:
    from campaign.report import plots

    assert plots.bimodality({"a": {"runs": []}}, tmp_path / "none.png") is None
    runs = [100.0, 102.0, 99.0, 101.0, 200.0, 203.0, 198.0, 201.0]
    path = plots.bimodality({"a": {"runs": runs, "bimodal": True, "low": 100.5, "high": 200.5}}, tmp_path / "b.png")
    assert path is not None
    with Image.open(path) as image:
        assert image.width >= 500 and len(image.getcolors(256) or []) >= 16


def test_side_by_side_tables_put_the_variants_in_columns(run_dir: store.RunDir) -> None:
    """Short answers and launch facts with a column per variant, the baseline first; a fact that differs from
    the baseline's is highlighted (measured answers, which always differ by noise, are not); every variant's
    decode matrix in one heat map; all of it before the per-variant sections, in HTML and Markdown alike."""
    data = html_report.gather(run_dir)
    short, facts, decode = html_report.side_by_side(data)
    assert short.headers[:2] == ["Question", "baseline"]
    assert set(short.headers[2:]) == {"small-cache", "small-chunk", "tight"}   # broken never answered
    assert list(facts.headers) == ["Fact", *short.headers[1:], "broken"]
    kv = next(row for row in facts.rows if tables.cell(row[0]).text == "kv_cache_tokens")
    shown = {h: tables.cell(c) for h, c in zip(facts.headers, kv, strict=True)}
    assert shown["baseline"].text == "2,097,152" and shown["baseline"].cls is None
    assert shown["small-cache"].text == "131,072" and shown["small-cache"].cls == "changed"
    assert shown["small-chunk"].cls is None
    assert all(tables.cell(c).cls is None for row in short.rows for c in row)
    assert decode.headers[1].startswith("baseline · 1") and any(h.startswith("tight · 4") for h in decode.headers)
    page = HtmlTables(html_report.render_html(data))
    assert page.tables[("Side by side", short.title)] == [list(short.headers), *tables.texts(short)]
    markdown = html_report.render_markdown(data)
    assert markdown.index("## Side by side") < markdown.index("## Variant: baseline")


def test_a_report_across_two_runs_of_one_matrix(run_dir: store.RunDir, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`campaign report RUN_A RUN_B`: the same page with the other run's variants as <name>@B, each diffed
    against this run's baseline (last week's baseline against tonight's); runs of another matrix are refused
    with one Error line."""
    import json

    other = tmp_path / "last-week"
    shutil.copytree(FIXTURE_RUN, other)
    # The command line in this process (run_cli: the same parsing, printing and one-line errors as the
    # `campaign` command, without a second interpreter's start).
    code = run_cli(["report", str(run_dir.root), str(other), "--format", "md"])
    out = capsys.readouterr()
    assert code == 0, out.err
    path = run_dir.root / "report" / "vs-last-week" / "report.md"
    assert str(path) in out.out.splitlines()
    verdict = path.read_text().split("## Verdict\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    # The same launches copied: nothing differs, but at this fixture's launch-to-launch spread (up to 96%)
    # nothing is shown within 3% either.
    assert verdict[0].startswith("- baseline@B: not settled: ")
    assert verdict[0].endswith("[streams at the floor: 4 -> 4 at 40 stream tok/s]")
    assert verdict[1].startswith("  - why: no flag change: not settled: ")   # @B is another night: no A/A
    assert ("- small-cache@B: revert: KV cache -93.8% (agents at 8K context: none, beyond the 2,048-token window) "
            "[streams at the floor: 4 -> 4 at 40 stream tok/s]") in verdict
    assert any(line.startswith("  - why: kv-cache-memory-bytes 1G -> 64M") for line in verdict)
    assert any("last-week (@B): baseline moved" in line for line in verdict)
    data = html_report.gather(run_dir, store.RunDir(other))
    assert "small-chunk@B" in html_report.side_by_side(data)[0].headers
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps(manifest | {"campaign": "another"}))
    assert run_cli(["report", str(run_dir.root), str(other)]) != 0
    refused = capsys.readouterr().err
    assert refused.splitlines()[0].startswith("Error: ") and "a run of 'another'" in refused


def text_grid(text: str, title: str) -> list[list[str]]:
    """The grid under `title` in command-line text, cut at the columns its dashes mark."""
    lines = text.split(title + "\n", 1)[1].splitlines()
    starts = [m.start() for m in re.finditer(r"-+", lines[1])]
    rows = []
    for line in [lines[0], *lines[2:]]:
        if not line:  # a blank line ends the table
            break
        rows.append([line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)])
    return rows


def markdown_grid(text: str, title: str) -> list[list[str]]:
    lines = text.split(f"### {title}\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert re.fullmatch(r"\|(---:?\|)+", lines[1])
    return [[re.sub(r"\\(.)", r"\1", v) for v in re.split(r"(?<!\\) \| ", line[2:-2])]
            for line in [lines[0], *lines[2:]]]


class HtmlTables(HTMLParser):
    """Every <table>'s cell texts, by the <h2> and <h3> headings above it."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.headings = {"h2": "", "h3": ""}
        self.heading: str | None = None
        self.tables: dict[tuple[str, str], list[list[str]]] = {}
        self.rows: list[list[str]] = []
        self.in_cell = False
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.headings:
            self.heading, self.headings[tag] = tag, ""
            if tag == "h2":
                self.headings["h3"] = ""
        elif tag == "table":
            self.rows = self.tables.setdefault((self.headings["h2"], self.headings["h3"]), [])
        elif tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self.rows[-1].append("")
            self.in_cell = True

    def handle_endtag(self, tag: str) -> None:
        if tag == self.heading:
            self.heading = None
        self.in_cell = self.in_cell and tag not in ("td", "th")

    def handle_data(self, data: str) -> None:
        if self.heading:
            self.headings[self.heading] += data
        elif self.in_cell:
            self.rows[-1][-1] += data


def test_text_markdown_and_html_carry_the_same_tables(run_dir: store.RunDir) -> None:
    """The decode matrix and all measurements of one stored run: one Table, three renderings, the same cells."""
    data = html_report.gather(run_dir)
    command_line = report.cells_by_variant_text(run_dir.cells(), run_dir.servers())
    markdown = html_report.render_markdown(data)
    page = HtmlTables(html_report.render_html(data))
    latest = report.latest_cells(run_dir.cells())
    for variant in ("baseline", "tight"):
        cells = list(latest[variant].values())
        text = command_line.split(f"### {variant}\n", 1)[1]
        md = markdown.split(f"## Variant: {variant}\n", 1)[1]
        for table in (report.decode_matrix_table(cells), report.all_measurements_tables(cells)[0]):
            assert table is not None
            expected = [list(table.headers), *tables.texts(table)]
            assert text_grid(text, table.title) == expected
            assert markdown_grid(md, table.title) == expected
            assert page.tables[(f"Variant: {variant}", table.title)] == expected
    # ... and they are the stored numbers, with the latency tails among the columns.
    cell = stored_valid_cell(run_dir)
    matrix = page.tables[("Variant: baseline", report.decode_matrix_table(list(latest["baseline"].values())).title)]
    assert f"{cell.total_tok_s:,.1f} tok/s · {cell.ttft_ms:,.0f} ms TTFT" in matrix[1]
    assert page.tables[("Variant: tight", report.decode_matrix_table(list(latest["tight"].values())).title)][1] == [
        "512", "Failed", "Over capacity"]
    assert {"TTFT p99", "ITL p99", "TPOT", "E2E p99"} <= set(report.ALL_HEADERS)


def test_the_command_line_names_launches_that_never_started(run_dir: store.RunDir) -> None:
    text = report.cells_by_variant_text(run_dir.cells(), run_dir.servers())
    assert "### broken: FAILED TO START (bad_argument): unrecognized arguments" in text
    assert "Why cells are not Valid:\n  512 x 1 decode: Failed: 1 of 1 requests failed" in text


def _plan(launches: list[tuple[str, int]], variants: list[planning.VariantPlan], *,
          previous: store.RunDir | None = None) -> planning.Plan:
    cells = [CellSpec(phase="decode", context_tokens=8192, concurrency=64, max_tokens=256, window_s=30)]
    rates = planning.Rates(1000.0, 30.0, 90.0, "guessed: no earlier run")
    return planning.Plan(launches=launches, variants=variants, cells=cells, previous=previous, previous_times=[],
                         estimate=planning.Estimate(launches=len(launches), launch_s=90.0, cells_s=100.0,
                                                    experiments_s={"overload-x1.25": 10.0}, rates=rates))


def test_the_plan_is_one_table_model_too(tmp_path: Path) -> None:
    previous = store.RunDir(tmp_path / "20250101T000000Z")
    plan = report.plan_tables(_plan(
        [("baseline", 0), ("memory", 0), ("memory", 1), ("baseline", 1), ("baseline", 2)],
        [planning.VariantPlan("baseline", {}, 567_464, []),
         planning.VariantPlan("memory", {"gpu-memory-utilization": 0.95}, None, [])], previous=previous),
        repeats=2)
    text = report.text(plan)
    assert "5  baseline  3       drift sentinel" in text
    assert "567,464 tokens (from 20250101T000000Z)" in text and "unknown until launched" in text
    assert "decode-sustained-L8192-C64-N256-W30  aggregate   " in text and "overload-x1.25" in text
    # 5 launches x (90 s start + 100 s of cells + 10 s of experiments) = 1,000 s.
    assert text.endswith("estimated duration: 16m40s = 5 launches x 3m20s (start 90 s, cells with warm-up and warm "
                         "check 100 s, experiments 10 s)\nrates: 1,000 prompt tok/s, 30.0 stream tok/s "
                         "(single-stream), 90 s to start: guessed: no earlier run")
    assert "| 5 | baseline | 3 | drift sentinel |" in tables.to_markdown(plan[0])
    assert "<td>5</td><td class=\"l\">baseline</td>" in tables.to_html(plan[0])


def test_the_speculative_sub_table_and_the_notes_reach_every_rendering() -> None:
    spec = CellSpec(phase="decode", context_tokens=8192, concurrency=1)
    cell = CellResult(spec=spec, phase="decode", context_tokens=8192, concurrency=1, label="single-stream",
                      status="Valid", total_tok_s=148.2, spec_acceptance_rate=0.595, spec_mean_acceptance_length=2.19,
                      spec_mean_accepted=1.19, notes=["counted per chunk: the server sent no continuous usage"])
    main, how, speculative, notes = report.all_measurements_tables([cell])
    assert main.headers[:4] == ["Phase", "Context", "Requests at once", "Status"]
    assert tables.texts(how)[0][:4] == ["Decode (sustained)", "8K", "1", "single-stream"]
    assert tables.texts(speculative) == [["8K", "1", "random", "148.2", "59.5%", "1.19", "2.19"]]
    assert "| 8K | 1 | random | 148.2 | 59.5% | 1.19 | 2.19 |" in tables.to_markdown(speculative)
    assert "<td>59.5%</td><td>1.19</td><td>2.19</td>" in tables.to_html(speculative)
    assert "- 8K x 1 decode: counted per chunk" in tables.to_markdown(notes)
    assert "Notes:\n  8K x 1 decode: counted per chunk" in report.all_measurements([cell])


def test_energy_per_token_reaches_the_tables_and_the_export_where_measured() -> None:
    from campaign.measure.cells import CellResult, CellSpec
    from campaign.report import tables
    from campaign.report import text as report

    spec = CellSpec(phase="decode", context_tokens=8192, concurrency=8)
    cell = CellResult(spec=spec, phase="decode", context_tokens=8192, concurrency=8, label=spec.label,
                      status="Valid", total_tok_s=1000.0, energy_j_per_token=0.412)
    rendered = tables.to_markdown(report.all_measurements_tables([cell])[-1])
    assert "0.412 J/token" in rendered
    assert "Energy" not in report.all_measurements(
        [cell.model_copy(update={"energy_j_per_token": None})])  # no GPU, no energy table


def test_the_plan_warns_that_one_repeat_judges_nothing_measured() -> None:
    def plan(repeats: int, names: list[str]) -> str:
        return report.text(report.plan_tables(
            _plan([(n, 0) for n in names], [planning.VariantPlan(n, {}, None, []) for n in names]), repeats=repeats))

    warned = plan(1, ["baseline", "memory"])
    assert "repeats: 1 with more than one variant" in warned and "keep or revert provisionally" in warned
    assert "repeats: 1 with" not in plan(2, ["baseline", "memory"])
    assert "repeats: 1 with" not in plan(1, ["baseline"])


# --- issue 50: one cell, three per-stream speeds, three names --------------------------------------------------
SEED_000 = 'seed 000\'s "per request"'   # the one place "per request" may be said: naming what total ÷ streams was


def _per_request_said(text: str) -> list[str]:
    """Where a rendering says "per request" (or per-request) other than naming seed 000's figure."""
    text = html.unescape(text).replace(SEED_000, "")
    return [text[max(0, m.start() - 40):m.end() + 40] for m in re.finditer(r"per[- ]request", text, re.IGNORECASE)]


def test_each_per_stream_speed_has_one_name_in_every_rendering(run_dir: store.RunDir) -> None:
    """Issue 50: stream tok/s (per_request_tok_s), total ÷ streams (total tok/s over the requests at once, shown,
    never stored) and TPOT (a time) have one name each in the text, Markdown and HTML tables, the diff, the
    verdict and the legend; the HTML header carries the definition the legend gives; and no rendering calls
    any of them "per request"."""
    data = html_report.gather(run_dir)
    command_line = report.cells_by_variant_text(run_dir.cells(), run_dir.servers())
    markdown = html_report.render_markdown(data)
    page = html_report.render_html(data)
    tables_in_page = HtmlTables(page)
    cells = list(report.latest_cells(run_dir.cells())["baseline"].values())
    table = report.all_measurements_tables(cells)[0]
    headers = list(table.headers)
    stream, share, tpot = headers.index("Stream tok/s"), headers.index("Total ÷ streams"), headers.index("TPOT")
    assert headers[stream - 2:stream + 1] == ["Total tok/s", "Total ÷ streams", "Stream tok/s"]
    for grid in (text_grid(command_line.split("### baseline\n", 1)[1], table.title),
                 markdown_grid(markdown.split("## Variant: baseline\n", 1)[1], table.title),
                 tables_in_page.tables[("Variant: baseline", table.title)]):
        assert grid[0] == headers
        assert not [h for h in grid[0] if re.search(r"per[- ]request", h, re.IGNORECASE)]
        for cell, row in zip(cells, grid[1:], strict=True):
            # Stream tok/s is the stored field; total ÷ streams the stored total over the requests at once, in
            # decode cells only (a prefill has one request and no total).
            assert row[stream] == report.fmt_num(cell.per_request_tok_s)
            assert row[tpot] == report.fmt_itl(cell.tpot_ms)
            if cell.phase == "decode":
                assert cell.total_tok_s is not None
                assert row[share] == f"{cell.total_tok_s / cell.concurrency:,.1f}"
            else:
                assert row[share] == report.DASH
    assert [c.concurrency for c in cells if c.phase == "decode"] == [1, 4]   # a real division, not only by one
    # The HTML header says what the figure is, in the legend's words.
    definition = names.definition("per_request_tok_s")
    assert definition is not None
    assert f'<th title="{html.escape(definition)}">Stream tok/s</th>' in page
    legend = {row[0]: row for row in tables_in_page.tables[("The figures", "")]}
    assert legend["stream tok/s"] == ["stream tok/s", "per_request_tok_s", definition, "decode cells"]
    assert legend["total ÷ streams"][3] == "no: shown only"
    assert legend["TPOT"][1] == "tpot_ms" and "1000 / TPOT is not stream tok/s" in legend["TPOT"][2]
    # The diff and the verdict name the figures, never the fields the stored sentences carry; the report says,
    # under the A/B tables and in the legend, which speed the verdict judged.
    judged = ("speed, as the verdict judges it: total tok/s and stream tok/s in decode cells; prompt tok/s in "
              "prefill cells; total tok/s in rate cells; never total ÷ streams or 1000 / TPOT")
    diff = report.diff_text(data.diffs)
    for rendered in (diff, markdown, html.unescape(page)):
        assert judged in rendered
        assert _per_request_said(rendered) == []
    assert "stream tok/s" in diff and "per_request_tok_s" not in diff
    before_legend = markdown.split("## The figures", 1)[0]
    assert "| stream tok/s |" in before_legend and "per_request_tok_s" not in before_legend
    assert _per_request_said(command_line) == []


def test_a_stored_sentence_shows_the_fields_it_names_by_their_names() -> None:
    """The recommendation is stored with field names (summary.json is read by machines); every rendering shows
    the figures' names, and leaves alone what is not a figure's field (an experiment's value, a flag)."""
    stored = ("max-num-batched-tokens 2,048 -> 64: worse: per_request_tok_s at decode-sustained-L512-C4-N64-W4, "
              "ttft_p99_ms at decode-fixed-L512-C8-N64; moved: mean_total_tok_s at overload-x1.25 better; "
              "tpot_ms, prompt_tok_s")
    assert names.named(stored) == (
        "max-num-batched-tokens 2,048 -> 64: worse: stream tok/s at decode-sustained-L512-C4-N64-W4, TTFT p99 at "
        "decode-fixed-L512-C8-N64; moved: mean_total_tok_s at overload-x1.25 better; TPOT, prompt tok/s")
    assert names.name("generation_tok_s_drop_pct") == "generation_tok_s_drop_pct"   # not a figure of the table
    assert names.header("per_request_tok_s") == "Stream tok/s" and names.header("tpot_p99_ms") == "TPOT p99"
    assert names.total_over_streams("decode", 361.6, 8) == pytest.approx(45.2)
    assert names.total_over_streams("rate", 361.6, 1) is None and names.total_over_streams("decode", None, 8) is None


def test_the_docs_use_the_figures_names_and_hold_their_legend_word_for_word() -> None:
    """docs/results.md holds the legend the report shows (generated: `python -m campaign.report.names`), and no
    doc calls a figure "per request" but to name what seed 000 meant by it (total ÷ streams)."""
    root = Path(__file__).parent.parent
    assert names.markdown() in (root / "docs" / "results.md").read_text(), \
        "docs/results.md's figures are stale: paste `python -m campaign.report.names` under ## The figures"
    said = {path.name: _per_request_said(" ".join(path.read_text().split()))
            for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]}
    # results-format.md is generated from the records' own descriptions (campaign/stored/records.py).
    assert {doc: where for doc, where in said.items() if where and doc != "results-format.md"} == {}


@pytest.mark.browser
def test_a_rate_runs_report_draws_goodput_against_rate_with_the_capacity_bracket(tmp_path: Path) -> None:
    """Issue 53: a night of rate cells and a capacity search (the simulated A5000 pair in simulated time) has
    its loads drawn as stored: each rate cell's offered rate, achieved rate, goodput and p90 TTFT, each search
    probe held or failed as its cell says, the bracket as the search stored it; the page shows the chart, and
    a frontier needs a decode ladder, which this night has not."""
    matrix = {"schema_version": 1, "name": "rate-report", "profile": "a5000-tp2", "baseline": "baseline",
              "variants": [{"name": "baseline", "flags": {}}], "slo": {"ttft_p99_ms": 2000, "floor_tok_s": 20},
              "workloads": [{"kind": "rate", "contexts": [1024], "rates": [0.25, 0.5], "max_tokens": 128,
                             "duration_s": 30},
                            {"kind": "slo-search", "context": 1024, "max_tokens": 128, "duration_s": 20,
                             "start_rps": 0.5}],
              "repeats": 1}
    path = tmp_path / "rate-report.yaml"
    path.write_text(yaml.safe_dump(matrix))
    assert run_cli(["run", str(path), "--engine", "sim", "--clock", "virtual", "--out", str(tmp_path / "runs"),
                    "--plain"]) == 0
    (root,) = (tmp_path / "runs" / "rate-report").iterdir()
    data = html_report.gather(store.RunDir(root))
    loads, brackets = html_report.rate_loads(data)
    cells = sorted((c for c in data.latest["baseline"].values() if c.phase == "rate"), key=lambda c: c.request_rate)
    drawn = sorted((p for p in loads["baseline"] if p.passed is None), key=lambda p: p.offered)
    assert [(p.offered, p.achieved, p.goodput, p.ttft_p90_ms) for p in drawn] == [
        (c.request_rate, c.achieved_rate_rps, c.goodput_rps, c.ttft_p90_ms) for c in cells] and len(cells) == 2
    (search,) = [e.result for e in data.experiments if e.result.kind == "slo-search"]
    stored = search.details["slo_search"]
    assert brackets["baseline"] == (stored["last_pass_rps"], stored["first_fail_rps"]) != (None, None)
    probes = [p for p in loads["baseline"] if p.passed is not None]
    # The rate search's probes (the concurrency search's are closed loops: no offered rate to draw them at).
    assert {(p.offered, p.passed) for p in probes} == {(c["request_rate"], c["slo_passed"])
                                                        for c in search.details["probes"] if c["request_rate"]}
    assert any(p.passed for p in probes) and not all(p.passed for p in probes)
    # Beside the chart: each rate cell's server view against the client's, and its cache before the step, as
    # stored (in simulated time the two clocks are one: no gap).
    view = report.server_view_table(cells)
    assert view is not None and tables.texts(view) == [
        [c.spec.key, report.fmt_ms(c.client_ttft_mean_ms), report.fmt_ms(c.server_ttft_mean_ms), "+0.0 ms",
         report.fmt_itl(c.server_itl_mean_ms), report.fmt_num(c.server_first_tokens)] for c in cells]
    state = report.open_loop_state_table(cells)
    assert state is not None and [row[2] for row in tables.texts(state)] == [
        c.cache_state.note() if c.cache_state else "—" for c in cells]
    html_report.write(store.RunDir(root))
    page = (root / "report" / "report.html").read_text()
    assert 'alt="Goodput and the first token&#x27;s wait against the rate offered, with the capacity bracket"' in page
    assert "The frontier" not in page
    if CHROMIUM is None:
        pytest.fail("Chromium is not installed: run `make chromium` (Debian's package)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:   # and a browser shows it: every image loaded, nothing wider than 1280 px
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        shown = browser.new_page(viewport={"width": 1280, "height": 900})
        shown.goto((root / "report" / "report.html").as_uri())
        shown.wait_for_load_state("load")
        chart = shown.locator('img[alt^="Goodput and the first token"]')
        assert chart.count() == 1 and chart.evaluate("i => i.complete && i.naturalWidth > 500")
        assert shown.evaluate("document.documentElement.scrollWidth") <= 1280
        browser.close()


def test_the_frontier_is_each_variants_ladder_per_gpu_against_per_user(run_dir: store.RunDir) -> None:
    """Issue 53: the frontier's points are the decode ladder's own figures (the ladder the short answers use):
    a stream's tok/s across, total tok/s over the variant's GPUs up (tensor parallelism as its launch's log
    said); a variant on two GPUs halves its per-GPU figure."""
    from campaign.measure import answers
    from campaign.report import plots

    data = html_report.gather(run_dir)
    gpus = html_report.gpu_counts(data.servers)
    assert gpus["baseline"] == 1 and "broken" not in gpus
    points = plots.frontier_points(data.all_cells, gpus)
    ladder = answers.ladder_from_cells(data.all_cells["baseline"])
    assert points["baseline"] == [(s.concurrency, s.per_request_tok_s, s.total_tok_s) for s in ladder]
    assert [c for c, _, _ in points["baseline"]] == [1, 4]
    halved = plots.frontier_points(data.all_cells, {"baseline": 2})["baseline"]
    assert [y for _, _, y in halved] == [s.total_tok_s / 2 for s in ladder]
