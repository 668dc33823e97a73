"""A steady-state training step of each strategy, simulated from a profile on a cluster.

Each simulator replays the policy the strategy's code runs, with the same planning
functions, so a knob means the same thing here as in ``gradsync train``:

- ``allreduce``: :func:`gradsync.comm.fusion.plan_buckets` forms buckets in reverse
  parameter order up to the fusion threshold; a bucket is copied into its buffer on the
  backward thread and launched when complete, strictly in bucket order, one collective at a
  time; ``step()`` waits for the last, copies out, and the optimizer runs.
- ``ddp``: the same ordered launch over torch's buckets: rebuilt after the first step in
  gradient-ready order, the first capped at ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MB),
  the rest at DDP's default cap (25 MB).
- ``ps``: each server's partitions (:func:`gradsync.comm.placement.plan_placement`) in
  gradient-ready order, cut into push chunks (:func:`gradsync.comm.pushpull.plan_chunks`);
  a chunk is copied into its buffer and pushed when its last gradient is ready (after
  backward with ``--no-overlap``), over per-host links; its server aggregates and applies
  it and answers; the next forward waits for every answer. Asynchronous modes drop the
  barrier: a step is then bound by its own round trip or by the busiest resource.
- ``hybrid``: dense variables as ``allreduce``; sparse rows pushed when backward ends, while
  the last dense buckets are reduced, to partitioned servers (one pusher per host with local
  aggregation), and pulled in one round trip before the next forward, once the dense
  update is done and the servers have applied.
- ``p3``: slices (:func:`gradsync.comm.slicing.slice_variables`) queued when their gradient
  is ready and sent most urgent layer first, at most ``SEND_WINDOW`` in flight, by each
  worker's own sender; a server applies a slice once every worker's copy is in and answers
  the workers in turn; the next forward of layer i waits only for layer i's slices.
  Simulated event by event, worker by worker (:mod:`gradsync.predict.p3`).

Links are full duplex unless the network says otherwise: where point-to-point transfers
crossing a link both ways at once were measured slower (``Network.duplex_slowdown``, from
commbench's ``exchange``), ``ps``'s and ``p3``'s transfers slow the opposite direction
while both are busy.
Where the hosts share cores (``Cluster.shared_cores``) the CPU time of communication and of
the servers that overlaps compute lengthens it (:func:`shared_core_stretch`).

Links are modelled as first-come-first-served pipes (a transfer holds a host's outbound
and the peer's inbound pipe for bytes/rate); concurrent messages of symmetric workers are
summed on the link they share.

Example:
    >>> # predict_step(profile, cluster, StrategyChoice("allreduce", AllreduceOptions()))
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any

from gradsync.config import TrainConfig
from gradsync.errors import UserError
from gradsync.predict.links import SharedLinks
from gradsync.predict.network import Cluster
from gradsync.predict.p3 import simulate_p3
from gradsync.predict.parts import (
    COMM_TRACK,
    COMPUTE_TRACK,
    SERVER_TRACK,
    WORKER_WORK,
    Pipe,
    Span,
    densified,
    wire_span,
    with_server_layout,
)
from gradsync.predict.profile import Profile, VariableProfile
from gradsync.predict.sparse_rounds import INDEX_BYTES, rows_cpu_s, sparse_round
from gradsync.strategies.allreduce import AllreduceOptions
from gradsync.strategies.hybrid import HybridOptions
from gradsync.strategies.ps import PSOptions


@dataclass(frozen=True)
class StrategyChoice:
    """A strategy and its options (None: the strategy's defaults)."""

    name: str
    options: Any = None

    def label(self) -> str:
        """``ps:servers=2`` style: the options that differ from their defaults."""
        if self.options is None:
            return self.name
        changed = [
            f"{key}={value}".replace("=True", "") for key, value in self.options.changed().items()
        ]
        return ":".join([self.name, *changed])


@dataclass(frozen=True)
class StepPrediction:
    """A predicted steady-state step of one worker."""

    choice: StrategyChoice
    workers: int
    batch: int
    step_s: float
    compute_s: float
    bytes_per_worker: float
    spans: tuple[Span, ...] = field(default=(), repr=False)

    @property
    def throughput(self) -> float:
        """Samples per second of the whole job."""
        return self.workers * self.batch / self.step_s

    @property
    def worker_work_s(self) -> float:
        """The worker's own work besides forward and backward: its copies into and out of
        communication buffers and its optimizer step (compute, not communication)."""
        return sum(
            span.duration
            for span in self.spans
            if span.track == COMPUTE_TRACK and span.name.startswith(WORKER_WORK)
        )

    @property
    def exposed_comm_s(self) -> float:
        """What the step waits for communication beyond its compute: the step less forward,
        backward (:attr:`compute_s`) and :attr:`worker_work_s`. As Horovod's timeline
        counts it, the optimizer step and buffer copies are compute; backward stalled
        behind a bucket and CPU time lost to communication on shared cores are not.

        Example:
            >>> # with one worker nothing is sent: predict_step(...).exposed_comm_s == 0.0
        """
        return max(0.0, self.step_s - self.compute_s - self.worker_work_s)


def predict_step(
    profile: Profile,
    cluster: Cluster,
    choice: StrategyChoice,
    *,
    batchnorm: str = TrainConfig.batchnorm,
) -> StepPrediction:
    """Simulate one steady-state step of ``choice`` on ``cluster``; ``batchnorm`` as
    ``gradsync train --batchnorm`` (global: every BatchNorm layer synchronizes the workers)."""
    try:
        simulator = SIMULATORS[choice.name]
    except KeyError:
        raise UserError(
            f"predict cannot model strategy '{choice.name}'; choose from: {', '.join(SIMULATORS)}"
        ) from None
    if _waits_for_slowest(choice):
        profile = with_stragglers(profile, cluster.workers)
    if batchnorm == "global":
        profile = with_batchnorm_sync(profile, cluster)
    else:  # each worker normalizes its own shard: no layer synchronizes
        profile = replace(profile, batchnorm_channels=())
    if cluster.shared_cores is None:
        step_s, spans, moved = simulator(profile, cluster, choice.options)
    else:
        step_s, spans, moved = _on_shared_cores(profile, cluster, simulator, choice.options)
    return StepPrediction(
        choice=choice,
        workers=cluster.workers,
        batch=profile.batch,
        step_s=step_s,
        compute_s=profile.compute_s,
        bytes_per_worker=moved,
        spans=tuple(spans),
    )


def _waits_for_slowest(choice: StrategyChoice) -> bool:
    """Whether every step of ``choice`` waits for its slowest worker (all but
    asynchronous ``ps``, whose workers run apart)."""
    return not getattr(choice.options, "asynchronous", False)


def with_stragglers(profile: Profile, workers: int) -> Profile:
    """``profile`` with the compute of the slowest of ``workers`` workers in the median
    step (:meth:`Profile.straggler_stretch`): a synchronous step waits for it, every
    worker's gradients and forward waits included, so forward and backward lengthen and
    layer starts and gradient-ready times stretch in proportion.

    Example:
        >>> # with_stragglers(p, 8).compute_s == p.compute_s * p.straggler_stretch(8)
    """
    stretch = profile.straggler_stretch(workers)
    if stretch == 1.0:
        return profile
    longer = _lengthen_forward(profile, profile.forward_s * (stretch - 1))
    return _lengthen_backward(longer, profile.backward_s * (stretch - 1))


SHARED_CORE_ROUNDS = 20  # fixed-point rounds of the shared-core stretch (it converges fast)


def _on_shared_cores(
    profile: Profile, cluster: Cluster, simulator: Any, options: Any
) -> tuple[float, list[Span], float]:
    """Simulate with backward lengthened by the CPU work that overlaps compute, and the
    servers' work that overlaps it slowed to their share of the cores.

    Both depend on the schedule they change, so they are found by iteration: simulate with
    the previous round's stretch and server overlap, measure them anew
    (:func:`shared_core_stretch`, :func:`server_overlap`), until they settle.
    """
    extra, overlap = 0.0, 0.0
    result = simulator(profile, cluster, options)
    for _ in range(SHARED_CORE_ROUNDS):
        new_overlap = server_overlap(result[1])
        new = shared_core_stretch(result[1], cluster)
        if abs(new - extra) < 1e-9 and abs(new_overlap - overlap) < 1e-6:
            break
        extra, overlap = new, new_overlap
        slowed = replace(cluster, server_overlap=overlap)
        result = simulator(_lengthen_backward(profile, extra), slowed, options)
    return result


def _compute_intervals(spans: list[Span] | tuple[Span, ...]) -> list[tuple[float, float]]:
    """(start, end) of the worker's forward and backward spans."""
    return [  # p3 names its forward per layer: "FORWARD layer3"
        (s.start, s.start + s.duration)
        for s in spans
        if s.track == COMPUTE_TRACK and s.name.split(" ")[0] in ("FORWARD", "BACKWARD")
    ]


def _overlap_s(span: Span, intervals: list[tuple[float, float]]) -> float:
    return sum(
        max(0.0, min(end, span.start + span.duration) - max(begin, span.start))
        for begin, end in intervals
    )


def _server_cpu_s(span: Span) -> float:
    return span.duration if span.cpu_s is None else span.cpu_s


def server_overlap(spans: list[Span] | tuple[Span, ...]) -> float:
    """The share of the servers' CPU work (their spans) that falls while the worker
    computes; 0 without server spans.

    Example:
        >>> spans = [Span("compute", "BACKWARD", 0.0, 1.0), Span("server 0", "APPLY", 0.5, 1.0)]
        >>> server_overlap(spans)
        0.5
    """
    compute = _compute_intervals(spans)
    servers = [s for s in spans if s.track not in (COMPUTE_TRACK, COMM_TRACK) and s.duration > 0]
    total = sum(_server_cpu_s(s) for s in servers)
    if not total:
        return 0.0
    overlapping = sum(_server_cpu_s(s) * _overlap_s(s, compute) / s.duration for s in servers)
    return min(1.0, overlapping / total)


def _stretch_factor(seconds: float, extra_s: float) -> float:
    """How many times longer ``seconds`` is with ``extra_s`` added (a zero length counts as
    1e-12 s)."""
    return (seconds + extra_s) / max(seconds, 1e-12)


def _lengthen_forward(profile: Profile, extra_s: float) -> Profile:
    """``profile`` with forward ``extra_s`` seconds longer, layers starting in proportion."""
    stretch = _stretch_factor(profile.forward_s, extra_s)
    starts = tuple(replace(x, forward_start_s=x.forward_start_s * stretch) for x in profile.layers)
    return replace(profile, forward_s=profile.forward_s + extra_s, layers=starts)


def _lengthen_backward(profile: Profile, extra_s: float) -> Profile:
    """``profile`` with backward ``extra_s`` seconds longer, gradients ready in proportion."""
    stretch = _stretch_factor(profile.backward_s, extra_s)
    ready = tuple(replace(v, grad_ready_s=v.grad_ready_s * stretch) for v in profile.variables)
    return replace(profile, backward_s=profile.backward_s + extra_s, variables=ready)


def shared_core_stretch(spans: list[Span] | tuple[Span, ...], cluster: Cluster) -> float:
    """Seconds a worker's compute lengthens when every rank runs on ``cluster.shared_cores``
    cores: the CPU work that overlaps forward and backward, less what idle cores absorb,
    spread over the cores.

    The CPU work is the communication's (each span's bytes and messages at the network's
    measured CPU costs, both ends together: :meth:`Network.cpu_s`, the server transport's
    own for its spans) and the
    servers' (a server span is CPU time). The profile's compute was measured with every
    worker computing at once, so the workers keep ``min(workers, cores)`` cores busy; of
    the overlapping work X, ``max(0, cores − workers)`` idle cores absorb their share and
    the rest, spread over the cores, adds ``(X − idle) / cores`` to compute. 0 without
    shared cores.

    Example:
        >>> from gradsync.predict.network import Network
        >>> net = Network(bandwidth=1e9, cpu_s_per_byte=1e-9)
        >>> cluster = Cluster(workers=2, network=net, shared_cores=2)
        >>> spans = [Span("compute", "BACKWARD", 0.0, 1.0),
        ...          Span("communication", "ALLREDUCE", 0.5, 1.0, num_bytes=1e8)]
        >>> round(shared_core_stretch(spans, cluster), 6)  # half of 0.1 s overlaps, / 2 cores
        0.025
    """
    cores = cluster.shared_cores
    if cores is None:
        return 0.0
    compute = _compute_intervals(spans)
    if not compute:
        return 0.0
    net = cluster.network
    work = 0.0
    for span in spans:
        if span.track == COMPUTE_TRACK or span.duration <= 0:
            continue
        if span.track == COMM_TRACK:
            cpu = net.cpu_s(span.num_bytes, span.messages, wire=span.wire)
        else:  # a server's aggregation and update
            cpu = _server_cpu_s(span)
        work += cpu * _overlap_s(span, compute) / span.duration
    busy = sum(end - begin for begin, end in compute)
    idle = max(0, cores - cluster.workers) * busy
    return max(0.0, work - idle) / cores


def with_batchnorm_sync(profile: Profile, cluster: Cluster) -> Profile:
    """``profile`` with global BatchNorm's blocking collectives added to the compute.

    Each BatchNorm layer gathers its batch moments in forward (count, mean and M2 per
    channel, and its call's two-element tag, in float64: an all_gather) and sums two
    per-channel gradient terms with its tag and the tag's square in backward (a float64
    allreduce, :mod:`gradsync.comm.batchnorm`). Both block
    the layer, so forward and backward grow by their ring times; layer starts and
    gradient-ready times stretch in proportion. On hosts that share cores, with
    :attr:`Network.sync_message_s` measured, each message costs what it costs between
    ranks that compute between syncs (the profile's compute over its 2 syncs per layer).
    One worker, or a model without BatchNorm, is unchanged.

    Example:
        >>> # with_batchnorm_sync(resnet_profile, Cluster(workers=4, network=...)).forward_s
    """
    if cluster.workers < 2 or not profile.batchnorm_channels:
        return profile
    channels = profile.batchnorm_channels
    syncing = _syncing_cluster(cluster, profile.compute_s / (2 * len(channels)))
    gather = sum(syncing.ring_allgather_s((3 * c + 2) * 8) for c in channels)
    reduce = sum(syncing.ring_allreduce_s((2 * c + 4) * 8) for c in channels)
    return _lengthen_backward(_lengthen_forward(profile, gather), reduce)


def _syncing_cluster(cluster: Cluster, compute_between_s: float) -> Cluster:
    """``cluster`` as its blocking collectives see it when the ranks compute
    ``compute_between_s`` between them: on shared cores, each message costs the measured
    :meth:`Network.sync_hop_s`; on a real cluster, the idle ranks' hop."""
    network = cluster.network
    if cluster.shared_cores is None or not network.sync_message_s:
        return cluster
    hop = network.sync_hop_s(compute_between_s)
    return replace(cluster, network=replace(network, latency=0.0, message_s=hop))


# -- bucketed allreduce: allreduce and ddp ---------------------------------------------------


def _bucketed_allreduce(
    profile: Profile,
    cluster: Cluster,
    variables: tuple[VariableProfile, ...],
    buckets: list[list[int]],
    wire_element_size: int | None = None,
    sparse: tuple[VariableProfile, ...] = (),
    sparse_per_variable: bool = False,
    optimizer_s: float = 0.0,
) -> tuple[float, list[Span], float]:
    """Buckets launched in order as their last gradient is ready, one ring at a time; then
    the rows of ``sparse`` variables, allgathered (see :func:`_row_allgather`). The
    optimizer steps every variable at the profile's cost per byte, or takes
    ``optimizer_s`` where that was measured for the variables the worker updates (0: not
    measured)."""
    spans = [Span(COMPUTE_TRACK, "FORWARD", 0.0, profile.forward_s)]
    backward_start = profile.forward_s
    shift = comm_free = last_launch = moved = 0.0
    gap = _sync_gap_s(profile, cluster)
    for number, bucket in enumerate(buckets):
        members = [variables[i] for i in bucket]
        size = wire_element_size or members[0].element_size
        num_bytes = (sum(v.numel for v in members) + len(members)) * size  # + flags
        ready = backward_start + max(v.grad_ready_s for v in members) + shift
        launch = max(ready, last_launch)
        fill = num_bytes * profile.copy_s_per_byte  # MEMCPY_IN_FUSION_BUFFER, backward thread
        if fill > 0:  # within backward, which it lengthens
            spans.append(
                Span(COMPUTE_TRACK, f"MEMCPY_IN_FUSION_BUFFER bucket{number}", launch, fill)
            )
        shift += fill
        start = max(launch + fill, comm_free)
        duration = cluster.ring_allreduce_s(num_bytes)
        if gap is not None:  # backward's blocking syncs queue behind the bucket
            left = backward_start + profile.backward_s + shift - start
            shift += backward_lost_to_queue(gap, cluster.network.queue_s, duration, left)
        n = cluster.workers
        sent, messages = 2 * (n - 1) * num_bytes, 2 * n * (n - 1)  # a ring over all ranks
        name = f"ALLREDUCE bucket{number}"
        spans.append(Span(COMM_TRACK, name, start, duration, sent, messages))
        comm_free, last_launch, moved = start + duration, launch + fill, moved + num_bytes
    ring_share = 2 * (cluster.workers - 1) / cluster.workers if cluster.workers > 1 else 0.0
    moved *= ring_share
    if sparse:
        ready = backward_start + max(v.grad_ready_s for v in sparse) + shift
        start = max(ready, last_launch, comm_free)
        duration, sent = _row_allgather(cluster, sparse, per_variable=sparse_per_variable)
        duration += rows_cpu_s(profile, cluster.workers)  # coalesce, then sum every worker's
        spans.append(Span(COMM_TRACK, "ALLGATHER sparse rows", start, duration))
        comm_free, moved = start + duration, moved + sent
    synced = _backward_then_wait(spans, backward_start, profile.backward_s + shift, comm_free)
    dense_bytes = sum(v.num_bytes for v in variables)
    copy_out = dense_bytes * profile.copy_s_per_byte
    update = optimizer_s or (dense_bytes + sum(v.num_bytes for v in sparse)) * (
        profile.optimizer_s_per_byte
    )
    spans.append(Span(COMPUTE_TRACK, "MEMCPY_OUT_FUSION_BUFFER", synced, copy_out))
    spans.append(Span(COMPUTE_TRACK, "OPTIMIZER_STEP", synced + copy_out, update))
    return synced + copy_out + update, spans, moved


def _sync_gap_s(profile: Profile, cluster: Cluster) -> float | None:
    """Compute between two of global BatchNorm's blocking syncs where they cross host links
    that queue (:attr:`Network.queue_s`); None where no sync waits behind a bucket."""
    crosses = len(cluster.workers_per_host()) > 1
    if not profile.batchnorm_channels or not crosses or cluster.network.queue_s <= 0:
        return None
    return profile.compute_s / (2 * len(profile.batchnorm_channels))


def backward_lost_to_queue(
    gap_s: float, queue_s: float, transfer_s: float, backward_left_s: float
) -> float:
    """Seconds backward loses while a bucket of ``transfer_s`` crosses the link with
    ``backward_left_s`` of backward still to run: after every ``gap_s`` of compute a blocking
    sync waits behind the bucket's queued bytes, q = min(``queue_s``, ``transfer_s``), so
    backward runs at gap / (gap + q) of its speed until the bucket is across or backward
    is done.

    Example:
        >>> round(backward_lost_to_queue(0.001, 0.05, 0.1, 1.0), 4)  # stalls ~the whole bucket
        0.098
        >>> backward_lost_to_queue(0.001, 0.0, 0.1, 1.0)  # a shallow queue: nothing lost
        0.0
    """
    if backward_left_s <= 0 or queue_s <= 0:
        return 0.0
    wait = min(queue_s, transfer_s)
    return min(transfer_s * wait / (gap_s + wait), backward_left_s * wait / gap_s)


def _backward_then_wait(spans: list[Span], start: float, seconds: float, comm_done: float) -> float:
    """Record backward (``seconds`` from ``start``) and the wait for communication that ends
    at ``comm_done`` after it; return when both are over."""
    end = start + seconds
    spans.append(Span(COMPUTE_TRACK, "BACKWARD", start, seconds))
    if comm_done > end:
        spans.append(Span(COMPUTE_TRACK, "COMM_WAIT", end, comm_done - end))
    return max(end, comm_done)


def _row_allgather(
    cluster: Cluster, sparse: tuple[VariableProfile, ...], *, per_variable: bool
) -> tuple[float, float]:
    """Seconds and bytes sent per worker to allgather the rows each worker touched of the
    sparse variables. ``allreduce`` (:mod:`gradsync.comm.row_allgather`) runs two
    collectives for all of them: the row counts, then one buffer of every variable's int64
    indices and rows. DDP's sparse allreduce on Gloo (``per_variable``) runs three per
    variable: its row count, its indices, its rows. The bytes are the same."""
    rows = [v.rows_touched * (v.row_bytes + INDEX_BYTES) for v in sparse]
    if per_variable:
        seconds = sum(
            cluster.ring_allgather_s(INDEX_BYTES)
            + cluster.ring_allgather_s(v.rows_touched * INDEX_BYTES)
            + cluster.ring_allgather_s(v.sparse_bytes)
            for v in sparse
        )
    else:
        counts = 2 * len(sparse) * INDEX_BYTES  # a row count and a had-a-gradient flag each
        seconds = cluster.ring_allgather_s(counts) + cluster.ring_allgather_s(sum(rows))
    return seconds, (cluster.workers - 1) * sum(rows)


def _meta_params(variables: tuple[VariableProfile, ...]) -> list[Any]:
    """Storage-free stand-ins with ``numel()`` and ``element_size()`` for the planners."""
    import torch

    dtypes = {2: torch.float16, 4: torch.float32, 8: torch.float64}
    return [torch.empty(v.numel, dtype=dtypes[v.element_size], device="meta") for v in variables]


def simulate_allreduce(
    profile: Profile, cluster: Cluster, options: AllreduceOptions | None
) -> tuple[float, list[Span], float]:
    from gradsync.comm.fusion import plan_buckets

    options = options or AllreduceOptions()
    as_dense = options.sparse_as_dense  # Horovod's sparse_as_dense: rows go in the buckets
    if as_dense:
        profile = densified(profile)
    variables = profile.variables if as_dense else profile.dense_variables
    sparse = () if as_dense else profile.sparse_variables
    threshold = int(options.fusion_threshold_mb * 2**20)
    buckets = plan_buckets(_meta_params(variables), threshold, options.first_bucket_bytes)
    wire = 2 if options.fp16_compression else None
    return _bucketed_allreduce(profile, cluster, variables, buckets, wire, sparse)


def ddp_bucket_caps() -> tuple[int, int]:
    """Torch DDP's first-bucket and later-bucket caps in bytes, read from torch where it
    names them (its documented 1 MiB and 25 MiB where it does not, as in torch 2.11)."""
    import torch.distributed as dist
    from torch.nn.parallel import distributed

    first = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1 << 20)
    return first, int(getattr(distributed, "_DEFAULT_BUCKET_CAP_MB", 25) * 2**20)


