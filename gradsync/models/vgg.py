"""VGG-16: configuration D of Simonyan & Zisserman (2015), without batch normalization.

K. Simonyan and A. Zisserman, 2015, "Very Deep Convolutional Networks for Large-Scale Image
Recognition" (ICLR). Thirteen 3x3 convolutions with ReLU in five stages of 2, 2, 3, 3, 3
layers and widths 64, 128, 256, 512, 512, each stage closed by a 2x2 max-pool, then fully
connected 4096 - 4096 - classes with dropout 0.5 after the first two. There is no batch
normalization, as in the Horovod benchmark the seed documents recreate.

Initialization: He et al. (2015) normal for the convolutions and Glorot & Bengio (2010)
uniform for the fully connected layers (the paper's note on training without its staged
pre-training, which is not reproduced), zero biases.

Presets: ``paper`` is the ImageNet model (224x224x3, 1000 classes, fc 4096, batch 64,
138M parameters); ``default`` is the CIFAR-size variant (32x32x3, 10 classes) at
half the widths with fc 1024, batch 32; ``tiny`` is the same shape at widths
2-8 and fc 16, batch 8. Real data (``--data``, CIFAR-10 binary) needs a 32x32 preset.

Example:
    >>> from gradsync.models.base import BuildRequest
    >>> workload = build(BuildRequest(preset="tiny"))
    >>> batch = workload.dataset.batch(step=0, size=8, start=0, stop=8)
    >>> tuple(workload.model(*batch.inputs).shape)
    (8, 10)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from gradsync.data.base import Dataset
from gradsync.data.cifar import IMAGE_SHAPE as CIFAR_IMAGE_SHAPE
from gradsync.data.cifar import NUM_CLASSES as CIFAR_NUM_CLASSES
from gradsync.data.cifar import CIFAR10Images, cifar_test_set
from gradsync.data.synthetic import SyntheticImages
from gradsync.errors import UserError
from gradsync.models.base import BuildRequest, ModelSpec, Workload, check_preset, parse_options

NAME = "vgg16"
CONVS_PER_STAGE_D = (2, 2, 3, 3, 3)
NUM_POOLS = len(CONVS_PER_STAGE_D)


@dataclass(frozen=True, kw_only=True)
class VGGConfig:
    """Convolutions and widths per stage, classifier width, input size and default batch.

    The defaults are configuration D (VGG-16); configuration E (VGG-19) has 2, 2, 4, 4, 4
    convolutions per stage (``gradsync.models.vgg19``).
    """

    configuration: str = "D"
    convs_per_stage: tuple[int, int, int, int, int] = CONVS_PER_STAGE_D
    stage_widths: tuple[int, int, int, int, int] = (64, 128, 256, 512, 512)
    fc_width: int = 4096
    dropout: float = 0.5
    image_size: int = 224
    num_classes: int = 1000
    global_batch: int = 64


PAPER = VGGConfig()
CIFAR_SIZE = dataclasses.replace(PAPER, image_size=32, num_classes=10)
PRESETS: dict[str, VGGConfig] = {
    "paper": PAPER,
    "default": dataclasses.replace(
        CIFAR_SIZE, stage_widths=(32, 64, 128, 256, 256), fc_width=1024, global_batch=32
    ),
    "tiny": dataclasses.replace(
        CIFAR_SIZE, stage_widths=(2, 4, 4, 8, 8), fc_width=16, global_batch=8
    ),
}


class VGG(nn.Module):
    """A VGG configuration: conv layers in 5 pooled stages (13 for D), then a 3-layer classifier.

    Example:
        >>> import torch
        >>> model = VGG(PRESETS["tiny"])
        >>> tuple(model(torch.zeros(2, 3, 32, 32)).shape)
        (2, 10)
    """

    def __init__(self, config: VGGConfig) -> None:
        super().__init__()
        pooled_size = config.image_size >> NUM_POOLS
        if pooled_size < 1 or config.image_size % (1 << NUM_POOLS):
            raise ValueError(f"image_size must be a multiple of 32 (got {config.image_size})")
        layers: list[nn.Module] = []
        in_channels = 3
        for width, num_convs in zip(config.stage_widths, config.convs_per_stage, strict=True):
            for _ in range(num_convs):
                layers += [nn.Conv2d(in_channels, width, kernel_size=3, padding=1), nn.ReLU()]
                in_channels = width
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_channels * pooled_size * pooled_size, config.fc_width),
            nn.ReLU(),
            nn.Dropout(config.dropout),
            nn.Linear(config.fc_width, config.fc_width),
            nn.ReLU(),
            nn.Dropout(config.dropout),
            nn.Linear(config.fc_width, config.num_classes),
        )
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, images: Tensor) -> Tensor:
        return self.classifier(self.features(images))


DatasetFn = Callable[[VGGConfig, BuildRequest], tuple[Dataset, int, str]]


def build(request: BuildRequest) -> Workload:
    """VGG-16 of ``request.preset`` with synthetic images or CIFAR-10 from ``request.data``.

    Example:
        >>> build(BuildRequest(preset="tiny")).global_batch
        8
    """
    return build_vgg(request, name=NAME, presets=PRESETS, dataset=_dataset)


def build_vgg(
    request: BuildRequest, *, name: str, presets: Mapping[str, VGGConfig], dataset: DatasetFn
) -> Workload:
    """The VGG of ``presets[request.preset]``; ``dataset`` gives (data, classes, description).

    Shared by every VGG configuration of the zoo (``vgg16`` here, ``vgg19``).

    Example:
        >>> build_vgg(BuildRequest(preset="tiny"), name="vgg16", presets=PRESETS,
        ...           dataset=_dataset).global_batch
        8
    """
    check_preset(request.preset, name)
    parse_options(None, request.options, name)
    config = presets[request.preset]
    if not request.dropout:
        config = dataclasses.replace(config, dropout=0.0)
    data, num_classes, data_description = dataset(config, request)
    validation = cifar_test_set(request.data) if isinstance(data, CIFAR10Images) else None
    config = dataclasses.replace(config, num_classes=num_classes)
    model = VGG(config)
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    return Workload(
        model=model,
        dataset=data,
        loss=F.cross_entropy,
        global_batch=config.global_batch,
        validation=validation,
        num_validation=validation.num_samples if validation is not None else 0,
        description=(
            f"{name} ({request.preset}): configuration {config.configuration}, widths "
            f"{config.stage_widths}, fc {config.fc_width}, {config.image_size}x"
            f"{config.image_size} input, {config.num_classes} classes, {num_parameters:,} "
            f"parameters, {data_description}"
        ),
    )


def _dataset(config: VGGConfig, request: BuildRequest) -> tuple[Dataset, int, str]:
    image_shape = (3, config.image_size, config.image_size)
    if request.data is None:
        synthetic = SyntheticImages(
            seed=request.seed, num_classes=config.num_classes, image_shape=image_shape
        )
        return synthetic, config.num_classes, "synthetic images"
    if image_shape != CIFAR_IMAGE_SHAPE or config.num_classes != CIFAR_NUM_CLASSES:
        raise UserError(
            f"{NAME} preset '{request.preset}' takes {config.image_size}x{config.image_size} "
            f"images in {config.num_classes} classes but --data reads CIFAR-10 (32x32, 10 "
            "classes); use --preset default or tiny with CIFAR-10, or drop --data for synthetic "
            "images"
        )
    cifar = CIFAR10Images(request.data, seed=request.seed)
    return cifar, CIFAR_NUM_CLASSES, f"CIFAR-10 at {request.data}"


SPEC = ModelSpec(
    name=NAME,
    summary="VGG-16 (configuration D, no batch norm), ImageNet size or a CIFAR-size variant",
    build=build,
    presets=PRESETS,
)
