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
        ("--model", "resnet56", "--preset", "tiny"),  # global BatchNorm beside Horovod
        ("--model", "lstm-lm", "--preset", "tiny", "--model-option", "sparse=true"),
        ("--model", f"{ADVERSARIAL}:build_sparse"),
    ],
)
def test_real_horovod_matches_single_and_allreduce(model: tuple[str, ...], workdir: Path) -> None:
    verified = gradsync(
        "verify", "--strategies", "allreduce,horovod", "--workers", "2", *model,
        "--steps", "4", "--out", "verify", cwd=workdir, timeout=600,
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
