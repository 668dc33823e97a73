"""The same strategy, worker count and seed gives bit-identical parameters on a rerun."""

from __future__ import annotations

from pathlib import Path

import torch

from gradsync.checkpoint import load_checkpoint
from tests.e2e.conftest import gradsync


def test_rerun_is_bit_identical_with_dropout_on(workdir: Path) -> None:
    args = [
        "train",
        "--model",
        "transformer",
        "--preset",
        "tiny",
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--steps",
        "10",
    ]
    for out in ("first", "second"):
        result = gradsync(*args, "--out", out, cwd=workdir)
        assert result.returncode == 0, result.stderr
    first, second = load_checkpoint(workdir / "first"), load_checkpoint(workdir / "second")
    assert first.tensors.keys() == second.tensors.keys()
    for name, tensor in first.tensors.items():
        assert torch.equal(tensor, second.tensors[name]), name
    compare = gradsync("compare", "first", "second", "--tolerance", "0", cwd=workdir)
    assert compare.returncode == 0, compare.stdout


def test_different_seed_gives_different_parameters(workdir: Path) -> None:
    args = [
        "train",
        "--model",
        "mnist-cnn",
        "--preset",
        "tiny",
        "--strategy",
        "single",
        "--steps",
        "3",
    ]
    assert gradsync(*args, "--seed", "1", "--out", "s1", cwd=workdir).returncode == 0
    assert gradsync(*args, "--seed", "2", "--out", "s2", cwd=workdir).returncode == 0
    compare = gradsync("compare", "s1", "s2", cwd=workdir)
    assert compare.returncode == 1
