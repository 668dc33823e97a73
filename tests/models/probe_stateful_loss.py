"""A user model whose loss object keeps state (a curriculum counted in loss calls), for
ddp's step-0 probe (tests/e2e/test_ddp_probe.py): the probe calls a copy of the loss, so
the real one counts the training steps only (ddp was 2e-3 off single)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


class ScheduledLoss:
    """Label smoothing that decays with the number of calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return F.cross_entropy(output, targets, label_smoothing=0.3 / self.calls)


def build(seed: int = 0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 6, generator=g, dtype=torch.get_default_dtype())
    y = torch.randint(0, 5, (64,), generator=g)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5))
    return model, TensorDataset(x, y), ScheduledLoss()
