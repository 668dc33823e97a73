"""A small user model that fails on purpose, for the fault tests (tests/e2e/test_reliability.py).

Options (``--model-option KEY=VALUE``):

- ``crash_at=N``: the rank ``crash_rank`` (default 1) kills itself with SIGKILL in its N-th
  forward pass, once: it first creates the file ``marker``, and does nothing if it exists
  (so a resumed or restarted run goes through);
- ``nan_at=N``: the loss is NaN from the N-th forward pass on;
- ``raise_in_ranks=1``: every forward pass of a rank (a process group is up) raises
  ``RuntimeError("this model fails on purpose")``, while the launcher's own check of the
  model, which has no process group, goes through;
- ``sparse=1``: it also adds a row of a sparse ``nn.Embedding`` (picked by the first
  input) to its output, so ``hybrid`` has a sparse variable for its servers;
- ``ema=1``: it adds to its output a buffer that keeps a moving average of its outputs,
  each worker's own (of its shard), so a resume must give each worker its own back.

It has dropout, so a resumed run matches only if the RNG streams are restored too.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

ROWS = 12


class Faulty(nn.Module):
    def __init__(
        self,
        *,
        dropout: bool,
        crash_at: int,
        crash_rank: int,
        marker: str,
        sparse: bool,
        raise_in_ranks: bool = False,
        ema: bool = False,
    ) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2 if dropout else 0.0), nn.Linear(16, 4)
        )
        self.table = nn.Embedding(ROWS, 4, sparse=True) if sparse else None
        self.calls = 0
        self.crash_at, self.crash_rank, self.marker = crash_at, crash_rank, Path(marker)
        self.raise_in_ranks = raise_in_ranks
        self.register_buffer("ema", torch.zeros(4) if ema else None)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.raise_in_ranks and dist.is_initialized():
            raise RuntimeError("this model fails on purpose")
        crash_here = int(os.environ.get("RANK", "0")) == self.crash_rank
        if self.calls == self.crash_at and crash_here and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        output = self.layers(inputs)
        if self.table is not None:  # a few hot rows, others rarely: rows the servers leave behind
            rows = (inputs[:, 0].abs() * 4).long().clamp(max=ROWS - 1)
            output = output + self.table(rows)
        if self.ema is not None:  # the average of this worker's outputs so far
            self.ema.mul_(0.9).add_(output.detach().mean(0), alpha=0.1)
            output = output + self.ema
        return output


def build(
    seed: int = 0,
    dropout: bool = True,
    crash_at: str = "0",
    crash_rank: str = "1",
    marker: str = "crashed",
    nan_at: str = "0",
    sparse: str = "0",
    raise_in_ranks: str = "0",
    ema: str = "0",
):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(256, 8, generator=generator)
    targets = torch.randint(0, 4, (256,), generator=generator)
    model = Faulty(
        dropout=dropout,
        crash_at=int(crash_at),
        crash_rank=int(crash_rank),
        marker=marker,
        sparse=sparse == "1",
        raise_in_ranks=raise_in_ranks == "1",
        ema=ema == "1",
    )

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        value = nn.functional.cross_entropy(output, target)
        if int(nan_at) and model.calls >= int(nan_at):
            return value * float("nan")
        return value

    return model, TensorDataset(inputs, targets), loss
