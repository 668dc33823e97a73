"""Sparse push/pull: row-partitioned variables on parameter servers (Parallax's sparse path).

A *sparse variable* is a ``[rows, ...]`` tensor whose gradient touches few rows per step (an
embedding, a sampled-softmax weight). It is split into contiguous row ranges, *row
partitions* (:func:`partition_rows`, reusing :mod:`gradsync.comm.placement`), placed
round-robin on the servers. Per step:

- a *pusher* (a node's first worker, after local aggregation) sends every server one push:
  the coalesced ``(row indices, row values)`` of the partitions it owns;
- a server that has every pusher's push of step t sums them (pusher order), optionally
  divides by the number of workers, and applies SGD to the touched rows
  (:class:`SparseShard`);
- a worker pulls, just before a lookup reads them, exactly the rows its batch needs; the
  server answers a pull of step t once it has applied step t - 1.

Messages are variable-sized, so each is a fixed-size float64 header
``[kind, worker, step, lr, n_0 … n_{k-1}, g_0 … g_{k-1}]`` (``n_i`` rows for the server's
i-th partition; ``g_i`` = 1 when the pusher's variable had a gradient at all) followed, when
rows are named, by their int64 indices and (pushes) their values (the run's dtype). A
variable that had no gradient on any pusher is skipped by the server, as ``single``'s SGD
skips a parameter whose ``.grad`` is None: its momentum does not move its rows that step.
Replies go through :class:`gradsync.comm.pushpull.Outbox` (a queue for a colocated worker).

Example:
    >>> v = SparseVariable("emb", num_rows=10, row_numel=4)
    >>> [(p.start, p.stop, p.server) for p in partition_rows([v], 3, num_servers=2)]
    [(0, 4, 0), (4, 7, 1), (7, 10, 0)]
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as load_tensors
from torch import Tensor

from gradsync.comm.placement import Variable, partition_variables, place_round_robin
from gradsync.comm.pushpull import (
    DONE,
    PUSH,
    STATE,
    TAG_PULL,
    TAG_STATE,
    Outbox,
    TransportError,
    wait_local_reply,
)
from gradsync.trace import Phase

PULL = 3
TAG_SPARSE = 111
FIXED_HEADER = 4  # kind, worker, step, lr; then per partition a row count, then a flag


# -- variables, partitions, coalescing -------------------------------------------------------


@dataclass(frozen=True)
class SparseVariable:
    """A row-sparse parameter: its name, number of rows and elements per row."""

    name: str
    num_rows: int
    row_numel: int
    element_size: int = 4

    @property
    def row_bytes(self) -> int:
        return self.row_numel * self.element_size


@dataclass(frozen=True)
class RowPartition:
    """Rows ``[start, stop)`` of variable ``name``, owned by ``server``."""

    name: str
    start: int
    stop: int
    row_numel: int
    server: int

    @property
    def num_rows(self) -> int:
        return self.stop - self.start


def partition_rows(
    variables: Sequence[SparseVariable], num_partitions: int, *, num_servers: int
) -> list[RowPartition]:
    """``num_partitions`` near-equal row ranges per variable, placed round-robin on servers.

    A row is one "element" of :func:`~gradsync.comm.placement.partition_variables`, so the
    split is the ps strategy's (larger ranges first); the placement is TF's round-robin.
    """
    pieces = partition_variables(
        [Variable(v.name, v.num_rows, v.row_bytes) for v in variables],
        num_partitions,
        threshold_bytes=1,  # always split into min(num_partitions, rows) ranges
    )
    row_numel = {v.name: v.row_numel for v in variables}
    return [
        RowPartition(p.name, p.start, p.stop, row_numel[p.name], p.server)
        for p in place_round_robin(pieces, num_servers)
    ]


def coalesce_rows(grad: Tensor | None, num_rows: int) -> tuple[Tensor, Tensor]:
    """Sorted unique row indices and their summed gradient rows ``[n, row_numel]``.

    A sparse gradient is coalesced (duplicate lookups of a row summed); a dense one keeps
    its rows with any non-zero element (exact for SGD: a zero row changes nothing).

    Example:
        >>> g = torch.sparse_coo_tensor([[3, 1, 3]], torch.ones(3, 2), (5, 2))
        >>> idx, val = coalesce_rows(g, 5); idx.tolist(), val.tolist()
        ([1, 3], [[1.0, 1.0], [2.0, 2.0]])
    """
    if grad is None:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, 1)
    if grad.is_sparse:
        grad = grad.coalesce()
        indices = grad.indices()[0]
        return indices, grad.values().reshape(len(indices), -1)
    rows = grad.reshape(num_rows, -1)
    indices = rows.ne(0).any(dim=1).nonzero().squeeze(1)
    return indices, rows[indices]


def sum_rows(parts: Sequence[tuple[Tensor, Tensor]], num_rows: int) -> tuple[Tensor, Tensor]:
    """Merge several (indices, values) lists of one variable: duplicates summed, sorted."""
    parts = [(i, v) for i, v in parts if len(i)]
    if not parts:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, 1)
    if len(parts) == 1:
        return parts[0]
    indices = torch.cat([i for i, _ in parts])
    values = torch.cat([v for _, v in parts])
    merged = torch.sparse_coo_tensor(
        indices[None], values, (num_rows, values.shape[1]), check_invariants=False
    )
    return coalesce_rows(merged, num_rows)


def split_rows(
    indices: Tensor, values: Tensor | None, partitions: Sequence[RowPartition]
) -> list[tuple[Tensor, Tensor | None]]:
    """Sorted ``indices`` (and their rows) cut at the partitions' boundaries (model order)."""
    starts = torch.tensor([p.start for p in partitions[1:]], dtype=torch.long)
    cuts = [0, *torch.searchsorted(indices, starts).tolist(), len(indices)]
    return [
        (indices[a:b], None if values is None else values[a:b]) for a, b in itertools.pairwise(cuts)
    ]


