"""Issue 12 end to end: run folders, hangs, signals, resume, restarts, listeners, NaN loss,
bench identity. Small jobs of tests/models/faulty.py (dropout on, so RNG state matters)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from gradsync.checkpoint import load_checkpoint
from tests.e2e.conftest import FAULTY, gradsync

pytestmark = pytest.mark.slow

TINY = ["--model", "mnist-cnn", "--preset", "tiny"]


def _faulty(*extra: str) -> list[str]:
    return ["train", "--model", FAULTY, "--dtype", "float64", "--steps", "20", *extra]


def _assert_bit_identical(reference: Path, other: Path) -> None:
    want, got = load_checkpoint(reference).tensors, load_checkpoint(other).tensors
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert tensor.dtype == got[name].dtype and tensor.equal(got[name]), name


def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "gradsync", *args],
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(path: Path, job: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.stat().st_size > 0):
        assert job.poll() is None, job.communicate()[1]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def test_a_reused_out_is_refused_and_overwrite_replaces_it(workdir: Path) -> None:
    first = gradsync("train", *TINY, "--workers", "2", "--steps", "4", "--out", "run", cwd=workdir)
    assert first.returncode == 0, first.stderr
    again = ["train", *TINY, "--strategy", "single", "--steps", "3", "--out", "run"]
    refused = gradsync(*again, cwd=workdir, timeout=60)
    assert refused.returncode == 2 and "--overwrite" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    replaced = gradsync(*again, "--overwrite", cwd=workdir)
    assert replaced.returncode == 0, replaced.stderr
    summary = json.loads((workdir / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and len(summary["loss"]) == 3
    assert not (workdir / "run" / "metrics" / "rank1.jsonl").exists()
    assert not list((workdir / "run").glob(".launch-*")) + list((workdir / "run").glob("ranks-*"))


def test_unwritable_out_is_one_line_before_launch(workdir: Path) -> None:
    (workdir / "file").write_text("x")
    result = gradsync("train", *TINY, "--steps", "1", "--out", "file/run", cwd=workdir, timeout=60)
    assert result.returncode == 2 and "cannot be created or written" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# The server strategies keep parameters and optimizer state on their servers (hybrid: the
# sparse rows, with lazy momentum; its dense part is allreduced), so a resume must load them
# there. The warm-up spans the checkpoint: the learning rate must go on from step 10.
RESUMED = {
    "single": ("--strategy", "single", "--workers", "1"),
    "ddp": ("--strategy", "ddp", "--workers", "2"),
    "allreduce": ("--strategy", "allreduce", "--workers", "2"),
    "ps": ("--strategy", "ps", "--workers", "2", "--servers", "2", "--push-chunk-mb", "0"),
    "ps-colocate": ("--strategy", "ps", "--workers", "2", "--colocate"),
    "hybrid": ("--strategy", "hybrid", "--workers", "2", "--model-option", "sparse=1"),
    "hybrid-colocate": (
        "--strategy", "hybrid", "--workers", "2", "--colocate", "--model-option", "sparse=1",
    ),
    "p3": ("--strategy", "p3", "--workers", "2", "--slice-size", "40"),
    "p3-colocate": ("--strategy", "p3", "--workers", "2", "--colocate", "--slice-size", "40"),
    # Each worker's own moving average feeds its forward: it must get its own back.
    "allreduce-worker-buffers": (
        "--strategy", "allreduce", "--workers", "2", "--model-option", "ema=1",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(RESUMED))
def test_a_resumed_run_is_bit_identical_to_an_uninterrupted_one(case: str, workdir: Path) -> None:
    crash_rank = "0" if case == "single" else "1"
    common = _faulty(
        *RESUMED[case], "--lr-warmup-steps", "15",
        "--model-option", "crash_at=13", "--model-option", f"crash_rank={crash_rank}",
    )  # fmt: skip
    (workdir / "crashed").touch()  # the reference run does not crash
    reference = gradsync(*common, "--out", "reference", cwd=workdir)
    assert reference.returncode == 0, reference.stderr
    (workdir / "crashed").unlink()
    interrupted = gradsync(*common, "--checkpoint-every", "10", "--out", "run", cwd=workdir)
    assert interrupted.returncode != 0 and "SIGKILL" in interrupted.stderr
    assert load_checkpoint(workdir / "run").meta["step"] == 10
    resumed = gradsync(*common, "--checkpoint-every", "10", "--resume", "run", cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr
    _assert_bit_identical(workdir / "reference", workdir / "run")
    summary = json.loads((workdir / "run" / "summary.json").read_text())
    assert len(summary["loss"]) == 20


@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_max_restarts_survives_a_killed_rank(strategy: str, workdir: Path) -> None:
    common = _faulty("--strategy", strategy, "--workers", "2", "--model-option", "crash_at=13")
    (workdir / "crashed").touch()
    reference = gradsync(*common, "--out", "reference", cwd=workdir)
    assert reference.returncode == 0, reference.stderr
    (workdir / "crashed").unlink()
    result = gradsync(
        *common, "--checkpoint-every", "10", "--max-restarts", "1", "--out", "run", cwd=workdir
    )
    assert result.returncode == 0, result.stderr
    assert "restart 1 of 1" in result.stderr and "checkpoint at step 10" in result.stderr
    _assert_bit_identical(workdir / "reference", workdir / "run")


def test_a_stopped_rank_is_named_within_90_s(workdir: Path) -> None:
    args = ["train", *TINY, "--workers", "2", "--steps", "100000", "--hang-timeout", "30"]
    job = _start([*args, "--out", "run"], workdir)
    try:
        _wait_for(workdir / "run" / "metrics" / "rank1.jsonl", job)
        pids = json.loads((workdir / "run" / "ranks-node0.json").read_text())
        stopped_at = time.monotonic()
        os.kill(pids["1"], signal.SIGSTOP)
        _, stderr = job.communicate(timeout=90)
        assert time.monotonic() - stopped_at < 90
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 1
    assert "rank 1 (worker" in stderr and "hung" in stderr and "stopped" in stderr, stderr
    assert "of step" in stderr  # its last phase and step


def test_sigterm_stops_cleanly_with_a_consistent_checkpoint(workdir: Path) -> None:
    args = ["train", *TINY, "--workers", "2", "--steps", "100000", "--checkpoint-every", "2"]
    job = _start([*args, "--out", "run"], workdir)
    run = workdir / "run"
    try:
        _wait_for(run / "checkpoint.safetensors", job)
        pids = json.loads((run / "ranks-node0.json").read_text())
        job.send_signal(signal.SIGTERM)
        _, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 143, stderr
    assert stderr.strip().splitlines()[-1] == "gradsync: stopped by SIGTERM; every rank was stopped"
    assert not [p.name for p in run.rglob("*") if p.name.endswith(".tmp")]
    assert not list(run.glob(".launch-*")) and not list(run.glob("ranks-*"))
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with safe_open(str(run / "checkpoint.safetensors"), framework="pt") as handle:
        header = json.loads(handle.metadata()["gradsync"])
    sidecar = json.loads((run / "checkpoint.safetensors.json").read_text())
    assert header == sidecar


def _listening(pids: list[int]) -> list[tuple[str, str]]:
    """(local address hex, file) of every TCP listener owned by ``pids``."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append((fields[1].rsplit(":", 1)[0], table))
    return found


