"""Every synchronous strategy computes single's parameters (DESIGN.md §3)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import gradsync, verify_outcomes

MODELS = {
    # Sparse lstm-lm gradients are covered by the ps/hybrid suites and by the fusion tests;
    # DDP's own sparse allreduce on Gloo crashed once here (SIGSEGV inside torch), see README.
    "transformer": [],
    "lstm-lm": [],
    "resnet56": [],
}


@pytest.mark.parametrize("model", list(MODELS))
def test_ddp_and_allreduce_match_single_after_20_sgd_steps(model: str, workdir: Path) -> None:
    out = workdir / "verify"
    result = gradsync(
        "verify",
        "--model",
        model,
        "--preset",
        "tiny",
        *MODELS[model],
        "--strategies",
        "ddp,allreduce",
        "--workers",
        "2,4",
        "--steps",
        "20",
        "--out",
        str(out),
        cwd=workdir,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    outcomes = verify_outcomes(out)
    cells = {(o["strategy"], o["workers"]) for o in outcomes}
    assert cells == {("single", 1), ("ddp", 2), ("allreduce", 2), ("ddp", 4), ("allreduce", 4)}
    for outcome in outcomes:
        assert outcome["tolerance"] >= 1e-5
        assert outcome["max_abs"] <= 1e-5, outcome
    assert "tolerance" in result.stdout and "dropout is disabled" in result.stdout


def test_adam_matches_within_documented_tolerance(workdir: Path) -> None:
    out = workdir / "verify"
    result = gradsync(
        "verify",
        "--model",
        "transformer",
        "--preset",
        "tiny",
        "--optimizer",
        "adam",
        "--strategies",
        "ddp,allreduce",
        "--workers",
        "2",
        "--steps",
        "20",
        "--out",
        str(out),
        cwd=workdir,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for outcome in verify_outcomes(out):
        assert outcome["tolerance"] >= 0.25 * 1e-3 * 20
        assert outcome["max_abs"] <= 0.25 * 1e-3 * 20


def test_fp16_compression_is_reported_as_an_expected_difference(workdir: Path) -> None:
    out = workdir / "verify"
    result = gradsync(
        "verify",
        "--model",
        "mnist-cnn",
        "--preset",
        "tiny",
        "--fp16-compression",
        "--strategies",
        "allreduce",
        "--workers",
        "2",
        "--steps",
        "10",
        "--out",
        str(out),
        cwd=workdir,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    allreduce = next(o for o in verify_outcomes(out) if o["strategy"] == "allreduce")
    assert allreduce["verdict"] in ("match", "differs (expected)")
    assert allreduce["max_abs"] < 1e-2
    if allreduce["verdict"] != "match":
        assert "fp16" in allreduce["reason"]


def test_compare_flags_a_real_difference(workdir: Path) -> None:
    """A run that really differs (another learning rate) is beyond tolerance: exit 1."""
    from gradsync.checkpoint import load_checkpoint
    from gradsync.compare import diff_checkpoints, worst

    common = ["--model", "mnist-cnn", "--preset", "tiny", "--steps", "5"]
    a = gradsync("train", *common, "--strategy", "single", "--out", "a", cwd=workdir)
    b = gradsync(
        "train",
        *common,
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--lr",
        "0.06",
        "--deterministic",
        "--out",
        "b",
        cwd=workdir,
    )
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    diff = worst(diff_checkpoints(load_checkpoint(workdir / "a"), load_checkpoint(workdir / "b")))
    assert diff.max_abs > 1e-4
    compare = gradsync("compare", "a", "b", cwd=workdir)
    assert compare.returncode == 1 and "BEYOND" in compare.stdout
