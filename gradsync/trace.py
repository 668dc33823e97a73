"""Communication timeline: Chrome-trace (Perfetto) events, written off the training thread.

Every rank records begin/end events on named tracks — ``compute`` plus one per
communication channel — into ``<out>/timeline/rank<r>.jsonl`` through a background writer
thread, so training never waits on file I/O. At the end rank 0 merges the ranks' files into
one Chrome-trace JSON: one process per rank, one thread per track. Clocks are aligned to
rank 0's at start (ping-pong, smallest round trip wins).

Recording is off by default (:class:`NullTimeline`, whose methods do nothing); with
``--timeline-steps A:B`` only steps A ≤ step < B are recorded.

Example:
    >>> timeline = NullTimeline()
    >>> with timeline.span(COMPUTE, Phase.FORWARD):
    ...     pass
"""

from __future__ import annotations

import contextlib
import json
import math
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Protocol

import torch
import torch.distributed as dist

from gradsync.files import atomic_write_text

COMPUTE = "compute"
TIMELINE_DIR = "timeline"
TRACE_BEGINS = '{"traceEvents": '  # how a merged trace file starts (merge_rank_files)
CLOCK_ROUNDS = 8


class Phase:
    """Named phases. Compute phases run on the ``compute`` track; the others on a channel."""

    STEP = "STEP"
    FORWARD = "FORWARD"
    BACKWARD = "BACKWARD"
    OPTIMIZER_STEP = "OPTIMIZER_STEP"
    # The training thread blocked on communication (exposed, not overlapped):
    COMM_WAIT = "COMM_WAIT"
    WAIT_FOR_PARAMS = "WAIT_FOR_PARAMS"
    # Communication channels:
    QUEUE = "QUEUE"
    MEMCPY_IN_FUSION_BUFFER = "MEMCPY_IN_FUSION_BUFFER"
    MEMCPY_OUT_FUSION_BUFFER = "MEMCPY_OUT_FUSION_BUFFER"
    ALLREDUCE = "ALLREDUCE"
    ALLGATHER = "ALLGATHER"
    PUSH = "PUSH"
    PULL = "PULL"
    SERVER_AGGREGATE = "SERVER_AGGREGATE"
    SERVER_APPLY = "SERVER_APPLY"


COMPUTE_PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER_STEP)
EXPOSED_PHASES = (Phase.COMM_WAIT, Phase.WAIT_FOR_PARAMS)
# Local copies into and out of fusion buffers: their own phase, neither sent nor idle.
COPY_PHASES = (Phase.MEMCPY_IN_FUSION_BUFFER, Phase.MEMCPY_OUT_FUSION_BUFFER)
# Bytes in flight between ranks: the only spans that count as communication.
TRANSFER_PHASES = (Phase.ALLREDUCE, Phase.ALLGATHER, Phase.PUSH, Phase.PULL)
# What a parameter server does with what it received (its busy time, with the transfers).
SERVER_PHASES = (Phase.SERVER_AGGREGATE, Phase.SERVER_APPLY)


def parse_window(text: str | None) -> tuple[int, int] | None:
    """``"A:B"`` → (A, B): record steps A ≤ step < B; ``":B"`` and ``"A:"`` are open ends.

    Example:
        >>> parse_window("10:20"), parse_window(":5"), parse_window(None)
        ((10, 20), (0, 5), None)
    """
    if text is None:
        return None
    start, sep, stop = text.partition(":")
    try:
        window = (int(start or 0), int(stop) if stop else 2**62)
    except ValueError:
        window = (-1, -1)
    if not sep or window[0] < 0 or window[1] <= window[0]:
        raise ValueError(f"--timeline-steps {text!r} is not A:B with 0 <= A < B (e.g. 10:20)")
    return window


class Timeline(Protocol):
    """What strategies, the trainer and the servers record phases with: spans and
    begin/end pairs on named tracks, per step. Two implementations: :class:`NullTimeline`
    (recording off) and :class:`RecordingTimeline` (``--timeline``)."""

    enabled: bool

    def start_step(self, step: int) -> None: ...

    def span(
        self, track: str, name: str, *, step: int | None = None, **args: Any
    ) -> contextlib.AbstractContextManager[None]: ...

    def begin(self, track: str, name: str, *, step: int | None = None, **args: Any) -> None: ...

    def end(self, track: str, name: str, *, step: int | None = None, **args: Any) -> None: ...

    def record_step(self, step: int, started: float, elapsed: float) -> None: ...

    def instrument_forward(self, model: torch.nn.Module) -> None: ...

    def close(self) -> None: ...


