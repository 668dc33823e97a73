"""A user model that ``copy.deepcopy`` refuses, for ddp's step-0 probe
(tests/e2e/test_ddp_probe.py, tests/unit/test_probe_fallbacks.py).

Option ``kind`` (``--model-option kind=...``):

- ``lock`` (default): it holds a ``threading.Lock`` (a cache shared with a loading thread),
  which no copy can take: the probe cannot run, and ddp turns ``find_unused_parameters`` on;
- ``nonleaf``: a tensor attribute computed from a parameter in ``__init__`` (not a graph leaf);
- ``weight_norm``: the legacy hook-based ``torch.nn.utils.weight_norm``, whose ``weight`` is
  such a tensor, recomputed before every forward.
"""

from __future__ import annotations

import threading
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


class Uncopyable(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(6, 8), nn.Linear(8, 5)
        if kind == "lock":
            self.lock = threading.Lock()
        elif kind == "nonleaf":
            self.derived = self.inp.bias * 2
        elif kind == "weight_norm":
            with warnings.catch_warnings():  # deprecated, and still common in vocoders
                warnings.simplefilter("ignore", FutureWarning)
                self.inp = nn.utils.weight_norm(self.inp)
        else:
            raise ValueError(f"kind is lock, nonleaf or weight_norm, not {kind!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))


def build(seed: int = 0, kind: str = "lock"):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 6, generator=g, dtype=torch.get_default_dtype())
    y = torch.randint(0, 5, (64,), generator=g)
    return Uncopyable(kind), TensorDataset(x, y), F.cross_entropy
