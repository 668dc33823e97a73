"""Files that readers never see half-written: write a temporary file, fsync, rename.

Example:
    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "summary.json"
    >>> atomic_write_text(path, "{}")
    >>> path.read_text()
    '{}'
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write_bytes(path: Path, write: Any) -> None:
    """Call ``write(tmp_path)`` then rename over ``path``: readers never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; results are for everyone
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temp file + rename)."""
    atomic_write_bytes(path, lambda tmp: tmp.write_text(text))


def read_cell_records(path: Path, *, missing: str) -> list[dict[str, Any]]:
    """Every complete JSON record (an object with an ``id``) of the JSON-lines file
    ``path``, in the order written; none when it does not exist. A line that is not one
    (cut short when a job was killed) is skipped with a warning on stderr saying that its
    cell counts as ``missing``.

    Example:
        >>> import tempfile
        >>> log = Path(tempfile.mkdtemp()) / "cells.jsonl"
        >>> _ = log.write_text('{"id": "a"}' + chr(10) + '{"id": ')  # the last cut short
        >>> [r["id"] for r in read_cell_records(log, missing="not run")]
        ['a']
    """
    if not path.is_file():
        return []
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or "id" not in record:
            print(
                f"gradsync: warning: {path} line {number} is not a complete record "
                f"({line[:40]!r}…); skipped, its cell counts as {missing}",
                file=sys.stderr,
            )
            continue
        records.append(record)
    return records


def end_line_cut_short(path: Path) -> None:
    """Finish the last line of ``path`` when it was cut short (a job killed mid-write), so
    the next record appended starts on a line of its own; nothing for a missing or empty
    file, or one whose last line is whole.

    Example:
        >>> import tempfile
        >>> log = Path(tempfile.mkdtemp()) / "cells.jsonl"
        >>> _ = log.write_text('{"id": "a"}' + chr(10) + '{"id": ')
        >>> end_line_cut_short(log); end_line_cut_short(log)
        >>> log.read_text().count(chr(10))
        2
    """
    if not path.is_file() or not path.stat().st_size:
        return
    with path.open("rb") as handle:
        handle.seek(-1, os.SEEK_END)
        whole = handle.read(1) == b"\n"
    if not whole:
        with path.open("ab") as handle:
            handle.write(b"\n")
