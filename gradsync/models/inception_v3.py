"""Inception-v3: Szegedy, Vanhoucke, Ioffe, Shlens & Wojna (2016), "Rethinking the Inception
Architecture for Computer Vision" (CVPR), Table 1 and figures 5-7 and 10.

On a 299x299 input: a stem of five convolutions and two max-pools to 35x35x192; three
figure-5 modules (the 5x5 of the original Inception factorized into two 3x3, here with a
5x5 branch kept as in the published model) to 288 channels; a grid reduction (figure 10)
to 17x17x768; four figure-6 modules whose n x n convolutions are factorized into 1x7 and
7x1 (n = 7); a second grid reduction to 8x8x1280; two figure-7 modules with expanded 1x3 /
3x1 filter banks to 2048 channels; global average pooling, dropout and a 1000-way fully
connected layer. Every convolution is bias-free, followed by batch normalization (eps 1e-3)
and ReLU. The channel counts are those of the published model: 23,834,568 parameters
without the auxiliary head (the published 23.8M), 27,161,264 with it. The loss is
cross-entropy with label smoothing 0.1 (section 7).

The **auxiliary classifier** on the 17x17 grid (section 4: 5x5/3 average pool, 1x1 conv to
128, 5x5 conv to 768, fully connected) is off by default and switched on with
``--model-option aux=true``; the model then returns ``(logits, auxiliary logits)`` in
training mode and the loss adds 0.4 x the auxiliary cross-entropy (the weight of
TensorFlow's Inception-v3 training code; the paper gives none).

Presets: ``paper`` is the model above at 299x299, 1000 classes, batch 32 (section 8);
``default`` scales every channel count by 1/4 on 139x139 images, 100 classes, batch 32;
``tiny`` keeps one module of each kind at 1/32 of the channels on 75x75 images (the
smallest the stem and reductions allow), 10 classes, batch 8. Real images: ``--data DIR``
(an ImageNet-style folder tree), centre-cropped to the preset's size.

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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradsync.data.imagefolder import image_classification_data
from gradsync.models.base import BuildRequest, ModelSpec, Workload, check_preset, parse_options

NAME = "inception-v3"
BATCHNORM_EPS = 1e-3
AUX_WEIGHT = 0.4
MIN_IMAGE_SIZE = 75
# The published 17x17 modules widen their factorized 7x7 convolutions from module to module.
MODULE_B_WIDTHS = (128, 160, 160, 192)


@dataclass(frozen=True, kw_only=True)
class InceptionConfig:
    """Channel scale, modules per grid size (35, 17, 8), input, dropout, default batch."""

    width: float = 1.0
    num_modules: tuple[int, int, int] = (3, 4, 2)
    image_size: int = 299
    num_classes: int = 1000
    dropout: float = 0.2
    label_smoothing: float = 0.1
    global_batch: int = 32


PAPER = InceptionConfig()
PRESETS: dict[str, InceptionConfig] = {
    "paper": PAPER,
    "default": dataclasses.replace(PAPER, width=0.25, image_size=139, num_classes=100),
    "tiny": dataclasses.replace(
        PAPER,
        width=1 / 32,
        num_modules=(1, 1, 1),
        image_size=MIN_IMAGE_SIZE,
        num_classes=10,
        global_batch=8,
    ),
}


@dataclass
class InceptionOptions:
    """``--model-option`` keys of inception-v3: ``aux`` (the auxiliary classifier)."""

    aux: bool = False


class Scale:
    """Channel counts of the published model times ``width`` (at least 1).

    Example:
        >>> Scale(0.25)(192)
        48
    """

    def __init__(self, width: float) -> None:
        self.width = width

    def __call__(self, channels: int) -> int:
        return max(1, round(channels * self.width))


class ConvBN(nn.Sequential):
    """Bias-free convolution, batch normalization (eps 1e-3), ReLU."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        *,
        stride: int = 1,
        padding: int | tuple[int, int] = 0,
    ) -> None:
        super().__init__(
            nn.Conv2d(
                in_channels, out_channels, kernel_size, stride=stride, padding=padding, bias=False
            ),
            nn.BatchNorm2d(out_channels, eps=BATCHNORM_EPS),
            nn.ReLU(),
        )
        self.out_channels = out_channels


