"""The convolutional network of TensorFlow's official MNIST model.

The model of ``tensorflow/models`` ``official/mnist`` (The TensorFlow Authors, 2017) and of
TensorFlow's "Deep MNIST for experts" tutorial, on the MNIST digits of LeCun, Bottou,
Bengio & Haffner (1998), "Gradient-based learning applied to document recognition":
conv 5x5x32 (same) + ReLU, max-pool 2, conv 5x5x64 (same) + ReLU, max-pool 2,
fully connected 1024 + ReLU, dropout 0.4, fully connected 10; batch 100. This is the
model the Horovod MNIST assignment starts from.

Presets: ``paper`` and ``default`` are that model with batch 100 (a training step takes
about 50 ms on two CPU cores); ``tiny`` is a narrow version (2/4 channels, 16 hidden
units) with batch 8 for tests.

Example:
    >>> from gradsync.models.base import BuildRequest
    >>> workload = build(BuildRequest(preset="tiny"))
    >>> batch = workload.dataset.batch(step=0, size=8, start=0, stop=8)
    >>> tuple(workload.model(*batch.inputs).shape)
    (8, 10)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from gradsync.data.base import Dataset, HeldOutSteps
from gradsync.data.digits import SOURCE as DIGITS
from gradsync.data.digits import digits_split
from gradsync.data.mnist import NUM_CLASSES, MNISTImages, mnist_test_set
from gradsync.data.synthetic import SyntheticImages
from gradsync.errors import UserError
from gradsync.models.base import BuildRequest, ModelSpec, Workload, check_preset, parse_options

NAME = "mnist-cnn"
SYNTHETIC_VALIDATION = 1000  # held-out samples for validation accuracy


@dataclass(frozen=True, kw_only=True)
class MNISTCNNConfig:
    """Sizes of the network and of its default global batch."""

    conv1_channels: int = 32
    conv2_channels: int = 64
    hidden_units: int = 1024
    dropout: float = 0.4
    image_size: int = 28
    num_classes: int = NUM_CLASSES
    global_batch: int = 100


PAPER = MNISTCNNConfig()
PRESETS: dict[str, MNISTCNNConfig] = {
    "paper": PAPER,
    "default": PAPER,
    "tiny": dataclasses.replace(
        PAPER, conv1_channels=2, conv2_channels=4, hidden_units=16, global_batch=8
    ),
}


class MNISTCNN(nn.Module):
    """Two 5x5 conv/pool stages, a hidden fully connected layer with dropout, 10 logits.

    Example:
        >>> import torch
        >>> model = MNISTCNN(PRESETS["tiny"])
        >>> tuple(model(torch.zeros(2, 1, 28, 28)).shape)
        (2, 10)
    """

    def __init__(self, config: MNISTCNNConfig) -> None:
        super().__init__()
        if config.image_size % 4:
            raise ValueError(f"image_size must be a multiple of 4 (got {config.image_size})")
        pooled_size = config.image_size // 4
        self.features = nn.Sequential(
            nn.Conv2d(1, config.conv1_channels, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(config.conv1_channels, config.conv2_channels, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(config.conv2_channels * pooled_size * pooled_size, config.hidden_units),
            nn.ReLU(),
            nn.Dropout(config.dropout),
            nn.Linear(config.hidden_units, config.num_classes),
        )

    def forward(self, images: Tensor) -> Tensor:
        return self.classifier(self.features(images))


def build(request: BuildRequest) -> Workload:
    """The MNIST CNN of ``request.preset`` on synthetic digits or the idx files in ``request.data``.

    Example:
        >>> build(BuildRequest(preset="tiny")).global_batch
        8
    """
    check_preset(request.preset, NAME)
    parse_options(None, request.options, NAME)
    config = PRESETS[request.preset]
    if not request.dropout:
        config = dataclasses.replace(config, dropout=0.0)
    dataset, validation, num_train = _datasets(config, request)
    model = MNISTCNN(config)
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    return Workload(
        model=model,
        dataset=dataset,
        loss=F.cross_entropy,
        global_batch=config.global_batch,
        validation=validation,
        num_validation=validation.num_samples if validation is not None else 0,
        num_train_samples=num_train,
        description=(
            f"{NAME} ({request.preset}): conv {config.conv1_channels}/{config.conv2_channels}, "
            f"fc {config.hidden_units}, {num_parameters:,} parameters, "
            f"{'MNIST at ' + request.data if request.data else 'synthetic digits'}"
        ),
    )


def _datasets(config: MNISTCNNConfig, request: BuildRequest) -> tuple[Dataset, Any, int | None]:
    """Training data, validation data (with ``num_samples``) and the training set's size."""
    image_shape = (1, config.image_size, config.image_size)
    if request.data is None:
        synthetic = SyntheticImages(
            seed=request.seed, num_classes=config.num_classes, image_shape=image_shape
        )
        return synthetic, HeldOutSteps(synthetic, num_samples=SYNTHETIC_VALIDATION), None
    if request.data == DIGITS:
        train, validation = digits_split(seed=request.seed, image_size=config.image_size)
        return train, validation, train.num_samples
    images = MNISTImages(request.data, seed=request.seed)
    if images.image_shape != image_shape:
        raise UserError(
            f"MNIST images in {request.data} are {images.image_shape}, model '{NAME}' takes "
            f"{image_shape}; pass the standard 28x28 MNIST idx files"
        )
    return images, mnist_test_set(request.data), images.num_samples


SPEC = ModelSpec(
    name=NAME,
    summary="TensorFlow official MNIST CNN: 2 conv 5x5 + fc 1024, dropout 0.4, batch 100",
    build=build,
    presets=PRESETS,
)
