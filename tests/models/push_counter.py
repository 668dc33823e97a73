"""A model that counts the pushes a parameter server applied: parameter ``p.<w>`` grows by
exactly 1.0 for each push of worker ``w`` (with ``--lr 1 --momentum 0``: worker ``w``'s
gradient is ``-workers`` on its own scalar, which ``ps`` scales by 1/workers, and 0 on the
others'). A checkpoint of step k under asynchronous updates must therefore hold k in every
``p.<w>``: more means a push of step k or later was in it, and a resume would apply it twice.

``die=R:S`` SIGKILLs rank R as it starts step S, to leave the last periodic checkpoint.
"""

from __future__ import annotations

import os
import signal

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset


class PushCounter(nn.Module):
    def __init__(self, workers: int, die: str) -> None:
        super().__init__()
        self.p = nn.ParameterList([nn.Parameter(torch.zeros(1)) for _ in range(workers)])
        self.workers = workers
        self.rank = int(os.environ.get("RANK", "0"))
        self.die = tuple(int(part) for part in die.split(":")) if die else None
        self.steps = 0

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            if self.die == (self.rank, self.steps):
                os.kill(os.getpid(), signal.SIGKILL)
            self.steps += 1
        own = self.p[self.rank % self.workers]
        return (-self.workers * own).sum() * torch.ones(x.shape[0], dtype=x.dtype)


def build(
    seed: int = 0, workers: str = "2", die: str = ""
) -> tuple[nn.Module, TensorDataset, object]:
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(seed))
    y = torch.zeros(64, dtype=torch.long)
    return PushCounter(int(workers), die), TensorDataset(x, y), lambda out, _targets: out.mean()