Layer = tuple[int, int | tuple[int, int], int, int | tuple[int, int]]


class ConvChain(nn.Sequential):
    """Consecutive ConvBNs from ``(out_channels, kernel, stride, padding)`` tuples.

    Example:
        >>> ConvChain(3, (4, 1, 1, 0), (5, 3, 2, 0)).out_channels
        5
    """

    def __init__(self, in_channels: int, *layers: Layer) -> None:
        modules = []
        for out_channels, kernel, stride, padding in layers:
            modules.append(
                ConvBN(in_channels, out_channels, kernel, stride=stride, padding=padding)
            )
            in_channels = out_channels
        super().__init__(*modules)
        self.out_channels = in_channels


ROW, COLUMN = (1, 7), (7, 1)
ROW_PAD, COLUMN_PAD = (0, 3), (3, 0)


class ModuleA(nn.Module):
    """35x35 module (figure 5): 1x1 | 1x1-5x5 | 1x1-3x3-3x3 | avg-pool-1x1."""

    def __init__(self, in_channels: int, pool_channels: int, c: Scale) -> None:
        super().__init__()
        self.branches = nn.ModuleList(
            [
                ConvChain(in_channels, (c(64), 1, 1, 0)),
                ConvChain(in_channels, (c(48), 1, 1, 0), (c(64), 5, 1, 2)),
                ConvChain(in_channels, (c(64), 1, 1, 0), (c(96), 3, 1, 1), (c(96), 3, 1, 1)),
            ]
        )
        self.pool_branch = ConvChain(in_channels, (c(pool_channels), 1, 1, 0))
        self.out_channels = sum(b.out_channels for b in self.branches) + c(pool_channels)

    def forward(self, x: Tensor) -> Tensor:
        pooled = F.avg_pool2d(x, 3, stride=1, padding=1)
        return torch.cat([*(b(x) for b in self.branches), self.pool_branch(pooled)], dim=1)


class ReductionA(nn.Module):
    """35 -> 17 grid reduction (figure 10): 3x3/2 | 1x1-3x3-3x3/2 | max-pool/2."""

    def __init__(self, in_channels: int, c: Scale) -> None:
        super().__init__()
        self.branches = nn.ModuleList(
            [
                ConvChain(in_channels, (c(384), 3, 2, 0)),
                ConvChain(in_channels, (c(64), 1, 1, 0), (c(96), 3, 1, 1), (c(96), 3, 2, 0)),
            ]
        )
        self.out_channels = sum(b.out_channels for b in self.branches) + in_channels

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([*(b(x) for b in self.branches), F.max_pool2d(x, 3, stride=2)], dim=1)


class ModuleB(nn.Module):
    """17x17 module (figure 6, n = 7): 1x1 | 1x1-1x7-7x1 | 1x1-7x1-1x7-7x1-1x7 | pool-1x1."""

    def __init__(self, in_channels: int, mid: int, c: Scale) -> None:
        super().__init__()
        m = c(mid)
        self.branches = nn.ModuleList(
            [
                ConvChain(in_channels, (c(192), 1, 1, 0)),
                ConvChain(
                    in_channels, (m, 1, 1, 0), (m, ROW, 1, ROW_PAD), (c(192), COLUMN, 1, COLUMN_PAD)
                ),
                ConvChain(
                    in_channels,
                    (m, 1, 1, 0),
                    (m, COLUMN, 1, COLUMN_PAD),
                    (m, ROW, 1, ROW_PAD),
                    (m, COLUMN, 1, COLUMN_PAD),
                    (c(192), ROW, 1, ROW_PAD),
                ),
            ]
        )
        self.pool_branch = ConvChain(in_channels, (c(192), 1, 1, 0))
        self.out_channels = sum(b.out_channels for b in self.branches) + c(192)

    def forward(self, x: Tensor) -> Tensor:
        pooled = F.avg_pool2d(x, 3, stride=1, padding=1)
        return torch.cat([*(b(x) for b in self.branches), self.pool_branch(pooled)], dim=1)


