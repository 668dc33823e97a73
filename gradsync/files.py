"""Files that readers never see half-written: write a temporary file, fsync, rename.

Example:
    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "summary.json"
    >>> atomic_write_text(path, "{}")
    >>> path.read_text()
    '{}'
"""

from __future__ import annotations

import os
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