def plan_ddp_buckets(
    variables: tuple[VariableProfile, ...], cap_mb: float | None = None
) -> list[list[int]]:
    """DDP's rebuilt buckets: gradient-ready order, the first bucket capped smaller.

    Example:
        >>> v = [VariableProfile(name=n, numel=300_000, element_size=4, layer=0,
        ...                      grad_ready_s=t) for n, t in (("a", 2.0), ("b", 1.0))]
        >>> plan_ddp_buckets(tuple(v))
        [[1], [0]]
    """
    first_cap, cap = ddp_bucket_caps()
    cap = cap if cap_mb is None else int(cap_mb * 2**20)
    order = sorted(range(len(variables)), key=lambda i: (variables[i].grad_ready_s, -i))
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index in order:
        limit = first_cap if not buckets else cap
        if current and size + variables[index].num_bytes > limit:
            buckets.append(current)
            current, size = [], 0
        current.append(index)
        size += variables[index].num_bytes
    return [*buckets, current] if current else buckets


def simulate_ddp(
    profile: Profile, cluster: Cluster, options: Any = None
) -> tuple[float, list[Span], float]:
    # DDP reduces a sparse gradient on its own (Gloo allgathers its rows), not in a bucket.
    variables, sparse = profile.dense_variables, profile.sparse_variables
    cap_mb = None if options is None else options.bucket_cap_mb
    buckets = plan_ddp_buckets(variables, cap_mb)
    return _bucketed_allreduce(
        profile, cluster, variables, buckets, sparse=sparse, sparse_per_variable=True
    )