# -- the partition-count chooser ----------------------------------------------------------

PARTITION_OVERHEAD_S = 20e-6  # per partition per step: bucketing, header entry, index ops
BYTE_TIME_S = 1e-9  # ~1 GB/s through one server (loopback Gloo, CPU copies)
MAX_DOUBLINGS = 6


@dataclass(frozen=True)
class PartitionChoice:
    """The chosen partition count and every candidate's modelled cost (seconds per step)."""

    num_partitions: int
    costs: dict[int, float]

    def describe(self) -> str:
        table = ", ".join(f"P={p}: {c * 1e3:.3f} ms" for p, c in self.costs.items())
        return f"P={self.num_partitions} (modelled sparse time per step: {table})"


def choose_num_partitions(
    variables: Sequence[SparseVariable],
    touched: dict[str, Tensor],
    *,
    num_servers: int,
    candidates: Sequence[int] | None = None,
) -> PartitionChoice:
    """Parallax's automatic partitioning, as a small cost model over candidate counts.

    More partitions spread hot rows (low, frequent word ids) over more servers, so the
    busiest server moves fewer bytes; each partition also costs a fixed overhead. For each
    candidate P (S, 2S, 4S … 64S, at most the rows) the cost is
    ``P · variables · PARTITION_OVERHEAD_S + BYTE_TIME_S · 2 · max_server_bytes(P)``
    (push and pull), where a server's bytes are the ``touched`` rows (measured) it owns.
    Ties go to the smaller P.

    Example:
        >>> v = SparseVariable("emb", num_rows=50_000, row_numel=200)
        >>> hot = {"emb": torch.arange(2000)}  # every touched row is in the first 4%
        >>> choose_num_partitions([v], hot, num_servers=2).num_partitions
        32
    """
    most_rows = max(v.num_rows for v in variables)
    if candidates is None:
        candidates = [num_servers << k for k in range(MAX_DOUBLINGS + 1)]
    candidates = sorted({min(c, most_rows) for c in candidates if c >= 1})
    costs: dict[int, float] = {}
    for count in candidates:
        loads = [0] * num_servers
        for p in partition_rows(variables, count, num_servers=num_servers):
            rows = touched.get(p.name)
            if rows is None or not len(rows):
                continue
            inside = int(((rows >= p.start) & (rows < p.stop)).sum())
            loads[p.server] += inside * p.row_numel * 4
        num_parts = sum(min(count, v.num_rows) for v in variables)
        costs[count] = num_parts * PARTITION_OVERHEAD_S + BYTE_TIME_S * 2 * max(loads)
    best = min(costs, key=lambda c: (round(costs[c], 12), c))
    return PartitionChoice(best, costs)


