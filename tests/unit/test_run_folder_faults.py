"""Run-folder faults (docs/faults.md, Outputs): a rank killed mid-checkpoint, a full disk,
a run folder deleted while its job runs, a run killed before its summary."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from gradsync import checkpoint as checkpoint_module
from gradsync.checkpoint import load_checkpoint, save_checkpoint, sidecar_path
from gradsync.errors import UserError
from gradsync.files import WriteFailed, atomic_write_bytes, atomic_write_text
from gradsync.metrics import (
    METRICS_DIR,
    SUMMARY_FILE,
    MetricsWriter,
    StepRecord,
    summarize,
    unsummarized,
)
from gradsync.rundir import claim_run_dir, hold_run_dir, is_stale_temp, remove_stale_temps

REPO = Path(__file__).resolve().parents[2]
META = {"model": "m", "step": 1}


def _record(step: int, rank: int = 0) -> StepRecord:
    return StepRecord(
        step=step,
        rank=rank,
        loss=1.0 / (step + 1),
        step_time_s=0.1,
        samples_per_s=80.0,
        bytes_sent=10,
        bytes_recv=10,
        exposed_comm_s=0.0,
        lr=0.1,
    )


def _gradsync_header_file(path: Path) -> None:
    """What safetensors has written of a gradsync checkpoint when its writer is killed:
    the header, then part of the tensors."""
    header = b'{"__metadata__":{"gradsync":"{}"},"param/w":{"dtype":"F32"}}'
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4096)


# ------------------------------------------------ 1. a rank killed mid-checkpoint

# A rank SIGKILLed while safetensors writes its checkpoint (safetensors >= 0.6 writes its own
# temporary, .tmpXXXXXX, beside the file it is given, then renames it).
KILLED_WRITER = """
import os, signal, sys
from pathlib import Path
import torch
from gradsync import checkpoint

def killed(tensors, filename, metadata=None):
    sys.path.insert(0, {tests!r})
    from test_run_folder_faults import _gradsync_header_file
    _gradsync_header_file(Path(filename).parent / ".tmpYkwQaj")
    os.kill(os.getpid(), signal.SIGKILL)

checkpoint.save_file = killed
checkpoint.save_checkpoint(Path(sys.argv[1]) / "checkpoint.safetensors",
                           {{"param/w": torch.ones(2)}}, {{"step": 2}})
"""


def _run_killed_writer(run: Path) -> None:
    script = KILLED_WRITER.format(tests=str(REPO / "tests" / "unit"))
    result = subprocess.run(
        [sys.executable, "-c", script, str(run)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == -signal.SIGKILL, result.stderr


def _a_run(run: Path) -> None:
    (run / METRICS_DIR).mkdir(parents=True)
    (run / "config.json").write_text("{}")
    save_checkpoint(run / "checkpoint.safetensors", {"param/w": torch.zeros(2)}, META)


def test_a_write_killed_mid_checkpoint_leaves_only_a_temp_gradsync_knows(tmp_path: Path) -> None:
    """Before: safetensors' .tmpYkwQaj lay at the top of the run folder, and --overwrite
    refused it ("holds .tmpYkwQaj, which gradsync did not write")."""
    run = tmp_path / "run"
    _a_run(run)
    _run_killed_writer(run)
    left = [p for p in run.iterdir() if p.name.startswith(".")]
    assert len(left) == 1 and left[0].name.startswith(".checkpoint.safetensors.")
    assert left[0].is_dir() and [p.name for p in left[0].iterdir()] == [".tmpYkwQaj"]
    assert is_stale_temp(left[0])
    assert load_checkpoint(run / "checkpoint.safetensors").meta["step"] == 1  # intact
    claim_run_dir(run, overwrite=True)
    assert not any(run.iterdir())


def test_holding_a_run_folder_removes_stale_temps_only(tmp_path: Path) -> None:
    """A resume (or a claim) holds the folder: what killed writes left goes; before, the
    checkpoint-sized temporaries survived a successful --resume for good."""
    run = tmp_path / "run"
    _a_run(run)
    _run_killed_writer(run)
    _gradsync_header_file(run / ".tmpAbC123")  # an older gradsync let safetensors write here
    (run / ".summary.json.k2j4abcd.tmp").write_text("{")
    mine = [".tmpNotOur", ".notes.txt.x1.tmp", "notes.tmp", ".ranks-node1.json.q1.tmp"]
    for name in mine:
        (run / name).write_text("a user's file, or another node's")
    hold_run_dir(run, flag="--resume")
    assert sorted(p.name for p in run.iterdir()) == sorted(
        [*mine, "checkpoint.safetensors", "checkpoint.safetensors.json", "config.json", "metrics"]
    )


def test_overwrite_accepts_an_older_gradsyncs_safetensors_temp_not_a_users(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    _a_run(run)
    (run / ".tmpXy12Ab").write_text("not a checkpoint")
    with pytest.raises(UserError, match=r"\.tmpXy12Ab, which gradsync did not write"):
        claim_run_dir(run, overwrite=True)
    (run / ".tmpXy12Ab").unlink()
    _gradsync_header_file(run / ".tmpYkwQaj")
    claim_run_dir(run, overwrite=True)
    assert not any(run.iterdir())


def test_a_summary_removes_what_a_killed_attempt_left(tmp_path: Path) -> None:
    """A restart in the same launcher holds the folder already: the end of the job sweeps."""
    writer = MetricsWriter(tmp_path, 0)
    for step in range(3):
        writer.write(_record(step))
    writer.close()
    (tmp_path / ".checkpoint.safetensors.ab12cd34.tmp").mkdir()
    _gradsync_header_file(tmp_path / ".checkpoint.safetensors.ab12cd34.tmp" / ".tmpYkwQaj")
    summarize(tmp_path, global_batch=8, measure_warmup=1, run_info={"workers": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == [METRICS_DIR, SUMMARY_FILE]


def test_remove_stale_temps_never_follows_a_link(tmp_path: Path) -> None:
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "data.bin").write_text("x")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".checkpoint.safetensors.ab12cd34.tmp").symlink_to(kept)
    assert remove_stale_temps(run) == [".checkpoint.safetensors.ab12cd34.tmp"]
    assert (kept / "data.bin").is_file()


# ------------------------------------------------------------------ 2. a full disk


@pytest.mark.parametrize(
    "code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS], ids=["ENOSPC", "EDQUOT", "EROFS"]
)
def test_a_full_disk_is_one_line_and_keeps_the_old_file(tmp_path: Path, code: int) -> None:
    target = tmp_path / "summary.json"
    atomic_write_text(target, "old\n")

    def fails(tmp: Path) -> None:
        tmp.write_text("new, half")
        raise OSError(code, os.strerror(code))

    with pytest.raises(UserError) as caught:
        atomic_write_bytes(target, fails)
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"cannot write {target}: {os.strerror(code)}")
    assert "--out" in line and isinstance(caught.value, OSError)
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_safetensors_no_space_is_one_line_and_the_checkpoint_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: rank 0 ended in a 15-line traceback, SafetensorError ... No space left."""
    path = tmp_path / "checkpoint.safetensors"
    save_checkpoint(path, {"param/w": torch.zeros(4)}, META)
    before = path.read_bytes(), sidecar_path(path).read_text()

    def disk_full(tensors, filename, metadata=None):
        _gradsync_header_file(Path(filename).parent / ".tmpQw12Er")  # safetensors' own
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(checkpoint_module, "save_file", disk_full)
    with pytest.raises(WriteFailed, match=r"^cannot write .*checkpoint.safetensors: No space"):
        save_checkpoint(path, {"param/w": torch.ones(4)}, {**META, "step": 2})
    assert (path.read_bytes(), sidecar_path(path).read_text()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint.safetensors",
        "checkpoint.safetensors.json",
    ]