def test_a_local_job_listens_on_loopback_only(workdir: Path) -> None:
    job = _start(["train", *TINY, "--workers", "2", "--steps", "100000", "--out", "run"], workdir)
    try:
        _wait_for(workdir / "run" / "metrics" / "rank1.jsonl", job)
        pids = json.loads((workdir / "run" / "ranks-node0.json").read_text())
        listeners = _listening([job.pid, *pids.values()])
    finally:
        job.terminate()
        job.communicate(timeout=60)
    assert listeners, "the job's store and Gloo pairs should be listening"
    loopback = ("0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000")
    wildcard = [(address, table) for address, table in listeners if address not in loopback]
    assert not wildcard, f"listeners outside loopback: {wildcard}"


def test_a_loss_that_becomes_nan_stops_the_job_at_that_step(workdir: Path) -> None:
    """Not restarted either: --max-restarts relaunched it from a checkpoint that reaches the
    same NaN (session 31's probe)."""
    args = _faulty("--workers", "2", "--model-option", "nan_at=6", "--out", "run")
    result = gradsync(*args, "--max-restarts", "2", "--checkpoint-every", "2", cwd=workdir)
    assert result.returncode == 1
    assert "loss is nan at step 5" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr.split("gradsync: job failed:")[-1]
    assert "restart 1 of 2" not in result.stderr


def test_bench_reruns_changed_cells_and_skips_a_truncated_line(workdir: Path) -> None:
    experiment = workdir / "one.toml"
    text = 'name = "one"\nmodels = ["mnist-cnn"]\npreset = "tiny"\nstrategies = ["single"]\n'
    experiment.write_text(text + "workers = [1]\nsteps = 3\n")
    assert gradsync("bench", str(experiment), "--out", "out", cwd=workdir).returncode == 0
    experiment.write_text(text + "workers = [1]\nsteps = 4\n")
    changed = gradsync("bench", str(experiment), "--out", "out", cwd=workdir)
    assert changed.returncode == 0, changed.stderr
    assert "runs again, its settings changed (steps 3 → 4)" in changed.stdout
    results = workdir / "out" / "results.jsonl"
    last = results.read_text().splitlines()[-1]
    assert len(json.loads(last)["step_times_s"]) == 4
    results.write_text(results.read_text()[: -len(last) // 2])  # killed mid-write
    report = gradsync("report", "out", cwd=workdir, timeout=120)
    assert report.returncode == 0 and "not a complete record" in report.stderr
    resumed = gradsync("bench", str(experiment), "--out", "out", cwd=workdir)
    assert resumed.returncode == 0 and "runs again" in resumed.stdout  # the cut record is gone
    assert len(json.loads(results.read_text().splitlines()[-1])["step_times_s"]) == 4


def test_a_run_stopped_before_its_summary_is_finished_by_resume(workdir: Path) -> None:
    """A rank killed after the final checkpoint but before summary.json: --resume with the
    same --steps was refused ("pass a larger --steps"), so the run could never be summarized
    (session 31's probe)."""
    args = ["train", *TINY, "--workers", "2", "--steps", "4", "--checkpoint-every", "4"]
    assert gradsync(*args, "--out", "run", cwd=workdir).returncode == 0
    (workdir / "run" / "summary.json").unlink()
    resumed = gradsync(*args, "--resume", "run", cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr
    assert len(json.loads((workdir / "run" / "summary.json").read_text())["loss"]) == 4
    again = gradsync(*args, "--resume", "run", cwd=workdir, timeout=60)
    assert again.returncode == 2 and "pass a larger --steps" in again.stderr
