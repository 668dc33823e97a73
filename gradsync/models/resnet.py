"""ResNet-56 for CIFAR-10: He, Zhang, Ren & Sun (2016), "Deep Residual Learning for Image
Recognition" (CVPR), section 4.2.

A 3x3 convolution with 16 filters, then three stages of ``n`` basic blocks (two 3x3
convolutions each, batch normalization after every convolution) with 16, 32 and 64
filters on 32x32, 16x16 and 8x8 maps, global average pooling and a 10-way fully connected
layer: 6n + 2 layers, n = 9 for ResNet-56. Shortcuts are **option A**, as the paper uses on
CIFAR: identity, and where a stage halves the map and doubles the width, the input is
subsampled with stride 2 and padded with zero channels (no extra parameters).

Batch normalization is plain ``nn.BatchNorm2d``: its statistics are those of the batch it
sees, so splitting a batch over workers changes them unless the strategy converts the
layers to a cross-rank version (gradsync does).

Presets: ``paper`` is ResNet-56 with batch 128; ``default`` is ResNet-56 with batch 32 (a
training step takes about 0.16 s on two CPU cores); ``tiny`` is ResNet-8 (n = 1) at widths
4/8/16 with batch 8.

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

import torch.nn.functional as F
from torch import Tensor, nn

from gradsync.data.base import Dataset
from gradsync.data.cifar import IMAGE_SHAPE, NUM_CLASSES, CIFAR10Images, cifar_test_set
from gradsync.data.synthetic import SyntheticImages
from gradsync.models.base import BuildRequest, ModelSpec, Workload, check_preset, parse_options

NAME = "resnet56"


@dataclass(frozen=True, kw_only=True)
class ResNetConfig:
    """``blocks_per_stage`` is the paper's n (depth 6n + 2); ``stage_widths`` its 16/32/64."""

    blocks_per_stage: int = 9
    stage_widths: tuple[int, int, int] = (16, 32, 64)
    num_classes: int = NUM_CLASSES
    global_batch: int = 128

    @property
    def depth(self) -> int:
        return 6 * self.blocks_per_stage + 2


PAPER = ResNetConfig()
PRESETS: dict[str, ResNetConfig] = {
    "paper": PAPER,
    "default": dataclasses.replace(PAPER, global_batch=32),
    "tiny": dataclasses.replace(PAPER, blocks_per_stage=1, stage_widths=(4, 8, 16), global_batch=8),
}


class BasicBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus an option-A shortcut, then ReLU.

    Example:
        >>> import torch
        >>> block = BasicBlock(4, 8, stride=2)
        >>> tuple(block(torch.zeros(1, 4, 8, 8)).shape)
        (1, 8, 4, 4)
    """

    def __init__(self, in_channels: int, out_channels: int, *, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.stride = stride
        self.extra_channels = out_channels - in_channels

    def shortcut(self, x: Tensor) -> Tensor:
        """Option A: identity, or stride-2 subsampling with zero-padded extra channels."""
        if self.stride > 1:
            x = x[:, :, :: self.stride, :: self.stride]
        if self.extra_channels:
            low = self.extra_channels // 2
            x = F.pad(x, (0, 0, 0, 0, low, self.extra_channels - low))
        return x

    def forward(self, x: Tensor) -> Tensor:
        residual = F.relu(self.bn1(self.conv1(x)))
        residual = self.bn2(self.conv2(residual))
        return F.relu(residual + self.shortcut(x))


class CIFARResNet(nn.Module):
    """The 6n + 2 layer CIFAR ResNet of section 4.2.

    Example:
        >>> import torch
        >>> model = CIFARResNet(PRESETS["tiny"])
        >>> tuple(model(torch.zeros(2, 3, 32, 32)).shape)
        (2, 10)
    """

    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        first_width = config.stage_widths[0]
        self.stem = nn.Sequential(
            nn.Conv2d(3, first_width, 3, padding=1, bias=False),
            nn.BatchNorm2d(first_width),
            nn.ReLU(),
        )
        blocks: list[nn.Module] = []
        in_channels = first_width
        for stage, width in enumerate(config.stage_widths):
            for index in range(config.blocks_per_stage):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(BasicBlock(in_channels, width, stride=stride))
                in_channels = width
        self.blocks = nn.Sequential(*blocks)
        self.classifier = nn.Linear(in_channels, config.num_classes)
        # "We initialize the weights as in [He et al. 2015]" (section 3.4).
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")

    def forward(self, images: Tensor) -> Tensor:
        features = self.blocks(self.stem(images))
        return self.classifier(features.mean(dim=(2, 3)))


def build(request: BuildRequest) -> Workload:
    """ResNet of ``request.preset`` with synthetic images or CIFAR-10 from ``request.data``.

    ``request.dropout`` changes nothing: the model has no dropout.

    Example:
        >>> build(BuildRequest(preset="tiny")).global_batch
        8
    """
    check_preset(request.preset, NAME)
    parse_options(None, request.options, NAME)
    config = PRESETS[request.preset]
    dataset: Dataset
    validation = None
    if request.data is None:
        dataset = SyntheticImages(
            seed=request.seed, num_classes=config.num_classes, image_shape=IMAGE_SHAPE
        )
    else:
        dataset = CIFAR10Images(request.data, seed=request.seed)
        validation = cifar_test_set(request.data)
    model = CIFARResNet(config)
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    return Workload(
        model=model,
        dataset=dataset,
        loss=F.cross_entropy,
        global_batch=config.global_batch,
        validation=validation,
        num_validation=validation.num_samples if validation is not None else 0,
        description=(
            f"{NAME} ({request.preset}): ResNet-{config.depth}, widths {config.stage_widths}, "
            f"option-A shortcuts, {num_parameters:,} parameters, "
            f"{'CIFAR-10 at ' + request.data if request.data else 'synthetic images'}"
        ),
    )


SPEC = ModelSpec(
    name=NAME,
    summary="CIFAR ResNet-56 (6n+2, n=9, option-A shortcuts, batch norm), batch 128",
    build=build,
    presets=PRESETS,
)
