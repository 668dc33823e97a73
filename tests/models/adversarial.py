"""Adversarial test models: the parameter patterns users bring on day one.

``build_dense`` (SGD with momentum and weight decay welcome):

- an embedding tied to the output layer (one parameter, two readers);
- a gated branch used only by samples whose gate feature is high, so in one step some
  workers use it and others do not (and some steps nobody does);
- a never-used parameter, a frozen layer, a 0-dim scale, a non-contiguous weight;
- BatchNorm without affine parameters, reached under a second name, and BatchNorm without
  running statistics on a 3-d ``(N, C, L)`` input;
- a loss that reads a parameter itself (an L2 penalty written in the loss);
- a layer whose bias forward reads before calling the layer, and whose weight is the
  hook-based ``spectral_norm`` (a forward pre-hook of its own reads ``weight_orig``):
  strategies that wait for a layer's parameters must wait before either read;
- a weight read through ``.detach()`` early in forward and by its layer late, with a slow
  backward node between: backward still reads the saved weight after the layer's
  gradient is ready, so a strategy must not write new values into it before backward ends;
- a weight tied to a module that the forward calls first only from the third step on:
  the order of the first forward does not hold for every step.

``build_sparse`` (sparse gradients, so no weight decay: torch's SGD refuses it there):

- a sparse lookup table, a sparse table read only by gated samples, one looked up with
  the gate as a mask (a worker whose shard has no gated sample holds a sparse gradient of
  0 rows: it crashed allreduce and hybrid before session 29), a sparse table never read,
  and a sparse table tied to the output layer (read whole, so not a lookup).

Both are ordinary user models (``--model tests/models/adversarial.py:build_dense``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

VOCAB = 12
DIM = 8
FEATURES = 4
GATE = 0.9  # samples whose gate feature exceeds it take the gated branch (~10%)


def _dataset(seed: int, samples: int = 512) -> TensorDataset:
    """Column 0: a token id (as a float), column 1: the gate, the rest: features."""
    rng = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (samples, 1), generator=rng).to(torch.get_default_dtype())
    rest = torch.rand(samples, FEATURES, generator=rng, dtype=torch.get_default_dtype())
    targets = torch.randint(0, VOCAB, (samples,), generator=rng)
    return TensorDataset(torch.cat([ids, rest], dim=1), targets)


class _SlowBackward(torch.autograd.Function):
    """The identity, whose backward takes ``SLOW_BACKWARD_S``: what a strategy sends back
    once the gradients after it are ready has arrived before backward goes on."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        time.sleep(SLOW_BACKWARD_S)
        return grad


SLOW_BACKWARD_S = 0.05
TWIN_FROM_STEP = 2  # the tied twin is called first from this step on


def _gated(h: Tensor, gate: Tensor, branch: nn.Module, *inputs: Tensor) -> Tensor:
    """``h`` plus ``branch`` on the gated samples only; the branch is not run (so its
    parameters get no gradient) when no sample of this shard is gated."""
    if not gate.any():
        return h
    extra = torch.zeros_like(h)
    extra[gate] = branch(*(x[gate] for x in inputs))
    return h + extra