# -- parameter servers ---------------------------------------------------------------------


def _ps_placement(profile: Profile, servers: int, options: PSOptions) -> Any:
    from gradsync.comm.placement import Variable, plan_placement

    variables = [Variable(v.name, v.numel, v.element_size) for v in profile.variables]
    return plan_placement(
        variables,
        num_servers=servers,
        policy=options.placement,
        threshold_bytes=int(options.partition_threshold_mb * 2**20),
    )


@dataclass(frozen=True)
class _PushChunk:
    """One ps push message: its server, bytes and when its last gradient is ready."""

    server: int
    index: int
    num_bytes: float
    ready_s: float  # from the start of backward


def plan_ps_chunks(profile: Profile, servers: int, options: PSOptions) -> list[_PushChunk]:
    """The chunks ``ps`` pushes, planned by its workers' own
    :func:`~gradsync.strategies.ps.push_layout`; a chunk leaves after the one before it on
    its server."""
    from gradsync.strategies.ps import push_layout

    variables = {v.name: v for v in profile.variables}
    element = profile.variables[0].element_size if profile.variables else 4
    placement = _ps_placement(profile, servers, options)
    names = [v.name for v in profile.variables]
    layout, plans = push_layout(placement, names, options, element)
    chunks = []
    for server, (pieces, plan) in enumerate(zip(layout, plans, strict=True)):
        ready = 0.0
        for index, chunk in enumerate(plan):
            members = pieces[chunk.first_slot : chunk.stop_slot]
            ready = max(ready, *(variables[p.name].grad_ready_s for p in members))
            if not options.overlap:
                ready = profile.backward_s
            size = sum(p.numel * variables[p.name].element_size for p in members)
            chunks.append(_PushChunk(server, index, float(size), ready))
    return chunks


