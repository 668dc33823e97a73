"""``gradsync timeline summarize``: where each step's time went, from a Chrome trace.

Per rank, each step (its ``STEP`` span) splits into four parts that add up to the step time
(the table shows means over the steps after warm-up, which throughput leaves out too:
the job's ``measure_warmup`` when the trace records it, else gradsync's default for its
steps; every step when the trace holds warm-up steps only):

* **compute** — the FORWARD, BACKWARD and OPTIMIZER_STEP spans of the training thread,
  less the waits and copies that happen inside them;
* **copy** — local copies into and out of fusion buffers (MEMCPY_IN/OUT_FUSION_BUFFER):
  memory traffic on the training thread, neither communication nor idle;
* **exposed communication** — COMM_WAIT and WAIT_FOR_PARAMS spans: the training thread
  blocked on communication (wherever they nest, e.g. a pull inside forward);
* **idle** — the rest (data loading, Python between phases).

**Communication** is the union of the transfer spans (ALLREDUCE, ALLGATHER, PUSH, PULL) on
the channel tracks — bytes in flight between ranks, never copies, never the QUEUE phase in
which a bucket waits for its gradients. The **overlap ratio** is computed from those spans
only: the share of communication time during which the training thread was computing,
``|communication ∩ compute| / |communication|``.

A parameter server has no steps; its row shows its busy time (transfers, aggregation and
apply) per step it served.

Example:
    >>> # summary = summarize_trace(Path("trace.json")); print_summary(summary)
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gradsync.errors import UserError
from gradsync.files import atomic_write_text
from gradsync.stats import default_warmup
from gradsync.tables import print_table
from gradsync.trace import (
    COMPUTE_PHASES,
    COPY_PHASES,
    EXPOSED_PHASES,
    SERVER_PHASES,
    TRANSFER_PHASES,
    Phase,
)

TOP_TENSORS = 10
SLOWEST_STEPS = 5

Intervals = list[tuple[float, float]]  # disjoint, sorted, in µs


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
    """One step of one rank, in milliseconds: compute + copy + exposed + idle = step."""

    rank: int
    step: int
    begin_us: float
    step_ms: float
    compute_ms: float
    copy_ms: float
    exposed_comm_ms: float
    idle_ms: float
    comm_ms: float
    hidden_comm_ms: float


@dataclass
class RankSummary:
    rank: int
    role: str
    steps: int
    step_ms: float
    compute_ms: float
    copy_ms: float
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
    # The ranks' means leave out steps below this (warm-up, as throughput does); 0: none.
    warmup_steps: int = 0


def load_trace(path: Path) -> dict[str, Any]:
    """The Chrome trace ``path`` as ``--timeline`` writes it; anything else (not JSON, a
    binary file, a trace ``gradsync predict`` wrote) is a one-line UserError.

    Example:
        >>> # load_trace(Path("runs/a/trace.json"))["traceEvents"][0]["ph"]
    """
    try:
        trace = json.loads(path.read_text())
        if not isinstance(trace["traceEvents"], list):
            raise TypeError("traceEvents is not a list")
    except (OSError, ValueError, KeyError, TypeError) as error:  # ValueError: not UTF-8/JSON
        raise UserError(
            f"{path} is not a gradsync Chrome-trace file ({error}); write one with "
            "gradsync train --timeline PATH"
        ) from None
    if is_predicted_trace(trace):
        raise UserError(
            f"{path} is a predicted step from gradsync predict (one process per strategy, no "
            "measured steps): open it in Perfetto beside a measured trace; summarize traces "
            "written by gradsync train --timeline PATH"
        )
    return trace


# How gradsync predict's trace.json names each of its processes (one per strategy).
PREDICTED = "predicted "


def is_predicted_trace(trace: dict[str, Any]) -> bool:
    """Whether ``trace`` is a ``gradsync predict`` trace.json: its processes are strategies
    (named ``predicted <strategy> (...)``), its spans simulated, it has no measured steps.

    Example:
        >>> event = {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "predicted ddp"}}
        >>> is_predicted_trace({"traceEvents": [event]})
        True
    """
    names = (
        event["args"].get("name")
        for event in trace["traceEvents"]
        if isinstance(event, dict)
        and event.get("name") == "process_name"
        and isinstance(event.get("args"), dict)
    )
    return any(isinstance(name, str) and name.startswith(PREDICTED) for name in names)


def close_spans(events: list[dict[str, Any]]) -> dict[tuple[int, int], list[Span]]:
    """Pair B/E events per (pid, tid) track into spans (with nesting depth)."""
    spans: dict[tuple[int, int], list[Span]] = defaultdict(list)
    open_spans: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        if event["ph"] not in ("B", "E"):  # metadata (no tid on a process's), X, i, C
            continue
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


# -- interval arithmetic (µs in, ms out) ---------------------------------------------------


def merge(intervals: Iterable[tuple[float, float]]) -> Intervals:
    """Disjoint sorted intervals covering the same time.

    Example:
        >>> merge([(5, 7), (0, 2), (1, 3)])
        [(0, 3), (5, 7)]
    """
    merged: Intervals = []
    for begin, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((begin, end))
    return merged


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """The time covered by both (each argument disjoint and sorted).

    Example:
        >>> intersect([(0, 4)], [(1, 2), (3, 6)])
        [(1, 2), (3, 4)]
    """
    out: Intervals = []
    i = j = 0
    while i < len(a) and j < len(b):
        begin, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if begin < end:
            out.append((begin, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """The time covered by ``a`` and not by ``b`` (each disjoint and sorted).

    Example:
        >>> subtract([(0, 10)], [(2, 3), (8, 12)])
        [(0, 2), (3, 8)]
    """
    out: Intervals = []
    for begin, end in a:
        cursor = begin
        for cut_begin, cut_end in b:
            if cut_end <= cursor or cut_begin >= end:
                continue
            if cut_begin > cursor:
                out.append((cursor, cut_begin))
            cursor = max(cursor, cut_end)
        if cursor < end:
            out.append((cursor, end))
    return out


def length_ms(intervals: Intervals) -> float:
    return sum(end - begin for begin, end in intervals) / 1000


def _within(spans: Iterable[Span], names: tuple[str, ...], window: Span) -> Intervals:
    """The time of the spans named ``names`` (prefix before ``:``), clipped to ``window``."""
    return merge(
        (max(s.begin, window.begin), min(s.end, window.end))
        for s in spans
        if s.name.split(":")[0] in names
    )


# -- one step, one rank, one trace ---------------------------------------------------------


@dataclass(frozen=True)
class _RankSpans:
    """A rank's spans: its training thread's (``compute``) and every other track's."""

    compute: list[Span]
    channels: list[Span]


