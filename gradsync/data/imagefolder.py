"""Images in an ImageNet-style folder tree: ``DIR/<class>/<image>``, decoded with Pillow.

Every sub-folder of ``DIR`` is a class (labels in sorted folder-name order); every file in it
with an image extension (.jpg .jpeg .png .bmp .gif .ppm .tif .tiff .webp, any case) is a
sample. Images are converted to RGB, their shorter side resized (bilinear) to
``image_size / 0.875`` (256 for 224, the usual ImageNet evaluation transform) and the centre
``image_size`` square cropped, then normalized with the ImageNet channel statistics. There
is no random augmentation, so a sample is the same tensor on every rank and in every run and
``verify`` holds on real images; images of any size and mode may be mixed in one tree.

Every file's header is read when the dataset is built, so an unreadable image is a one-line
error naming it before training starts; pixels are decoded when a batch asks for them.

Example:
    >>> images = ImageFolder("data/imagenet/train", image_size=224, seed=0)  # doctest: +SKIP
    >>> images.batch(step=0, size=32, start=0, stop=16).inputs[0].shape  # doctest: +SKIP
    torch.Size([16, 3, 224, 224])
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from gradsync.data.base import Batch, IndexedSamples
from gradsync.data.synthetic import SyntheticImages
from gradsync.errors import UserError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".ppm", ".tif", ".tiff", ".webp")
CROP_FRACTION = 0.875  # resize to 256, crop 224
CHANNEL_MEAN = (0.485, 0.456, 0.406)
CHANNEL_STD = (0.229, 0.224, 0.225)
_HOW_TO_FIX = "pass --data a folder with one sub-folder of images per class (class/xxx.jpg)"


def list_image_folder(directory: str | Path) -> tuple[list[str], list[tuple[Path, int]]]:
    """The class names (sorted) and every ``(image path, label)`` of the tree, checked.

    Example:
        >>> list_image_folder("/nowhere")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: no image folder at /nowhere; pass --data a folder with ...
    """
    root = Path(directory)
    if not root.is_dir():
        raise UserError(f"no image folder at {root}; {_HOW_TO_FIX}")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise UserError(f"image folder {root} has no class sub-folders; {_HOW_TO_FIX}")
    samples: list[tuple[Path, int]] = []
    for label, name in enumerate(classes):
        images = sorted(p for p in (root / name).iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)
        if not images:
            raise UserError(
                f"class folder {root / name} holds no images ({', '.join(IMAGE_EXTENSIONS)}); "
                "add images to it or remove it"
            )
        samples += [(path, label) for path in images]
    return classes, samples


def check_image(path: Path) -> None:
    """Read ``path``'s header with Pillow; a UserError naming the file if it is not an image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.size  # noqa: B018 - the header is parsed by open; size proves it has one
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise UserError(
            f"cannot read image {path} ({type(error).__name__}: {error}); "
            "replace or delete the file"
        ) from None


def load_image(path: Path, image_size: int) -> Tensor:
    """``path`` as uint8 ``[3, image_size, image_size]``: RGB, shorter side resized, centre crop.

    Example:
        >>> load_image(Path("cat.jpg"), 224).shape  # doctest: +SKIP
        torch.Size([3, 224, 224])
    """
    from PIL import Image

    resized_short_side = math.ceil(image_size / CROP_FRACTION)
    try:
        with Image.open(path) as image:
            # draft lets the JPEG decoder scale down by 1/2..1/8 while decoding (deterministic).
            image.draft("RGB", (resized_short_side, resized_short_side))
            rgb = image.convert("RGB")
    except (OSError, ValueError) as error:
        raise UserError(
            f"cannot decode image {path} ({type(error).__name__}: {error}); "
            "replace or delete the file"
        ) from None
    width, height = rgb.size
    scale = resized_short_side / min(width, height)
    size = (max(image_size, round(width * scale)), max(image_size, round(height * scale)))
    rgb = rgb.resize(size, Image.Resampling.BILINEAR)
    left, top = (size[0] - image_size) // 2, (size[1] - image_size) // 2
    rgb = rgb.crop((left, top, left + image_size, top + image_size))
    return torch.from_numpy(np.asarray(rgb, dtype=np.uint8).copy()).permute(2, 0, 1)


class ImageFolder(IndexedSamples):
    """An image-folder tree as global batches: ``inputs = (normalized [n, 3, S, S],)``, labels.

    ``classes`` lists the class folders in label order; ``num_classes`` is their count.
    """

    def __init__(self, directory: str | Path, *, image_size: int, seed: int) -> None:
        self.classes, samples = list_image_folder(directory)
        for path, _ in samples:
            check_image(path)
        self.paths = [path for path, _ in samples]
        self.labels = torch.tensor([label for _, label in samples], dtype=torch.long)
        self.image_size = image_size
        self._mean = torch.tensor(CHANNEL_MEAN).view(1, 3, 1, 1)
        self._std = torch.tensor(CHANNEL_STD).view(1, 3, 1, 1)
        super().__init__(len(samples), seed)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def gather(self, indices: Tensor) -> Batch:
        pixels = torch.stack([load_image(self.paths[i], self.image_size) for i in indices])
        images = (pixels.float() / 255.0 - self._mean) / self._std
        return Batch(inputs=(images,), targets=self.labels[indices])


def image_classification_data(
    data: str | None, *, seed: int, image_size: int, num_classes: int
) -> tuple[IndexedSamples | SyntheticImages, int, str]:
    """The dataset of an ImageNet-style model: the folder tree at ``data``, else synthetic.

    Returns (dataset, number of classes, description); a folder's classes replace
    ``num_classes``.

    Example:
        >>> dataset, classes, text = image_classification_data(
        ...     None, seed=0, image_size=32, num_classes=10)
        >>> classes, text
        (10, 'synthetic 32x32 images')
    """
    if data is None:
        synthetic = SyntheticImages(
            seed=seed, num_classes=num_classes, image_shape=(3, image_size, image_size)
        )
        return synthetic, num_classes, f"synthetic {image_size}x{image_size} images"
    folder = ImageFolder(data, image_size=image_size, seed=seed)
    description = (
        f"image folder {data} ({folder.num_samples} images, {folder.num_classes} classes, "
        f"centre-cropped to {image_size}x{image_size})"
    )
    return folder, folder.num_classes, description