def simulate_ps(
    profile: Profile, cluster: Cluster, options: PSOptions | None
) -> tuple[float, list[Span], float]:
    options = options or PSOptions()
    profile = densified(profile)  # every variable is pushed dense
    servers = options.num_servers(cluster.workers)
    cluster = with_server_layout(cluster, servers, colocate=options.colocate)
    if options.asynchronous:
        return _simulate_async_ps(profile, cluster, options, servers)
    return _simulate_sync_ps(profile, cluster, plan_ps_chunks(profile, servers, options))


def _simulate_sync_ps(
    profile: Profile, cluster: Cluster, chunks: list[_PushChunk]
) -> tuple[float, list[Span], float]:
    """Chunks pushed as backward completes them (each copied into its buffer on the
    backward thread first), over host links the connections share
    (:class:`~gradsync.predict.links.SharedLinks`); each server applies a chunk once every
    worker's is in and answers it; the step ends when the last answer is back."""
    spans = [Span(COMPUTE_TRACK, "FORWARD", 0.0, profile.forward_s)]
    links = SharedLinks(cluster)
    per_byte_apply = profile.aggregate_s_per_byte * cluster.workers + profile.apply_s_per_byte
    server_cpu = [Pipe() for _ in range(cluster.servers)]
    backward_start = profile.forward_s
    shift = 0.0
    # Transfers start in time order (a heap); the links say when each is in.
    starts: list[tuple[float, int, str, _PushChunk]] = []  # (when, tie, what, chunk)
    tie = itertools.count()  # equal times: the order the starts were made in
    for _, group in itertools.groupby(
        sorted(chunks, key=lambda c: (c.ready_s, c.server)), lambda c: c.ready_s
    ):
        together = list(group)
        fill = sum(c.num_bytes for c in together) * profile.copy_s_per_byte  # into buffers
        if fill > 0:  # on the backward thread, within backward, which it lengthens
            copied = backward_start + together[0].ready_s + shift
            spans.append(Span(COMPUTE_TRACK, "MEMCPY_IN_PUSH_BUFFER", copied, fill))
        shift += fill
        leaves = backward_start + together[0].ready_s + shift
        starts += [(leaves, next(tie), "PUSH", c) for c in together]
    heapq.heapify(starts)
    began: dict[tuple[str, int, int], float] = {}
    done = 0.0
    while starts or links.busy:
        now = min(starts[0][0] if starts else math.inf, links.next_event())
        for what, chunk in links.advance(now):
            key = (what, chunk.server, chunk.index)
            name = f"{what} server {chunk.server} chunk {chunk.index}"
            remote = cluster.remote_workers(chunk.server)
            span = wire_span(name, began[key], now - began[key], chunk.num_bytes, 2, remote)
            spans.append(span)
            if what == "PULL":
                done = max(done, now)
                continue
            work = chunk.num_bytes * per_byte_apply + profile.server_round_s
            work += cluster.remote_workers(chunk.server) * cluster.network.serial_s(chunk.num_bytes)
            wall = work * cluster.server_slowdown
            applied = server_cpu[chunk.server].hold(now, wall)
            name = f"AGGREGATE_APPLY server {chunk.server} chunk {chunk.index}"
            spans.append(Span(SERVER_TRACK, name, applied - wall, wall, cpu_s=work))
            heapq.heappush(starts, (applied, next(tie), "PULL", chunk))
        while starts and starts[0][0] <= now:
            _, _, what, chunk = heapq.heappop(starts)
            began[(what, chunk.server, chunk.index)] = now
            move = links.push if what == "PUSH" else links.pull
            move(now, server=chunk.server, num_bytes=chunk.num_bytes, tag=(what, chunk))
    synced = _backward_then_wait(spans, backward_start, profile.backward_s + shift, done)
    total = sum(c.num_bytes for c in chunks)
    copy_out = total * profile.copy_s_per_byte
    spans.append(Span(COMPUTE_TRACK, "MEMCPY_OUT_PULL_BUFFER", synced, copy_out))
    return synced + copy_out, spans, 2 * total


