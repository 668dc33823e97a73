"""Parameter slicing (P3, Jayarajan et al. SysML'19, §3.1), as pure functions.

Every variable (one parameter tensor, flattened) is cut into contiguous *slices* of at
most ``slice_size`` values — ``ceil(numel / slice_size)`` near-equal pieces, the larger
first — and the slices, taken in model order, go to the servers round-robin: slice i to
server i mod S. Small slices are what let a late, urgent slice overtake queued ones, and
round-robin spreads every layer over all servers. ``slice_size=None`` turns slicing off:
one slice per variable (still round-robin).

Each server keeps its slices in model order; ``offset`` is where a slice starts in that
server's flat buffer.

Example:
    >>> slices = slice_variables([("a", 5), ("b", 2)], slice_size=2, num_servers=2)
    >>> [(s.name, s.start, s.stop, s.server) for s in slices]
    [('a', 0, 2, 0), ('a', 2, 4, 1), ('a', 4, 5, 0), ('b', 0, 2, 1)]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gradsync.comm.pieces import Piece
from gradsync.errors import UserError


def slice_bounds(numel: int, slice_size: int | None) -> list[tuple[int, int]]:
    """``[start, stop)`` of each slice of a variable of ``numel`` values.

    Example:
        >>> slice_bounds(10, 4), slice_bounds(10, None), slice_bounds(0, 4)
        ([(0, 4), (4, 7), (7, 10)], [(0, 10)], [(0, 0)])
    """
    count = 1 if slice_size is None or numel == 0 else math.ceil(numel / slice_size)
    base, extra = divmod(numel, count)
    bounds, start = [], 0
    for i in range(count):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def slice_variables(
    variables: Sequence[tuple[str, int]], *, slice_size: int | None, num_servers: int
) -> list[Piece]:
    """Slice ``(name, numel)`` variables and place the slices round-robin on the servers.

    More servers than slices is a UserError (a server would own nothing).
    """
    if slice_size is not None and slice_size < 1:
        raise UserError(f"--slice-size must be a positive number of values, got {slice_size}")
    pieces = [(name, a, b) for name, numel in variables for a, b in slice_bounds(numel, slice_size)]
    if num_servers > len(pieces):
        raise UserError(
            f"{num_servers} parameter servers but only {len(pieces)} slices to place; "
            f"use at most {len(pieces)} servers (or a smaller --slice-size)"
        )
    offsets = [0] * num_servers
    slices = []
    for index, (name, start, stop) in enumerate(pieces):
        server = index % num_servers
        slices.append(Piece(name, start, stop, server=server, offset=offsets[server], index=index))
        offsets[server] += stop - start
    return slices


def server_sizes(slices: Sequence[Piece], num_servers: int) -> list[int]:
    """Values each server owns."""
    sizes = [0] * num_servers
    for s in slices:
        sizes[s.server] += s.numel
    return sizes


__all__ = ["server_sizes", "slice_bounds", "slice_variables"]
