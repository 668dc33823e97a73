"""MNIST training images from the idx files of LeCun et al. (1998), plain or gzipped.

``train-images-idx3-ubyte``: big-endian magic 0x00000803, count, rows, columns, then one
byte per pixel; ``train-labels-idx1-ubyte``: magic 0x00000801, count, then one byte per
label. Images are scaled to [0, 1] as in TensorFlow's official MNIST model.

Example:
    >>> data = MNISTImages("data/mnist", seed=0)  # doctest: +SKIP
    >>> batch = data.batch(step=0, size=100, start=0, stop=100)  # doctest: +SKIP
    >>> batch.inputs[0].shape  # doctest: +SKIP
    torch.Size([100, 1, 28, 28])
"""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import torch
from torch import Tensor

from gradsync.data.base import Batch, FixedSamples, IndexedSamples
from gradsync.errors import UserError

IMAGES_FILE = "train-images-idx3-ubyte"
LABELS_FILE = "train-labels-idx1-ubyte"
IMAGES_MAGIC = 0x00000803
LABELS_MAGIC = 0x00000801
NUM_CLASSES = 10
_HOW_TO_FIX = "pass --data a directory holding the MNIST idx files"


def read_idx(
    directory: Path, name: str, *, magic: int, num_dims: int
) -> tuple[tuple[int, ...], bytes]:
    """The dimensions and raw bytes of ``directory/name`` (or ``name.gz``), validated.

    Example:
        >>> read_idx(Path("/nowhere"), LABELS_FILE, magic=LABELS_MAGIC, num_dims=1)
        ... # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: no MNIST labels at /nowhere/train-labels-idx1-ubyte(.gz); ...
    """
    what = "MNIST images" if num_dims == 3 else "MNIST labels"
    plain, zipped = directory / name, directory / f"{name}.gz"
    if plain.is_file():
        path, content = plain, plain.read_bytes()
    elif zipped.is_file():
        path = zipped
        try:
            content = gzip.decompress(zipped.read_bytes())
        except (OSError, EOFError) as error:
            raise UserError(
                f"{what} file {path} is not valid gzip ({error}); {_HOW_TO_FIX}"
            ) from None
    else:
        raise UserError(f"no {what} at {plain}(.gz); {_HOW_TO_FIX}")
    header_size = 4 * (1 + num_dims)
    if len(content) < header_size:
        raise UserError(f"{what} file {path} is too short for an idx header; {_HOW_TO_FIX}")
    found_magic, *dims = struct.unpack(f">{1 + num_dims}I", content[:header_size])
    if found_magic != magic:
        raise UserError(
            f"{what} file {path} has magic number 0x{found_magic:08x}, expected 0x{magic:08x}; "
            f"{_HOW_TO_FIX}"
        )
    expected_size = header_size + _product(dims)
    if len(content) != expected_size:
        raise UserError(
            f"{what} file {path} holds {len(content)} bytes but its header {tuple(dims)} says "
            f"{expected_size}; the file is truncated or corrupt, {_HOW_TO_FIX}"
        )
    return tuple(dims), content[header_size:]


def _product(values: list[int]) -> int:
    result = 1
    for value in values:
        result *= value
    return result


class MNISTImages(IndexedSamples):
    """MNIST training set: ``inputs = (images [n, 1, rows, cols] in [0, 1],)``, int64 labels."""

    def __init__(self, directory: str | Path, *, seed: int) -> None:
        location = Path(directory)
        if not location.is_dir():
            raise UserError(f"no MNIST directory at {location}; {_HOW_TO_FIX}")
        (count, rows, columns), pixels = read_idx(
            location, IMAGES_FILE, magic=IMAGES_MAGIC, num_dims=3
        )
        (label_count,), label_bytes = read_idx(
            location, LABELS_FILE, magic=LABELS_MAGIC, num_dims=1
        )
        if count != label_count:
            raise UserError(
                f"MNIST files in {location} disagree: {count} images but {label_count} labels; "
                f"{_HOW_TO_FIX}"
            )
        if count == 0:
            raise UserError(f"MNIST files in {location} hold 0 images; {_HOW_TO_FIX}")
        self.images = torch.frombuffer(bytearray(pixels), dtype=torch.uint8).view(
            count, 1, rows, columns
        )
        self.labels = torch.frombuffer(bytearray(label_bytes), dtype=torch.uint8).long()
        if count and int(self.labels.max()) >= NUM_CLASSES:
            raise UserError(
                f"MNIST labels in {location} go up to {int(self.labels.max())}, "
                f"expected digits 0-9; {_HOW_TO_FIX}"
            )
        super().__init__(count, seed)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(channels, rows, columns)`` of the stored images."""
        return tuple(self.images.shape[1:])  # type: ignore[return-value]

    def gather(self, indices: Tensor) -> Batch:
        images = self.images[indices].float() / 255.0
        return Batch(inputs=(images,), targets=self.labels[indices])


TEST_IMAGES_FILE = "t10k-images-idx3-ubyte"
TEST_LABELS_FILE = "t10k-labels-idx1-ubyte"


def mnist_test_set(directory: str | Path) -> FixedSamples | None:
    """The 10,000 MNIST test images (``t10k-*`` idx files) for validation, if present."""
    location = Path(directory)
    if not any((location / f"{TEST_IMAGES_FILE}{ext}").is_file() for ext in ("", ".gz")):
        return None
    (count, rows, columns), pixels = read_idx(
        location, TEST_IMAGES_FILE, magic=IMAGES_MAGIC, num_dims=3
    )
    (label_count,), label_bytes = read_idx(
        location, TEST_LABELS_FILE, magic=LABELS_MAGIC, num_dims=1
    )
    if count != label_count:
        raise UserError(
            f"MNIST test files in {location} disagree: {count} images but "
            f"{label_count} labels; {_HOW_TO_FIX}"
        )
    images = torch.frombuffer(bytearray(pixels), dtype=torch.uint8).view(count, 1, rows, columns)
    labels = torch.frombuffer(bytearray(label_bytes), dtype=torch.uint8).long()
    return FixedSamples(images.float() / 255.0, labels)