def _simulate_async_ps(
    profile: Profile, cluster: Cluster, options: PSOptions, servers: int
) -> tuple[float, list[Span], float]:
    """No barrier: each push is applied on arrival. A worker's step is its own round trip,
    unless a shared resource (a server's CPU or a link) is busier than that per step."""
    per_server = [float(b) for b in _ps_placement(profile, servers, options).bytes_per_server()]
    total = sum(per_server)
    workers = cluster.workers
    copy = total * profile.copy_s_per_byte
    push = cluster.link_phase_s(per_server)
    pull = cluster.link_phase_s(per_server)
    per_push = [b * (profile.aggregate_s_per_byte + profile.apply_s_per_byte) for b in per_server]
    round_trip = profile.compute_s + 2 * copy + push / workers + max(per_push) + pull / workers
    server_busy = max(workers * b for b in per_push)
    step = max(round_trip, server_busy, push, pull)
    spans = _phase_spans(
        profile,
        [
            ("MEMCPY_IN_PUSH_BUFFER", copy, COMPUTE_TRACK),
            ("PUSH", push, COMM_TRACK),
            ("AGGREGATE_APPLY", max(per_push), SERVER_TRACK),
            ("PULL", pull, COMM_TRACK),
            ("MEMCPY_OUT_PULL_BUFFER", copy, COMPUTE_TRACK),
        ],
    )
    return step, spans, 2 * total


