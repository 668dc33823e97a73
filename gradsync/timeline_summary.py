"""``gradsync timeline summarize``: where each step's time went, from a Chrome trace.

Per rank, each step (its ``STEP`` span) splits into the parts below (the table shows
means over steps, so the parts add up):

* **compute** — the top-level FORWARD, BACKWARD and OPTIMIZER_STEP spans on the compute track;
* **exposed communication** — COMM_WAIT and WAIT_FOR_PARAMS spans: the training thread
  blocked on communication that did not overlap computation;
* **idle** — the rest (data loading, Python between phases).

Communication time counts the transfer phases (allreduce, push, pull, fusion copies, server
aggregate/apply), not the QUEUE phase, in which a bucket waits for its gradients.

They add up to the step time by construction. The **overlap ratio** is the share of the
communication time (union of the channel tracks' spans) hidden behind computation:
1 − exposed / communication.

Example:
    >>> # summary = summarize_trace(Path("trace.json")); print_summary(summary)
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gradsync.checkpoint import atomic_write_text
from gradsync.errors import UserError
from gradsync.tables import print_table
from gradsync.trace import COMM_PHASES, COMPUTE_PHASES, EXPOSED_PHASES, Phase

TOP_TENSORS = 10
SLOWEST_STEPS = 5


@dataclass(frozen=True)
class Span:
    """One closed B/E pair."""

    name: str
    begin: float
    end: float
    depth: int
    args: dict[str, Any]

    @property
    def duration(self) -> float:
        return self.end - self.begin


@dataclass
class StepBreakdown:
    """One step of one rank, in milliseconds."""

    rank: int
    step: int
    begin_us: float
    step_ms: float
    compute_ms: float
    exposed_comm_ms: float
    idle_ms: float
    comm_ms: float


@dataclass
class RankSummary:
    rank: int
    role: str
    steps: int
    step_ms: float
    compute_ms: float
    exposed_comm_ms: float
    idle_ms: float
    comm_ms: float
    overlap_ratio: float | None


@dataclass
class TraceSummary:
    path: str
    strategy: str
    ranks: list[RankSummary]
    top_tensors: list[dict[str, Any]]
    slowest_steps: list[dict[str, Any]]
    steps: list[StepBreakdown] = field(repr=False)


def load_trace(path: Path) -> dict[str, Any]:
    try:
        trace = json.loads(path.read_text())
        if not isinstance(trace["traceEvents"], list):
            raise TypeError("traceEvents is not a list")
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise UserError(
            f"{path} is not a gradsync Chrome-trace file ({error}); write one with "
            "gradsync train --timeline PATH"
        ) from None
    return trace


def close_spans(events: list[dict[str, Any]]) -> dict[tuple[int, int], list[Span]]:
    """Pair B/E events per (pid, tid) track into spans (with nesting depth)."""
    spans: dict[tuple[int, int], list[Span]] = defaultdict(list)
    open_spans: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        track = (event["pid"], event["tid"])
        if event["ph"] == "B":
            open_spans[track].append(event)
        elif event["ph"] == "E":
            begin = open_spans[track].pop()
            spans[track].append(
                Span(
                    begin["name"],
                    begin["ts"],
                    event["ts"],
                    len(open_spans[track]),
                    begin.get("args", {}),
                )
            )
    return spans


def _names(events: list[dict[str, Any]], kind: str) -> dict[Any, str]:
    return {
        (e["pid"], e["tid"]) if kind == "thread_name" else e["pid"]: e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == kind
    }


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, current_end = 0.0, float("-inf")
    for begin, end in sorted(intervals):
        if end <= current_end:
            continue
        total += end - max(begin, current_end)
        current_end = end
    return total / 1000


def summarize_trace(path: Path) -> TraceSummary:
    """Break every recorded step of every rank down; aggregate per rank and per tensor."""
    trace = load_trace(path)
    events = trace["traceEvents"]
    spans = close_spans(events)
    process_names = _names(events, "process_name")
    steps: list[StepBreakdown] = []
    tensor_ms: dict[str, float] = defaultdict(float)
    tensor_bytes: dict[str, int] = defaultdict(int)
    for pid in sorted({pid for pid, _ in spans}):
        compute = spans.get((pid, 0), [])
        comm = [
            s
            for (p, tid), track in spans.items()
            if p == pid and tid != 0
            for s in track
            if s.name in COMM_PHASES
        ]
        for span in comm:
            if "tensor" in span.args:
                tensor_ms[span.args["tensor"]] += span.duration / 1000
                tensor_bytes[span.args["tensor"]] += int(span.args.get("bytes", 0))
        for step_span in (s for s in compute if s.name == Phase.STEP):
            inside = [
                s
                for s in compute
                if s.depth == 1 and step_span.begin <= s.begin and s.end <= step_span.end
            ]
            compute_ms = sum(s.duration for s in inside if s.name in COMPUTE_PHASES) / 1000
            exposed_ms = sum(s.duration for s in inside if s.name in EXPOSED_PHASES) / 1000
            step_ms = step_span.duration / 1000
            comm_ms = _union_ms(
                [
                    (max(s.begin, step_span.begin), min(s.end, step_span.end))
                    for s in comm
                    if s.end > step_span.begin and s.begin < step_span.end
                ]
            )
            steps.append(
                StepBreakdown(
                    rank=pid,
                    step=int(step_span.args.get("step", -1)),
                    begin_us=step_span.begin,
                    step_ms=step_ms,
                    compute_ms=compute_ms,
                    exposed_comm_ms=exposed_ms,
                    idle_ms=max(0.0, step_ms - compute_ms - exposed_ms),
                    comm_ms=comm_ms,
                )
            )
    ranks = []
    for pid in sorted({s.rank for s in steps} | {pid for pid, _ in spans}):
        mine = [s for s in steps if s.rank == pid]
        comm_total = sum(s.comm_ms for s in mine)
        exposed = sum(s.exposed_comm_ms for s in mine)
        if not mine:  # a server: no steps of its own; its busy time per step it served
            served = [
                s
                for (p, tid), track in spans.items()
                if p == pid
                for s in track
                if s.name in COMM_PHASES
            ]
            count = len({s.args.get("step") for s in served}) or 1
            comm_total = _union_ms([(s.begin, s.end) for s in served]) / count
        ranks.append(
            RankSummary(
                rank=pid,
                role=process_names.get(pid, f"rank {pid}"),
                steps=len(mine),
                step_ms=_mean(s.step_ms for s in mine),
                compute_ms=_mean(s.compute_ms for s in mine),
                exposed_comm_ms=_mean(s.exposed_comm_ms for s in mine),
                idle_ms=_mean(s.idle_ms for s in mine),
                comm_ms=_mean(s.comm_ms for s in mine) if mine else comm_total,
                # Exposed time can slightly exceed the transfers (waiting includes Python).
                overlap_ratio=max(0.0, 1 - exposed / comm_total) if mine and comm_total else None,
            )
        )
    top = sorted(tensor_ms.items(), key=lambda item: -item[1])[:TOP_TENSORS]
    slowest = sorted(steps, key=lambda s: -s.step_ms)[:SLOWEST_STEPS]
    return TraceSummary(
        path=str(path),
        strategy=str(trace.get("otherData", {}).get("strategy", "?")),
        ranks=ranks,
        top_tensors=[
            {"tensor": name, "comm_ms": ms, "bytes": tensor_bytes[name]} for name, ms in top
        ],
        slowest_steps=[{"rank": s.rank, "step": s.step, "step_ms": s.step_ms} for s in slowest],
        steps=steps,
    )


def _mean(values: Any) -> float:
    values = list(values)
    return statistics.fmean(values) if values else 0.0


def print_summary(summary: TraceSummary) -> None:
    """Tables: per-rank breakdown, top tensors, slowest steps."""
    rows = [
        [
            str(r.rank),
            r.role,
            str(r.steps),
            f"{r.step_ms:.1f}",
            f"{r.compute_ms:.1f}",
            f"{r.exposed_comm_ms:.1f}",
            f"{r.idle_ms:.1f}",
            f"{r.comm_ms:.1f}",
            "-" if r.overlap_ratio is None else f"{r.overlap_ratio:.0%}",
        ]
        for r in summary.ranks
    ]
    print_table(
        f"{summary.strategy}: mean step breakdown (ms) — {summary.path}",
        [
            "rank",
            "role",
            "steps",
            "step",
            "compute",
            "exposed comm",
            "idle",
            "comm (all)",
            "overlap",
        ],
        rows,
    )
    print_table(
        "top tensors by communication time",
        ["tensor", "comm ms (sum)", "bytes (sum)"],
        [[t["tensor"], f"{t['comm_ms']:.1f}", f"{t['bytes']:,}"] for t in summary.top_tensors],
    )
    print_table(
        "slowest steps",
        ["rank", "step", "ms"],
        [[str(s["rank"]), str(s["step"]), f"{s['step_ms']:.1f}"] for s in summary.slowest_steps],
    )


def write_summary(summary: TraceSummary, out_json: Path) -> None:
    payload = asdict(summary)
    atomic_write_text(out_json, json.dumps(payload, indent=2) + "\n")


def gantt(path: Path, out_png: Path, step: int | None = None) -> int:
    """Render one step (default: the median-length step of rank 0) for all ranks as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = load_trace(path)
    events = trace["traceEvents"]
    spans = close_spans(events)
    thread_names = _names(events, "thread_name")
    step_spans = {
        (pid, int(s.args.get("step", -1))): s
        for (pid, tid), track in spans.items()
        if tid == 0
        for s in track
        if s.name == Phase.STEP
    }
    if not step_spans:
        raise UserError(f"{path} records no steps; widen --timeline-steps")
    if step is None:
        rank0 = sorted(
            (s.duration, k[1])
            for k, s in step_spans.items()
            if k[0] == min(k[0] for k in step_spans)
        )
        step = rank0[len(rank0) // 2][1]
    windows = [s for (pid, st), s in step_spans.items() if st == step]
    begin = min(s.begin for s in windows)
    end = max(s.end for s in windows)
    colors = {
        Phase.FORWARD: "tab:blue",
        Phase.BACKWARD: "tab:orange",
        Phase.OPTIMIZER_STEP: "tab:green",
        Phase.COMM_WAIT: "tab:red",
        Phase.WAIT_FOR_PARAMS: "tab:red",
        Phase.ALLREDUCE: "tab:purple",
        Phase.PUSH: "tab:brown",
        Phase.PULL: "tab:pink",
        Phase.QUEUE: "tab:gray",
        Phase.SERVER_AGGREGATE: "tab:olive",
        Phase.SERVER_APPLY: "tab:cyan",
        Phase.MEMCPY_IN_FUSION_BUFFER: "gold",
        Phase.MEMCPY_OUT_FUSION_BUFFER: "goldenrod",
    }
    tracks = sorted(k for k in spans if any(begin <= s.end and s.begin <= end for s in spans[k]))
    fig, ax = plt.subplots(figsize=(12, 0.35 * len(tracks) + 1.5))
    for row, track in enumerate(tracks):
        for span in spans[track]:
            if span.end < begin or span.begin > end or span.name == Phase.STEP:
                continue
            base = span.name.split(":")[0]
            ax.broken_barh(
                [((span.begin - begin) / 1000, span.duration / 1000)],
                (row - 0.4 + 0.1 * span.depth, 0.8 - 0.2 * span.depth),
                color=colors.get(base, "tab:gray"),
                alpha=0.85,
            )
    ax.set_yticks(range(len(tracks)))
    ax.set_yticklabels(
        [f"rank {pid} · {thread_names.get((pid, tid), tid)}" for pid, tid in tracks], fontsize=7
    )
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began")
    ax.set_title(f"{trace.get('otherData', {}).get('strategy', '')}: step {step}, all ranks")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return step
