"""What ``hybrid``'s sparse variables cost a step: the node's gather, the push, the
servers' sum, update and pull answers, and the pull (:func:`sparse_round`).

``hybrid`` (:mod:`gradsync.strategies.hybrid`, :mod:`gradsync.comm.sparse`) moves the rows
a step touched of each sparse variable through partitioned servers. With local
aggregation the workers of a host first gather their rows (two all-gathers: counts, then
indices and values as one buffer) and each sums them; one of them pushes the sum. A server sums its
pushers' rows, applies momentum SGD to their union, and answers each worker's pull of the
rows its next step reads, each row caught up first.

The servers' work is priced from the profile's per-row times, measured with that code on
the model's own rows (:class:`~gradsync.predict.profile.VariableProfile`); profiles taken
before session 19 have none, and their work is priced per byte (an add and a dense update).

Example:
    >>> # sparse_round(profile, cluster, HybridOptions()).gather_s
"""

from __future__ import annotations

from dataclasses import dataclass

from gradsync.predict.network import Cluster
from gradsync.predict.profile import Profile, VariableProfile
from gradsync.strategies.hybrid import HybridOptions

INDEX_BYTES = 8  # int64 row indices of sparse pushes and pulls
GATHER_COLLECTIVES = 2  # counts and flags, then the rows (comm.sparse.gather_rows_on_node)


@dataclass(frozen=True)
class SparseRound:
    """One step's sparse work, in seconds (``*_cpu_s``: a server's CPU time, before any
    slowdown on shared cores) and bytes.

    ``gather_s``: from the end of backward until the rows to push are ready (coalescing
    them; with local aggregation and several workers on a host, its gather and sum);
    ``push_s``, ``pull_s``: the transfers; ``update_cpu_s``: the busiest server's sum and
    update; ``answer_cpu_s``: its reading of every worker's pull. ``gather_bytes``: what
    the gather sends over the whole job; ``moved``: bytes one worker pushes and pulls.
    """

    gather_s: float
    gather_bytes: float
    push_s: float
    update_cpu_s: float
    answer_cpu_s: float
    pull_s: float
    moved: float


def sparse_round(profile: Profile, cluster: Cluster, options: HybridOptions) -> SparseRound:
    """The sparse work of one ``hybrid`` step of ``profile`` on ``cluster`` (laid out with
    the strategy's servers). Each server owns ranges of rows (``partition_rows``, as the
    strategy places them); its share of a variable's rows is where the profiled steps'
    rows lay (:meth:`VariableProfile.rows_share`), and the busiest server sets the pace.
    Where the hosts share cores, the servers' work and the transport's CPU for a phase's
    messages take at least their sum spread over the cores."""
    loads = _server_loads(profile, cluster, options)
    per_host, pushers = _aggregation(cluster, options)
    gather_s, gather_bytes = _node_gather(profile, cluster, per_host)
    push_s = cluster.link_phase_s(loads.pushed) + _worker_transport_s(cluster, loads.pushed) / 2
    pull_s = cluster.link_phase_s(loads.pulled) + _worker_transport_s(cluster, loads.pulled)
    messages = _messages_per_worker(len(loads.pushed), options.colocate)
    return SparseRound(
        gather_s=gather_s,
        gather_bytes=gather_bytes,
        push_s=max(push_s, _cpu_floor(cluster, pushers, sum(loads.pushed), messages)),
        update_cpu_s=_busiest(cluster, loads.update_s),
        answer_cpu_s=_busiest(cluster, loads.answer_s),
        pull_s=max(pull_s, _cpu_floor(cluster, cluster.workers, sum(loads.pulled), 2 * messages)),
        moved=sum(loads.pushed) + sum(loads.pulled),
    )


def _aggregation(cluster: Cluster, options: HybridOptions) -> tuple[int, int]:
    """The most workers whose rows one push carries (a host's, with local aggregation),
    and how many pushers there are (one per host with it, else every worker)."""
    if options.local_aggregation:
        return cluster.busiest_worker_host(), cluster.num_hosts
    return 1, cluster.workers


@dataclass(frozen=True)
class _ServerLoads:
    """Per server: the bytes one pusher pushes to it and one worker pulls from it, and its
    CPU seconds for a step's update (sum and momentum SGD) and answers (reads), each with
    the transport's Python work on the messages it takes in and sends."""

    pushed: list[float]
    pulled: list[float]
    update_s: list[float]
    answer_s: list[float]


