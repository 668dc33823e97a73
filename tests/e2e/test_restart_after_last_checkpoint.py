"""A restart after the final checkpoint has no step left to run: every strategy must then
finish at once. hybrid's dedicated servers start at the end of the first step, so with no
step they used to wait forever for worker 0's spec (the job hung until --hang-timeout)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.e2e.conftest import REPO, gradsync

pytestmark = pytest.mark.slow

STEPS = 4

# tests/models/faulty.py with a validation set, so that rank 0 runs a forward after the
# final checkpoint (the validation pass): its crash_at then kills it after that checkpoint.
MODEL = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from gradsync.models.base import Workload
from gradsync.models.user import MapStyleSamples
from tests.models.faulty import build as build_faulty


def build(seed=0, dropout=True, crash_at="0", crash_rank="1", sparse="0"):
    model, dataset, loss = build_faulty(
        seed=seed, dropout=dropout, crash_at=crash_at, crash_rank=crash_rank, sparse=sparse
    )
    samples = MapStyleSamples(dataset, seed=0)
    return Workload(
        model=model, dataset=samples, loss=loss, global_batch=32,
        validation=samples, num_validation=8,
    )
"""


@pytest.mark.parametrize("colocate", [False, True], ids=["dedicated", "colocate"])
def test_hybrid_restarted_after_its_final_checkpoint_finishes_at_once(
    colocate: bool, workdir: Path
) -> None:
    (workdir / "validated.py").write_text(MODEL)
    args = [
        "train", "--model", "validated.py:build", "--dtype", "float64",
        "--strategy", "hybrid", "--workers", "2", "--steps", str(STEPS),
        "--model-option", "sparse=1", "--model-option", "crash_rank=0",
        "--model-option", f"crash_at={STEPS + 1}",  # the validation pass's forward
        "--max-restarts", "1", "--hang-timeout", "60", "--out", "run",
        *(["--colocate"] if colocate else []),
    ]  # fmt: skip
    started = time.monotonic()
    result = gradsync(*args, cwd=workdir, timeout=120)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    assert (workdir / "crashed").exists(), "rank 0 never crashed after the final checkpoint"
    assert "restart 1 of 1" in result.stderr
    assert f"checkpoint at step {STEPS}" in result.stderr
    assert elapsed < 50, f"the restart with no step left took {elapsed:.0f} s"
