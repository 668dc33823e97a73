"""One table, two renderings: the terminal (rich) and Markdown for result files."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print an aligned table to stdout (cells are text, never rich markup)."""
    table = Table(title=escape(title))
    for header in headers:
        table.add_column(escape(header))
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    Console(width=max(120, Console().width)).print(table)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured Markdown table; a ``|`` in a header or a cell is escaped, so it
    stays in its column.

    Example:
        >>> print(markdown_table(["a", "max |Δ|"], [["1", "2"]]))
        | a | max \\|Δ\\| |
        |---|---|
        | 1 | 2 |
    """
    lines = [_markdown_row(headers), "|" + "---|" * len(headers)]
    lines += [_markdown_row(row) for row in rows]
    return "\n".join(lines)


def _markdown_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"
