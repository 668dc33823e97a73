"""ddp's step-0 probe on user models it crashed on or changed (tests/models/probe_*.py): ddp
matches single in float64 ``verify`` (2 workers, 3 steps)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import REPO, gradsync, verify_outcomes

pytestmark = pytest.mark.slow

MODELS = REPO / "tests" / "models"


def _verify(workdir: Path, model: str, strategies: str, *options: str) -> dict[str, str]:
    """Verdict per strategy of ``gradsync verify`` (it must exit 0)."""
    result = gradsync(
        "verify",
        "--model",
        f"{MODELS / model}:build",
        *options,
        "--strategies",
        strategies,
        "--workers",
        "2",
        "--steps",
        "3",
        "--out",
        "verify",
        cwd=workdir,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return {o["strategy"]: o["verdict"] for o in verify_outcomes(workdir / "verify")}


def test_a_model_deepcopy_refuses(workdir: Path) -> None:
    """A lock in the model: the probe cannot run, so ddp turns find_unused_parameters on and
    says why in one line; with the option given it does not probe at all (both crashed)."""
    verdicts = _verify(
        workdir,
        "probe_nocopy.py",
        "ddp,ddp:find_unused_parameters=true",
        "--model-option",
        "kind=lock",
    )
    assert set(verdicts.values()) == {"reference", "match"}, verdicts
    probed = (workdir / "verify" / "ddp-w2" / "stdout.log").read_text()
    assert "ddp: find_unused_parameters=True (the step-0 probe could not run: the model " in probed
    assert "_thread.lock" in probed
    (given,) = (workdir / "verify").glob("ddp-find_unused*/stdout.log")
    assert "probe" not in given.read_text()


def test_a_loss_object_with_state(workdir: Path) -> None:
    """The probe called the loss once more: ddp was 2e-3 off single."""
    assert _verify(workdir, "probe_stateful_loss.py", "ddp")["ddp"] == "match"


def test_a_model_with_syncbatchnorm(workdir: Path) -> None:
    """The probe ran before global BatchNorm replaced torch's GPU-only SyncBatchNorm."""
    assert _verify(workdir, "probe_syncbn.py", "ddp")["ddp"] == "match"