def _server_loads(profile: Profile, cluster: Cluster, options: HybridOptions) -> _ServerLoads:
    sparse = profile.sparse_variables
    servers = options.num_servers(cluster.workers)
    holdings = server_holdings(sparse, options.partitions or servers, servers)
    per_host, pushers = _aggregation(cluster, options)
    pushed_rows = {v.name: min(v.num_rows, per_host * v.rows_touched) for v in sparse}
    row_bytes = {v.name: v.row_bytes + INDEX_BYTES for v in sparse}

    def per_server(cost: dict[str, float], per_call: dict[str, float]) -> list[float]:
        """Each server's share of ``cost`` (whole-variable seconds or bytes) plus
        ``per_call`` for every partition it holds."""
        return [
            sum(h.share * cost[n] + h.partitions * per_call[n] for n, h in held.items())
            for held in holdings
        ]

    nothing = dict.fromkeys(pushed_rows, 0.0)
    pushed = per_server({n: r * row_bytes[n] / per_host for n, r in pushed_rows.items()}, nothing)
    pulled = per_server({v.name: v.rows_touched * row_bytes[v.name] for v in sparse}, nothing)
    update = per_server(
        {v.name: _update_cpu_s(profile, v, cluster.workers, pushers, pushed_rows[v.name])
         for v in sparse},
        {v.name: _update_call_s(v) for v in sparse},
    )  # fmt: skip
    workers = cluster.workers
    answer = per_server(
        {v.name: workers * v.read_s_per_row * v.rows_touched for v in sparse},
        {v.name: workers * v.read_call_s for v in sparse},
    )
    serial = cluster.network.serial_s  # one message in and one out
    return _ServerLoads(
        pushed=pushed,
        pulled=pulled,
        update_s=[
            u + _remote_pushers(cluster, s, options.local_aggregation) * serial(pushed[s]) / 2
            for s, u in enumerate(update)
        ],
        answer_s=[a + cluster.remote_workers(s) * serial(pulled[s]) for s, a in enumerate(answer)],
    )


def _update_call_s(variable: VariableProfile) -> float:
    """A server's fixed seconds per partition it updates: measured, or for a profile from
    before session 19 the partition chooser's estimate (``PARTITION_OVERHEAD_S``)."""
    from gradsync.comm.sparse import PARTITION_OVERHEAD_S

    return variable.apply_call_s if _measured(variable) else PARTITION_OVERHEAD_S


def _messages_per_worker(servers: int, colocate: bool) -> int:
    """Server-transport messages one worker sends in a push (one per server; a colocated
    worker hands its own server's share over in memory)."""
    return servers - 1 if colocate else servers


def _cpu_floor(cluster: Cluster, senders: int, num_bytes: float, messages: int) -> float:
    """On shared cores, the job's CPU seconds for ``senders`` each moving ``num_bytes`` in
    ``messages`` server-transport messages (:meth:`Network.cpu_s`, both ends), spread
    over the cores: a phase cannot be shorter. 0 on a real cluster."""
    if cluster.shared_cores is None:
        return 0.0
    cpu = cluster.network.cpu_s(senders * num_bytes, senders * messages, wire=True)
    return cpu / cluster.shared_cores


def _worker_transport_s(cluster: Cluster, bytes_per_server: list[float]) -> float:
    """A worker's Python work on one message in and one out (:meth:`Network.serial_s`) per
    server off its host that it exchanges ``bytes_per_server[s]`` with (a push is half of
    that: one out; a pull all of it: its request out, the answer in)."""
    host = cluster.worker_host(0)
    return sum(
        cluster.network.serial_s(num_bytes)
        for server, num_bytes in enumerate(bytes_per_server)
        if cluster.server_host(server) != host
    )


def _remote_pushers(cluster: Cluster, server: int, local_aggregation: bool) -> int:
    """Pushers whose pushes to ``server`` cross its host's link: with local aggregation
    one per worker host other than the server's, else every remote worker."""
    if not local_aggregation:
        return cluster.remote_workers(server)
    return len(set(cluster.workers_per_host()) - {cluster.server_host(server)})


def _busiest(cluster: Cluster, work: list[float]) -> float:
    """Seconds the servers take for ``work`` (each server's, done in parallel): the busiest
    server's; where the hosts share cores, at least all of it spread over them.

    Example:
        >>> from gradsync.predict.network import Network
        >>> net = Network(bandwidth=1e9)
        >>> _busiest(Cluster(workers=2, network=net), [1.0] * 8)  # a real cluster
        1.0
        >>> _busiest(Cluster(workers=2, network=net, shared_cores=2), [1.0] * 8)
        4.0
    """
    busiest = max(work)
    if cluster.shared_cores is None:
        return busiest
    return max(busiest, sum(work) / cluster.shared_cores)


