"""A user model for gradsync: LeNet-5 (LeCun et al. 1998) on a map-style dataset.

Any model drops into gradsync through one function. Run it with::

    gradsync train  --model examples/user_model.py:build --strategy allreduce --workers 2
    gradsync verify --model examples/user_model.py:build --strategies ddp,allreduce --workers 2
    gradsync train  --model examples/user_model.py:build --model-option width=2

The contract:

* ``build`` takes any of the keyword arguments ``preset`` (tiny/default/paper), ``seed``,
  ``data`` (the ``--data`` path or None) and ``dropout`` (False under ``verify``), plus your
  own ``--model-option KEY=VALUE`` keys (as strings). Declare only the ones you use.
* It returns ``(model, dataset, loss)``:

  - ``model``: an ``nn.Module``; it is called as ``model(*inputs)``.
  - ``dataset``: a map-style dataset (``len`` and ``dataset[i] -> (input, target)``); gradsync
    draws every step's global batch from it by epoch permutations seeded by (seed, epoch), so
    the batches do not depend on the number of workers. A gradsync ``Dataset`` (see
    ``gradsync/data/base.py``) works too.
  - ``loss(output, targets)``: a **mean over the samples** of the batch, so that averaging
    equal shards' gradients equals the global batch's gradient.

  Return a ``gradsync.models.base.Workload`` instead to set the default global batch.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


class LeNet5(nn.Module):
    """LeNet-5: two convolution/pooling stages and three fully connected layers."""

    def __init__(self, width: int = 1, dropout: float = 0.0) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6 * width, 5, padding=2),
            nn.Tanh(),
            nn.AvgPool2d(2),
            nn.Conv2d(6 * width, 16 * width, 5),
            nn.Tanh(),
            nn.AvgPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(16 * width * 25, 120),
            nn.Tanh(),
            nn.Dropout(dropout),
            nn.Linear(120, 84),
            nn.Tanh(),
            nn.Linear(84, 10),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))


def build(preset: str = "default", seed: int = 0, dropout: bool = True, width: str = "1"):
    """LeNet-5 with 512 synthetic 28×28 digits-like images (class-dependent patterns)."""
    generator = torch.Generator().manual_seed(seed)
    num_samples = 64 if preset == "tiny" else 512
    labels = torch.randint(0, 10, (num_samples,), generator=generator)
    patterns = torch.randn(10, 1, 28, 28, generator=generator)
    images = patterns[labels] + 0.5 * torch.randn(num_samples, 1, 28, 28, generator=generator)
    model = LeNet5(width=int(width), dropout=0.5 if dropout else 0.0)
    return model, TensorDataset(images, labels), nn.functional.cross_entropy