# -- the server ---------------------------------------------------------------------------


@dataclass
class Request:
    """One message as a server sees it. ``wire_bytes`` is 0 from a colocated worker."""

    kind: int
    worker: int
    step: int
    lr: float
    indices: list[Tensor]  # per partition of the server, global row ids
    values: list[Tensor] | None
    wire_bytes: int
    present: list[bool]  # per partition: the pusher's variable had a gradient


class SparseShard:
    """One server's row partitions and torch's SGD rule restricted to the rows it must touch.

    ``torch.optim.SGD`` on a sparse gradient keeps a sparse momentum buffer whose rows are
    every row ever touched; each step it decays all of them and moves them all. With
    momentum m > 0 this shard does the same: ``active`` rows (ever touched), ``buf[active]
    *= m; buf[touched] += g; value[active] -= lr · buf[active]``. Rows never touched keep
    their bit pattern; with m = 0 (plain sparse SGD) so does every row not touched this step.

    Example:
        >>> part = RowPartition("e", 0, 4, 1, 0)
        >>> shard = SparseShard([part], {"e": torch.zeros(4, 1)}, momentum=0.0)
        >>> shard.apply([(torch.tensor([2]), torch.ones(1, 1))], lr=0.5)
        >>> shard.values[0].flatten().tolist()
        [0.0, 0.0, -0.5, 0.0]
    """

    def __init__(
        self, partitions: Sequence[RowPartition], initial: dict[str, Tensor], *, momentum: float
    ) -> None:
        self.partitions = list(partitions)
        self.momentum = momentum
        self.values = [
            initial[p.name].reshape(-1, p.row_numel)[p.start : p.stop].clone()
            for p in self.partitions
        ]
        self.buffers = [torch.zeros_like(v) for v in self.values] if momentum else []
        self.active = [torch.zeros(0, dtype=torch.long) for _ in self.partitions]
        self.num_applied = 0

    def apply(self, grads: Sequence[tuple[Tensor, Tensor] | None], *, lr: float) -> None:
        """One SGD step; ``grads[i]`` = (local row indices, rows) of partition i, or None
        when its variable had no gradient anywhere (then it is left alone, momentum too)."""
        for i, entry in enumerate(grads):
            if entry is None:
                continue
            rows, grad = entry
            values = self.values[i]
            if not self.momentum:
                if len(rows):
                    values.index_add_(0, rows, grad, alpha=-lr)
                continue
            buf, active = self.buffers[i], self.active[i]
            if len(active):
                buf[active] = buf[active] * self.momentum
            if len(rows):
                buf.index_add_(0, rows, grad)
                active = torch.unique(torch.cat([active, rows]))
                self.active[i] = active
            if len(active):
                values.index_add_(0, active, buf[active], alpha=-lr)
        self.num_applied += 1

    def rows(self, indices: Sequence[Tensor]) -> Tensor:
        """The current values of the requested global rows, flat, in partition order."""
        pieces = [
            self.values[i][rows - p.start].reshape(-1)
            for i, (p, rows) in enumerate(zip(self.partitions, indices, strict=True))
            if len(rows)
        ]
        return torch.cat(pieces) if pieces else torch.zeros(0)

    def state_tensors(self) -> dict[str, Tensor]:
        tensors = {f"{i}/values": v.clone() for i, v in enumerate(self.values)}
        tensors.update({f"{i}/momentum_buffer": b.clone() for i, b in enumerate(self.buffers)})
        return tensors


def _counts(header: Tensor, num_partitions: int) -> list[int]:
    return [int(n) for n in header[FIXED_HEADER : FIXED_HEADER + num_partitions].tolist()]


