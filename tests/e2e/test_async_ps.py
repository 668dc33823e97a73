"""Asynchronous parameter servers: a checkpoint holds each push at most once, one worker is
held to single's parameters, and the metrics name the learning rate each step used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradsync.checkpoint import load_checkpoint
from tests.e2e.conftest import REPO, gradsync, verify_outcomes

pytestmark = pytest.mark.slow
COUNTER = f"{REPO / 'tests' / 'models' / 'push_counter.py'}:build"
TINY = ("--model", "mnist-cnn", "--preset", "tiny", "--threads", "1")


@pytest.mark.parametrize("updates", [("--async",), ("--staleness", "1")])
def test_an_asynchronous_checkpoint_holds_no_push_of_its_own_step(
    updates: tuple[str, ...], workdir: Path
) -> None:
    """Worker 1 pushed step 4 while worker 0 fetched the servers' state for the step-4
    checkpoint (3 runs of 3): a resume then applied that push a second time."""
    killed = gradsync(
        "train", "--strategy", "ps", *updates, "--colocate", "--workers", "2",
        "--model", COUNTER, "--model-option", "die=1:6", "--lr", "1", "--momentum", "0",
        "--dtype", "float64", "--threads", "1", "--steps", "8", "--checkpoint-every", "4",
        "--out", "run", cwd=workdir,
    )  # fmt: skip
    assert killed.returncode != 0, killed.stderr
    checkpoint = load_checkpoint(workdir / "run")
    assert checkpoint.meta["step"] == 4
    counts = [float(checkpoint.tensors[f"param/p.{w}"]) for w in range(2)]
    assert counts == [4.0, 4.0]


def test_one_asynchronous_worker_is_held_to_single(workdir: Path) -> None:
    """With one worker the pushes arrive in order: async is sync, and a bug in the
    asynchronous path must fail verify, not pass as an expected difference."""
    verified = gradsync(
        "verify", "--strategies", "ps:async,ps:staleness=2", "--workers", "1",
        *TINY, "--steps", "4", "--out", "verify", cwd=workdir,
    )  # fmt: skip
    assert verified.returncode == 0, verified.stderr
    verdicts = [o["verdict"] for o in verify_outcomes(workdir / "verify")]
    assert verdicts == ["reference", "match", "match"]


@pytest.mark.parametrize("strategy", ["allreduce", "ps", "p3"])
def test_the_metrics_name_the_learning_rate_each_step_used(strategy: str, workdir: Path) -> None:
    """With warm-up over 3 steps the updates use 0.1, 0.2, 0.3, 0.3: the metrics said
    0.2, 0.3, … (read after the schedule moved) and, for p3, the rate of whichever answer
    arrived last."""
    trained = gradsync(
        "train", "--strategy", strategy, "--workers", "2", *TINY, "--steps", "4",
        "--lr", "0.3", "--lr-warmup-steps", "3", "--out", "run", cwd=workdir,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    for rank in range(2):
        lines = (workdir / "run" / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()
        rates = [round(json.loads(line)["lr"], 12) for line in lines]
        assert rates == [0.1, 0.2, 0.3, 0.3]
