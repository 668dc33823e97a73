"""Timeline recorder and summary on hand-made events (no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradsync.timeline_summary import close_spans, summarize_trace
from gradsync.trace import COMPUTE, NullTimeline, Phase, Timeline, merge_rank_files, parse_window


def test_parse_window() -> None:
    assert parse_window("2:5") == (2, 5)
    assert parse_window("3:")[0] == 3
    for bad in ("5:2", "a:b", "7", "-1:3"):
        with pytest.raises(ValueError, match="--timeline-steps"):
            parse_window(bad)


def test_null_timeline_records_nothing(tmp_path: Path) -> None:
    timeline = NullTimeline()
    with timeline.span(COMPUTE, Phase.FORWARD):
        timeline.begin("x", Phase.PUSH)
    assert not list(tmp_path.iterdir())


def test_recorder_keeps_only_the_window_and_merges(tmp_path: Path) -> None:
    timeline = Timeline(tmp_path, rank=0, role="worker", window=(1, 2))
    for step in range(3):
        timeline.start_step(step)
        with timeline.span(COMPUTE, Phase.FORWARD):
            pass
        timeline.begin("bucket0", Phase.ALLREDUCE, tensor="bucket0", bytes=4)
        timeline.end("bucket0", Phase.ALLREDUCE)
        timeline.record_step(step, started=float(step), elapsed=0.5)
    timeline.close()
    trace_path = tmp_path / "trace.json"
    merge_rank_files(tmp_path, trace_path, {"strategy": "test"})
    events = json.loads(trace_path.read_text())["traceEvents"]
    begins = [e for e in events if e["ph"] == "B"]
    assert {e["args"]["step"] for e in begins} == {1}
    assert sorted(e["name"] for e in begins) == ["ALLREDUCE", "FORWARD", "STEP"]
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {"compute", "bucket0"}


def _trace(tmp_path: Path, events: list[dict]) -> Path:
    metadata = [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "rank 0 (worker)"}}
    ]
    path = tmp_path / "t.json"
    path.write_text(
        json.dumps({"traceEvents": metadata + events, "otherData": {"strategy": "allreduce"}})
    )
    return path


def _span(name: str, begin: float, end: float, tid: int = 0, **args: object) -> list[dict]:
    return [
        {"ph": "B", "name": name, "pid": 0, "tid": tid, "ts": begin, "args": {"step": 0, **args}},
        {"ph": "E", "name": name, "pid": 0, "tid": tid, "ts": end},
    ]


def test_summary_splits_a_step_exactly(tmp_path: Path) -> None:
    # A 10 ms step: forward 2, backward 3 (an allreduce of 4 ms overlaps its last 2 ms
    # and 2 more), comm wait 2, optimizer 1, idle 2.
    events = (
        _span("STEP", 0, 10_000)
        + _span("FORWARD", 1000, 3000)
        + _span("FORWARD:encoder", 1000, 2000)
        + _span("BACKWARD", 3000, 6000)
        + _span("COMM_WAIT", 6000, 8000)
        + _span("OPTIMIZER_STEP", 8000, 9000)
        + _span("ALLREDUCE", 4000, 8000, tid=1, tensor="bucket0", bytes=100)
    )
    events.sort(key=lambda e: (e["tid"], e["ts"], e["ph"] == "B"))
    summary = summarize_trace(_trace(tmp_path, events))
    (step,) = summary.steps
    assert step.step_ms == pytest.approx(10)
    assert step.compute_ms == pytest.approx(6)
    assert step.exposed_comm_ms == pytest.approx(2)
    assert step.idle_ms == pytest.approx(2)
    assert step.comm_ms == pytest.approx(4)
    assert summary.ranks[0].overlap_ratio == pytest.approx(0.5)
    assert summary.top_tensors == [{"tensor": "bucket0", "comm_ms": 4.0, "bytes": 100}]
    assert summary.slowest_steps[0]["step_ms"] == pytest.approx(10)


def test_close_spans_nests() -> None:
    events = _span("A", 0, 10) + _span("B", 2, 3)
    events.sort(key=lambda e: e["ts"])
    spans = close_spans(events)[(0, 0)]
    assert {(s.name, s.depth) for s in spans} == {("A", 0), ("B", 1)}
