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
