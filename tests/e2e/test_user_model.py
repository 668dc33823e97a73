"""A user model file works end to end: train, verify, compare."""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.conftest import USER_MODEL, gradsync, verify_outcomes


def test_user_model_train_verify_compare(workdir: Path) -> None:
    model = f"{USER_MODEL}:build"
    train = gradsync(
        "train",
        "--model",
        model,
        "--preset",
        "tiny",
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--steps",
        "6",
        "--global-batch",
        "16",
        "--model-option",
        "width=2",
        "--out",
        "run",
        cwd=workdir,
    )
    assert train.returncode == 0, train.stderr
    summary = json.loads((workdir / "run" / "summary.json").read_text())
    assert summary["model"] == model and summary["global_batch"] == 16
    assert len(summary["loss"]) == 6

    verify = gradsync(
        "verify",
        "--model",
        model,
        "--preset",
        "tiny",
        "--strategies",
        "ddp,allreduce",
        "--workers",
        "2",
        "--steps",
        "8",
        "--global-batch",
        "16",
        "--out",
        "verify",
        cwd=workdir,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert all(o["max_abs"] <= 1e-5 for o in verify_outcomes(workdir / "verify"))

    compare = gradsync(
        "compare", "verify/single-w1", "verify/ddp-w2", "verify/allreduce-w2", cwd=workdir
    )
    assert compare.returncode == 0, compare.stdout + compare.stderr
    assert "features.0.weight" in compare.stdout


def test_user_model_with_unknown_option_is_a_user_error(workdir: Path) -> None:
    result = gradsync(
        "train",
        "--model",
        f"{USER_MODEL}:build",
        "--model-option",
        "depth=3",
        "--steps",
        "1",
        "--out",
        "run",
        cwd=workdir,
    )
    assert result.returncode == 2
    assert "depth" in result.stderr and "Traceback" not in result.stderr


UNSEEDED = """
import random

import torch
from torch import nn
from torch.utils.data import TensorDataset


def build(**request):
    torch.manual_seed(random.SystemRandom().randint(0, 10**9))  # not the request's seed
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=generator), torch.arange(64) % 3)
    return nn.Linear(8, 3), data, nn.functional.cross_entropy
"""


def test_verify_refuses_a_model_that_single_cannot_reproduce(workdir: Path) -> None:
    """A model built from an unseeded draw drifts from itself far beyond float64 rounding:
    any tolerance taken from that drift would pass every strategy (a probe's 'match')."""
    (workdir / "unseeded.py").write_text(UNSEEDED)
    result = gradsync(
        "verify",
        "--model",
        "unseeded.py:build",
        "--strategies",
        "allreduce",
        "--workers",
        "2",
        "--steps",
        "3",
        "--global-batch",
        "8",
        "--out",
        "verify",
        cwd=workdir,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "single differs from its own rerun" in result.stderr
    assert "match" not in result.stdout