def _phase_spans(profile: Profile, phases: list[tuple[str, float, str]]) -> list[Span]:
    """Forward, backward, then ``phases`` one after another."""
    spans = [
        Span(COMPUTE_TRACK, "FORWARD", 0.0, profile.forward_s),
        Span(COMPUTE_TRACK, "BACKWARD", profile.forward_s, profile.backward_s),
    ]
    now = profile.compute_s
    for name, duration, track in phases:
        spans.append(Span(track, name, now, duration))
        now += duration
    return spans


# -- hybrid --------------------------------------------------------------------------------


def simulate_hybrid(
    profile: Profile, cluster: Cluster, options: HybridOptions | None
) -> tuple[float, list[Span], float]:
    """Dense variables as ``allreduce`` reduces them; the sparse rows (:func:`sparse_round`)
    gathered on each host when backward ends and pushed, while the last dense buckets are
    reduced; the dense update waits for the push to be sent; the next step's one pull
    waits for the dense update and for the servers' update, and for the server to read
    every worker's rows."""
    from gradsync.comm.fusion import plan_buckets

    options = options or HybridOptions()
    dense = profile.dense_variables
    threshold = int(options.fusion_threshold_mb * 2**20)
    buckets = plan_buckets(_meta_params(dense), threshold, options.first_bucket_bytes)
    if dense:
        # The worker updates its dense variables only: as measured, where the profile did.
        end, spans, moved = _bucketed_allreduce(
            profile, cluster, dense, buckets, optimizer_s=profile.dense_optimizer_s
        )
    else:
        end, spans, moved = profile.compute_s, _phase_spans(profile, []), 0.0
    if not profile.sparse_variables:
        return end, spans, moved
    cluster = with_server_layout(
        cluster, options.num_servers(cluster.workers), colocate=options.colocate
    )
    work = sparse_round(profile, cluster, options)
    backward = next(s for s in spans if s.name == "BACKWARD")
    gathered = backward.start + backward.duration + work.gather_s
    pushed = gathered + work.push_s
    update = next((s.start for s in spans if s.name == "OPTIMIZER_STEP"), end)
    if pushed > update:  # the dense update waits for the rows to leave
        spans.append(Span(COMPUTE_TRACK, "COMM_WAIT sparse rows", update, pushed - update))
        end += pushed - update
    applied = pushed + work.update_cpu_s * cluster.server_slowdown
    pull_start = max(end, applied)
    answered = work.answer_cpu_s * cluster.server_slowdown
    spans += [
        Span(COMM_TRACK, "SPARSE_PUSH", gathered, work.push_s),
        Span(SERVER_TRACK, "SPARSE_APPLY", pushed, applied - pushed, cpu_s=work.update_cpu_s),
        Span(SERVER_TRACK, "SPARSE_ANSWER", pull_start, answered, cpu_s=work.answer_cpu_s),
        Span(COMM_TRACK, "SPARSE_PULL", pull_start, answered + work.pull_s),
    ]
    if work.gather_s:  # the node's gather where workers share a host, else coalescing only
        name = "ALLGATHER sparse rows" if work.gather_bytes else "COALESCE sparse rows"
        rows = Span(COMM_TRACK, name, gathered - work.gather_s, work.gather_s)
        spans.append(replace(rows, num_bytes=work.gather_bytes))
    return pull_start + answered + work.pull_s, spans, moved + work.moved


SIMULATORS = {
    "allreduce": simulate_allreduce,
    "ddp": simulate_ddp,
    "ps": simulate_ps,
    "hybrid": simulate_hybrid,
    "p3": simulate_p3,
}

__all__ = [
    "SIMULATORS",
    "Span",
    "StepPrediction",
    "StrategyChoice",
    "backward_lost_to_queue",
    "predict_step",
    "shared_core_stretch",
]