class ReductionB(nn.Module):
    """17 -> 8 grid reduction: 1x1-3x3/2 | 1x1-1x7-7x1-3x3/2 | max-pool/2."""

    def __init__(self, in_channels: int, c: Scale) -> None:
        super().__init__()
        self.branches = nn.ModuleList(
            [
                ConvChain(in_channels, (c(192), 1, 1, 0), (c(320), 3, 2, 0)),
                ConvChain(
                    in_channels,
                    (c(192), 1, 1, 0),
                    (c(192), ROW, 1, ROW_PAD),
                    (c(192), COLUMN, 1, COLUMN_PAD),
                    (c(192), 3, 2, 0),
                ),
            ]
        )
        self.out_channels = sum(b.out_channels for b in self.branches) + in_channels

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([*(b(x) for b in self.branches), F.max_pool2d(x, 3, stride=2)], dim=1)


class SplitBranch(nn.Module):
    """A stem of ConvBNs, then parallel 1x3 and 3x1 ConvBNs concatenated (figure 7)."""

    def __init__(self, stem: ConvChain, out_channels: int) -> None:
        super().__init__()
        self.stem = stem
        self.row = ConvBN(stem.out_channels, out_channels, (1, 3), padding=(0, 1))
        self.column = ConvBN(stem.out_channels, out_channels, (3, 1), padding=(1, 0))
        self.out_channels = 2 * out_channels

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        return torch.cat([self.row(x), self.column(x)], dim=1)


class ModuleC(nn.Module):
    """8x8 module (figure 7): 1x1 | 1x1-(1x3, 3x1) | 1x1-3x3-(1x3, 3x1) | avg-pool-1x1."""

    def __init__(self, in_channels: int, c: Scale) -> None:
        super().__init__()
        self.branches = nn.ModuleList(
            [
                ConvChain(in_channels, (c(320), 1, 1, 0)),
                SplitBranch(ConvChain(in_channels, (c(384), 1, 1, 0)), c(384)),
                SplitBranch(ConvChain(in_channels, (c(448), 1, 1, 0), (c(384), 3, 1, 1)), c(384)),
            ]
        )
        self.pool_branch = ConvChain(in_channels, (c(192), 1, 1, 0))
        self.out_channels = sum(b.out_channels for b in self.branches) + c(192)

    def forward(self, x: Tensor) -> Tensor:
        pooled = F.avg_pool2d(x, 3, stride=1, padding=1)
        return torch.cat([*(b(x) for b in self.branches), self.pool_branch(pooled)], dim=1)


class AuxiliaryHead(nn.Module):
    """Section 4's side head on the 17x17 grid: avg-pool 5x5/3, 1x1, 5x5, fully connected.

    Example:
        >>> head = AuxiliaryHead(8, 10, Scale(1 / 32))
        >>> [tuple(head(torch.zeros(2, 8, size, size)).shape) for size in (17, 3)]
        [(2, 10), (2, 10)]
    """

    def __init__(self, in_channels: int, num_classes: int, c: Scale) -> None:
        super().__init__()
        self.convs = ConvChain(in_channels, (c(128), 1, 1, 0), (c(768), 5, 1, 0))
        self.classifier = nn.Linear(c(768), num_classes)

    def forward(self, x: Tensor) -> Tensor:
        # 17x17 -> 5x5 as published; the reduced presets' smaller grids average to 5x5 too.
        pooled = F.avg_pool2d(x, 5, stride=3) if x.shape[-1] >= 17 else F.adaptive_avg_pool2d(x, 5)
        x = self.convs(pooled)
        return self.classifier(x.mean(dim=(2, 3)))


