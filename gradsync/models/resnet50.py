"""ResNet-50 for ImageNet: He, Zhang, Ren & Sun (2016), "Deep Residual Learning for Image
Recognition" (CVPR), Table 1 and section 3.3.

A 7x7/2 convolution with 64 filters and a 3x3/2 max-pool, then four stages of 3, 4, 6, 3
**bottleneck** blocks (1x1 reducing to width w, 3x3 at w, 1x1 expanding to 4w; w = 64, 128,
256, 512), batch normalization after every convolution, global average pooling and a
1000-way fully connected layer: 25,557,032 parameters (the published 25.6M). Shortcuts are
identity, and **projections** (1x1 convolution + batch normalization, option B) where the
width or the map size changes. As in the paper, the stages after the first downsample with
stride 2 in their first block's first 1x1 convolution.

Batch normalization is plain ``nn.BatchNorm2d``; the strategies make its statistics span
the global batch across ranks (see ``resnet56``).

Presets: ``paper`` is ResNet-50 at 224x224, 1000 classes, batch 256 (section 3.4);
``default`` keeps the depth (3, 4, 6, 3) at a quarter of the widths (w = 16 .. 128) on
96x96 images, 100 classes, global batch 32 (the P3 artifact's default batch size), about 1.5M
parameters; ``tiny`` is one bottleneck per stage at w = 2 .. 16 on 32x32 images, 10
classes, batch 8. Real images: ``--data DIR`` with an ImageNet-style folder tree
(:mod:`gradsync.data.imagefolder`), centre-cropped to the preset's size.

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

from gradsync.data.imagefolder import image_classification_data
from gradsync.models.base import BuildRequest, ModelSpec, Workload, check_preset, parse_options

NAME = "resnet50"
EXPANSION = 4  # a bottleneck's output is 4x its width


@dataclass(frozen=True, kw_only=True)
class ResNet50Config:
    """Blocks per stage, the first stage's width w (doubling per stage), input and batch."""

    blocks_per_stage: tuple[int, int, int, int] = (3, 4, 6, 3)
    base_width: int = 64
    image_size: int = 224
    num_classes: int = 1000
    global_batch: int = 256


PAPER = ResNet50Config()
PRESETS: dict[str, ResNet50Config] = {
    "paper": PAPER,
    "default": dataclasses.replace(
        PAPER, base_width=16, image_size=96, num_classes=100, global_batch=32
    ),
    "tiny": dataclasses.replace(
        PAPER,
        blocks_per_stage=(1, 1, 1, 1),
        base_width=2,
        image_size=32,
        num_classes=10,
        global_batch=8,
    ),
}


def conv_bn(
    in_channels: int, out_channels: int, kernel_size: int, stride: int = 1
) -> nn.Sequential:
    """A bias-free convolution ("same" padding) followed by batch normalization.

    Example:
        >>> import torch
        >>> tuple(conv_bn(3, 8, 3, stride=2)(torch.zeros(1, 3, 8, 8)).shape)
        (1, 8, 4, 4)
    """
    return nn.Sequential(
        nn.Conv2d(
            in_channels,
            out_channels,
            kernel_size,
            stride=stride,
            padding=kernel_size // 2,
            bias=False,
        ),
        nn.BatchNorm2d(out_channels),
    )


class Bottleneck(nn.Module):
    """1x1 (stride s) - 3x3 - 1x1 x4, each with BN, ReLU between; shortcut added, then ReLU.

    Example:
        >>> import torch
        >>> block = Bottleneck(16, 8, stride=2)
        >>> tuple(block(torch.zeros(1, 16, 8, 8)).shape)
        (1, 32, 4, 4)
    """

    def __init__(self, in_channels: int, width: int, *, stride: int) -> None:
        super().__init__()
        out_channels = width * EXPANSION
        self.reduce = conv_bn(in_channels, width, 1, stride=stride)
        self.conv = conv_bn(width, width, 3)
        self.expand = conv_bn(width, out_channels, 1)
        self.projection = (
            conv_bn(in_channels, out_channels, 1, stride=stride)
            if stride != 1 or in_channels != out_channels
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        residual = F.relu(self.reduce(x))
        residual = F.relu(self.conv(residual))
        residual = self.expand(residual)
        shortcut = x if self.projection is None else self.projection(x)
        return F.relu(residual + shortcut)


class ResNet50(nn.Module):
    """The bottleneck ResNet of Table 1 (50 layers with blocks 3, 4, 6, 3).

    Example:
        >>> import torch
        >>> model = ResNet50(PRESETS["tiny"])
        >>> tuple(model(torch.zeros(2, 3, 32, 32)).shape)
        (2, 10)
    """

    def __init__(self, config: ResNet50Config) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            conv_bn(3, config.base_width, 7, stride=2),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        blocks: list[nn.Module] = []
        in_channels = config.base_width
        for stage, num_blocks in enumerate(config.blocks_per_stage):
            width = config.base_width << stage
            for index in range(num_blocks):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(Bottleneck(in_channels, width, stride=stride))
                in_channels = width * EXPANSION
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
    """ResNet-50 of ``request.preset`` on synthetic images or the image folder ``request.data``.

    ``request.dropout`` changes nothing: the model has no dropout.

    Example:
        >>> build(BuildRequest(preset="tiny")).global_batch
        8
    """
    check_preset(request.preset, NAME)
    parse_options(None, request.options, NAME)
    config = PRESETS[request.preset]
    dataset, num_classes, data_description = image_classification_data(
        request.data,
        seed=request.seed,
        image_size=config.image_size,
        num_classes=config.num_classes,
    )
    config = dataclasses.replace(config, num_classes=num_classes)
    model = ResNet50(config)
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    return Workload(
        model=model,
        dataset=dataset,
        loss=F.cross_entropy,
        global_batch=config.global_batch,
        description=(
            f"{NAME} ({request.preset}): bottleneck blocks {config.blocks_per_stage}, widths "
            f"{config.base_width}..{config.base_width << 3}, {config.num_classes} classes, "
            f"{num_parameters:,} parameters, {data_description}"
        ),
    )


SPEC = ModelSpec(
    name=NAME,
    summary="ResNet-50 (He et al. 2016, bottleneck, projection shortcuts), ImageNet size",
    build=build,
    presets=PRESETS,
)