class DenseAdversary(nn.Module):
    """Tied, gated, unused, frozen, 0-dim, non-contiguous parameters and odd BatchNorms."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.features = nn.Linear(FEATURES, DIM)
        self.norm_plain = nn.BatchNorm1d(DIM, affine=False)
        self.norm_alias = self.norm_plain  # one layer, two names; forward uses the second
        self.norm_batch_only = nn.BatchNorm1d(DIM // 2, track_running_stats=False)
        self.mix = nn.Parameter(torch.randn(DIM, DIM).t())  # non-contiguous
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-dim
        self.gated = nn.Linear(DIM, DIM)
        self.frozen = nn.Linear(DIM, DIM).requires_grad_(False)
        self.never_used = nn.Parameter(torch.randn(3))
        self.late = nn.utils.spectral_norm(nn.Linear(DIM, DIM))  # a pre-hook reads it
        self.echo = nn.Linear(DIM, DIM)  # read detached early, by itself late
        self.tail = nn.Linear(DIM, DIM)
        self.twin = nn.Linear(DIM, DIM)  # called first, from TWIN_FROM_STEP on
        self.twin.weight = self.tail.weight
        self.out = nn.Linear(DIM, VOCAB)
        self.out.weight = self.embed.weight  # tied
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor) -> Tensor:
        ids, gate = x[:, 0].long(), x[:, 1] > GATE
        if self.training:
            self.calls += 1
        shift = torch.tanh(self.late.bias).mean()  # read long before self.late runs
        h = self.embed(ids) + self.features(x[:, 1:]) + shift
        if self.calls > TWIN_FROM_STEP:
            h = h + torch.tanh(self.twin(h))
        h = self.norm_alias(h)
        n = h.shape[0]
        h = self.norm_batch_only(h.view(n, DIM // 2, 2)).view(n, DIM)
        h = h + torch.tanh(F.linear(h, self.echo.weight.detach()))  # a stop-gradient read
        h = _SlowBackward.apply(torch.tanh(F.linear(h, self.mix)) * self.scale)
        h = _gated(h, gate, self.gated, h)
        h = torch.tanh(self.tail(self.echo(h)))
        return self.out(self.frozen(self.late(h)))


class SparseAdversary(nn.Module):
    """Sparse lookup tables: plain, gated, looked up with a mask that may select no
    sample, never read, and tied to the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.lookup = nn.Embedding(VOCAB, DIM, sparse=True)
        self.rare = nn.Embedding(VOCAB, DIM, sparse=True)
        self.masked = nn.Embedding(VOCAB, DIM, sparse=True)
        self.never_read = nn.Embedding(VOCAB, DIM, sparse=True)
        self.tied = nn.Embedding(VOCAB, DIM, sparse=True)
        self.hidden = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, VOCAB)
        self.out.weight = self.tied.weight

    def forward(self, x: Tensor) -> Tensor:
        ids, gate = x[:, 0].long(), x[:, 1] > GATE
        h = self.lookup(input=ids) + self.tied((ids + 1) % VOCAB)  # a keyword, as torch allows
        h = _gated(h, gate, self.rare, ids)
        masked = torch.zeros_like(h)
        masked[gate] = self.masked(ids[gate])  # no gated sample: a gradient of 0 rows
        h = h + masked
        return self.out(torch.tanh(self.hidden(h)))


def _build(model: nn.Module, seed: int) -> tuple[nn.Module, TensorDataset, object]:
    return model, _dataset(seed), F.cross_entropy


PENALTY = 1e-3  # the L2 penalty the dense adversary's loss adds on its features layer


def build_dense(seed: int = 0) -> tuple[nn.Module, TensorDataset, object]:
    """The dense adversary, its data and a loss that reads one of its parameters."""
    model = DenseAdversary()

    def penalized(output: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(output, targets) + PENALTY * model.features.weight.pow(2).sum()

    return model, _dataset(seed), penalized


def build_sparse(seed: int = 0) -> tuple[nn.Module, TensorDataset, object]:
    """The sparse adversary, its data and loss."""
    return _build(SparseAdversary(), seed)


class ReentrantCheckpointed(nn.Module):
    """A layer run inside a reentrant activation checkpoint and again outside it: its
    gradient is accumulated twice in one backward."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(FEATURES + 1, FEATURES + 1)
        self.shared = nn.Linear(FEATURES + 1, FEATURES + 1)
        self.head = nn.Linear(FEATURES + 1, VOCAB)

    def forward(self, x: Tensor) -> Tensor:
        from torch.utils.checkpoint import checkpoint

        # A reentrant checkpoint passes gradients only if its input needs one: run a layer
        # first, as any real model would.
        h = self.first(x)
        inner = checkpoint(lambda h: torch.tanh(self.shared(h)), h, use_reentrant=True)
        return self.head(self.shared(inner))


def build_reentrant(seed: int = 0) -> tuple[nn.Module, TensorDataset, object]:
    """A shared layer under reentrant checkpointing (strategies that push from gradient
    hooks must refuse it, not lose half its gradient)."""
    return _build(ReentrantCheckpointed(), seed)
