"""End-to-end helpers: run the real ``gradsync`` command in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
# A user model that fails on purpose where asked (its options: tests/models/faulty.py).
FAULTY = f"{REPO / 'tests' / 'models' / 'faulty.py'}:build"
USER_MODEL = REPO / "examples" / "user_model.py"


def gradsync(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``gradsync ARGS`` and capture its output (fails the test on timeout)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "gradsync", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def verify_outcomes(out: Path) -> list[dict[str, Any]]:
    return json.loads((out / "verify.json").read_text())["outcomes"]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


def kill_rank_when_running(
    job: subprocess.Popen[str], out: Path, metrics_file: str, rank: int
) -> tuple[str, float, dict[str, int]]:
    """Once ``metrics_file`` shows progress, SIGKILL ``rank``; return the job's stderr, the
    seconds from the kill until the job ended, and the ranks' pids (the job is killed if it
    outlives 30 s)."""
    metrics = out / "metrics" / metrics_file
    try:
        deadline = time.monotonic() + 60
        while not (metrics.exists() and metrics.stat().st_size > 0):
            assert time.monotonic() < deadline and job.poll() is None, "the job never started"
            time.sleep(0.1)
        pids = json.loads((out / "ranks-node0.json").read_text())
        killed_at = time.monotonic()
        os.kill(pids[str(rank)], signal.SIGKILL)
        _, stderr = job.communicate(timeout=30)
        return stderr, time.monotonic() - killed_at, pids
    finally:
        if job.poll() is None:
            job.kill()
