"""`gradsync timeline summarize`: the ranks' means leave out warm-up steps, as throughput."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gradsync.timeline_summary import summarize_trace


def _trace(path: Path, durations_us: list[float], other: dict[str, Any]) -> Path:
    """One rank, one STEP span per duration, each wholly FORWARD compute."""
    events: list[dict[str, Any]] = []
    ts = 0.0
    for step, duration in enumerate(durations_us):
        for ph, name, at in (("B", "STEP", ts), ("B", "FORWARD", ts)):
            events.append({"ph": ph, "name": name, "pid": 0, "tid": 0, "ts": at, "args": {}})
        events[-2]["args"] = {"step": step}
        for name in ("FORWARD", "STEP"):
            events.append({"ph": "E", "name": name, "pid": 0, "tid": 0, "ts": ts + duration})
        ts += duration + 10
    path.write_text(json.dumps({"traceEvents": events, "otherData": other}))
    return path


def test_the_mean_step_leaves_out_warm_up_steps(tmp_path: Path) -> None:
    """Probe 30b: a 295 ms first step made the mean 74.6 ms while later steps took 2–7 ms."""
    durations = [295_000.0, 20_000.0, 7_000.0, 2_000.0, 3_000.0, 4_000.0]
    trace = _trace(tmp_path / "t.json", durations, {"strategy": "single", "steps": 6})
    summary = summarize_trace(trace)
    (rank,) = summary.ranks
    assert summary.warmup_steps == 5  # gradsync's default for 6 steps, as throughput
    assert (rank.steps, rank.step_ms) == (1, 4.0)
    assert len(summary.steps) == 6 and summary.slowest_steps[0]["step_ms"] == 295.0


def test_a_trace_of_warm_up_steps_only_counts_every_step(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.json", [3_000.0, 1_000.0], {"strategy": "x", "steps": 100})
    summary = summarize_trace(trace)
    assert summary.warmup_steps == 0 and summary.ranks[0].step_ms == 2.0
