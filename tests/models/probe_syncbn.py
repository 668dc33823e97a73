"""A user model built with ``nn.SyncBatchNorm``, for ddp's step-0 probe
(tests/e2e/test_ddp_probe.py). torch's layer syncs on GPUs only ("SyncBatchNorm expected
input tensor to be on GPU" once a process group is up); the probe runs after gradsync's
global BatchNorm has replaced it, as training does, so it runs on the CPU too."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


def build(seed: int = 0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 6, generator=g, dtype=torch.get_default_dtype())
    y = torch.randint(0, 5, (64,), generator=g)
    model = nn.Sequential(nn.Linear(6, 8), nn.SyncBatchNorm(8), nn.Tanh(), nn.Linear(8, 5))
    return model, TensorDataset(x, y), F.cross_entropy