def test_a_metrics_line_on_a_full_disk_is_one_line(tmp_path: Path) -> None:
    """Before: OSError [Errno 28] at metrics.py, a traceback. /dev/full answers ENOSPC."""
    (tmp_path / METRICS_DIR).mkdir()
    (tmp_path / METRICS_DIR / "rank0.jsonl").symlink_to("/dev/full")
    writer = MetricsWriter(tmp_path, 0)
    with pytest.raises(WriteFailed) as caught:
        writer.write(_record(0))
    assert str(caught.value).startswith(
        f"cannot write {tmp_path / METRICS_DIR / 'rank0.jsonl'}: No space left on device "
        f"(the file system of {tmp_path})"
    )


def test_other_write_errors_are_unchanged(tmp_path: Path) -> None:
    def fails(tmp: Path) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    with pytest.raises(PermissionError):
        atomic_write_bytes(tmp_path / "x.json", fails)
    assert not any(tmp_path.iterdir())


# ------------------------------------------------- 3. the run folder deleted mid-run


def test_a_run_folder_removed_mid_run_is_one_line_not_recreated(tmp_path: Path) -> None:
    """Before: the next checkpoint re-created the folder (no lock, config or metrics), the
    job trained on blind and failed at the end: ValueError: no steps to measure."""
    run = tmp_path / "run"
    writer = MetricsWriter(run, 0)
    writer.write(_record(0))
    shutil.rmtree(run)
    with pytest.raises(WriteFailed, match=f"run folder {run} was removed while the job ran"):
        writer.write(_record(1))
    with pytest.raises(WriteFailed, match=f"run folder {run} was removed while the job ran"):
        save_checkpoint(run / "checkpoint.safetensors", {"param/w": torch.ones(2)}, META)
    assert not run.exists()


def test_a_metrics_file_removed_mid_run_is_one_line(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path, 3)
    (tmp_path / METRICS_DIR / "rank3.jsonl").unlink()
    with pytest.raises(WriteFailed, match=r"rank3.jsonl was removed while the job ran"):
        writer.write(_record(0, rank=3))


def test_a_first_write_still_creates_its_folder(tmp_path: Path) -> None:
    """Only a job's own run folder, once gone, is refused: a new folder is made as before."""
    MetricsWriter(tmp_path / "run", 0).close()
    atomic_write_text(tmp_path / "other" / "a" / "report.md", "x")
    atomic_write_text(tmp_path / "run" / "cells" / "c1" / "summary.json", "{}")
    assert (tmp_path / "other" / "a" / "report.md").is_file()
    assert json.loads((tmp_path / "run" / "cells" / "c1" / "summary.json").read_text()) == {}


# ------------------------------------------- 4. killed after the final checkpoint


def test_a_run_without_its_summary_is_unsummarized(tmp_path: Path) -> None:
    """What --resume needs to finish a run killed after its final checkpoint (resume.py's
    check_resume refuses step == --steps unless ``unsummarized``)."""
    assert not unsummarized(tmp_path)  # no metrics: nothing to summarize
    writer = MetricsWriter(tmp_path, 0)
    for step in range(3):
        writer.write(_record(step))
    writer.close()
    assert unsummarized(tmp_path)
    summarize(tmp_path, global_batch=8, measure_warmup=1, run_info={"workers": 1})
    assert not unsummarized(tmp_path)
