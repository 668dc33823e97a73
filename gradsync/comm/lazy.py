"""Momentum SGD on row-sparse gradients whose per-step cost depends only on the rows touched.

``torch.optim.SGD`` (no dampening, no Nesterov) on a sparse gradient keeps a momentum buffer
over every row ever touched and, every step, decays all of them and moves all of them::

    buf[active] *= m;  buf[touched] += g;  value[active] -= lr_t · buf[active]

so its cost grows with the number of rows touched so far. A row that no step touches from
step c+1 to step c+k follows a closed form: its buffer is ``m^k · b`` and its value moved
by ``-b · Σ_{j=1..k} lr_{c+j} m^j``. :class:`LazyMomentumRows` keeps, per row, the step
it is up to date with, and catches a row up (values and buffer) only when it is touched
or read (a pull).

A checkpoint changes nothing: :meth:`~LazyMomentumRows.state` saves every row as if
caught up (copies) and, for ``--resume``, the rows still behind as they are (``lag/…``),
with the step each is up to and the sums below; :meth:`~LazyMomentumRows.load` puts them
back, so a resumed run catches each row up when the uninterrupted one does, bit for bit.

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
        # index_select/index_copy_ (rows are unique): the same copies as tensor[rows]
        # reads and writes, several times faster on CPU.
        buf = self.buffer.index_select(0, rows) * self.momentum + grad
        self.buffer.index_copy_(0, rows, buf.to(self.buffer.dtype))
        moved = self.values.index_select(0, rows) - lr * buf
        self.values.index_copy_(0, rows, moved.to(self.values.dtype))
        self.synced.index_fill_(0, rows, self.count)

    def read(self, rows: Tensor) -> Tensor:
        """The current values of local ``rows`` (caught up first)."""
        self._catch_up(rows)
        return self.values.index_select(0, rows)

    def sync_all(self) -> None:
        """Catch every row up."""
        self._catch_up(torch.arange(len(self.values)))

    def state(self) -> dict[str, Tensor]:
        """``values`` and ``momentum_buffer`` of every row caught up to now, as copies (the
        rows stay as they are), and ``lag/…``: the rows behind (``rows``, local) as they are
        (``values``, ``momentum_buffer``), the step each is up to (``synced``) and the sums
        G (``sums``, one per step applied). A row whose buffer is zero is never behind:
        catching it up changes nothing.

        Example:
            >>> rows = LazyMomentumRows(torch.zeros(2, 1), momentum=0.5)
            >>> rows.apply(torch.tensor([0]), torch.ones(1, 1), lr=1.0)
            >>> rows.apply(torch.tensor([1]), torch.ones(1, 1), lr=1.0)
            >>> state = rows.state()
            >>> state["values"].flatten().tolist(), state["lag/rows"].tolist()
            ([-1.5, -1.0], [0])
        """
        values, buffer = self.values.clone(), self.buffer.clone()
        behind = (self.synced < self.count) & buffer.ne(0).flatten(1).any(1)
        rows = behind.nonzero().flatten()
        if len(rows):
            values[rows], buffer[rows] = self._caught_up(rows)
        return {
            "values": values,
            "momentum_buffer": buffer,
            "lag/rows": rows,
            "lag/values": self.values[rows].clone(),
            "lag/momentum_buffer": self.buffer[rows].clone(),
            "lag/synced": self.synced[rows].clone(),
            "lag/sums": self._sums[: self.count].clone(),
        }

    def load(self, values: Tensor, buffer: Tensor | None, lag: dict[str, Tensor] | None) -> None:
        """Install saved values and momentum (keys of :meth:`state`): every row up to date,
        but the ``lag`` rows, which go on as they were saved."""
        self.values.copy_(values)
        self.buffer.copy_(buffer if buffer is not None else torch.zeros_like(values))
        self.count = 0 if lag is None else len(lag["sums"])
        self.synced.fill_(self.count)
        self._sums = torch.zeros(max(64, 2 * self.count), dtype=torch.float64)
        if lag is not None:
            self._sums[: self.count] = lag["sums"]
            rows = lag["rows"]
            self.values[rows] = lag["values"]
            self.buffer[rows] = lag["momentum_buffer"]
            self.synced[rows] = lag["synced"]

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
        behind = self.synced.index_select(0, rows) < self.count
        if not bool(behind.any()):
            return
        rows = rows[behind]
        values, buffer = self._caught_up(rows)
        self.values.index_copy_(0, rows, values)
        self.buffer.index_copy_(0, rows, buffer)
        self.synced.index_fill_(0, rows, self.count)

    def _caught_up(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """The values and buffers of ``rows`` (behind) as of step ``count``, computed anew."""
        since = self.synced.index_select(0, rows)
        buf = self.buffer.index_select(0, rows)
        moved = self._sums.index_select(0, since).to(buf.dtype).unsqueeze(1)
        steps = (self.count - since).to(torch.float64)
        decay = torch.pow(self.momentum, steps).to(buf.dtype).unsqueeze(1)
        return self.values.index_select(0, rows) - moved * buf, buf * decay


__all__ = ["LazyMomentumRows", "window_steps"]