class NullTimeline:
    """Recording off: every method is a no-op."""

    enabled = False
    _nothing = contextlib.nullcontext()

    def start_step(self, step: int) -> None:
        pass

    def span(
        self, track: str, name: str, *, step: int | None = None, **args: Any
    ) -> contextlib.AbstractContextManager[None]:
        return self._nothing

    def begin(self, track: str, name: str, *, step: int | None = None, **args: Any) -> None:
        pass

    def end(self, track: str, name: str, *, step: int | None = None, **args: Any) -> None:
        pass

    def record_step(self, step: int, started: float, elapsed: float) -> None:
        pass

    def instrument_forward(self, model: torch.nn.Module) -> None:
        pass

    def close(self) -> None:
        pass


class RecordingTimeline(NullTimeline):
    """Records events of one rank into ``<out>/timeline/rank<rank>.jsonl``.

    Timestamps are ``time.perf_counter()`` in microseconds plus ``offset_us`` (rank 0's
    clock minus this rank's), so all ranks share rank 0's time base.
    """

    enabled = True

    def __init__(
        self,
        out_dir: Path,
        *,
        rank: int,
        role: str,
        window: tuple[int, int] | None,
        offset_us: float = 0.0,
    ) -> None:
        directory = out_dir / TIMELINE_DIR
        directory.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.window = window or (0, 2**62)
        self.offset_us = offset_us
        self.step = -1
        self.active = False
        self._tracks: dict[str, int] = {COMPUTE: 0}
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._file: IO[str] = open(directory / f"rank{rank}.jsonl", "w")  # noqa: SIM115
        self._writer = threading.Thread(target=self._drain, name="timeline-writer", daemon=True)
        self._writer.start()
        self._emit(
            {
                "ph": "M",
                "name": "process_name",
                "pid": rank,
                "tid": 0,
                "args": {"name": f"rank {rank} ({role})"},
            }
        )
        self._emit(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": rank,
                "tid": 0,
                "args": {"sort_index": rank},
            }
        )
        self._name_track(COMPUTE, 0)

    # -- recording ----------------------------------------------------------------------
    def start_step(self, step: int) -> None:
        """Recording follows the window: events are kept only for steps inside it."""
        self.step = step
        self.active = self.window[0] <= step < self.window[1]

    def now_us(self) -> float:
        return time.perf_counter() * 1e6 + self.offset_us

    def _recording(self, step: int | None) -> bool:
        # An explicit step (a server thread answering step s) is judged by the window alone,
        # so threads other than the training thread never touch ``self.step``.
        if step is None:
            return self.active
        return self.window[0] <= step < self.window[1]

    def begin(self, track: str, name: str, *, step: int | None = None, **args: Any) -> None:
        if self._recording(step):
            self._event("B", track, name, self.now_us(), args, step=step)

    def end(self, track: str, name: str, *, step: int | None = None, **args: Any) -> None:
        if self._recording(step):
            self._event("E", track, name, self.now_us(), args)

    @contextlib.contextmanager
    def _span(
        self, track: str, name: str, args: dict[str, Any], step: int | None
    ) -> Iterator[None]:
        self._event("B", track, name, self.now_us(), args, step=step)
        try:
            yield
        finally:
            self._event("E", track, name, self.now_us(), {})

    def span(
        self, track: str, name: str, *, step: int | None = None, **args: Any
    ) -> contextlib.AbstractContextManager[None]:
        return self._span(track, name, args, step) if self._recording(step) else self._nothing

    def record_step(self, step: int, started: float, elapsed: float) -> None:
        """The STEP span, with exactly the timestamps the step time was measured with."""
        if self.active:
            begin = started * 1e6 + self.offset_us
            self._event("B", COMPUTE, Phase.STEP, begin, {"step": step}, step_span=True)
            self._event("E", COMPUTE, Phase.STEP, begin + elapsed * 1e6, {}, step_span=True)

    def instrument_forward(self, model: torch.nn.Module) -> None:
        """Forward spans per top-level module (hooks; nothing recorded outside the window)."""
        for name, module in model.named_children():
            module.register_forward_pre_hook(
                lambda _m, _i, layer=name: self.begin(COMPUTE, f"{Phase.FORWARD}:{layer}")
            )
            module.register_forward_hook(
                lambda _m, _i, _o, layer=name: self.end(COMPUTE, f"{Phase.FORWARD}:{layer}")
            )

    # -- output -------------------------------------------------------------------------
    def _event(
        self,
        ph: str,
        track: str,
        name: str,
        ts: float,
        args: dict[str, Any],
        step_span: bool = False,
        step: int | None = None,
    ) -> None:
        tid = self._tracks.get(track)
        if tid is None:
            # New tracks are rare; the lock keeps two threads from naming one twice.
            with self._lock:
                tid = self._tracks.get(track)
                if tid is None:
                    tid = self._tracks[track] = len(self._tracks)
                    self._name_track(track, tid)
        event = {"ph": ph, "name": name, "pid": self.rank, "tid": tid, "ts": ts}
        if ph == "B":
            event["args"] = {"step": self.step if step is None else step, **args}
        if step_span:
            event["cat"] = "step"
        self._emit(event)

    def _name_track(self, track: str, tid: int) -> None:
        self._emit(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": self.rank,
                "tid": tid,
                "args": {"name": track},
            }
        )
        self._emit(
            {
                "ph": "M",
                "name": "thread_sort_index",
                "pid": self.rank,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )

    def _emit(self, event: dict[str, Any]) -> None:
        self._queue.put(event)

    def _drain(self) -> None:
        while (event := self._queue.get()) is not None:
            self._file.write(json.dumps(event) + "\n")
        self._file.close()

    def close(self) -> None:
        """Flush and stop the writer thread (a second call does nothing)."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()


def clock_offset_us(rank: int, world_size: int, group: Any = None) -> float:
    """Rank 0's clock minus this rank's, in µs, from ping-pongs with rank 0.

    Of ``CLOCK_ROUNDS`` round trips, the one with the smallest round-trip time gives the
    estimate ``t_rank0 − (t_send + t_receive)/2`` (Cristian's algorithm).
    """
    if world_size == 1:
        return 0.0
    buffer = torch.zeros(1, dtype=torch.float64)
    best_rtt, offset = math.inf, 0.0
    for peer in range(1, world_size):
        for _ in range(CLOCK_ROUNDS):
            if rank == 0:
                dist.recv(buffer, src=peer, group=group)
                buffer[0] = time.perf_counter() * 1e6
                dist.send(buffer, dst=peer, group=group)
            elif rank == peer:
                sent = time.perf_counter() * 1e6
                dist.send(buffer, dst=0, group=group)
                dist.recv(buffer, src=0, group=group)
                received = time.perf_counter() * 1e6
                if received - sent < best_rtt:
                    best_rtt = received - sent
                    offset = float(buffer[0]) - (sent + received) / 2
    return offset


def open_timeline(
    out_dir: Path,
    *,
    path: str | None,
    window_text: str | None,
    rank: int,
    world_size: int,
    role: str,
) -> Timeline:
    """A recording :class:`Timeline` when ``path`` is set (clocks aligned), else a no-op one.

    Every rank of the job must call it (clock alignment talks to rank 0).
    """
    if path is None:
        return NullTimeline()
    offset = clock_offset_us(rank, world_size) if dist.is_initialized() else 0.0
    return RecordingTimeline(
        out_dir, rank=rank, role=role, window=parse_window(window_text), offset_us=offset
    )


def merge_rank_files(
    out_dir: Path, destination: Path, metadata: dict[str, Any], *, world_size: int
) -> int:
    """Merge the event files of ranks 0..``world_size``-1 into one Chrome-trace JSON (a
    file of a rank beyond, from an earlier job in the folder, is not this job's); returns
    the event count."""
    events: list[dict[str, Any]] = []
    for rank in range(world_size):
        path = out_dir / TIMELINE_DIR / f"rank{rank}.jsonl"
        if path.is_file():
            lines = path.read_text().splitlines()
            events += [json.loads(line) for line in lines if line.strip()]
    # Per track, B/E in time order (metadata first); a stable sort keeps B before E at ties.
    events.sort(key=lambda e: (e["pid"], e["tid"], e["ph"] != "M", e.get("ts", 0.0)))
    trace = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": metadata}
    atomic_write_text(destination, json.dumps(trace) + "\n")
    return len(events)
