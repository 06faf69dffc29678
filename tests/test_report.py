"""Reports from stored run directories: HTML opened in a real headless Chromium, Markdown, PNG charts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from campaign import html_report, store
from campaign.cells import CellResult, CellSpec

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
    store.write_new(launch / "server.json", {
        "kind": "server", "variant": "tight", "repeat": 0, "flags": {"kv-cache-memory-bytes": "4M"},
        "command": ["python", "-m", "vllm.entrypoints.openai.api_server", "--kv-cache-memory-bytes", "4M"],
        "facts": {"vllm_version": "0.32.0", "device": "CPU", "kv_cache_tokens": 8192, "block_size": 128},
        "ready_s": 40.0})
    over = CellSpec(phase="decode", context_tokens=512, concurrency=4, max_tokens=64, window_s=4, warmup_s=0.5)
    failed = CellSpec(phase="decode", context_tokens=512, concurrency=1, max_tokens=64, window_s=4, warmup_s=0.5)
    for spec, status, reason in ((over, "Over capacity", "not run: 4 x (512 + 64) tokens exceed 8,192"),
                                 (failed, "Failed", "1 of 1 requests failed: EngineCore encountered an issue")):
        run.write_cell("tight", 0, CellResult(spec=spec, phase="decode", context_tokens=512,
                                              concurrency=spec.concurrency, label=spec.label, status=status,
                                              reasons=[reason]), launch=launch.name, telemetry=None)
    broken = run.new_launch_dir("broken")
    store.write_new(broken / "failure.json", {"kind": "failure", "variant": "broken", "repeat": 0,
                                              "failure_kind": "bad_argument", "message": "unrecognized arguments",
                                              "hint": None, "log_tail": "error: unrecognized arguments"})
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
        assert page.locator("text=How this was measured").count() == 1
        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert shot.stat().st_size > 50_000


def test_png_charts_are_non_trivial(run_dir: store.RunDir, tmp_path: Path) -> None:
    paths = html_report.write(run_dir, fmt="png", out=tmp_path / "charts")
    names = {p.name for p in paths}
    assert {"throughput.png", "prefill_vs_context.png", "agents_that_fit.png"} <= names
    for path in paths:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 15_000


def test_markdown_has_the_same_tables(run_dir: store.RunDir, tmp_path: Path) -> None:
    path = html_report.write(run_dir, fmt="md", out=tmp_path / "report.md")[0]
    text = path.read_text()
    assert "Short answers: baseline" in text and "Over capacity" in text
    assert "recommendation:" in text and "single-stream" in text and "aggregate" in text