class SparseInbox:
    """Every request addressed to one server, in arrival order (one thread per remote worker)."""

    def __init__(
        self,
        partitions: Sequence[RowPartition],
        *,
        remote: dict[int, int],
        group: Any,
        timeout_s: float,
    ) -> None:
        self.partitions = list(partitions)
        self.timeout_s = timeout_s
        self._queue: queue.Queue[Request | BaseException] = queue.Queue()
        for rank in remote.values():
            threading.Thread(
                target=self._receive, args=(rank, group), name=f"sparse-recv-{rank}", daemon=True
            ).start()

    def _receive(self, rank: int, group: Any) -> None:
        try:
            while True:
                header = torch.empty(FIXED_HEADER + 2 * len(self.partitions), dtype=torch.float64)
                dist.recv(header, src=rank, group=group, tag=TAG_SPARSE)
                kind, counts = int(header[0]), _counts(header, len(self.partitions))
                wire = header.numel() * 8
                indices = torch.empty(sum(counts), dtype=torch.long)
                values = None
                if len(indices):
                    dist.recv(indices, src=rank, group=group, tag=TAG_SPARSE)
                    wire += indices.numel() * 8
                    if kind == PUSH:
                        width = sum(
                            n * p.row_numel for n, p in zip(counts, self.partitions, strict=True)
                        )
                        values = torch.empty(width)
                        dist.recv(values, src=rank, group=group, tag=TAG_SPARSE)
                        wire += values.numel() * values.element_size()
                self._queue.put(self._decode(header, counts, indices, values, wire))
                if kind == DONE:
                    return
        except BaseException as error:  # the server loop re-raises it, naming the rank
            self._queue.put(TransportError(f"receiving from rank {rank} failed: {error}"))

    def _decode(
        self, header: Tensor, counts: list[int], indices: Tensor, values: Tensor | None, wire: int
    ) -> Request:
        index_parts = list(torch.split(indices, counts))
        value_parts = None
        if values is not None or int(header[0]) == PUSH:
            widths = [n * p.row_numel for n, p in zip(counts, self.partitions, strict=True)]
            flat = values if values is not None else torch.zeros(0)
            value_parts = [
                v.reshape(n, p.row_numel)
                for v, n, p in zip(torch.split(flat, widths), counts, self.partitions, strict=True)
            ]
        kind, worker, step = (int(x) for x in header[:3].tolist())
        flags = header[FIXED_HEADER + len(counts) :].gt(0).tolist()
        return Request(kind, worker, step, float(header[3]), index_parts, value_parts, wire, flags)

    def put_local(
        self, header: Tensor, counts: list[int], indices: Tensor, values: Tensor | None
    ) -> None:
        """A request from the worker in this process (private copies)."""
        self._queue.put(self._decode(header, counts, indices, values, 0))

    def get(self) -> Request:
        try:
            item = self._queue.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TransportError(
                f"no request reached this server in {self.timeout_s:g} s"
            ) from None
        if isinstance(item, BaseException):
            raise item
        return item


@dataclass
class RoundTally:
    """Bytes one server moved for one step (pushes and pull requests in, pull replies out)."""

    bytes_recv: int = 0
    bytes_sent: int = 0
    busy_s: float = 0.0


