"""Timeline recorder and summary on hand-made events (no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradsync.timeline_summary import (
    close_spans,
    intersect,
    length_ms,
    merge,
    subtract,
    summarize_trace,
)
from gradsync.trace import (
    COMPUTE,
    NullTimeline,
    Phase,
    RecordingTimeline,
    merge_rank_files,
    parse_window,
)


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
    timeline = RecordingTimeline(tmp_path, rank=0, role="worker", window=(1, 2))
    for step in range(3):
        timeline.start_step(step)
        with timeline.span(COMPUTE, Phase.FORWARD):
            pass
        timeline.begin("bucket0", Phase.ALLREDUCE, tensor="bucket0", bytes=4)
        timeline.end("bucket0", Phase.ALLREDUCE)
        timeline.record_step(step, started=float(step), elapsed=0.5)
    timeline.close()
    trace_path = tmp_path / "trace.json"
    # A rank file beyond the job's world (an earlier job of 3 ranks in the folder) stays out.
    stale = '{"ph": "B", "name": "SERVER_APPLY", "pid": 2, "tid": 0, "ts": 0, "args": {}}'
    (tmp_path / "timeline" / "rank2.jsonl").write_text(stale + "\n")
    merge_rank_files(tmp_path, trace_path, {"strategy": "test"}, world_size=2)
    events = json.loads(trace_path.read_text())["traceEvents"]
    assert all(e["pid"] != 2 for e in events)
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


def _sorted(events: list[dict]) -> list[dict]:
    # Per track in time order; at a tie an end closes before the next span begins.
    return sorted(events, key=lambda e: (e["tid"], e["ts"], e["ph"] == "B"))


def test_copies_are_their_own_phase_and_overlap_counts_transfers_only(tmp_path: Path) -> None:
    # A 20 ms step. Forward 0–4 holds a 1 ms blocking pull (WAIT_FOR_PARAMS, nested);
    # backward 4–10 holds a 1 ms copy into the fusion buffer (8–9) on the bucket's track;
    # the allreduce runs 9–14, the training thread waits 10–14, copies out 14–15,
    # steps the optimizer 15–17 and is idle 17–20.
    events = _sorted(
        _span("STEP", 0, 20_000)
        + _span("FORWARD", 0, 4000)
        + _span("FORWARD:embedding", 0, 2000)
        + _span("WAIT_FOR_PARAMS", 1000, 2000)
        + _span("BACKWARD", 4000, 10_000)
        + _span("COMM_WAIT", 10_000, 14_000)
        + _span("OPTIMIZER_STEP", 15_000, 17_000)
        + _span("PULL", 1000, 2000, tid=2, tensor="embedding", bytes=10)
        + _span("QUEUE", 5000, 8000, tid=1, tensor="bucket0")
        + _span("MEMCPY_IN_FUSION_BUFFER", 8000, 9000, tid=1, tensor="bucket0")
        + _span("ALLREDUCE", 9000, 14_000, tid=1, tensor="bucket0", bytes=100)
        + _span("MEMCPY_OUT_FUSION_BUFFER", 14_000, 15_000, tid=1, tensor="bucket0")
    )
    summary = summarize_trace(_trace(tmp_path, events))
    (step,) = summary.steps
    assert step.compute_ms == pytest.approx(3 + 5 + 2)
    assert step.copy_ms == pytest.approx(2)
    assert step.exposed_comm_ms == pytest.approx(1 + 4)
    assert step.idle_ms == pytest.approx(3)
    assert step.compute_ms + step.copy_ms + step.exposed_comm_ms + step.idle_ms == pytest.approx(
        step.step_ms
    )
    # Transfers: the pull (1 ms, blocked on) and the allreduce (5 ms, 1 ms under backward).
    assert step.comm_ms == pytest.approx(6)
    assert step.hidden_comm_ms == pytest.approx(1)
    assert summary.ranks[0].overlap_ratio == pytest.approx(1 / 6)
    assert [t["tensor"] for t in summary.top_tensors] == ["bucket0", "embedding"]
    assert summary.top_tensors[0]["comm_ms"] == pytest.approx(5)


def test_copies_alone_are_no_communication(tmp_path: Path) -> None:
    # One worker: the copy into the fusion buffer during backward is all there is.
    events = _sorted(
        _span("STEP", 0, 10_000)
        + _span("BACKWARD", 0, 6000)
        + _span("MEMCPY_IN_FUSION_BUFFER", 4000, 6000, tid=1, tensor="bucket0")
        + _span("MEMCPY_OUT_FUSION_BUFFER", 6000, 7000, tid=1, tensor="bucket0")
    )
    summary = summarize_trace(_trace(tmp_path, events))
    (step,) = summary.steps
    assert (step.compute_ms, step.copy_ms, step.idle_ms) == pytest.approx((4, 3, 3))
    assert step.comm_ms == 0 and step.exposed_comm_ms == 0
    assert summary.ranks[0].overlap_ratio is None


@pytest.mark.parametrize(
    ("a", "b", "both", "a_only"),
    [
        ([(0, 10)], [(2, 3), (8, 12)], [(2, 3), (8, 10)], [(0, 2), (3, 8)]),
        ([(0, 1), (5, 6)], [(1, 5)], [], [(0, 1), (5, 6)]),
        ([(0, 4)], [(0, 4)], [(0, 4)], []),
    ],
)
def test_interval_arithmetic(a, b, both, a_only) -> None:
    assert intersect(a, b) == both
    assert subtract(a, b) == a_only
    assert length_ms(merge(a + b)) == pytest.approx(length_ms(a_only) + length_ms(b))


def test_close_spans_nests() -> None:
    events = _span("A", 0, 10) + _span("B", 2, 3)
    events.sort(key=lambda e: e["ts"])
    spans = close_spans(events)[(0, 0)]
    assert {(s.name, s.depth) for s in spans} == {("A", 0), ("B", 1)}
