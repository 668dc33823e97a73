"""Files that readers never see half-written: write a temporary file, fsync, rename.

Example:
    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "summary.json"
    >>> atomic_write_text(path, "{}")
    >>> path.read_text()
    '{}'
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from gradsync.errors import UserError

_UMASK = os.umask(0)
os.umask(_UMASK)

# Errors of the device a file is written to, not of gradsync: one line each (WriteFailed).
_DEVICE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
_DEVICE_ADVICE = {
    errno.ENOSPC: "free space there, or pass another --out",
    errno.EDQUOT: "free space within your quota, or pass another --out",
    errno.EROFS: "pass an --out on a writable file system",
}

_live_folders: set[Path] = set()  # run folders a running job writes into (watch_folder)


class WriteFailed(UserError, OSError):
    """A file could not be written for a cause outside gradsync (the disk is full, a quota
    is reached, the file system is read-only, the run folder was removed): one line naming
    the file and the cause. Still an ``OSError``, so a caller that handles failed writes
    (``except OSError``) handles it as before."""


def device_error(
    path: Path, error: BaseException, *, folder: Path | None = None
) -> WriteFailed | None:
    """The one-line :class:`WriteFailed` for ``error``, raised writing ``path``, when its
    cause is the device (no space left, a quota, a read-only file system), also when a
    library wrapped the ``OSError`` in an error of its own (safetensors' SafetensorError says
    "No space left on device (os error 28)"); None for any other error. ``folder``: the
    one to name (the run folder of a file in its subfolder), ``path``'s own by default.

    Example:
        >>> error = device_error(Path("run/x.json"), OSError(28, "No space left on device"))
        >>> isinstance(error, UserError), str(error).split(";")[0]
        (True, 'cannot write run/x.json: No space left on device (the file system of run)')
        >>> device_error(Path("x"), ValueError("bad")) is None
        True
    """
    code = getattr(error, "errno", None) if isinstance(error, OSError) else None
    if code not in _DEVICE_ERRNOS:
        text = str(error)
        code = next((c for c in _DEVICE_ERRNOS if os.strerror(c) in text), None)
        if code is None:
            return None
    return WriteFailed(
        f"cannot write {path}: {os.strerror(code)} (the file system of {folder or path.parent}); "
        f"{_DEVICE_ADVICE[code]}"
    )


def watch_folder(folder: Path) -> None:
    """Mark ``folder`` as the run folder of a job running in this process: from now on a
    write into it while it no longer exists (deleted while the job ran) is one line
    (:func:`check_folder`), never a new empty folder that the job fills blind.

    Example:
        >>> import tempfile
        >>> run = Path(tempfile.mkdtemp()) / "run"
        >>> run.mkdir(); watch_folder(run); run.rmdir()
        >>> atomic_write_text(run / "summary.json", "{}")
        Traceback (most recent call last):
        ...
        gradsync.files.WriteFailed: run folder ... was removed while the job ran; summary.json ...
    """
    _live_folders.add(Path(os.path.abspath(folder)))


def check_folder(path: Path) -> None:
    """WriteFailed when ``path`` lies in a run folder of :func:`watch_folder` that has been
    removed (a new subfolder of one that is still there is made as before)."""
    if not _live_folders or path.parent.is_dir():
        return
    target = Path(os.path.abspath(path))
    for folder in _live_folders:
        if target.is_relative_to(folder) and not folder.is_dir():
            raise WriteFailed(
                f"run folder {folder} was removed while the job ran; {path.name} is not "
                "written there: start the run again"
            )


def atomic_write_bytes(path: Path, write: Any) -> None:
    """Call ``write(tmp_path)`` then rename over ``path``: readers never see a partial file.

    ``tmp_path`` lies in a temporary folder of its own, ``.{name}.{random}.tmp`` beside
    ``path`` (a name gradsync recognizes as its own: ``rundir.is_run_entry``), so that a
    writer's own temporary file (safetensors writes ``.tmpXXXXXX`` beside its target) is
    inside it too, and a process killed mid-write leaves one entry that a claim or resume
    of the folder removes. A missing folder is created, except a run folder removed while
    its job runs (:func:`watch_folder`); a full disk, a quota or a read-only file system is
    one line (:class:`WriteFailed`) and leaves no temporary behind.
    """
    check_folder(path)
    folder = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        folder = tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        tmp = Path(folder) / path.name
        write(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # safetensors creates 0600; results are for everyone
        os.replace(tmp, path)
    except Exception as error:
        if (failed := device_error(path, error)) is not None:
            raise failed from None
        check_folder(path)  # removed while writing: say so, not the write's own error
        raise
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


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