@dataclass
class SparseServer:
    """The loop of one sparse server: synchronous rounds over the pushers' pushes.

    ``pushers`` are the worker indices that push (one per node with local aggregation);
    ``scale`` multiplies the summed gradient (1/workers when averaging, 1 when summing).
    """

    shard: SparseShard
    inbox: SparseInbox
    outbox: Outbox
    pushers: list[int]
    num_workers: int
    scale: float
    timeline: Any
    track: str
    on_round: Callable[[int, RoundTally], None] = lambda step, tally: None
    pending: dict[int, Request] = field(default_factory=dict)
    waiting: list[Request] = field(default_factory=list)
    tallies: dict[int, RoundTally] = field(default_factory=dict)

    def run(self) -> None:
        done: set[int] = set()
        while len(done) < self.num_workers:
            request = self.inbox.get()
            tally = self.tallies.setdefault(max(request.step, 0), RoundTally())
            tally.bytes_recv += request.wire_bytes
            if request.kind == DONE:
                done.add(request.worker)
            elif request.kind == PUSH:
                self._on_push(request)
            elif request.kind in (PULL, STATE):
                self.waiting.append(request)
                self._answer_ready()
            else:
                raise RuntimeError(f"unknown request kind {request.kind} from {request.worker}")
        self.outbox.flush()

    def _on_push(self, request: Request) -> None:
        if request.worker in self.pending:
            raise RuntimeError(f"worker {request.worker} pushed step {request.step} twice")
        self.pending[request.worker] = request
        if len(self.pending) < len(self.pushers):
            return
        started = time.perf_counter()
        step, lr = request.step, self.pending[self.pushers[0]].lr
        grads = []
        with self.timeline.span(self.track, Phase.SERVER_AGGREGATE, step=step):
            for i, p in enumerate(self.shard.partitions):
                if not any(self.pending[w].present[i] for w in self.pushers):
                    grads.append(None)  # no gradient anywhere: single's SGD skips it
                    continue
                # Fixed pusher order: bit-identical reruns.
                parts = [
                    (self.pending[w].indices[i], self.pending[w].values[i]) for w in self.pushers
                ]
                rows, grad = sum_rows(parts, p.stop)
                grads.append((rows - p.start, grad * self.scale if self.scale != 1 else grad))
        with self.timeline.span(self.track, Phase.SERVER_APPLY, step=step):
            self.shard.apply(grads, lr=lr)
        self.pending.clear()
        tally = self.tallies.setdefault(step, RoundTally())
        tally.busy_s += time.perf_counter() - started
        self._answer_ready()
        # Pulls of step t came before the pushes of step t: the round's tally is complete.
        self.on_round(step, self.tallies.pop(step))

    def _answer_ready(self) -> None:
        held = []
        for request in self.waiting:
            if self.shard.num_applied < request.step:  # step t reads step t - 1's update
                held.append(request)
            elif request.kind == STATE:
                self.outbox.send_state(request.worker, self.shard.state_tensors())
            else:
                reply = self.shard.rows(request.indices)
                sent = self.outbox.send(request.worker, reply, TAG_PULL)
                self.tallies.setdefault(request.step, RoundTally()).bytes_sent += sent
        self.waiting = held


# -- the worker's end ---------------------------------------------------------------------


