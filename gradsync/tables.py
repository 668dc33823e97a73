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
    """A GitHub-flavoured Markdown table.

    Example:
        >>> print(markdown_table(["a", "b"], [["1", "2"]]))
        | a | b |
        |---|---|
        | 1 | 2 |
    """
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)
