"""Failure contract (DESIGN.md §5): no hangs, named ranks, one-line user errors, exit 2."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import gradsync, kill_rank_when_running


def test_sigkilled_rank_ends_the_job_naming_it(workdir: Path) -> None:
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gradsync",
            "train",
            "--model",
            "lstm-lm",
            "--preset",
            "tiny",
            "--strategy",
            "allreduce",
            "--workers",
            "2",
            "--steps",
            "100000",
            "--out",
            "run",
        ],
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    stderr, elapsed, pids = kill_rank_when_running(job, workdir / "run", "rank1.jsonl", 1)
    assert job.returncode not in (0, None)
    assert elapsed < 30
    assert "rank 1" in stderr and "SIGKILL" in stderr, stderr
    assert "Traceback" not in stderr, stderr  # the survivor's lost connection: one line
    with pytest.raises(ProcessLookupError):
        os.kill(pids["0"], 0)  # the surviving rank was torn down too


BAD_INPUTS = {
    "unknown model": (["train", "--model", "resnet", "--steps", "1"], "unknown model 'resnet'"),
    "unknown strategy": (
        ["train", "--strategy", "gossip", "--steps", "1"],
        "unknown strategy 'gossip'",
    ),
    "indivisible batch": (
        ["train", "--model", "mnist-cnn", "--workers", "3", "--global-batch", "8", "--steps", "1"],
        "does not divide by --workers 3",
    ),
    "missing data": (
        ["train", "--model", "mnist-cnn", "--data", "no/such/dir", "--steps", "1"],
        "no/such/dir does not exist",
    ),
    "unknown preset": (["train", "--model", "vgg16", "--preset", "huge"], "unknown preset"),
    "bad model option": (
        ["train", "--model", "lstm-lm", "--model-option", "sparse=maybe"],
        "sparse",
    ),
    "single with workers": (["train", "--strategy", "single", "--workers", "2"], "--workers 1"),
    "bad flag": (["train", "--workers", "zero"], "not an integer"),
    "seed beyond torch's": (["train", "--seed", str(1 << 64)], "is not a seed from 0 to 2**63"),
    "unknown optimizer": (["train", "--optimizer", "lamb"], "unknown optimizer"),
    "verify on GPUs it cannot have": (
        ["verify", "--model", "mnist-cnn", "--device", "cuda", "--strategies", "ps"],
        "--device cuda",
    ),
    "server strategy on a GPU": (
        ["train", "--strategy", "ps", "--device", "cuda", "--steps", "1"],
        "trains on the CPU only",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2(case: str, workdir: Path) -> None:
    args, message = BAD_INPUTS[case]
    result = gradsync(*args, "--out", "run", cwd=workdir, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gradsync: error: ") and message in lines[0], lines[0]
    assert not (workdir / "run").exists()  # refused before anything was written


def test_port_in_use_is_a_user_error(workdir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = gradsync(
            "train",
            "--model",
            "mnist-cnn",
            "--preset",
            "tiny",
            "--workers",
            "2",
            "--master-port",
            str(port),
            "--steps",
            "1",
            "--out",
            "run",
            cwd=workdir,
            timeout=60,
        )
    assert result.returncode == 2
    assert f"--master-port {port}" in result.stderr and "Traceback" not in result.stderr


def test_corrupt_checkpoint_is_a_user_error(workdir: Path) -> None:
    good = gradsync(
        "train",
        "--model",
        "mnist-cnn",
        "--preset",
        "tiny",
        "--strategy",
        "single",
        "--steps",
        "1",
        "--out",
        "good",
        cwd=workdir,
    )
    assert good.returncode == 0, good.stderr
    corrupt = workdir / "corrupt.safetensors"
    corrupt.write_bytes((workdir / "good" / "checkpoint.safetensors").read_bytes()[:100])
    result = gradsync("compare", "good", str(corrupt), cwd=workdir, timeout=60)
    assert result.returncode == 2
    assert "corrupt" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_compare_of_different_models_is_a_user_error(workdir: Path) -> None:
    for model in ("mnist-cnn", "resnet56"):
        run = gradsync(
            "train",
            "--model",
            model,
            "--preset",
            "tiny",
            "--strategy",
            "single",
            "--steps",
            "1",
            "--out",
            model,
            cwd=workdir,
        )
        assert run.returncode == 0, run.stderr
    result = gradsync("compare", "mnist-cnn", "resnet56", cwd=workdir, timeout=60)
    assert result.returncode == 2
    assert "different models" in result.stderr and "Traceback" not in result.stderr


def test_failing_rank_user_error_reaches_the_launcher_as_exit_2(workdir: Path) -> None:
    """An error only a rank can see (a malformed data file) is still one line and exit 2."""
    data = workdir / "mnist"
    data.mkdir()
    (data / "train-images-idx3-ubyte").write_bytes(b"not an idx file")
    (data / "train-labels-idx1-ubyte").write_bytes(b"nor this")
    result = gradsync(
        "train",
        "--model",
        "mnist-cnn",
        "--preset",
        "tiny",
        "--workers",
        "2",
        "--data",
        str(data),
        "--steps",
        "1",
        "--out",
        "run",
        cwd=workdir,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("gradsync: error:") == 1, result.stderr


UNFREEZES_ITS_HEAD = """
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.head.requires_grad_(False)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:  # fine-tuning that unfreezes its head during the run
            self.head.requires_grad_(True)
        return self.head(torch.relu(self.body(x)))


def build():
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    return Model(), data, nn.functional.cross_entropy
"""


def test_a_parameter_unfrozen_during_training_stops_the_run(workdir: Path) -> None:
    """Every strategy synchronizes the parameters trainable at set-up: a layer unfrozen in
    forward would be updated with each worker's own gradient, the copies drifting apart
    silently. The run stops at that step, one line, exit 2."""
    (workdir / "unfreezes.py").write_text(UNFREEZES_ITS_HEAD)
    result = gradsync("train", "--model", "unfreezes.py:build", "--strategy", "allreduce",
                      "--workers", "2", "--steps", "5", "--out", "run", cwd=workdir)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "parameter 'head.weight' was frozen when training started" in result.stderr
    assert "Traceback" not in result.stderr


CLAMPS_LATER = """
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:  # a max-norm constraint that first binds after some steps
            with torch.no_grad():
                self.body.weight.mul_(0.5)
        return self.head(torch.relu(self.body(x)))


def build():
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    return Model(), data, nn.functional.cross_entropy
"""


@pytest.mark.parametrize("strategy", ["ps", "p3"])
def test_a_later_edit_in_forward_to_server_values_stops_the_run(
    workdir: Path, strategy: str
) -> None:
    """The launcher's trial forward does not change the weight; the third forward does.
    Under ps and p3 the servers' values would overwrite the change at the next step: the
    run was silently wrong (verify 4e-2 from single). It stops at that step, one line,
    exit 2."""
    (workdir / "clamps.py").write_text(CLAMPS_LATER)
    result = gradsync("train", "--model", "clamps.py:build", "--strategy", strategy,
                      "--workers", "2", "--steps", "5", "--out", "run", cwd=workdir)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "changes parameter body.weight in place during forward at step" in result.stderr
    assert "Traceback" not in result.stderr