@dataclass(frozen=True)
class Holding:
    """What one server holds of a sparse variable: its share of the rows a step touches,
    and how many partitions (each a call of the server's update and of a pull's read)."""

    share: float
    partitions: int


def server_holdings(
    sparse: tuple[VariableProfile, ...], partitions: int, servers: int
) -> list[dict[str, Holding]]:
    """Per server, what it holds of each sparse variable, partitioned and placed as
    ``comm.sparse.partition_rows`` does.

    Example:
        >>> v = VariableProfile(name="e", numel=100, element_size=4, layer=0, grad_ready_s=0.0,
        ...                     sparse=True, num_rows=100, row_bins=(0.75, 0.25))
        >>> [held["e"].share for held in server_holdings((v,), partitions=2, servers=2)]
        [0.75, 0.25]
    """
    from gradsync.comm.sparse import SparseVariable, partition_rows

    variables = [
        SparseVariable(v.name, v.num_rows, v.numel // v.num_rows, v.element_size) for v in sparse
    ]
    by_name = {v.name: v for v in sparse}
    holdings = [{v.name: Holding(0.0, 0) for v in sparse} for _ in range(servers)]
    for part in partition_rows(variables, partitions, num_servers=servers):
        held = holdings[part.server][part.name]
        share = by_name[part.name].rows_share(part.start, part.stop)
        holdings[part.server][part.name] = Holding(held.share + share, held.partitions + 1)
    return holdings


def _measured(variable: VariableProfile) -> bool:
    """Whether the profile timed the server's row work (session 19 on). The call's fixed
    cost is always above zero when timed; a per-row cost can be zero (below the clock's
    resolution once the call's cost is taken off, on a few rows)."""
    return variable.apply_call_s > 0 or variable.apply_s_per_row > 0


def _update_cpu_s(
    profile: Profile, v: VariableProfile, workers: int, pushers: int, pushed_rows: float
) -> float:
    """All servers' sum of the pushers' rows of ``v`` and update of their union."""
    if not _measured(v):  # a profile from before session 19: an add per pusher, a dense update
        return v.sparse_bytes * (pushers * profile.aggregate_s_per_byte + profile.apply_s_per_byte)
    summed = pushers * pushed_rows if pushers > 1 else 0.0  # one pusher: nothing to add
    union = min(v.num_rows, workers * v.rows_touched)
    return v.merge_s_per_row * summed + v.apply_s_per_row * union


def rows_cpu_s(profile: Profile, lists: int) -> float:
    """A worker's CPU seconds to coalesce its sparse gradients into rows and sum ``lists``
    workers' rows (0 for a profile without those times; one list: no sum).

    Example:
        >>> # rows_cpu_s(profile, lists=4)  # allreduce's all-gather of 4 workers' rows
    """
    summing = lists if lists > 1 else 0
    return sum(
        v.coalesce_s + summing * v.rows_touched * v.merge_s_per_row
        for v in profile.sparse_variables
    )


def _node_gather(profile: Profile, cluster: Cluster, per_host: int) -> tuple[float, float]:
    """Seconds from the end of backward until a host's rows are summed, and the bytes its
    gather sends over the whole job: each worker coalesces its rows; with ``per_host`` > 1
    workers, two blocking all-gathers (each member's rows to every other), then each
    member sums ``per_host`` lists."""
    if per_host < 2:
        return rows_cpu_s(profile, 1), 0.0
    net = cluster.network
    sparse = profile.sparse_variables
    rows_bytes = sum(v.rows_touched * (v.row_bytes + INDEX_BYTES) for v in sparse)
    hops = GATHER_COLLECTIVES * (per_host - 1) * net.sync_hop_s(profile.backward_s)
    transfer = (per_host - 1) * rows_bytes / net.intra_rate
    unmeasured = [v for v in sparse if not _measured(v)]  # before session 19: per byte
    summing = rows_cpu_s(profile, per_host) + sum(
        per_host * v.sparse_bytes * profile.aggregate_s_per_byte for v in unmeasured
    )
    hosts = cluster.num_hosts
    return hops + transfer + summing, hosts * per_host * (per_host - 1) * rows_bytes


__all__ = ["Holding", "SparseRound", "rows_cpu_s", "server_holdings", "sparse_round"]
