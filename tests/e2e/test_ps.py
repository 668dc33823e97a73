"""Strategy ``ps`` end to end: equivalence, asynchronous runs, a dead server, bad topologies.

The sync matrix is the issue's: 1 and 2 dedicated servers and colocated servers, at 2 and 4
workers, on the tiny transformer, lstm-lm and resnet56 (10 steps each to keep it quick).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import gradsync, kill_rank_when_running, verify_outcomes

# 1 dedicated server and colocated servers are in the equivalence matrix (test_equivalence)
ALL_SERVERS = "ps:servers=2"
SYNC_CELLS = {
    # model: (extra options, verify --strategies, --workers, --steps)
    "transformer": ([], ALL_SERVERS, "2,4", "10"),
    "lstm-lm": (
        ["--model-option", "sparse=true", "--model-option", "sampled_softmax=16"],
        ALL_SERVERS,
        "2,4",
        "10",
    ),
    "resnet56": ([], ALL_SERVERS, "2,4", "10"),
}


@pytest.mark.parametrize("model", list(SYNC_CELLS))
def test_sync_ps_matches_single(model: str, workdir: Path) -> None:
    options, strategies, workers, steps = SYNC_CELLS[model]
    out = workdir / "verify"
    result = gradsync(
        "verify",
        "--model",
        model,
        "--preset",
        "tiny",
        *options,
        "--strategies",
        strategies,
        "--workers",
        workers,
        "--steps",
        steps,
        "--out",
        str(out),
        cwd=workdir,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    outcomes = verify_outcomes(out)
    expected = {(s, int(w)) for s in strategies.split(",") for w in workers.split(",")}
    assert {(o["strategy"], o["workers"]) for o in outcomes} == expected | {("single", 1)}
    for outcome in outcomes:
        assert outcome["verdict"] in ("reference", "match"), outcome
        assert outcome["max_abs"] <= outcome["tolerance"]
    # Servers write their own metrics: bytes per step for each server.
    summary = json.loads((out / f"ps-servers2-w{workers[-1]}" / "summary.json").read_text())
    assert len(summary["servers"]) == 2
    assert all(s["bytes_recv_per_step"] > 0 for s in summary["servers"].values())
    # CPU per step: every worker's process, then the dedicated servers' on top.
    workers_cpu = sum(r["cpu_s_per_step"] for r in summary["ranks"].values())
    servers_cpu = sum(s["cpu_s_per_step"] for s in summary["servers"].values())
    assert workers_cpu > 0 and servers_cpu > 0
    assert summary["cpu_s_per_step"] == pytest.approx(workers_cpu + servers_cpu)


def test_async_and_stale_runs_learn_and_are_reported_as_asynchronous(workdir: Path) -> None:
    out = workdir / "verify"
    result = gradsync(
        "verify",
        "--model",
        "lstm-lm",
        "--preset",
        "tiny",
        "--strategies",
        "ps:async,ps:staleness=2,ps:staleness=2:push_chunk_mb=0",  # last: a push per variable
        "--workers",
        "2",
        "--steps",
        "100",
        "--out",
        str(out),
        cwd=workdir,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "differs:" in result.stdout and "asynchronous" in result.stdout  # cells may wrap
    for outcome in verify_outcomes(out)[1:]:
        assert outcome["verdict"] == "differs: asynchronous updates", outcome
        assert f"distance to single {outcome['max_abs']:.2e}" in outcome["reason"]
        loss = json.loads((Path(outcome["out"]) / "summary.json").read_text())["loss"]
        assert len(loss) == 100
        assert statistics.fmean(loss[-10:]) < loss[0] - 0.02, (outcome["strategy"], loss)


def test_killed_server_ends_the_job_naming_it(workdir: Path) -> None:
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gradsync",
            "train",
            "--model",
            "lstm-lm",
            "--preset",
            "tiny",
            "--strategy",
            "ps",
            "--servers",
            "2",
            "--workers",
            "2",
            "--steps",
            "100000",
            "--out",
            "run",
        ],
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    stderr, elapsed, pids = kill_rank_when_running(job, workdir / "run", "server3.jsonl", 3)
    assert job.returncode not in (0, None)
    assert elapsed < 30
    assert "rank 3 (server 1" in stderr and "SIGKILL" in stderr, stderr
    for rank in ("0", "1", "2"):
        with pytest.raises(ProcessLookupError):
            os.kill(pids[rank], 0)  # no orphans


BAD_TOPOLOGIES = {
    "no workers": (["--workers", "0"], "--workers: 0 is not a positive integer"),
    "servers and colocate": (["--servers", "2", "--colocate"], "--servers with --colocate"),
    "more servers than variables": (
        ["--model", "mnist-cnn", "--servers", "30"],
        "30 parameter servers but only 8 variables",
    ),
    "no servers": (["--servers", "0"], "--servers must be >= 1, got 0"),
    "staleness in sync mode": (["--staleness", "0"], "--staleness must be >= 1, got 0"),
}


@pytest.mark.parametrize("case", list(BAD_TOPOLOGIES))
def test_bad_topology_is_one_line_and_exit_2(case: str, workdir: Path) -> None:
    args, message = BAD_TOPOLOGIES[case]
    result = gradsync(
        "train", "--strategy", "ps", "--preset", "tiny", *args, "--out", "run", cwd=workdir
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradsync: error: ") and message in lines[0]
