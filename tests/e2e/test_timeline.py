"""`--timeline`: valid Chrome traces, a bounded window, and a summary that adds up."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from gradsync.timeline_summary import summarize_trace
from tests.e2e.conftest import gradsync

STRATEGIES = ["allreduce", "ddp", "ps"]


def _check_trace(path: Path, window: range) -> dict:
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    stacks: dict[tuple[int, int], list[str]] = defaultdict(list)
    last_ts: dict[tuple[int, int], float] = {}
    steps = defaultdict(set)
    for event in events:
        assert event["ph"] in ("B", "E", "M"), event
        if event["ph"] == "M":
            continue
        track = (event["pid"], event["tid"])
        assert event["ts"] >= last_ts.get(track, float("-inf")), event  # monotonic per track
        last_ts[track] = event["ts"]
        if event["ph"] == "B":
            stacks[track].append(event["name"])
            steps[event["pid"]].add(event["args"]["step"])
        else:
            assert stacks[track] and stacks[track].pop() == event["name"], event
    assert all(not stack for stack in stacks.values()), "a B without its E"
    for pid, recorded in steps.items():
        assert recorded == set(window), (pid, recorded)  # every step in the window, only those
    return trace


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_trace_is_valid_and_bounded_by_the_window(strategy: str, workdir: Path) -> None:
    trace_path = workdir / "trace.json"
    result = gradsync(
        "train",
        "--model",
        "transformer",
        "--preset",
        "tiny",
        "--strategy",
        strategy,
        "--workers",
        "2",
        "--steps",
        "10",
        "--timeline",
        str(trace_path),
        "--timeline-steps",
        "3:7",
        "--out",
        "run",
        cwd=workdir,
    )
    assert result.returncode == 0, result.stderr
    trace = _check_trace(trace_path, range(3, 7))
    # What summarize needs to leave the warm-up out as the run did (None: the default).
    assert trace["otherData"]["steps"] == 10 and "measure_warmup" in trace["otherData"]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert "compute" in names
    phases = {e["name"].split(":")[0] for e in trace["traceEvents"] if e["ph"] == "B"}
    assert {"STEP", "FORWARD", "BACKWARD"} <= phases
    if strategy != "ps":  # parameter servers hold the optimizer: SERVER_APPLY instead
        assert "OPTIMIZER_STEP" in phases
    if strategy == "allreduce":
        assert {"ALLREDUCE", "QUEUE", "MEMCPY_IN_FUSION_BUFFER", "COMM_WAIT"} <= phases
        allreduce = next(
            e for e in trace["traceEvents"] if e["name"] == "ALLREDUCE" and e["ph"] == "B"
        )
        assert {"tensor", "bytes", "step"} <= allreduce["args"].keys()
    if strategy == "ps":
        assert {"PUSH", "PULL", "COMM_WAIT", "SERVER_AGGREGATE", "SERVER_APPLY"} <= phases
        processes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
        assert "rank 2 (server)" in processes

    summary = summarize_trace(trace_path)
    metrics = {
        (rank, record["step"]): record["step_time_s"] * 1000
        for rank in (0, 1)
        for record in map(
            json.loads, (workdir / "run" / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()
        )
    }
    assert len(summary.steps) == 2 * 4
    for step in summary.steps:
        parts = step.compute_ms + step.copy_ms + step.exposed_comm_ms + step.idle_ms
        measured = metrics[(step.rank, step.step)]
        assert parts == pytest.approx(measured, rel=0.05)

    cli = gradsync("timeline", "summarize", str(trace_path), cwd=workdir)
    assert cli.returncode == 0, cli.stderr
    assert (workdir / "trace.summary.json").exists()
    png = (workdir / "trace.gantt.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_recording_is_off_by_default(workdir: Path) -> None:
    result = gradsync(
        "train",
        "--model",
        "mnist-cnn",
        "--preset",
        "tiny",
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--steps",
        "2",
        "--out",
        "run",
        cwd=workdir,
    )
    assert result.returncode == 0, result.stderr
    assert not (workdir / "run" / "timeline").exists()


def test_bad_window_is_a_user_error(workdir: Path) -> None:
    result = gradsync("train", "--timeline", "t.json", "--timeline-steps", "9:3", cwd=workdir)
    assert result.returncode == 2
    assert "--timeline-steps '9:3'" in result.stderr


def test_summarize_rejects_a_non_trace(workdir: Path) -> None:
    (workdir / "x.json").write_text("{}")
    result = gradsync("timeline", "summarize", "x.json", cwd=workdir)
    assert result.returncode == 2 and "not a gradsync Chrome-trace" in result.stderr


@pytest.mark.parametrize("overlap", [True, False])
def test_ps_pushes_leave_while_backward_runs(overlap: bool, workdir: Path) -> None:
    """With overlap, a variable's push starts from its gradient hook, inside backward; with
    --no-overlap every push waits until backward has returned."""
    trace_path = workdir / "trace.json"
    result = gradsync(
        "train",
        *("--model", "mnist-cnn", "--preset", "tiny", "--strategy", "ps", "--workers", "2"),
        *("--push-chunk-mb", "0", "--steps", "4", "--timeline", str(trace_path)),
        *("--timeline-steps", "1:3", "--out", "run"),
        *([] if overlap else ["--no-overlap"]),
        cwd=workdir,
    )
    assert result.returncode == 0, result.stderr
    events = [e for e in _check_trace(trace_path, range(1, 3))["traceEvents"] if e["ph"] != "M"]
    rank0 = min(e["pid"] for e in events)
    backward = defaultdict(list)  # step → [begin, end] on rank 0
    current = None
    for event in (e for e in events if e["pid"] == rank0 and e["name"] == "BACKWARD"):
        current = event["args"]["step"] if event["ph"] == "B" else current
        backward[current].append(event["ts"])
    pushes = [e for e in events if e["pid"] == rank0 and e["name"] == "PUSH" and e["ph"] == "B"]
    for step, (begin, end) in backward.items():
        inside = [p for p in pushes if p["args"]["step"] == step and begin <= p["ts"] <= end]
        chunks = [p for p in pushes if p["args"]["step"] == step]
        assert len(chunks) >= 4 if overlap else len(chunks) == 1  # per variable; per server
        assert len(inside) == (len(chunks) if overlap else 0), (step, len(inside))
