"""scikit-learn's handwritten digits (Alpaydin & Kaynak 1998, UCI "optdigits" test set):
1,797 real 8×8 images of the digits 0–9 that ship inside scikit-learn, so no download.

Selected with ``--data sklearn:digits`` for ``mnist-cnn``: the images are scaled to [0, 1]
(from 0–16) and resized bilinearly to the model's 28×28 input. A fixed permutation seeded
by the run's seed holds out 20% (359 images) for validation; training draws from the other
1,438 by epoch permutations like every real-data reader.

Example:
    >>> train, validation = digits_split(seed=0, image_size=28)
    >>> train.num_samples, validation.num_samples
    (1438, 359)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from gradsync.data.base import Batch, FixedSamples, IndexedSamples, generator
from gradsync.errors import UserError

SOURCE = "sklearn:digits"
VALIDATION_FRACTION = 0.2


class TensorSamples(IndexedSamples):
    """Global batches from in-memory ``images``/``labels`` by epoch permutations."""

    def __init__(self, images: Tensor, labels: Tensor, *, seed: int) -> None:
        super().__init__(len(labels), seed)
        self.images, self.labels = images, labels

    def gather(self, indices: Tensor) -> Batch:
        return Batch(inputs=(self.images[indices],), targets=self.labels[indices])


def digits_split(*, seed: int, image_size: int) -> tuple[TensorSamples, FixedSamples]:
    """Training and validation sets of the digits, resized to ``image_size``²."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise UserError(
            "--data sklearn:digits needs scikit-learn; pip install scikit-learn "
            "(or pass --data a folder of MNIST idx files)"
        ) from None
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(
        images, size=(image_size, image_size), mode="bilinear", align_corners=False
    )
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=generator(seed, 0xD1617))
    held_out = int(len(labels) * VALIDATION_FRACTION)
    validation, train = order[:held_out], order[held_out:]
    return (
        TensorSamples(images[train], labels[train], seed=seed),
        FixedSamples(images[validation], labels[validation]),
    )
