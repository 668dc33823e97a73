"""Real Horovod through gradsync's harness, where ``horovod.torch`` imports (CI has no
Horovod: these tests are skipped there). Its parameters match ``single`` and gradsync's
``allreduce`` in float64 on the zoo and on the adversarial models; where Horovod's own
semantics differ (a non-contiguous parameter; zeros for gradients nobody computed), gradsync
says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradsync.strategies.horovod import unavailable
from tests.e2e.conftest import REPO, gradsync, verify_outcomes

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(unavailable() is not None, reason="horovod.torch does not import"),
]
ADVERSARIAL = REPO / "tests" / "models" / "adversarial.py"


@pytest.mark.parametrize(
    "model",
    [
        ("--model", "resnet56", "--preset", "tiny", "--steps", "4"),  # global BatchNorm too
        ("--model", "lstm-lm", "--preset", "tiny", "--model-option", "sparse=true"),
        # step 9: one worker's shard reads no row of a gated sparse table, for the first
        # time; Horovod alone would allreduce dense zeros against the others' allgather
        ("--model", f"{ADVERSARIAL}:build_sparse", "--steps", "12"),
    ],
)
def test_real_horovod_matches_single_and_allreduce(model: tuple[str, ...], workdir: Path) -> None:
    verified = gradsync(
        "verify", "--strategies", "allreduce,horovod", "--workers", "2", *model,
        "--out", "verify", cwd=workdir, timeout=600,
    )  # fmt: skip
    assert verified.returncode == 0, verified.stderr
    outcomes = {o["strategy"]: o for o in verify_outcomes(workdir / "verify")}
    assert outcomes["horovod"]["verdict"] == "match", outcomes["horovod"]


def test_a_non_contiguous_parameter_is_refused_before_launch(workdir: Path) -> None:
    trained = gradsync(
        "train", "--strategy", "horovod", "--workers", "2", "--model",
        f"{ADVERSARIAL}:build_dense", "--steps", "2", "--out", "run", cwd=workdir,
    )  # fmt: skip
    assert trained.returncode == 2
    assert trained.stderr.strip().splitlines() == [
        "gradsync: error: horovod: parameter mix is not contiguous (a transposed view?), and "
        "Horovod allreduces a gradient in place only when it is contiguous; build it with "
        ".contiguous(), or use --strategy allreduce, which reduces it as it is"
    ]
    assert not (workdir / "run").exists()


def test_a_gradient_accumulated_twice_is_named_as_allreduce_names_it(workdir: Path) -> None:
    """Horovod's own assertion advises backward_passes_per_step, which gradsync has no
    flag for."""
    trained = gradsync(
        "train", "--strategy", "horovod", "--workers", "2", "--model",
        f"{ADVERSARIAL}:build_reentrant", "--steps", "2", "--out", "run", cwd=workdir,
    )  # fmt: skip
    assert trained.returncode != 0
    assert "was accumulated twice in one backward" in trained.stderr
    assert "backward_passes_per_step" not in trained.stderr