def _rank_spans(spans: dict[tuple[int, int], list[Span]], pid: int) -> _RankSpans:
    channels = [s for (p, tid), track in spans.items() if p == pid and tid != 0 for s in track]
    return _RankSpans(compute=spans.get((pid, 0), []), channels=channels)


def break_down_step(rank: int, step_span: Span, mine: _RankSpans) -> StepBreakdown:
    """Split one STEP span into compute, copy, exposed communication and idle time."""
    top_level = [s for s in mine.compute if s.depth == 1]
    copy = _within(mine.channels + mine.compute, COPY_PHASES, step_span)
    exposed = subtract(_within(mine.compute, EXPOSED_PHASES, step_span), copy)
    compute = subtract(subtract(_within(top_level, COMPUTE_PHASES, step_span), exposed), copy)
    comm = _within(mine.channels, TRANSFER_PHASES, step_span)
    step_ms = step_span.duration / 1000
    busy_ms = length_ms(compute) + length_ms(copy) + length_ms(exposed)
    return StepBreakdown(
        rank=rank,
        step=int(step_span.args.get("step", -1)),
        begin_us=step_span.begin,
        step_ms=step_ms,
        compute_ms=length_ms(compute),
        copy_ms=length_ms(copy),
        exposed_comm_ms=length_ms(exposed),
        idle_ms=max(0.0, step_ms - busy_ms),
        comm_ms=length_ms(comm),
        hidden_comm_ms=length_ms(intersect(comm, compute)),
    )


def _server_busy_ms(mine: _RankSpans) -> float:
    """A server's busy time (transfers, aggregation, apply) per step it served."""
    served = [s for s in mine.channels if s.name in TRANSFER_PHASES + SERVER_PHASES]
    count = len({s.args.get("step") for s in served}) or 1
    return length_ms(merge((s.begin, s.end) for s in served)) / count


def summarize_rank(
    pid: int, role: str, steps: list[StepBreakdown], mine: _RankSpans
) -> RankSummary:
    """Means over a rank's steps; overlap = hidden communication / communication."""
    comm_total = sum(s.comm_ms for s in steps)
    return RankSummary(
        rank=pid,
        role=role,
        steps=len(steps),
        step_ms=_mean(s.step_ms for s in steps),
        compute_ms=_mean(s.compute_ms for s in steps),
        copy_ms=_mean(s.copy_ms for s in steps),
        exposed_comm_ms=_mean(s.exposed_comm_ms for s in steps),
        idle_ms=_mean(s.idle_ms for s in steps),
        comm_ms=_mean(s.comm_ms for s in steps) if steps else _server_busy_ms(mine),
        overlap_ratio=sum(s.hidden_comm_ms for s in steps) / comm_total if comm_total else None,
    )


