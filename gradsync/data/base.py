"""The data contract: every step has one global batch fixed by (seed, step).

A dataset hands out any contiguous range of samples of a step's global batch, so worker
``k`` of ``N`` asks for ``[k*B/N, (k+1)*B/N)`` and ``single`` asks for ``[0, B)``. Nothing
here depends on the number of workers: that is what makes every strategy comparable with
the single-process reference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from gradsync.errors import UserError

_MASK64 = (1 << 64) - 1


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 chained), stable across runs and machines.

    Example:
        >>> mix_seed(0, 5, 3) == mix_seed(0, 5, 3) != mix_seed(0, 5, 4)
        True
    """
    state = 0x9E3779B97F4A7C15
    for part in parts:
        state = (state + (part & _MASK64) + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state & ((1 << 63) - 1)


def generator(*parts: int) -> torch.Generator:
    """A CPU generator seeded by :func:`mix_seed` of ``parts``."""
    return torch.Generator().manual_seed(mix_seed(*parts))


@dataclass(frozen=True)
class Batch:
    """A slice of a global batch.

    ``inputs`` (positional model arguments) and ``targets`` are per-sample (dim 0 is the
    sample); ``shared`` tensors are the same for the whole global batch (e.g. sampled-softmax
    candidates) and are given to every shard unchanged as keyword arguments. The model is
    called as ``model(*inputs, **shared)``.
    """

    inputs: tuple[Tensor, ...]
    targets: Tensor
    shared: Mapping[str, Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.targets.shape[0])

    def to(self, device: torch.device, dtype: torch.dtype = torch.float32) -> Batch:
        """The same batch on ``device``, floating-point tensors in ``dtype`` (integer ones
        such as token ids and labels unchanged); a no-op when nothing changes.

        Example:
            >>> batch = Batch(inputs=(torch.zeros(2, 3),), targets=torch.zeros(2).long())
            >>> batch.to(torch.device("cpu"), torch.float64).inputs[0].dtype
            torch.float64
        """
        tensors = [*self.inputs, self.targets, *self.shared.values()]
        if device.type == "cpu" and all(_in_dtype(t, dtype) for t in tensors):
            return self

        def move(tensor: Tensor) -> Tensor:
            wanted = dtype if tensor.is_floating_point() else tensor.dtype
            return tensor.to(device, wanted, non_blocking=True)

        return Batch(
            inputs=tuple(move(v) for v in self.inputs),
            targets=move(self.targets),
            shared={k: move(v) for k, v in self.shared.items()},
        )


def _in_dtype(tensor: Tensor, dtype: torch.dtype) -> bool:
    return not tensor.is_floating_point() or tensor.dtype == dtype


@runtime_checkable
class Dataset(Protocol):
    """Deterministic source of global batches.

    ``batch(step=s, size=B, start=a, stop=b)`` returns samples ``[a, b)`` of the global batch
    of size ``B`` at step ``s``; the same arguments always give the same tensors.
    """

    def batch(self, *, step: int, size: int, start: int, stop: int) -> Batch: ...


def shard_bounds(global_batch: int, num_workers: int, worker: int) -> tuple[int, int]:
    """Worker ``worker`` of ``num_workers`` takes the contiguous shard ``[start, stop)``.

    Example:
        >>> shard_bounds(8, 2, 1)
        (4, 8)
    """
    if num_workers < 1 or global_batch % num_workers:
        raise UserError(
            f"global batch {global_batch} does not divide by {num_workers} workers; "
            f"use a --global-batch that is a multiple of {num_workers}"
        )
    per_worker = global_batch // num_workers
    return worker * per_worker, (worker + 1) * per_worker


def per_sample(
    seed: int, step: int, start: int, stop: int, draw: Callable[[torch.Generator], Tensor]
) -> Tensor:
    """Stack ``draw(g)`` for samples ``start..stop-1``, each with its own generator.

    Sample ``i`` draws from a generator seeded by (seed, step, i).

    This is what makes synthetic data independent of how the global batch is sharded.
    """
    return torch.stack([draw(generator(seed, step, index)) for index in range(start, stop)])


class IndexedSamples:
    """A global-batch view over ``n`` stored samples: epoch permutations seeded by (seed, epoch).

    Sample ``i`` of step ``s`` (global batch ``B``) is element ``p % n`` of the permutation of
    epoch ``p // n``, where ``p = s*B + i``. Subclasses implement :meth:`gather`.
    """

    def __init__(self, num_samples: int, seed: int) -> None:
        if num_samples < 1:
            raise UserError("the data file holds no samples; check the --data path")
        self.num_samples = num_samples
        self.seed = seed

    @lru_cache(maxsize=4)  # noqa: B019 - a handful of epochs, owned by the instance
    def _permutation(self, epoch: int) -> Tensor:
        return torch.randperm(self.num_samples, generator=generator(self.seed, epoch))

    def indices(self, *, step: int, size: int, start: int, stop: int) -> Tensor:
        positions = range(step * size + start, step * size + stop)
        return torch.stack(
            [self._permutation(p // self.num_samples)[p % self.num_samples] for p in positions]
        )

    def batch(self, *, step: int, size: int, start: int, stop: int) -> Batch:
        return self.gather(self.indices(step=step, size=size, start=start, stop=stop))

    def gather(self, indices: Tensor) -> Batch:
        raise NotImplementedError


class HeldOutSteps:
    """Validation samples for synthetic data: the samples of steps no training run reaches.

    Step ``s`` of this view is step ``offset + s`` of ``dataset`` (same distribution, never
    trained on, since runs are far shorter than ``offset`` steps).
    """

    OFFSET = 1 << 40

    def __init__(self, dataset: Dataset, num_samples: int) -> None:
        self.dataset = dataset
        self.num_samples = num_samples

    def batch(self, *, step: int, size: int, start: int, stop: int) -> Batch:
        return self.dataset.batch(step=self.OFFSET + step, size=size, start=start, stop=stop)


class FixedSamples:
    """A fixed set (validation): the same samples in the same order at every step."""

    def __init__(self, images: Tensor, labels: Tensor) -> None:
        self.images, self.labels = images, labels
        self.num_samples = len(labels)

    def batch(self, *, step: int, size: int, start: int, stop: int) -> Batch:
        return Batch(inputs=(self.images[start:stop],), targets=self.labels[start:stop])
