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
- a worker pulls the rows its batch needs (hybrid: every table's in one request per server
  before the forward, :mod:`gradsync.comm.prefetch`); the server answers a pull of step t
  once it has applied step t - 1.

Messages use the toolkit's framing (:mod:`gradsync.comm.wire`, served by
:func:`gradsync.comm.server.serve`): a push or pull header is followed by a float64
``[n_0 … n_{k-1}, g_0 … g_{k-1}]`` (``n_i`` rows for the server's i-th partition; ``g_i`` = 1
when the pusher's variable had a gradient at all), then, when rows are named, their int64
indices and (pushes) their values (the run's dtype). A variable that had no gradient on any
pusher is skipped by the server, as ``single``'s SGD skips a parameter whose ``.grad`` is
None: its momentum does not move its rows that step.

Example:
    >>> v = SparseVariable("emb", num_rows=10, row_numel=4)
    >>> [(p.start, p.stop, p.server) for p in partition_rows([v], 3, num_servers=2)]
    [(0, 4, 0), (4, 7, 1), (7, 10, 0)]
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradsync.checkpoint import LAZY, OPTIM, PARAM
from gradsync.comm.groups import NodeGroup
from gradsync.comm.lazy import LazyMomentumRows
from gradsync.comm.placement import Variable, partition_variables, place_round_robin
from gradsync.comm.server import Gather, ServerMetrics, ServerPolicy
from gradsync.comm.wire import (
    HEADER,
    TAG_PUSH,
    TAG_REPLY,
    Header,
    Kind,
    Message,
    Outbox,
    Recv,
    ServerLinks,
)
from gradsync.trace import NullTimeline, Phase

LAG_ROWS = ("rows", "values", "momentum_buffer", "synced")  # per row behind; plus "sums"

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
        >>> coalesce_rows(torch.sparse_coo_tensor([[]], torch.ones(0, 2), (5, 2)), 5)[1].shape
        torch.Size([0, 2])
    """
    if grad is None:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, 1)
    if grad.is_sparse:
        grad = grad.coalesce()
        indices = grad.indices()[0]
        width = math.prod(grad.shape[1:])  # a worker that looked up no row has 0 of them
        return indices, grad.values().reshape(len(indices), width)
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


def gather_rows_on_node(
    rows: dict[str, tuple[Tensor, Tensor]],
    present: dict[str, bool],
    num_rows: dict[str, int],
    node: NodeGroup,
) -> tuple[dict[str, tuple[Tensor, Tensor]], dict[str, bool], int]:
    """Collective over ``node``: every member's coalesced rows per variable (in
    ``num_rows``' order), summed in member order (the same sum on every run), whether any
    member had a gradient per variable, and the bytes this rank moved.

    Two all-gathers: the row counts and flags, then each member's indices and values as
    one byte buffer (indices first), padded to the longest member's.
    """
    names = list(num_rows)
    counts = torch.tensor(
        [len(rows[n][0]) for n in names] + [int(present[n]) for n in names], dtype=torch.long
    )
    all_counts = [torch.zeros_like(counts) for _ in node.ranks]
    dist.all_gather(all_counts, counts, group=node.group)
    widths = [rows[n][1].shape[1] for n in names]  # values are [rows, row_numel]
    anywhere = {n: any(int(c[len(names) + i]) for c in all_counts) for i, n in enumerate(names)}
    all_counts = [c[: len(names)] for c in all_counts]
    flat_val = torch.cat([rows[n][1].reshape(-1) for n in names])
    sizes = [_packed_size(c, widths, flat_val.element_size()) for c in all_counts]
    packed = torch.zeros(max(sizes), dtype=torch.uint8)
    mine = _pack_bytes(torch.cat([rows[n][0] for n in names]), flat_val)
    packed[: len(mine)] = mine
    everyone = [torch.empty_like(packed) for _ in node.ranks]
    dist.all_gather(everyone, packed, group=node.group)
    moved = (len(node.ranks) - 1) * (packed.numel() + counts.numel() * 8)
    per_member: dict[str, list[tuple[Tensor, Tensor]]] = {n: [] for n in names}
    for member_counts, member_bytes in zip(all_counts, everyone, strict=True):
        counted = member_counts.tolist()
        member_idx, member_val = _unpack_bytes(member_bytes, sum(counted), flat_val.dtype)
        i_off = v_off = 0
        for n, k, w in zip(names, counted, widths, strict=True):
            per_member[n].append(
                (member_idx[i_off : i_off + k], member_val[v_off : v_off + k * w].view(k, w))
            )
            i_off += k
            v_off += k * w
    merged = {n: sum_rows(per_member[n], num_rows[n]) for n in names}
    return merged, anywhere, moved


def _packed_size(counts: Tensor, widths: list[int], value_size: int) -> int:
    """Bytes of a member's packed rows: its int64 indices, then its values."""
    counted = counts.tolist()
    return sum(counted) * 8 + sum(k * w for k, w in zip(counted, widths, strict=True)) * value_size


def _pack_bytes(indices: Tensor, values: Tensor) -> Tensor:
    """``indices`` (int64) then ``values`` as one uint8 tensor (their bytes, exactly).

    Example:
        >>> packed = _pack_bytes(torch.tensor([3, 1]), torch.tensor([0.5, -2.0]))
        >>> idx, val = _unpack_bytes(packed, 2, torch.float32)
        >>> idx.tolist(), val.tolist()
        ([3, 1], [0.5, -2.0])
    """
    return torch.cat(
        [indices.contiguous().view(torch.uint8), values.contiguous().view(torch.uint8)]
    )


def _unpack_bytes(packed: Tensor, num_indices: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The inverse of :func:`_pack_bytes` (trailing padding ignored)."""
    split = num_indices * 8
    values = packed[split:]
    values = values[: len(values) - len(values) % dtype.itemsize]
    return packed[:split].view(torch.int64), values.view(dtype)


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
    apply_cost: tuple[float, float] = (0.0, 0.0),
) -> PartitionChoice:
    """Parallax's automatic partitioning, as a small cost model over candidate counts.

    More partitions spread hot rows (low, frequent word ids) over more servers, so the
    busiest server moves and applies fewer rows; each partition also costs a fixed
    overhead. For each candidate P (S, 2S, 4S … 64S, at most the rows) the cost is
    ``P · variables · PARTITION_OVERHEAD_S + BYTE_TIME_S · 2 · max_server_bytes(P)``
    (push and pull) plus the busiest server's apply time, ``apply_cost`` = (seconds per
    partition, seconds per element) as :func:`measure_apply_cost` measures them; a server's
    bytes and elements are those of the ``touched`` rows (measured) it owns. Ties go to the
    smaller P.

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
    per_partition_s, per_element_s = apply_cost
    costs: dict[int, float] = {}
    for count in candidates:
        loads = [0] * num_servers  # touched elements per server
        applies = [0.0] * num_servers
        for p in partition_rows(variables, count, num_servers=num_servers):
            applies[p.server] += per_partition_s
            rows = touched.get(p.name)
            if rows is None or not len(rows):
                continue
            inside = int(((rows >= p.start) & (rows < p.stop)).sum())
            loads[p.server] += inside * p.row_numel
        num_parts = sum(min(count, v.num_rows) for v in variables)
        busiest_apply = max(a + n * per_element_s for a, n in zip(applies, loads, strict=True))
        costs[count] = (
            num_parts * PARTITION_OVERHEAD_S + BYTE_TIME_S * 2 * 4 * max(loads) + busiest_apply
        )
    best = min(costs, key=lambda c: (round(costs[c], 12), c))
    return PartitionChoice(best, costs)


# -- the server ---------------------------------------------------------------------------


class SparseShard:
    """One server's row partitions under torch's SGD rule for sparse gradients.

    With momentum, each partition is a :class:`~gradsync.comm.lazy.LazyMomentumRows`:
    the rows a step touches are updated, the others are caught up in closed form when
    next read, so a step costs what its rows cost. Rows never touched keep their bit
    pattern; with momentum 0 (plain sparse SGD) so does every row not touched this step.

    Example:
        >>> part = RowPartition("e", 0, 4, 1, 0)
        >>> shard = SparseShard([part], {"e": torch.zeros(4, 1)}, momentum=0.0)
        >>> shard.apply([(torch.tensor([2]), torch.ones(1, 1))], lr=0.5)
        >>> shard.rows([torch.tensor([1, 2])]).tolist()
        [0.0, -0.5]
    """

    def __init__(
        self, partitions: Sequence[RowPartition], initial: dict[str, Tensor], *, momentum: float
    ) -> None:
        self.partitions = list(partitions)
        self.momentum = momentum
        self.parts = [
            LazyMomentumRows(
                initial[p.name].reshape(-1, p.row_numel)[p.start : p.stop].clone(),
                momentum=momentum,
            )
            for p in self.partitions
        ]
        self.num_applied = 0

    def apply(self, grads: Sequence[tuple[Tensor, Tensor] | None], *, lr: float) -> None:
        """One SGD step; ``grads[i]`` = (local row indices, rows) of partition i, or None
        when its variable had no gradient anywhere (then it is left alone, momentum too)."""
        for part, entry in zip(self.parts, grads, strict=True):
            if entry is not None:
                part.apply(*entry, lr=lr)
        self.num_applied += 1

    def rows(self, indices: Sequence[Tensor]) -> Tensor:
        """The current values of the requested global rows, flat, in partition order."""
        pieces = [
            part.read(rows - p.start).reshape(-1)
            for part, p, rows in zip(self.parts, self.partitions, indices, strict=True)
            if len(rows)
        ]
        return torch.cat(pieces) if pieces else torch.zeros(0)

    def state_tensors(self) -> dict[str, Tensor]:
        """``<i>/values`` per partition i and, with momentum, ``<i>/momentum_buffer`` and
        ``<i>/lag/…`` (:meth:`~gradsync.comm.lazy.LazyMomentumRows.state`: saving changes
        nothing)."""
        tensors = {}
        for i, part in enumerate(self.parts):
            state = part.state() if self.momentum else {"values": part.values.clone()}
            tensors.update({f"{i}/{key}": value for key, value in state.items()})
        return tensors

    def load_state_tensors(self, tensors: dict[str, Tensor]) -> None:
        """The inverse of :meth:`state_tensors`."""
        for i, part in enumerate(self.parts):
            prefix = f"{i}/lag/"
            lag = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
            part.load(tensors[f"{i}/values"], tensors.get(f"{i}/momentum_buffer"), lag or None)


def measure_apply_cost(row_numel: int, *, momentum: float, rows: int = 256) -> tuple[float, float]:
    """Seconds one server spends applying a partition's step: (fixed, per element).

    Timed on a scratch partition (the fastest of a few repeats), so the partition chooser
    prices the apply as this machine runs it.
    """
    part = RowPartition("scratch", 0, 2 * rows, row_numel, 0)
    shard = SparseShard([part], {"scratch": torch.zeros(2 * rows, row_numel)}, momentum=momentum)

    def fastest(n: int) -> float:
        index, grad = torch.arange(0, 2 * n, 2), torch.ones(n, row_numel)
        best = math.inf
        for _ in range(5):
            started = time.perf_counter()
            shard.apply([(index, grad)], lr=0.1)
            best = min(best, time.perf_counter() - started)
        return best

    one, many = fastest(1), fastest(rows)
    return one, max(many - one, 0.0) / ((rows - 1) * row_numel)


def sparse_reader(partitions: Sequence[RowPartition]):
    """A server's :data:`~gradsync.comm.wire.ReadBody` for pushes and pulls: per-partition
    row counts and had-a-gradient flags (float64), then the rows' indices and (pushes)
    their values."""
    widths = [p.row_numel for p in partitions]

    def read(header: Header, recv: Recv) -> list[Tensor]:
        if header.kind not in (Kind.PUSH, Kind.PULL):
            return []
        meta = recv(torch.empty(2 * len(widths), dtype=torch.float64))
        counts = [int(n) for n in meta[: len(widths)].tolist()]
        if not sum(counts):
            return [meta]
        indices = recv(torch.empty(sum(counts), dtype=torch.long))
        if header.kind == Kind.PULL:
            return [meta, indices]
        values = recv(torch.empty(sum(n * w for n, w in zip(counts, widths, strict=True))))
        return [meta, indices, values]

    return read


@dataclass
class Rows:
    """A push or pull cut per partition: global row ids, values (pushes), gradient flags."""

    indices: list[Tensor]
    values: list[Tensor] | None
    present: list[bool]

    @classmethod
    def decode(cls, message: Message, partitions: Sequence[RowPartition]) -> Rows:
        meta, *rest = message.tensors
        k = len(partitions)
        counts = [int(n) for n in meta[:k].tolist()]
        indices = list(torch.split(rest[0] if rest else torch.zeros(0, dtype=torch.long), counts))
        values = None
        if message.kind == Kind.PUSH:
            flat = rest[1] if len(rest) > 1 else torch.zeros(0)
            widths = [n * p.row_numel for n, p in zip(counts, partitions, strict=True)]
            values = [
                v.reshape(n, p.row_numel)
                for v, n, p in zip(torch.split(flat, widths), counts, partitions, strict=True)
            ]
        return cls(indices, values, meta[k:].gt(0).tolist())


class SparseServer(ServerPolicy):
    """Synchronous rounds over the pushers' pushes; pulls answered once the step before
    them is applied.

    ``pushers`` are the worker indices that push (one per node with local aggregation);
    ``scale`` multiplies the summed gradient (1/workers when averaging, 1 when summing).
    """

    def __init__(
        self,
        shard: SparseShard,
        outbox: Outbox,
        metrics: ServerMetrics,
        *,
        pushers: Sequence[int],
        scale: float,
        timeline: Any = None,
        track: str = "sparse-server",
    ) -> None:
        self.shard, self.outbox, self.metrics = shard, outbox, metrics
        self.pushers = list(pushers)
        self.scale = scale
        self.timeline = timeline or NullTimeline()
        self.track = track
        self.rounds = Gather(self.pushers)
        self.waiting: list[Message] = []

    def on_push(self, message: Message) -> None:
        step, lr = message.step, message.header.lr
        pushes = self.rounds.add(step, message.worker, Rows.decode(message, self.shard.partitions))
        if pushes is None:
            return
        with self.metrics.busy(step):
            with self.timeline.span(self.track, Phase.SERVER_AGGREGATE, step=step):
                grads = self._sum(pushes)
            with self.timeline.span(self.track, Phase.SERVER_APPLY, step=step):
                self.shard.apply(grads, lr=lr)
        self._answer_ready()
        # Pulls of step t came before the pushes of step t: the round's tally is complete.
        self.metrics.finish(step)

    def _sum(self, pushes: list[Rows]) -> list[tuple[Tensor, Tensor] | None]:
        """Per partition: the pushers' rows summed (pusher order: bit-identical reruns)."""
        grads: list[tuple[Tensor, Tensor] | None] = []
        for i, p in enumerate(self.shard.partitions):
            if not any(push.present[i] for push in pushes):
                grads.append(None)  # no gradient anywhere: single's SGD skips it
                continue
            parts = [(push.indices[i], push.values[i]) for push in pushes if push.values]
            rows, grad = sum_rows(parts, p.stop)
            grads.append((rows - p.start, grad * self.scale if self.scale != 1 else grad))
        return grads

    def on_pull(self, message: Message) -> None:
        self.waiting.append(message)
        self._answer_ready()

    def on_state(self, message: Message) -> None:
        self.waiting.append(message)
        self._answer_ready()

    def _answer_ready(self) -> None:
        held = []
        for request in self.waiting:
            if self.shard.num_applied < request.step:  # step t reads step t - 1's update
                held.append(request)
            elif request.kind == Kind.STATE:
                self.outbox.send_state(request.worker, self.shard.state_tensors())
            else:
                wanted = Rows.decode(request, self.shard.partitions).indices
                with self.metrics.busy(request.step):
                    values = self.shard.rows(wanted)
                sent = self.outbox.send(
                    request.worker, Header(Kind.REPLY, step=request.step), [values]
                )
                self.metrics.tally(request.step).bytes_sent += sent
        self.waiting = held

    def state_tensors(self) -> dict[str, Tensor]:
        return self.shard.state_tensors()

    def load_state_tensors(self, tensors: dict[str, Tensor]) -> None:
        self.shard.load_state_tensors(tensors)

    def resume_at(self, steps_done: int) -> None:
        self.shard.num_applied = steps_done  # a pull of step t waits for t applied steps


def install_rows(
    states: Sequence[dict[str, Tensor]],
    on_server: Sequence[Sequence[RowPartition]],
    tables: dict[str, Tensor],
    buffers: dict[str, Tensor] | None = None,
) -> None:
    """Write every server's rows (``states[s]``: :meth:`SparseShard.state_tensors`) into
    the whole ``tables`` and, with momentum, ``buffers`` (name → tensor, rows first)."""
    for state, parts in zip(states, on_server, strict=True):
        for i, p in enumerate(parts):
            rows = slice(p.start, p.stop)
            tables[p.name].view(-1, p.row_numel)[rows] = state[f"{i}/values"]
            if buffers is not None:
                buffers[p.name].view(-1, p.row_numel)[rows] = state[f"{i}/momentum_buffer"]


def lag_tensors(
    states: Sequence[dict[str, Tensor]], on_server: Sequence[Sequence[RowPartition]]
) -> dict[str, Tensor]:
    """The rows every server has not caught up yet (``<i>/lag/…`` of
    :meth:`SparseShard.state_tensors`) as checkpoint tensors ``lazy/<name>/…``: global row
    numbers in ascending order, so they do not depend on the partitioning.

    Example:
        >>> lag = {"0/lag/rows": torch.tensor([1]), "0/lag/synced": torch.tensor([4]),
        ...        "0/lag/values": torch.ones(1, 2), "0/lag/momentum_buffer": torch.ones(1, 2),
        ...        "0/lag/sums": torch.zeros(5, dtype=torch.float64)}
        >>> lag_tensors([lag], [[RowPartition("e", 2, 4, 2, 0)]])["lazy/e/rows"].tolist()
        [3]
    """
    lags: dict[str, list[dict[str, Tensor]]] = {}
    for state, parts in zip(states, on_server, strict=True):
        for i, p in enumerate(parts):
            if f"{i}/lag/sums" in state:
                lag = {key: state[f"{i}/lag/{key}"] for key in (*LAG_ROWS, "sums")}
                lags.setdefault(p.name, []).append({**lag, "rows": lag["rows"] + p.start})
    tensors = {}
    for name, parts_lag in lags.items():
        rows = torch.cat([lag["rows"] for lag in parts_lag])
        order = rows.argsort()
        for key in LAG_ROWS:
            tensors[f"{LAZY}{name}/{key}"] = torch.cat([lag[key] for lag in parts_lag])[order]
        # Every partition of a variable applies the same steps: the same sums.
        tensors[f"{LAZY}{name}/sums"] = parts_lag[0]["sums"]
    return tensors


def cut_rows(
    tensors: dict[str, Tensor], on_server: Sequence[Sequence[RowPartition]]
) -> list[dict[str, Tensor]]:
    """Each server's state (keys of :meth:`SparseShard.state_tensors`) from checkpoint
    ``tensors`` (resume): the inverse of :func:`install_rows` and :func:`lag_tensors`.

    Example:
        >>> parts = [[RowPartition("e", 0, 1, 2, 0)], [RowPartition("e", 1, 3, 2, 1)]]
        >>> cut_rows({"param/e": torch.arange(6.0).view(3, 2)}, parts)[1]["0/values"].tolist()
        [[2.0, 3.0], [4.0, 5.0]]
    """
    states = []
    for parts in on_server:
        state = {}
        for i, p in enumerate(parts):
            rows = slice(p.start, p.stop)
            state[f"{i}/values"] = tensors[PARAM + p.name].reshape(-1, p.row_numel)[rows]
            buffer = tensors.get(f"{OPTIM}{p.name}/momentum_buffer")
            if buffer is not None:
                state[f"{i}/momentum_buffer"] = buffer.reshape(-1, p.row_numel)[rows]
            lag = f"{LAZY}{p.name}/"
            if lag + "sums" in tensors:
                behind = tensors[lag + "rows"]
                inside = (behind >= p.start) & (behind < p.stop)
                for key in LAG_ROWS:
                    state[f"{i}/lag/{key}"] = tensors[lag + key][inside]
                state[f"{i}/lag/rows"] = behind[inside] - p.start
                state[f"{i}/lag/sums"] = tensors[lag + "sums"]
        states.append(state)
    return states


# -- the worker's end ---------------------------------------------------------------------


class SparseClient(ServerLinks):
    """A worker's end: push coalesced rows to servers, pull the rows lookups need.

    ``partitions[s]`` are server s's; the rest as :class:`~gradsync.comm.wire.ServerLinks`.
    :attr:`num_pulls` counts pull round trips (one :meth:`pull`: one request per server
    asked, all answered before it returns).
    """

    def __init__(self, *, partitions: Sequence[Sequence[RowPartition]], **links: Any) -> None:
        super().__init__(**links)
        self.partitions = [list(p) for p in partitions]
        self.num_pulls = 0
        self._posted: list[tuple[Any, Tensor]] = []  # pushes in flight, with their tensors

    def _send_rows(
        self,
        server: int,
        header: Header,
        indices: Sequence[Tensor],
        values: Sequence[Tensor] | None = None,
        present: Sequence[bool] | None = None,
        *,
        post: bool = False,
    ) -> int:
        counts = [float(len(i)) for i in indices]
        flags = [float(p) for p in present] if present is not None else [0.0] * len(counts)
        tensors = [torch.tensor([*counts, *flags], dtype=torch.float64)]
        if sum(counts):
            tensors.append(torch.cat(list(indices)))
            if values is not None:
                flat = torch.cat([v.reshape(-1) for v in values])
                tensors.append(flat.to(torch.get_default_dtype()))
        if self.servers[server] is None:  # the server keeps what it gets: private copies
            tensors = [t.clone() for t in tensors]
        elif post:
            return self._post(server, header, tensors)
        return self.send(server, header, tensors)

    def _post(self, server: int, header: Header, tensors: Sequence[Tensor]) -> int:
        """Start sending one message to remote server ``server``; it leaves while the caller
        goes on (:meth:`wait_pushes`). Returns its wire bytes."""
        pieces = [header.encode(), *(t.contiguous() for t in tensors)]
        rank = self.servers[server]
        # Each tensor is kept with its work: it must live until it has been sent.
        self._posted.extend(
            (dist.isend(t, dst=rank, group=self.lanes.to(rank), tag=TAG_PUSH), t) for t in pieces
        )
        return sum(t.numel() * t.element_size() for t in pieces)

    def wait_pushes(self) -> None:
        """Wait until every posted push has left (bounded by the process group timeout)."""
        while self._posted:
            work, _ = self._posted.pop(0)
            work.wait()

    def done(self) -> None:
        self.wait_pushes()
        super().done()

    def push(
        self,
        step: int,
        lr: float,
        rows: Sequence[Sequence[tuple[Tensor, Tensor]]],
        present: Sequence[Sequence[bool]],
    ) -> int:
        """Send server s the (indices, values) of each of its partitions and whether their
        variables had a gradient (``present[s][i]``); returns wire bytes.

        It returns once the pushes are handed to the transport, after waiting for the
        previous step's to leave: a worker's messages to a server arrive in the order they
        were sent, so its next pull (which the server answers after applying this push)
        needs no wait here.
        """
        self.wait_pushes()
        header = Header(Kind.PUSH, worker=self.worker, step=step, lr=lr)
        return sum(
            self._send_rows(
                s, header, [i for i, _ in parts], [v for _, v in parts], flags, post=True
            )
            for s, (parts, flags) in enumerate(zip(rows, present, strict=True))
        )

    def pull(self, step: int, wanted: Sequence[Sequence[Tensor]]) -> tuple[list[Tensor], int, int]:
        """Ask server s for rows ``wanted[s][i]`` of its partition i (after step - 1's update).

        Returns the flat values per server (partition order) and the (sent, received) bytes.
        """
        replies: list[Tensor] = [torch.zeros(0)] * len(self.servers)
        works, sent, received = [], 0, 0
        asked = [s for s, rows in enumerate(wanted) if sum(len(r) for r in rows)]
        self.num_pulls += bool(asked)
        for s in asked:
            width = sum(
                len(r) * p.row_numel for r, p in zip(wanted[s], self.partitions[s], strict=True)
            )
            replies[s] = torch.empty(width)
            rank = self.servers[s]
            if rank is not None:  # receives posted before the request goes out
                header, group = torch.empty(HEADER, dtype=torch.float64), self.lanes.from_rank(rank)
                for tensor in (header, replies[s]):
                    works.append(dist.irecv(tensor, src=rank, group=group, tag=TAG_REPLY))
                received += HEADER * 8 + width * replies[s].element_size()
        header = Header(Kind.PULL, worker=self.worker, step=step)
        for s in asked:
            sent += self._send_rows(s, header, wanted[s])
        for s in asked:
            if self.servers[s] is None:
                replies[s] = self.local_reply().tensors[0]
        for work in works:
            work.wait()
        return replies, sent, received


__all__ = [
    "PartitionChoice",
    "RowPartition",
    "Rows",
    "SparseClient",
    "SparseServer",
    "SparseShard",
    "SparseVariable",
    "choose_num_partitions",
    "coalesce_rows",
    "cut_rows",
    "gather_rows_on_node",
    "install_rows",
    "lag_tensors",
    "measure_apply_cost",
    "partition_rows",
    "sparse_reader",
    "split_rows",
    "sum_rows",
]
