"""The P3 artifact's models compute single's parameters under P3 and its baseline (DESIGN §3).

One ``gradsync verify`` per model at its tiny preset, 2 workers, ``p3`` (whose servers are
the parameter-server baseline's, plus slicing and priority; the other strategies on these
models are in the README's verify table, kept out of here for time); BatchNorm models
(resnet50, inception-v3) also exercise the cross-rank statistics, sockeye a packed
bidirectional LSTM and attention.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import gradsync, verify_outcomes

MODELS = ["resnet50", "inception-v3", "vgg19", "sockeye"]
STRATEGIES = ("p3",)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_p3_matches_single_on_the_tiny_preset(model: str, workdir: Path) -> None:
    out = workdir / "verify"
    result = gradsync(
        "verify",
        "--model",
        model,
        "--preset",
        "tiny",
        "--strategies",
        ",".join(STRATEGIES),
        "--workers",
        "2",
        "--steps",
        "2",
        "--out",
        str(out),
        cwd=workdir,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    outcomes = verify_outcomes(out)
    assert {(o["strategy"], o["workers"]) for o in outcomes} == {
        ("single", 1),
        *((strategy, 2) for strategy in STRATEGIES),
    }
    for outcome in outcomes:
        assert outcome["verdict"] in ("reference", "match"), outcome
        assert outcome["max_abs"] <= outcome["tolerance"], outcome
