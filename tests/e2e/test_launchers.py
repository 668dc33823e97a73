"""Started by torchrun, by an MPI/Slurm-style environment, or as two "nodes" on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gradsync.launch import free_port
from tests.e2e.conftest import gradsync

TRAIN = [
    "train",
    "--model",
    "mnist-cnn",
    "--preset",
    "tiny",
    "--strategy",
    "allreduce",
    "--steps",
    "4",
]


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_torchrun_provides_the_ranks(workdir: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "-m",
            "gradsync",
            *TRAIN,
            "--out",
            "run",
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "torchrun: intra-op threads 1" in result.stdout
    summary = _summary(workdir / "run")
    assert summary["launcher"] == "torchrun" and summary["workers"] == 2


def test_torchrun_world_size_mismatch_is_a_user_error(workdir: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "-m",
            "gradsync",
            *TRAIN,
            "--workers",
            "3",
            "--out",
            "run",
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode != 0
    assert "torchrun started 2 processes but --workers 3" in result.stderr


def _spawn_with_env(workdir: Path, envs: list[dict[str, str]], out: str) -> list[subprocess.Popen]:
    return [
        subprocess.Popen(
            [sys.executable, "-m", "gradsync", *TRAIN, "--out", out],
            cwd=workdir,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for env in envs
    ]


def test_open_mpi_environment(workdir: Path) -> None:
    port = str(free_port())
    envs = [
        {
            "OMPI_COMM_WORLD_RANK": str(r),
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "MASTER_PORT": port,
        }
        for r in range(2)
    ]
    processes = _spawn_with_env(workdir, envs, "mpi")
    outputs = [p.communicate(timeout=300) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    assert _summary(workdir / "mpi")["launcher"] == "mpirun"


def test_slurm_srun_environment(workdir: Path) -> None:
    port = free_port()
    envs = [
        {
            "SLURM_PROCID": str(r),
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_LOCALID": str(r),
            "SLURM_STEP_TASKS_PER_NODE": "2",
            "SLURM_STEP_NODELIST": "localhost",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        for r in range(2)
    ]
    processes = _spawn_with_env(workdir, envs, "slurm")
    outputs = [p.communicate(timeout=300) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    assert _summary(workdir / "slurm")["launcher"] == "slurm"


def test_two_nodes_with_gradsyncs_own_launcher(workdir: Path) -> None:
    """Two `gradsync train --nnodes 2` processes, one per node, meet at the master port."""
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gradsync",
                *TRAIN,
                "--workers",
                "4",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                "--out",
                "nodes" if node == 0 else "node1-own-disk",
            ],
            cwd=workdir,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    summary = _summary(workdir / "nodes")
    # Node 1 wrote to a folder of its own (a disk node 0 does not see): node 0 summarizes
    # what it has and says so; node 1 does not look for a summary of its own.
    assert summary["workers"] == 4 and set(summary["ranks"]) == {"0", "1"}
    assert "the summary covers 2 of 4 workers" in outputs[0][0]
    assert "node 1: done; node 0 writes the results" in outputs[1][0]
    assert {p.name for p in (workdir / "node1-own-disk" / "metrics").iterdir()} == {
        "rank2.jsonl",
        "rank3.jsonl",
    }


def test_rank_0_claims_the_folder_under_torchrun(workdir: Path) -> None:
    """A used --out is refused on every rank, as by gradsync's own launcher; the run in it
    stays whole; --overwrite replaces it, and the new trace holds this job's ranks only."""
    first = _torchrun(workdir, 3, "--strategy", "ps", "--workers", "2", "--timeline", "t1.json")
    assert first.returncode == 0, first.stderr
    checkpoint = (workdir / "claimed" / "checkpoint.safetensors").read_bytes()
    again = _torchrun(workdir, 2, "--strategy", "ddp", "--timeline", "t2.json")
    assert again.returncode != 0
    refusals = [line for line in again.stderr.splitlines() if "already holds a run" in line]
    assert len(refusals) == 2, again.stderr  # every rank, one line each
    assert (workdir / "claimed" / "checkpoint.safetensors").read_bytes() == checkpoint
    replaced = _torchrun(workdir, 2, "--strategy", "ddp", "--timeline", "t2.json", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    events = json.loads((workdir / "t2.json").read_text())["traceEvents"]
    assert {event["pid"] for event in events} == {0, 1}


FAILS_ON_FIRST_ATTEMPT = """
import os

import torch
from torch import nn
from torch.utils.data import TensorDataset


def build(**request):
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ.get("RANK") == "1":
        raise RuntimeError("rank 1 fails on the first attempt")
    generator = torch.Generator().manual_seed(request.get("seed", 0))
    data = TensorDataset(torch.randn(64, 8, generator=generator), torch.arange(64) % 3)
    return nn.Linear(8, 3), data, nn.functional.cross_entropy
"""


def test_a_torchrun_restart_takes_its_own_folder_back(workdir: Path) -> None:
    """Rank 0 claimed --out on the first attempt; the restarted launch (--max-restarts) is
    the same run id, so it is not refused as 'already holds a run'."""
    (workdir / "flaky.py").write_text(FAILS_ON_FIRST_ATTEMPT)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--max-restarts=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            "--rdzv-id=flaky",
            "-m",
            "gradsync",
            "train",
            "--model",
            "flaky.py:build",
            "--strategy",
            "allreduce",
            "--steps",
            "3",
            "--global-batch",
            "8",
            "--timeout",
            "60",
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 1 fails on the first attempt" in result.stdout + result.stderr
    out = workdir / "runs" / "train-allreduce-torchrun-run-flaky"
    assert json.loads((out / "summary.json").read_text())["workers"] == 2
    assert json.loads((out / "launch.json").read_text()) == {"job": "torchrun run flaky"}


def _torchrun(workdir: Path, processes: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={processes}",
            "--master-port",
            str(free_port()),
            "-m",
            "gradsync",
            *TRAIN,
            "--out",
            "claimed",
            "--timeout",
            "60",
            *args,
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_metrics_lines_carry_bytes_per_rank(workdir: Path) -> None:
    for strategy in ("ddp", "allreduce"):
        result = gradsync(
            "train",
            "--model",
            "mnist-cnn",
            "--preset",
            "tiny",
            "--strategy",
            strategy,
            "--workers",
            "2",
            "--steps",
            "3",
            "--out",
            strategy,
            cwd=workdir,
        )
        assert result.returncode == 0, result.stderr
        for rank in (0, 1):
            lines = (workdir / strategy / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()
            records = [json.loads(line) for line in lines]
            assert [r["step"] for r in records] == [0, 1, 2]
            assert all(r["bytes_sent"] > 0 and r["bytes_recv"] > 0 for r in records)
            assert all(r["samples_per_s"] > 0 and r["loss"] > 0 for r in records)
    ddp = _summary(workdir / "ddp")["bytes_sent_per_step"]
    allreduce = _summary(workdir / "allreduce")["bytes_sent_per_step"]
    # Same gradients, same ring model, no compression; allreduce's buckets also carry one
    # had-a-gradient flag per parameter (a float32 each; the ring factor at 2 ranks is 1).
    from gradsync.models import build_workload

    tensors = len(list(build_workload("mnist-cnn", preset="tiny").model.parameters()))
    assert allreduce - ddp == 4 * tensors
