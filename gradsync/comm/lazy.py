"""Momentum SGD on row-sparse gradients whose per-step cost depends only on the rows touched.

``torch.optim.SGD`` (no dampening, no Nesterov) on a sparse gradient keeps a momentum buffer
over every row ever touched and, every step, decays all of them and moves all of them::

    buf[active] *= m;  buf[touched] += g;  value[active] -= lr_t · buf[active]

so its cost grows with the number of rows touched so far. A row that no step touches from
step c+1 to step c+k follows a closed form: its buffer is ``m^k · b`` and its value moved
by ``-b · Σ_{j=1..k} lr_{c+j} m^j``. :class:`LazyMomentumRows` keeps, per row, the step
it is up to date with, and catches a row up (values and buffer) only when it is touched,
read (a pull) or saved (a checkpoint).

The sums ``G[c] = Σ_{j≥1} lr_{c+j} m^j`` are kept for every past step c and advanced each
step over a window of the last ``J`` steps only, where ``m^J / (1 - m) < 2^-64``: the terms
beyond it are below float64's resolution of the sum (the sum is not approximated any more
than rounding already does). The per-step cost is O(J + touched rows), constant over a run.

Example:
    >>> rows = LazyMomentumRows(torch.zeros(3, 1), momentum=0.5)
    >>> rows.apply(torch.tensor([0]), torch.ones(1, 1), lr=1.0)  # row 0: buf 1, value -1
    >>> rows.apply(torch.tensor([1]), torch.ones(1, 1), lr=1.0)  # row 0 decays: -1.5
    >>> rows.read(torch.tensor([0, 1, 2])).flatten().tolist()
    [-1.5, -1.0, 0.0]
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

NEGLIGIBLE = 2.0**-64  # relative size of the momentum terms left out of a row's catch-up


def window_steps(momentum: float) -> int:
    """Steps after which ``m^J / (1 - m)`` is below :data:`NEGLIGIBLE`.

    Example:
        >>> window_steps(0.9)
        443
    """
    if momentum == 0:
        return 1
    return math.ceil(math.log(NEGLIGIBLE * (1 - momentum)) / math.log(momentum))


class LazyMomentumRows:
    """The rows of one partition (``values``, ``[rows, row_numel]``) under torch's sparse
    momentum SGD, with untouched rows caught up in closed form when next used."""

    def __init__(self, values: Tensor, *, momentum: float) -> None:
        self.values = values
        self.momentum = momentum
        self.buffer = torch.zeros_like(values)
        self.count = 0  # steps applied
        self.synced = torch.zeros(len(values), dtype=torch.long)  # step each row is up to
        self.window = window_steps(momentum)
        self._powers = torch.tensor(momentum, dtype=torch.float64) ** torch.arange(
            1, self.window + 1, dtype=torch.float64
        )
        self._sums = torch.zeros(64, dtype=torch.float64)  # G[c], see the module docstring

    def apply(self, rows: Tensor, grad: Tensor, *, lr: float) -> None:
        """One step: ``grad`` (``[n, row_numel]``) on the sorted unique local ``rows``."""
        if not self.momentum:
            if len(rows):
                self.values.index_add_(0, rows, grad, alpha=-lr)
            return
        self._catch_up(rows)
        self._advance(lr)  # also when no row is touched: the others still decay and move
        if not len(rows):
            return
        buf = self.buffer[rows] * self.momentum + grad
        self.buffer[rows] = buf
        self.values[rows] = self.values[rows] - lr * buf
        self.synced[rows] = self.count

    def read(self, rows: Tensor) -> Tensor:
        """The current values of local ``rows`` (caught up first)."""
        self._catch_up(rows)
        return self.values[rows]

    def sync_all(self) -> None:
        """Catch every row up (before the values and buffers are saved)."""
        self._catch_up(torch.arange(len(self.values)))

    def load(self, values: Tensor, buffer: Tensor | None) -> None:
        """Install saved values and momentum (every row up to date)."""
        self.values.copy_(values)
        self.buffer.copy_(buffer if buffer is not None else torch.zeros_like(values))
        self.count = 0
        self.synced.zero_()
        self._sums.zero_()

    def _advance(self, lr: float) -> None:
        """Step ``count + 1`` with rate ``lr``: add ``lr · m^(count+1-c)`` to G[c] for the
        last ``window`` steps c."""
        step = self.count + 1
        if step >= len(self._sums):
            grown = torch.zeros(2 * len(self._sums), dtype=torch.float64)
            grown[: len(self._sums)] = self._sums
            self._sums = grown
        low = max(0, step - self.window)
        self._sums[low:step] += lr * self._powers[: step - low].flip(0)
        self.count = step

    def _catch_up(self, rows: Tensor) -> None:
        if not self.momentum or not len(rows):
            return
        since = self.synced[rows]
        behind = since < self.count
        if not bool(behind.any()):
            return
        rows, since = rows[behind], since[behind]
        buf = self.buffer[rows]
        moved = self._sums[since].to(buf.dtype).unsqueeze(1)
        self.values[rows] = self.values[rows] - moved * buf
        steps = (self.count - since).to(torch.float64)
        self.buffer[rows] = buf * torch.pow(self.momentum, steps).to(buf.dtype).unsqueeze(1)
        self.synced[rows] = self.count


__all__ = ["LazyMomentumRows", "window_steps"]
