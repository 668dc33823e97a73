"""What ``hybrid``'s sparse variables cost a step: the node's gather, the push, the
servers' sum, update and pull answers, and the pull (:func:`sparse_round`).

``hybrid`` (:mod:`gradsync.strategies.hybrid`, :mod:`gradsync.comm.sparse`) moves the rows
a step touched of each sparse variable through partitioned servers. With local
aggregation the workers of a host first gather their rows (three all-gathers: counts,
indices, values) and each sums them; one of them pushes the sum. A server sums its
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
GATHER_COLLECTIVES = 3  # counts and flags, indices, values (comm.sparse.gather_rows_on_node)


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
    rows lay (:meth:`VariableProfile.rows_share`), and the busiest server sets the pace."""
    from gradsync.comm.sparse import PARTITION_OVERHEAD_S

    sparse = profile.sparse_variables
    servers = options.num_servers(cluster.workers)
    partitions = options.partitions or servers
    shares = server_shares(sparse, partitions, servers)
    per_host = cluster.busiest_worker_host() if options.local_aggregation else 1
    pushers = cluster.num_hosts if options.local_aggregation else cluster.workers
    pushed_rows = {v.name: min(v.num_rows, per_host * v.rows_touched) for v in sparse}
    push = {v.name: pushed_rows[v.name] * (v.row_bytes + INDEX_BYTES) / per_host for v in sparse}
    pull = {v.name: v.rows_touched * (v.row_bytes + INDEX_BYTES) for v in sparse}
    update = {
        v.name: _update_cpu_s(profile, v, cluster.workers, pushers, pushed_rows[v.name])
        for v in sparse
    }
    answer = {v.name: cluster.workers * v.read_s_per_row * v.rows_touched for v in sparse}

    def per_server(cost: dict[str, float]) -> list[float]:
        return [sum(share[name] * cost[name] for name in cost) for share in shares]

    gather_s, gather_bytes = _node_gather(profile, cluster, per_host)
    return SparseRound(
        gather_s=gather_s,
        gather_bytes=gather_bytes,
        push_s=cluster.link_phase_s(per_server(push)),
        update_cpu_s=max(per_server(update)) + partitions * len(sparse) * PARTITION_OVERHEAD_S,
        answer_cpu_s=max(per_server(answer)),
        pull_s=cluster.link_phase_s(per_server(pull)),
        moved=sum(push.values()) + sum(pull.values()),
    )


def server_shares(
    sparse: tuple[VariableProfile, ...], partitions: int, servers: int
) -> list[dict[str, float]]:
    """Per server, the share of each sparse variable's rows it owns.

    Example:
        >>> v = VariableProfile(name="e", numel=100, element_size=4, layer=0, grad_ready_s=0.0,
        ...                     sparse=True, num_rows=100, row_bins=(0.75, 0.25))
        >>> server_shares((v,), partitions=2, servers=2)
        [{'e': 0.75}, {'e': 0.25}]
    """
    from gradsync.comm.sparse import SparseVariable, partition_rows

    variables = [
        SparseVariable(v.name, v.num_rows, v.numel // v.num_rows, v.element_size) for v in sparse
    ]
    shares: list[dict[str, float]] = [
        dict.fromkeys((v.name for v in sparse), 0.0) for _ in range(servers)
    ]
    by_name = {v.name: v for v in sparse}
    for part in partition_rows(variables, partitions, num_servers=servers):
        shares[part.server][part.name] += by_name[part.name].rows_share(part.start, part.stop)
    return shares


def _measured(variable: VariableProfile) -> bool:
    return variable.apply_s_per_row > 0


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
    workers, three blocking all-gathers (each member's rows to every other), then each
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


__all__ = ["SparseRound", "rows_cpu_s", "sparse_round"]
