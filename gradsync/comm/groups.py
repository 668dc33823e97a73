"""Node-local process groups: the ranks that share a machine (or an emulated host).

Local aggregation (Parallax's hybrid, hierarchical allreduce) first reduces inside a node,
then across nodes. Nodes may hold different numbers of ranks, so the layout is learned by
an all-gather of every rank's node index rather than derived from ``rank // local_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class NodeGroup:
    """This rank's node: its index, its ranks (global numbering) and their process group."""

    node: int
    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None


def node_local_group(node_rank: int, timeout: timedelta | None = None) -> NodeGroup:
    """Collective: every rank calls it with its node index; returns this rank's node group,
    whose collectives give up after ``timeout`` (the job's ``--timeout``; torch's default,
    30 minutes, when None).

    Every rank creates every node's group, in node order, as ``new_group`` requires.

    Example:
        >>> # group = node_local_group(env.node_rank)
        >>> # dist.all_reduce(tensor, group=group.group)  # sums over this node only
    """
    gathered = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor([node_rank]))
    nodes = [int(t) for t in gathered]
    mine = NodeGroup(node_rank, (dist.get_rank(),), None)
    for node in sorted(set(nodes)):
        members = tuple(rank for rank, n in enumerate(nodes) if n == node)
        group = dist.new_group(list(members), timeout=timeout)
        if node == node_rank:
            mine = NodeGroup(node, members, group)
    return mine
