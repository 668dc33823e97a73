"""VGG-19: configuration E of Simonyan & Zisserman (2015), "Very Deep Convolutional Networks
for Large-Scale Image Recognition" (ICLR), Table 1, without batch normalization.

Sixteen 3x3 convolutions with ReLU in five stages of 2, 2, 4, 4, 4 layers and widths 64,
128, 256, 512, 512, each closed by a 2x2 max-pool, then fully connected 4096 - 4096 -
classes with dropout 0.5: 143,667,240 parameters at 224x224 with 1000 classes (the
published 144M; Table 2). The network is :class:`gradsync.models.vgg.VGG` with
configuration E's convolutions per stage; initialization is the same as VGG-16's.

Presets: ``paper`` is the ImageNet model at 224x224, 1000 classes, batch 256 (section
3.1); ``default`` is configuration E at half the widths with fc 1024 on 32x32 images, 100
classes, batch 32; ``tiny`` is configuration E at widths 2-8 and fc 16 on 32x32 images, 10
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

from gradsync.data.base import Dataset
from gradsync.data.imagefolder import image_classification_data
from gradsync.models import vgg
from gradsync.models.base import BuildRequest, ModelSpec, Workload

NAME = "vgg19"
CONVS_PER_STAGE_E = (2, 2, 4, 4, 4)

PAPER = dataclasses.replace(
    vgg.PAPER, configuration="E", convs_per_stage=CONVS_PER_STAGE_E, global_batch=256
)
PRESETS: dict[str, vgg.VGGConfig] = {
    "paper": PAPER,
    "default": dataclasses.replace(
        PAPER,
        stage_widths=(32, 64, 128, 256, 256),
        fc_width=1024,
        image_size=32,
        num_classes=100,
        global_batch=32,
    ),
    "tiny": dataclasses.replace(
        PAPER,
        stage_widths=(2, 4, 4, 8, 8),
        fc_width=16,
        image_size=32,
        num_classes=10,
        global_batch=8,
    ),
}


def _dataset(config: vgg.VGGConfig, request: BuildRequest) -> tuple[Dataset, int, str]:
    return image_classification_data(
        request.data,
        seed=request.seed,
        image_size=config.image_size,
        num_classes=config.num_classes,
    )


def build(request: BuildRequest) -> Workload:
    """VGG-19 of ``request.preset`` on synthetic images or the image folder ``request.data``.

    Example:
        >>> build(BuildRequest(preset="tiny")).global_batch
        8
    """
    return vgg.build_vgg(request, name=NAME, presets=PRESETS, dataset=_dataset)


SPEC = ModelSpec(
    name=NAME,
    summary="VGG-19 (configuration E, no batch norm), ImageNet size or a CIFAR-size variant",
    build=build,
    presets=PRESETS,
)