def _top_tensors(channels: list[Span]) -> list[dict[str, Any]]:
    """The tensors (buckets, partitions) with the most transfer time, with their bytes."""
    tensor_ms: dict[str, float] = defaultdict(float)
    tensor_bytes: dict[str, int] = defaultdict(int)
    for span in channels:
        if "tensor" in span.args and span.name in TRANSFER_PHASES + SERVER_PHASES:
            tensor_ms[span.args["tensor"]] += span.duration / 1000
            tensor_bytes[span.args["tensor"]] += int(span.args.get("bytes", 0))
    top = sorted(tensor_ms.items(), key=lambda item: -item[1])[:TOP_TENSORS]
    return [{"tensor": name, "comm_ms": ms, "bytes": tensor_bytes[name]} for name, ms in top]


def summarize_trace(path: Path) -> TraceSummary:
    """Break every recorded step of every rank down; aggregate per rank and per tensor."""
    trace = load_trace(path)
    events = trace["traceEvents"]
    spans = close_spans(events)
    process_names = _names(events, "process_name")
    steps: list[StepBreakdown] = []
    ranks: list[RankSummary] = []
    channels: list[Span] = []
    by_rank: dict[int, list[StepBreakdown]] = {}
    for pid in sorted({pid for pid, _ in spans}):
        mine = _rank_spans(spans, pid)
        own = [break_down_step(pid, s, mine) for s in mine.compute if s.name == Phase.STEP]
        by_rank[pid] = own
        steps += own
        channels += mine.channels
    warmup = warmup_of(trace.get("otherData", {}))
    if not any(s.step >= warmup for s in steps):  # the window records warm-up steps only
        warmup = 0
    for pid, own in by_rank.items():
        measured = [s for s in own if s.step >= warmup]
        mine = _rank_spans(spans, pid)
        ranks.append(summarize_rank(pid, process_names.get(pid, f"rank {pid}"), measured, mine))
    slowest = sorted(steps, key=lambda s: -s.step_ms)[:SLOWEST_STEPS]
    return TraceSummary(
        path=str(path),
        strategy=str(trace.get("otherData", {}).get("strategy", "?")),
        ranks=ranks,
        top_tensors=_top_tensors(channels),
        slowest_steps=[{"rank": s.rank, "step": s.step, "step_ms": s.step_ms} for s in slowest],
        steps=steps,
        warmup_steps=warmup,
    )


def warmup_of(other_data: dict[str, Any]) -> int:
    """The warm-up steps of the job a trace recorded, as its throughput leaves them out: its
    ``measure_warmup`` when the trace names it, else gradsync's default for its steps.

    Example:
        >>> warmup_of({"steps": 6}), warmup_of({"steps": 100}), warmup_of({"steps": 6,
        ...                                                               "measure_warmup": 1})
        (5, 10, 1)
        >>> warmup_of({})  # not recorded: every step counts
        0
    """
    given, steps = other_data.get("measure_warmup"), other_data.get("steps")
    if isinstance(given, int) and not isinstance(given, bool) and given >= 0:
        return given
    if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0:
        return default_warmup(steps)
    return 0


def _mean(values: Any) -> float:
    values = list(values)
    return statistics.fmean(values) if values else 0.0


def steps_counted(steps: Iterable[int], warmup: int) -> str:
    """Which of the recorded ``steps`` a breakdown averages, in words (its table's title),
    when those before ``warmup`` are left out.

    Example:
        >>> steps_counted([3, 4, 5, 6], warmup=5)
        'steps 5–6; the 2 recorded warm-up steps before are left out, as throughput leaves them out'
        >>> steps_counted([10, 11, 12], warmup=5)
        'every recorded step (10–12)'
    """
    recorded = sorted(set(steps))
    if not recorded:
        return "every recorded step"
    left_out = [step for step in recorded if step < warmup]
    if not left_out:
        return f"every recorded step ({recorded[0]}–{recorded[-1]})"
    return (
        f"steps {warmup}–{recorded[-1]}; the {len(left_out)} recorded warm-up steps before "
        "are left out, as throughput leaves them out"
    )


def print_summary(summary: TraceSummary) -> None:
    """Tables: per-rank breakdown, top tensors, slowest steps."""
    rows = [
        [
            str(r.rank),
            r.role,
            str(r.steps),
            f"{r.step_ms:.1f}",
            f"{r.compute_ms:.1f}",
            f"{r.copy_ms:.1f}",
            f"{r.exposed_comm_ms:.1f}",
            f"{r.idle_ms:.1f}",
            f"{r.comm_ms:.1f}",
            "-" if r.overlap_ratio is None else f"{r.overlap_ratio:.0%}",
        ]
        for r in summary.ranks
    ]
    print_table(
        f"{summary.strategy}: mean step breakdown (ms) over "
        f"{steps_counted((s.step for s in summary.steps), summary.warmup_steps)} — "
        f"{summary.path}",
        [
            "rank",
            "role",
            "steps",
            "step",
            "compute",
            "copy",
            "exposed comm",
            "idle",
            "comm (transfers)",
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
        Phase.ALLGATHER: "mediumpurple",
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
