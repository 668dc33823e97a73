"""Two real ranks that disagree on the world size: one clear line each, exit 2, no hang."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradsync.launch import free_port

pytestmark = pytest.mark.slow


def test_ranks_started_with_different_world_sizes(workdir: Path) -> None:
    port = str(free_port())
    argv = [sys.executable, "-m", "gradsync", "train", "--model", "mnist-cnn", "--preset"]
    argv += ["tiny", "--strategy", "allreduce", "--steps", "2", "--timeout", "60", "--out", "run"]
    ranks = [
        subprocess.Popen(
            argv,
            cwd=workdir,
            env={**os.environ, "RANK": str(rank), "WORLD_SIZE": size, "MASTER_PORT": port},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, size in ((0, "2"), (1, "3"))
    ]
    errors = [rank.communicate(timeout=120)[1] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [2, 2], errors
    expected = "was started with 2 ranks, rank 1 on "
    for stderr in errors:
        (line,) = stderr.splitlines()
        assert line.startswith("gradsync: error: ranks disagree on the world size: rank 0 on ")
        assert expected in line and line.endswith(
            "with 3; start every rank from one launch (the same -n / --nproc-per-node × --nnodes)"
        )