class InceptionV3(nn.Module):
    """Inception-v3 (Table 1); with ``aux`` it returns ``(logits, aux_logits)`` when training.

    Example:
        >>> model = InceptionV3(PRESETS["tiny"])
        >>> tuple(model(torch.zeros(2, 3, 75, 75)).shape)
        (2, 10)
    """

    def __init__(self, config: InceptionConfig, *, aux: bool = False) -> None:
        super().__init__()
        if config.image_size < MIN_IMAGE_SIZE:
            raise ValueError(f"image_size must be >= {MIN_IMAGE_SIZE} (got {config.image_size})")
        if not 1 <= config.num_modules[1] <= len(MODULE_B_WIDTHS):
            raise ValueError(f"1 to 4 modules on the 17x17 grid (got {config.num_modules[1]})")
        c = Scale(config.width)
        self.stem = ConvChain(3, (c(32), 3, 2, 0), (c(32), 3, 1, 0), (c(64), 3, 1, 1))
        self.stem2 = ConvChain(self.stem.out_channels, (c(80), 1, 1, 0), (c(192), 3, 1, 0))
        num_a, num_b, num_c = config.num_modules
        pool_channels = [32] + [64] * (num_a - 1)
        blocks_35: list[nn.Module] = []
        channels = self.stem2.out_channels
        for pool in pool_channels:
            blocks_35.append(ModuleA(channels, pool, c))
            channels = blocks_35[-1].out_channels
        self.grid_35 = nn.Sequential(*blocks_35, ReductionA(channels, c))
        channels = self.grid_35[-1].out_channels
        blocks_17: list[nn.Module] = []
        for mid in MODULE_B_WIDTHS[:num_b]:
            blocks_17.append(ModuleB(channels, mid, c))
            channels = blocks_17[-1].out_channels
        self.grid_17 = nn.Sequential(*blocks_17)
        self.aux = AuxiliaryHead(channels, config.num_classes, c) if aux else None
        reduction = ReductionB(channels, c)
        channels = reduction.out_channels
        blocks_8: list[nn.Module] = [reduction]
        for _ in range(num_c):
            blocks_8.append(ModuleC(channels, c))
            channels = blocks_8[-1].out_channels
        self.grid_8 = nn.Sequential(*blocks_8)
        self.dropout = nn.Dropout(config.dropout)
        self.classifier = nn.Linear(channels, config.num_classes)

    def forward(self, images: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        x = self.stem(images)
        x = self.stem2(F.max_pool2d(x, 3, stride=2))
        x = self.grid_17(self.grid_35(F.max_pool2d(x, 3, stride=2)))
        aux_logits = self.aux(x) if self.aux is not None and self.training else None
        x = self.grid_8(x).mean(dim=(2, 3))
        logits = self.classifier(self.dropout(x))
        return logits if aux_logits is None else (logits, aux_logits)


@dataclass(frozen=True)
class InceptionLoss:
    """Label-smoothed cross-entropy, plus ``aux_weight`` x the auxiliary head's when given.

    Example:
        >>> loss = InceptionLoss(label_smoothing=0.0)
        >>> logits, labels = torch.zeros(2, 4), torch.tensor([0, 1])
        >>> round(float(loss((logits, logits), labels) / loss(logits, labels)), 4)
        1.4
    """

    label_smoothing: float
    aux_weight: float = AUX_WEIGHT

    def __call__(self, output: Tensor | tuple[Tensor, Tensor], labels: Tensor) -> Tensor:
        logits, aux_logits = output if isinstance(output, tuple) else (output, None)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)
        if aux_logits is not None:
            aux = F.cross_entropy(aux_logits, labels, label_smoothing=self.label_smoothing)
            loss = loss + self.aux_weight * aux
        return loss


def build(request: BuildRequest) -> Workload:
    """Inception-v3 of ``request.preset`` on synthetic images or the folder ``request.data``.

    Example:
        >>> build(BuildRequest(preset="tiny", options={"aux": "true"})).model.aux is not None
        True
    """
    check_preset(request.preset, NAME)
    options: InceptionOptions = parse_options(InceptionOptions, request.options, NAME)
    config = PRESETS[request.preset]
    if not request.dropout:
        config = dataclasses.replace(config, dropout=0.0)
    dataset, num_classes, data_description = image_classification_data(
        request.data,
        seed=request.seed,
        image_size=config.image_size,
        num_classes=config.num_classes,
    )
    config = dataclasses.replace(config, num_classes=num_classes)
    model = InceptionV3(config, aux=options.aux)
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    return Workload(
        model=model,
        dataset=dataset,
        loss=InceptionLoss(label_smoothing=config.label_smoothing),
        global_batch=config.global_batch,
        description=(
            f"{NAME} ({request.preset}): channels x{config.width:g}, modules "
            f"{config.num_modules}, {config.image_size}x{config.image_size} input, "
            f"{config.num_classes} classes, auxiliary head {'on' if options.aux else 'off'}, "
            f"{num_parameters:,} parameters, {data_description}"
        ),
    )


SPEC = ModelSpec(
    name=NAME,
    summary="Inception-v3 (Szegedy et al. 2016), 299x299; option aux (auxiliary classifier)",
    build=build,
    presets=PRESETS,
    options=InceptionOptions,
)
