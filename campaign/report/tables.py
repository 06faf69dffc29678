"""One table model, three renderings: plain text for the terminal, Markdown, HTML.

A table is built once, as data (`Table` of `Cell`s), and every output renders that same object, the way
hyperfine's Markdown, AsciiDoc and Org exporters share one table and differ only in row syntax. The renderers
add nothing a table does not say: the HTML-only parts of a cell (hover title, CSS class, heat-map shade, a long
form folded under it) are data on the cell, ignored where a format cannot show them; so is a header's hover text
(what the column's figure is, `header_titles`).

Shapes: a table with headers is a grid (left out when it has no rows), with `lead` lines said before it (the
diff's flag and fact changes) and `notes` after it. A table without headers is a titled list of its notes
(in text, "Title:" and the items indented under it). Text pads every column on the right, as the command line
always has; `align` steers HTML and Markdown.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Cell:
    text: str
    title: str | None = None   # HTML hover text (why a cell is not Valid, which label it has)
    cls: str | None = None     # HTML class: "bad", "over", "better", "worse", "noise", "warn", ...
    heat: float | None = None  # 0..1: the cell's share of the table's best value, as an HTML background
    # The whole text where `text` is its short form (a verdict's reasoning under its headline): HTML folds it
    # under the cell's text, one click away; the verdict's lines say it on a line of its own.
    more: str | None = None


Item = Cell | str


@dataclass(frozen=True)
class Table:
    title: str = ""
    headers: Sequence[str] = ()
    rows: Sequence[Sequence[Item]] = ()
    align: str = ""              # "l" or "r" per column; missing letters: the first column "l", the rest "r"
    lead: Sequence[Item] = ()    # lines before the grid
    notes: Sequence[Item] = ()   # lines after the grid; a table without headers is a list of these
    cls: str = ""                # HTML class of the <table> ("heat" for the decode matrix)
    header_titles: Sequence[str | None] = ()  # HTML hover text per header (a figure's definition), or None

    def header_title(self, index: int) -> str | None:
        return self.header_titles[index] if index < len(self.header_titles) else None

    def column_align(self, index: int) -> str:
        if index < len(self.align):
            return self.align[index]
        return "l" if index == 0 else "r"


def cell(item: Item) -> Cell:
    return item if isinstance(item, Cell) else Cell(item)


def texts(table: Table) -> list[list[str]]:
    """The grid's cell texts, row by row: what every rendering shows."""
    return [[cell(c).text for c in row] for row in table.rows]


# --- text -----------------------------------------------------------------------------------------------------


def grid_text(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def to_text(table: Table) -> str:
    lines = [table.title + ("" if table.headers else ":")] if table.title else []
    lines += [cell(i).text for i in table.lead]
    if table.headers and table.rows:
        lines.append(grid_text(table.headers, texts(table)))
    indent = "" if table.headers else "  "
    lines += [indent + cell(i).text for i in table.notes]
    return "\n".join(lines)


# --- Markdown -------------------------------------------------------------------------------------------------

_MD_SPECIAL = "\\|`*<"


def md_escape(text: str) -> str:
    """Inline text that reads as itself in a Markdown table cell or paragraph: no pipes, tags or emphasis."""
    out = "".join(f"\\{ch}" if ch in _MD_SPECIAL else ch for ch in text)
    return " ".join(out.split())


def _md_row(values: Sequence[str]) -> str:
    return "| " + " | ".join(md_escape(v) for v in values) + " |"


def to_markdown(table: Table) -> str:
    blocks = [f"### {md_escape(table.title)}"] if table.title else []
    if table.lead:
        blocks.append("\n".join(f"- {md_escape(cell(i).text)}" for i in table.lead))
    if table.headers and table.rows:
        rule = "|" + "|".join("---:" if table.column_align(i) == "r" else "---"
                              for i in range(len(table.headers))) + "|"
        blocks.append("\n".join([_md_row(table.headers), rule, *(_md_row(r) for r in texts(table))]))
    if table.notes and table.headers:
        blocks += [md_escape(cell(i).text) for i in table.notes]
    elif table.notes:
        blocks.append("\n".join(f"- {md_escape(cell(i).text)}" for i in table.notes))
    return "\n\n".join(blocks)


# --- HTML -----------------------------------------------------------------------------------------------------


def _e(value: object) -> str:
    return html.escape(str(value))


def heat_style(share: float) -> str:
    """Background from pale to deep green by share of the table's best cell."""
    share = max(0.0, min(1.0, share))
    lightness = 95 - 45 * share
    colour = "#fff" if lightness < 60 else "#222"
    return f"background:hsl(140,45%,{lightness:.0f}%);color:{colour}"


def _attrs(classes: Sequence[str | None], c: Cell | None = None) -> str:
    joined = " ".join(x for x in classes if x)
    out = f' class="{joined}"' if joined else ""
    if c is not None and c.heat is not None:
        out += f' style="{heat_style(c.heat)}"'
    if c is not None and c.title:
        out += f' title="{_e(c.title)}"'
    return out


MORE = "the whole reasoning"   # the fold's label


def _td(c: Cell, align: str, label: str | None = None) -> str:
    more = f"<details><summary>{MORE}</summary>{_e(c.more)}</details>" if c.more else ""
    named = f' data-label="{_e(label)}"' if label else ""
    return f"<td{_attrs([c.cls, 'l' if align == 'l' else None], c)}{named}>{_e(c.text)}{more}</td>"


def _th(table: Table, index: int) -> str:
    text = table.headers[index]
    c = Cell(text, title=table.header_title(index))
    return f"<th{_attrs(['l' if table.column_align(index) == 'l' else None], c)}>{_e(text)}</th>"


def _li(items: Sequence[Item]) -> str:
    return "<ul>" + "".join(f"<li{_attrs([c.cls], c)}>{_e(c.text.strip())}</li>"
                            for c in map(cell, items)) + "</ul>"


def to_html(table: Table) -> str:
    parts = [f"<h3>{_e(table.title)}</h3>"] if table.title else []
    if table.lead:
        parts.append(_li(table.lead))
    if table.headers and table.rows:
        head = "".join(_th(table, i) for i in range(len(table.headers)))
        # A "stack" table (the diff's per-cell verdicts) becomes a card a row on a phone, each value under its
        # column's name (the report's CSS): what a verdict rests on needs no sideways scroll there.
        stack = "stack" in table.cls.split()
        body = "".join("<tr>" + "".join(_td(cell(c), table.column_align(i), table.headers[i] if stack else None)
                                        for i, c in enumerate(row)) + "</tr>" for row in table.rows)
        parts.append(f"<table{_attrs([table.cls])}><tr>{head}</tr>{body}</table>")
    if table.notes and table.headers:
        parts += [f"<p{_attrs([c.cls or 'note'], c)}>{_e(c.text)}</p>" for c in map(cell, table.notes)]
    elif table.notes:
        parts.append(_li(table.notes))
    return "".join(parts)
