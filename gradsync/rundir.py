"""Run folders: one job's outputs, never mixed with another job's.

A job refuses a results folder that already holds files (``--overwrite`` clears it
deliberately, but only when it looks like gradsync's own output), and checks before any
process starts that the folder can be created and written.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from gradsync.errors import JobFailed, UserError, one_line
from gradsync.files import atomic_write_text

FAILURE_FILE = "failure.txt"  # a failed job's whole error (record_failure)
LAUNCH_FILE = "launch.json"  # under torchrun, srun or mpirun: the launch that claimed it

# Files and folders a gradsync job writes at the top of its run folder.
RUN_MARKERS = (
    "config.json",
    "summary.json",
    "metrics",
    "stdout.log",
    "checkpoint.safetensors",
    LAUNCH_FILE,
    "verify.json",
    "results.jsonl",
    "commbench.json",
    # predict, predict --validate, predict --experiment:
    "predictions.json",
    "cells.jsonl",
    "predict-experiment.json",
    FAILURE_FILE,
)


# Everything else a gradsync job may write at the top of its folder: with the markers,
# what ``--overwrite`` may clear (a run's subfolders of their own are recognized as runs).
RUN_ENTRIES = frozenset(RUN_MARKERS) | {
    "checkpoint.safetensors.json", "stderr.log", "srun-config.json", "hosts",  # train
    "timeline",  # train --timeline's folder, the timeline command's summaries
    "verify.md", "single-rerun", "results.json", "results.md",  # verify, demo
    "experiment.toml", "report.md", "cells", "plots", "job.sbatch",  # bench, sbatch
    "commbench.md", "commbench.png",  # commbench
    "predictions.md", "scaling.png", "bandwidth.png", "trace.json", "gain-vs-published.png",
    "plan.toml", "profiles", "calibration", "runs", "validation.md", "validation.json",
}  # fmt: skip
# What ``gradsync timeline summarize X.json`` writes beside its trace, whatever its name.
TIMELINE_OUTPUT_SUFFIXES = (".summary.json", ".gantt.png")


def is_run_entry(item: Path) -> bool:
    """Whether ``item``, at the top of a run folder, is a name a gradsync command writes
    there (an atomic write's temporary, ``.{name}.{random}.tmp``, included): one of
    :data:`RUN_ENTRIES`, or a trace's summary or Gantt chart, ``X.summary.json`` or
    ``X.gantt.png``, with that trace ``X.json`` beside it.

    Example:
        >>> import tempfile
        >>> run = Path(tempfile.mkdtemp())
        >>> _ = (run / "t2.json").write_text('{"traceEvents": []}')
        >>> [is_run_entry(run / n) for n in ("hosts", "t2.summary.json", ".t2.gantt.png.1.tmp")]
        [True, True, True]
        >>> is_run_entry(run / "budget.summary.json"), is_run_entry(run / "notes.json")
        (False, False)
    """
    if _is_safetensors_temp(item):
        return True
    name = item.name
    if name.startswith(".") and name.endswith(".tmp"):  # .{entry}.{random}.tmp
        name = name[1:].rsplit(".", 2)[0]
    return name in RUN_ENTRIES or _is_timeline_output(item.with_name(name))


def is_stale_temp(item: Path) -> bool:
    """Whether ``item``, at the top of a run folder, is what an atomic write of gradsync's
    left when its process was killed mid-write: ``.{entry}.{random}.tmp`` (a file, or the
    folder the write used) for a name gradsync writes there, or safetensors' own
    ``.tmpXXXXXX`` of a checkpoint (gradsync before 2026-11 let it write beside the
    checkpoint). Another node's launch files are never stale: that node may be writing them.

    Example:
        >>> import tempfile
        >>> run = Path(tempfile.mkdtemp())
        >>> [is_stale_temp(run / n) for n in (".summary.json.x1.tmp", ".notes.txt.x1.tmp")]
        [True, False]
        >>> is_stale_temp(run / "config.json"), is_stale_temp(run / ".ranks-node1.json.x1.tmp")
        (False, False)
    """
    name = item.name
    if _other_node(name):
        return False
    if _is_safetensors_temp(item):
        return True
    return name.startswith(".") and name.endswith(".tmp") and is_run_entry(item)


def remove_stale_temps(folder: Path) -> list[str]:
    """Remove what killed atomic writes left at the top of the run folder ``folder``
    (:func:`is_stale_temp`; a checkpoint's is the checkpoint's size) and return their
    names; never a user's file, nor what a link points to. Call it only where no writer of
    this run is running: with the folder just locked (a claim, ``--resume``), or at the end
    of a job.

    Example:
        >>> import tempfile
        >>> run = Path(tempfile.mkdtemp())
        >>> (run / ".checkpoint.safetensors.ab12.tmp").mkdir()
        >>> _ = (run / ".config.json.cd34.tmp").write_text("{")
        >>> _ = (run / "notes.tmp").write_text("mine")
        >>> remove_stale_temps(run), sorted(p.name for p in run.iterdir())
        (['.checkpoint.safetensors.ab12.tmp', '.config.json.cd34.tmp'], ['notes.tmp'])
    """
    removed = []
    try:
        items = sorted(folder.iterdir())
    except OSError:
        return removed
    for item in items:
        if not is_stale_temp(item):
            continue
        with contextlib.suppress(OSError):  # gone already, or not ours to remove: leave it
            _remove_entry(item)
            removed.append(item.name)
    return removed


_SAFETENSORS_TEMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")


def _is_safetensors_temp(item: Path) -> bool:
    """Whether ``item`` is safetensors' temporary ``.tmpXXXXXX`` of a gradsync checkpoint: a
    plain file whose header (written first) holds gradsync's metadata."""
    if not _SAFETENSORS_TEMP.fullmatch(item.name) or item.is_symlink() or not item.is_file():
        return False
    try:
        with item.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = handle.read(min(size, 1 << 20))
    except OSError:
        return False
    return header.startswith(b'{"') and b'"__metadata__":{"gradsync":' in header


def _is_timeline_output(item: Path) -> bool:
    """Whether ``item`` is ``X.summary.json`` or ``X.gantt.png`` with a trace ``X.json``
    (a file that starts as gradsync's merged traces do) beside it."""
    from gradsync.trace import TRACE_BEGINS  # here: gradsync.trace imports torch

    for suffix in TIMELINE_OUTPUT_SUFFIXES:
        stem = item.name.removesuffix(suffix)
        if stem and stem != item.name:
            return _begins(item.with_name(f"{stem}.json"), TRACE_BEGINS)
    return False


def claim_run_dir(
    path: Path, *, overwrite: bool, flag: str = "--out", inputs: Iterable[str | Path] = ()
) -> None:
    """Make ``path`` an empty, writable run folder, or raise a one-line UserError.

    An existing folder with files in it is refused unless ``overwrite``; then it is cleared,
    but only if it holds a gradsync output (so ``--overwrite`` cannot empty a home folder),
    and never while one of the run's ``inputs`` (a model file, data, a profile, the
    experiment file) lies inside it.

    Example:
        >>> import tempfile
        >>> run = Path(tempfile.mkdtemp()) / "run"
        >>> claim_run_dir(run, overwrite=False)
        >>> (run / "config.json").write_text("{}")
        2
        >>> claim_run_dir(run, overwrite=False)
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: --out ... already holds a run (config.json); pass --overwrite ...
    """
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file, not a folder; pick another {flag}")
    hold_run_dir(path, flag=flag)  # before looking: a live job's files are never cleared
    found = (
        sorted(p.name for p in path.iterdir() if not _other_node(p.name)) if path.is_dir() else []
    )
    if found:
        if not overwrite:
            raise UserError(
                f"{flag} {path} already holds a run ({', '.join(found[:3])}"
                f"{', …' if len(found) > 3 else ''}); pass --overwrite to replace it, "
                f"or pick another {flag}"
            )
        if not _holds_gradsync_output(path, found):
            raise UserError(
                f"--overwrite refuses to clear {path}: it holds files but no gradsync run "
                f"({', '.join(found[:3])}); pick another {flag}"
            )
        if inside := [str(i) for i in inputs if _lies_inside(Path(i), path)]:
            raise UserError(
                f"--overwrite refuses to clear {path}: this run reads {inside[0]}, which lies "
                f"inside it; move that file out first, or pick another {flag}"
            )
        if foreign := [name for name in found if not _written_by_gradsync(path / name)]:
            raise UserError(
                f"--overwrite refuses to clear {path}: it also holds {', '.join(foreign[:3])}"
                f"{', …' if len(foreign) > 3 else ''}, which gradsync did not write; move "
                f"{'it' if len(foreign) == 1 else 'them'} out first, or pick another {flag}"
            )
        for item in path.iterdir():
            if (item.is_dir() and not item.is_symlink()) or not _other_node(item.name):
                _remove_entry(item)


def _remove_entry(item: Path) -> None:
    """Remove a folder with what it holds, or a file; a link itself, never what it points to."""
    if item.is_dir() and not item.is_symlink():
        shutil.rmtree(item)
    else:
        item.unlink()


_held: dict[Path, int] = {}  # the folders this process locked: open until it exits


def hold_run_dir(path: Path, *, flag: str = "--out") -> None:
    """Lock the folder ``path`` for this process, creating it, or raise a one-line
    UserError: two jobs never write one folder at once. The lock is an ``flock`` on the
    folder itself (no file of its own), which ends with the process however it ends.

    Example:
        >>> import tempfile
        >>> run = Path(tempfile.mkdtemp()) / "run"
        >>> hold_run_dir(run); hold_run_dir(run)  # this process's own: held once
        >>> list(run.iterdir())
        []
    """
    key = path.resolve()
    if key in _held:
        return
    check_writable(path, flag=flag)
    folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(folder)
        raise UserError(
            f"{flag} {path} is being written by another gradsync job right now; wait for it "
            f"to end, or pick another {flag}"
        ) from None
    except OSError:  # a file system without locks (some network mounts): go on unlocked
        os.close(folder)
        return
    _held[key] = folder
    remove_stale_temps(path)  # held now: no writer of ours is running there


def claim_resumable_dir(
    out: Path,
    definition: Path,
    *,
    kept_as: str,
    holds_same: Callable[[Path], bool],
    other: str,
    overwrite: bool,
) -> bool:
    """``out`` for a run that goes on where it stopped; returns whether it goes on.

    A run is defined by a file (an experiment, a validation plan), kept in its folder as
    ``kept_as``. A folder without that copy is claimed as :func:`claim_run_dir` claims one:
    new, empty, or cleared with ``overwrite``. A folder with it goes on when
    ``holds_same(out)`` says its outputs are this run's, and is otherwise refused in one line
    (``other`` says what it holds) unless ``overwrite``. The definition is then copied in,
    which marks the folder as this run's.

    Example:
        >>> import tempfile
        >>> out, plan = Path(tempfile.mkdtemp()) / "v", Path(tempfile.mkdtemp()) / "plan.toml"
        >>> _ = plan.write_text("steps = 5")
        >>> same = lambda folder: (folder / "plan.toml").read_text() == plan.read_text()
        >>> claim = lambda: claim_resumable_dir(out, plan, kept_as="plan.toml",
        ...     holds_same=same, other="another plan's cells", overwrite=False)
        >>> claim(), claim()
        (False, True)
        >>> _ = plan.write_text("steps = 6"); claim()
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: --out ... holds another plan's cells; pass --overwrite ...
    """
    resumes = (out / kept_as).is_file() and not overwrite
    if not resumes:
        claim_run_dir(out, overwrite=overwrite, inputs=[definition])
    elif holds_same(out):
        hold_run_dir(out)
    else:
        raise UserError(
            f"--out {out} holds {other}; pass --overwrite to replace it, or pick another --out"
        )
    kept = out / kept_as
    if not (kept.exists() and kept.samefile(definition)):  # run from the folder's own copy
        shutil.copyfile(definition, kept)
    return resumes


def claim_output_file(
    path: Path, *, overwrite: bool, flag: str = "--out", begins: str | None = None
) -> None:
    """Make sure ``path`` can be written as one output file, or raise a one-line UserError:
    not a folder, its folder creatable and writable, and no existing file replaced unless
    ``overwrite`` (so a trace or a profile never lands on another run's files), and then
    only a file of the kind written, whose text ``begins`` so (a trace, a profile).

    Example:
        >>> import tempfile
        >>> target = Path(tempfile.mkdtemp()) / "profile.json"
        >>> claim_output_file(target, overwrite=False)
        >>> _ = target.write_text("{}")
        >>> claim_output_file(target, overwrite=False)
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: --out ... already exists; pass --overwrite to replace it, ...
    """
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder; name a file (e.g. {path / 'out.json'})")
    if path.exists() and not overwrite:
        raise UserError(
            f"{flag} {path} already exists; pass --overwrite to replace it, or pick another {flag}"
        )
    if path.exists() and begins is not None and not _begins(path, begins):
        raise UserError(
            f"{flag} {path} is not gradsync's output, and --overwrite replaces only that; "
            f"pick another {flag}"
        )
    if any(parent.exists() and not parent.is_dir() for parent in path.parents):
        raise UserError(f"{flag} {path}: a folder on its path is a file; pick another {flag}")
    check_writable(path.parent, flag=flag)


def _begins(path: Path, text: str) -> bool:
    """Whether the file ``path`` starts with ``text`` (unreadable: no)."""
    try:
        with path.open("rb") as handle:
            return handle.read(len(text.encode())) == text.encode()
    except OSError:
        return False


def _holds_gradsync_output(path: Path, names: list[str]) -> bool:
    """Whether a folder holding ``names`` is gradsync's output: a run's files at its top, or
    runs one level down (a ``demo`` or ``verify`` folder, whose cells are runs of their own,
    even when it stopped before writing its summary; a ``predict --experiment`` folder of
    before session 22, with a ``predictions.json`` in each model's subfolder)."""
    if any(name in RUN_MARKERS for name in names):
        return True
    return any(_is_run(path / name) for name in names)


def _written_by_gradsync(item: Path) -> bool:
    """Whether ``item``, at the top of a run folder, is one of gradsync's outputs: a name a
    job writes there (an atomic write's temporary, a dot and a suffix added, included), or
    a folder that is a run of its own (a verify cell), or one that holds nothing else (a
    cell that stopped before its first file: empty)."""
    if is_run_entry(item) or _other_node(item.name):
        return True
    if not item.is_dir() or item.is_symlink():
        return False
    return _is_run(item) or all(_written_by_gradsync(inner) for inner in item.iterdir())


def _is_run(folder: Path) -> bool:
    """A train run (its config and metrics) or a prediction (its predictions)."""
    if (folder / "predictions.json").is_file():
        return True
    return (folder / "config.json").is_file() and (folder / "metrics").is_dir()


def _lies_inside(item: Path, folder: Path) -> bool:
    """Whether ``item`` exists and is ``folder`` or lies below it (links resolved)."""
    if not item.exists():
        return False
    return item.resolve().is_relative_to(folder.resolve())


def _other_node(name: str) -> bool:
    """Bookkeeping of another node of the same multi-node job, which may start first: its
    launch files, their atomic-write temporaries (a leading dot added) and its write probe."""
    return name.lstrip(".").startswith(("ranks-node", "launch-node", "gradsync-probe."))


def check_writable(path: Path, *, flag: str = "--out") -> None:
    """Create ``path`` (and parents) and write a probe file there; UserError when we cannot.

    Example:
        >>> check_writable(Path("/proc/no-such-folder"))
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: --out /proc/no-such-folder cannot be created or written ...
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".gradsync-probe.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise UserError(
            f"{flag} {path} cannot be created or written ({error.strerror or error}); "
            "pick a writable folder"
        ) from None


def record_failure(folder: Path, error: Exception) -> str:
    """Keep a failed job's whole error (the ranks' last stderr lines) in
    ``folder/failure.txt`` and return its most telling line, for a report's one row.

    Only a job that ran leaves the file: a refusal before launch (UserError) is one line
    already, and its folder may not be the job's to write in.

    Example:
        >>> import tempfile
        >>> run = Path(tempfile.mkdtemp())
        >>> record_failure(run, JobFailed("rank 1 failed; its last stderr lines:\\n  KeyError: 3"))
        'KeyError: 3'
        >>> (run / "failure.txt").read_text().splitlines()[-1]
        '  KeyError: 3'
    """
    if isinstance(error, JobFailed) and folder.is_dir():
        with contextlib.suppress(OSError):  # the report's line still says what failed
            atomic_write_text(folder / FAILURE_FILE, f"{error}\n")
    return one_line(error)


__all__ = [
    "RUN_ENTRIES",
    "RUN_MARKERS",
    "check_writable",
    "claim_output_file",
    "claim_resumable_dir",
    "claim_run_dir",
    "hold_run_dir",
    "is_stale_temp",
    "record_failure",
    "remove_stale_temps",
]
