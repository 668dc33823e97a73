"""One word for a piece of a variable: the unit ``ps`` places on servers, ``p3`` slices and
sends by priority, and a server keeps in its flat state.

Example:
    >>> Piece("fc.weight", 0, 6, server=1, offset=4).numel
    6
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of the flattened variable ``name``.

    ``server`` owns it (-1: not placed yet) and keeps it at ``offset`` in its flat state;
    ``index`` numbers p3's pieces in model order; ``element_size`` is in bytes.
    """

    name: str
    start: int
    stop: int
    server: int = -1
    offset: int = 0
    index: int = -1
    element_size: int = 4

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def num_bytes(self) -> int:
        return self.numel * self.element_size


__all__ = ["Piece"]