class SparseClient:
    """A worker's end: push coalesced rows to servers, pull the rows a lookup needs.

    ``servers`` lists each server's global rank (None: the server in this process, reached
    through ``local`` = (its inbox, its outbox)); ``partitions[s]`` are server s's.
    """

    def __init__(
        self,
        *,
        worker: int,
        servers: Sequence[int | None],
        partitions: Sequence[Sequence[RowPartition]],
        group: Any,
        timeout_s: float,
        local: tuple[SparseInbox, Outbox] | None = None,
        alive: Callable[[], bool] = lambda: True,
    ) -> None:
        self.worker = worker
        self.servers = list(servers)
        self.partitions = [list(p) for p in partitions]
        self.group = group
        self.timeout_s = timeout_s
        self.local = local
        self.alive = alive

    def _header(
        self,
        kind: int,
        step: int,
        lr: float,
        counts: Sequence[int],
        present: Sequence[bool] | None = None,
    ) -> Tensor:
        flags = [float(p) for p in present] if present is not None else [0.0] * len(counts)
        return torch.tensor([kind, self.worker, step, lr, *counts, *flags], dtype=torch.float64)

    def _send(
        self,
        server: int,
        kind: int,
        step: int,
        lr: float,
        indices: Sequence[Tensor],
        values: Sequence[Tensor] | None = None,
        present: Sequence[bool] | None = None,
    ) -> int:
        counts = [len(i) for i in indices]
        header = self._header(kind, step, lr, counts, present)
        flat_indices = torch.cat(list(indices)) if indices else torch.zeros(0, dtype=torch.long)
        flat_values = None
        if values is not None and len(flat_indices):
            flat_values = torch.cat([v.reshape(-1) for v in values]).to(torch.get_default_dtype())
        rank = self.servers[server]
        if rank is None:
            assert self.local is not None
            self.local[0].put_local(
                header,
                counts,
                flat_indices.clone(),
                None if flat_values is None else flat_values.clone(),
            )
            return 0
        dist.send(header, dst=rank, group=self.group, tag=TAG_SPARSE)
        sent = header.numel() * 8
        if len(flat_indices):
            dist.send(flat_indices.contiguous(), dst=rank, group=self.group, tag=TAG_SPARSE)
            sent += flat_indices.numel() * 8
            if flat_values is not None:
                dist.send(flat_values.contiguous(), dst=rank, group=self.group, tag=TAG_SPARSE)
                sent += flat_values.numel() * flat_values.element_size()
        return sent

    def push(
        self,
        step: int,
        lr: float,
        rows: Sequence[Sequence[tuple[Tensor, Tensor]]],
        present: Sequence[Sequence[bool]],
    ) -> int:
        """Send server s the (indices, values) of each of its partitions and whether their
        variables had a gradient (``present[s][i]``); returns wire bytes."""
        return sum(
            self._send(s, PUSH, step, lr, [i for i, _ in parts], [v for _, v in parts], flags)
            for s, (parts, flags) in enumerate(zip(rows, present, strict=True))
        )

    def pull(self, step: int, wanted: Sequence[Sequence[Tensor]]) -> tuple[list[Tensor], int, int]:
        """Ask server s for rows ``wanted[s][i]`` of its partition i (after step - 1's update).

        Returns the flat values per server (partition order) and the (sent, received) bytes.
        """
        replies: list[Tensor] = [torch.zeros(0)] * len(self.servers)
        works, sent, received = [], 0, 0
        asked = [s for s, rows in enumerate(wanted) if sum(len(r) for r in rows)]
        for s in asked:
            width = sum(
                len(r) * p.row_numel for r, p in zip(wanted[s], self.partitions[s], strict=True)
            )
            replies[s] = torch.empty(width)
            if self.servers[s] is not None:  # receive posted before the request goes out
                works.append(
                    dist.irecv(replies[s], src=self.servers[s], group=self.group, tag=TAG_PULL)
                )
                received += width * replies[s].element_size()
        for s in asked:
            sent += self._send(s, PULL, step, 0.0, wanted[s])
        for s in asked:
            if self.servers[s] is None:
                replies[s] = self._local_reply(TAG_PULL)
        for work in works:
            work.wait()
        return replies, sent, received

    def request_state(self, step: int) -> list[dict[str, Tensor]]:
        """Every server's partitions (values, momentum) once it has applied ``step`` steps."""
        for s, parts in enumerate(self.partitions):
            self._send(s, STATE, step, 0.0, [torch.zeros(0, dtype=torch.long)] * len(parts))
        states = []
        for rank in self.servers:
            if rank is None:
                self._local_reply(TAG_STATE)  # the length; the bytes follow
                data = self._local_reply(TAG_STATE)
            else:
                length = torch.zeros(1, dtype=torch.int64)
                dist.recv(length, src=rank, group=self.group, tag=TAG_STATE)
                data = torch.empty(int(length.item()), dtype=torch.uint8)
                dist.recv(data, src=rank, group=self.group, tag=TAG_STATE)
            states.append(load_tensors(data.numpy().tobytes()))
        return states

    def done(self) -> None:
        """Tell every server this worker has finished."""
        for s, parts in enumerate(self.partitions):
            self._send(s, DONE, -1, 0.0, [torch.zeros(0, dtype=torch.long)] * len(parts))

    def _local_reply(self, tag: int) -> Tensor:
        assert self.local is not None
        return wait_local_reply(self.local[1].local[tag], self.alive, self.timeout_s)


__all__ = [
    "PartitionChoice",
    "RowPartition",
    "SparseClient",
    "SparseInbox",
    "SparseServer",
    "SparseShard",
    "SparseVariable",
    "choose_num_partitions",
    "coalesce_rows",
    "partition_rows",
    "split_rows",
    "sum_rows",
]
