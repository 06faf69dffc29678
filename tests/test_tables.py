"""One table model, three renderings: text for the terminal, Markdown tables, escaped HTML."""

from __future__ import annotations

from campaign.report.tables import Cell, Table, md_escape, texts, to_html, to_markdown, to_text

SMALL = Table(title="Speeds", headers=["Name", "Tok/s", "Status"], align="lrl",
              rows=[["a", "1.0", Cell("Valid")], ["longer name", "22.5", Cell("Failed", title="why", cls="bad")]],
              notes=["measured twice", Cell("warning: noisy", cls="warn")])


def test_text_pads_every_column_and_strips_line_ends() -> None:
    assert to_text(SMALL) == (
        "Speeds\n"
        "Name         Tok/s  Status\n"
        "-----------  -----  ------\n"
        "a            1.0    Valid\n"
        "longer name  22.5   Failed\n"
        "measured twice\n"
        "warning: noisy")


def test_text_lead_lines_come_before_the_grid_and_a_grid_needs_rows() -> None:
    table = Table(title="b vs a", lead=["flag  x: 1 -> 2"], headers=["Cell"], notes=["recommendation: keep"])
    assert to_text(table) == "b vs a\nflag  x: 1 -> 2\nrecommendation: keep"


def test_a_table_without_headers_is_a_list() -> None:
    table = Table(title="Why cells are not Valid", notes=["512 x 4 decode: Over capacity", "512 x 1 decode: Failed"])
    assert to_text(table) == "Why cells are not Valid:\n  512 x 4 decode: Over capacity\n  512 x 1 decode: Failed"
    assert to_markdown(table) == ("### Why cells are not Valid\n\n- 512 x 4 decode: Over capacity\n"
                                  "- 512 x 1 decode: Failed")
    assert to_html(table) == ("<h3>Why cells are not Valid</h3><ul><li>512 x 4 decode: Over capacity</li>"
                              "<li>512 x 1 decode: Failed</li></ul>")


def test_markdown_is_a_real_table_with_an_alignment_row() -> None:
    assert to_markdown(SMALL) == (
        "### Speeds\n\n"
        "| Name | Tok/s | Status |\n"
        "|---|---:|---|\n"
        "| a | 1.0 | Valid |\n"
        "| longer name | 22.5 | Failed |\n\n"
        "measured twice\n\n"
        "warning: noisy")
    assert "```" not in to_markdown(SMALL)


def test_markdown_escapes_pipes_tags_and_emphasis() -> None:
    table = Table(headers=["Flag", "Value"], rows=[["a|b", "<script>*x*`y`\\"], ["multi\nline", "ok"]])
    lines = to_markdown(table).splitlines()
    assert lines[2] == r"| a\|b | \<script>\*x\*\`y\`\\ |"
    assert lines[3] == "| multi line | ok |"  # a newline would end the row
    assert md_escape("  two  spaces ") == "two spaces"


def test_html_escapes_text_and_titles_and_keeps_classes() -> None:
    table = Table(title="A & <B>", headers=["Name", "Value"], cls="heat", rows=[
        ["<x>", Cell("1 & 2", title='say "why" <now>', cls="cell bad")],
        ["plain", Cell("93.0 tok/s", cls="cell", heat=1.0)], ["pale", Cell("1.0 tok/s", cls="cell", heat=0.0)]])
    page = to_html(table)
    assert page.startswith("<h3>A &amp; &lt;B&gt;</h3><table class=\"heat\">")
    assert '<th class="l">Name</th><th>Value</th>' in page
    assert "<td class=\"l\">&lt;x&gt;</td>" in page
    assert '<td class="cell bad" title="say &quot;why&quot; &lt;now&gt;">1 &amp; 2</td>' in page
    assert 'style="background:hsl(140,45%,50%);color:#fff"' in page   # the best cell: deep green, white text
    assert 'style="background:hsl(140,45%,95%);color:#222"' in page   # none of the best: pale
    assert 'class=""' not in page and "<script" not in page


def test_html_notes_are_paragraphs_with_their_class_and_lead_lines_a_list() -> None:
    page = to_html(SMALL)
    assert page.endswith('<p class="note">measured twice</p><p class="warn">warning: noisy</p>')
    assert '<td class="bad l" title="why">Failed</td>' in page
    lead = to_html(Table(title="b vs a", lead=[Cell("NOT COMPARABLE: x", cls="warn"), "      (indented)"]))
    assert lead == '<h3>b vs a</h3><ul><li class="warn">NOT COMPARABLE: x</li><li>(indented)</li></ul>'


def test_every_rendering_shows_the_same_cell_texts() -> None:
    assert texts(SMALL) == [["a", "1.0", "Valid"], ["longer name", "22.5", "Failed"]]
    for row in texts(SMALL):
        assert "| " + " | ".join(row) + " |" in to_markdown(SMALL)
        assert [value for value in row if value in to_text(SMALL)] == row
        assert all(f">{value}</td>" in to_html(SMALL) for value in row)


def test_a_header_says_what_its_figure_is_where_a_format_can_show_it() -> None:
    """A header's hover text (a figure's definition) is data on the table: an HTML title on its <th>, nothing in
    text or Markdown, whose headers stay the same words."""
    table = Table(headers=["Context", "Stream tok/s"], rows=[["8K", "53.2"]],
                  header_titles=[None, 'tokens a second "while it streamed"'])
    page = to_html(table)
    assert '<th class="l">Context</th><th title="tokens a second &quot;while it streamed&quot;">Stream tok/s</th>' \
        in page
    assert to_text(table).splitlines()[0] == "Context  Stream tok/s"
    assert to_markdown(table).splitlines()[0] == "| Context | Stream tok/s |"
    assert "title=" not in to_html(Table(headers=["A", "B"], rows=[["1", "2"]]))
