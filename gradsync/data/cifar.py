"""CIFAR-10 training images from the binary version of Krizhevsky (2009).

``data_batch_1.bin`` .. ``data_batch_5.bin`` each hold 3073-byte records: one label byte
(0-9) then 3072 pixel bytes, the 32x32 red, green and blue planes in turn. Images are
normalized per channel with the training set's mean and standard deviation. ``test_batch.bin``,
where present, is the validation set (:func:`cifar_test_set`).

Example:
    >>> data = CIFAR10Images("data/cifar-10-batches-bin", seed=0)  # doctest: +SKIP
    >>> data.batch(step=0, size=128, start=0, stop=64).inputs[0].shape  # doctest: +SKIP
    torch.Size([64, 3, 32, 32])
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from gradsync.data.base import Batch, FixedSamples, IndexedSamples
from gradsync.errors import UserError

BATCH_FILES = tuple(f"data_batch_{number}.bin" for number in range(1, 6))
TEST_FILE = "test_batch.bin"
EXTRACTED_FOLDER = "cifar-10-batches-bin"
IMAGE_SHAPE = (3, 32, 32)
RECORD_BYTES = 1 + 3 * 32 * 32
NUM_CLASSES = 10
CHANNEL_MEAN = (0.4914, 0.4822, 0.4465)
CHANNEL_STD = (0.2470, 0.2435, 0.2616)
_HOW_TO_FIX = (
    "pass --data the directory holding data_batch_1.bin..data_batch_5.bin "
    "(the extracted CIFAR-10 binary version)"
)


def find_cifar_directory(path: str | Path) -> Path:
    """``path`` or its ``cifar-10-batches-bin`` folder, whichever holds the batch files.

    Example:
        >>> find_cifar_directory("/nowhere")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: no CIFAR-10 directory at /nowhere; pass --data the directory ...
    """
    location = Path(path)
    if not location.is_dir():
        raise UserError(f"no CIFAR-10 directory at {location}; {_HOW_TO_FIX}")
    if not (location / BATCH_FILES[0]).is_file() and (location / EXTRACTED_FOLDER).is_dir():
        return location / EXTRACTED_FOLDER
    return location


def read_records(path: Path) -> Tensor:
    """The records of one batch file as uint8 ``[n, 3073]``, with UserErrors for bad files."""
    if not path.is_file():
        raise UserError(f"no CIFAR-10 batch file at {path}; {_HOW_TO_FIX}")
    content = path.read_bytes()
    if not content or len(content) % RECORD_BYTES:
        raise UserError(
            f"CIFAR-10 batch file {path} holds {len(content)} bytes, not a positive multiple of "
            f"the {RECORD_BYTES}-byte record; the file is truncated or not the binary version, "
            f"{_HOW_TO_FIX}"
        )
    return torch.frombuffer(bytearray(content), dtype=torch.uint8).view(-1, RECORD_BYTES)


class CIFAR10Images(IndexedSamples):
    """CIFAR-10 training set: ``inputs = (normalized images [n, 3, 32, 32],)``, int64 labels."""

    def __init__(self, directory: str | Path, *, seed: int) -> None:
        location = find_cifar_directory(directory)
        records = torch.cat([read_records(location / name) for name in BATCH_FILES])
        self.images, self.labels = _images_and_labels(records, location)
        super().__init__(len(records), seed)

    def gather(self, indices: Tensor) -> Batch:
        return Batch(inputs=(normalized(self.images[indices]),), targets=self.labels[indices])


def cifar_test_set(directory: str | Path) -> FixedSamples | None:
    """The 10,000 CIFAR-10 test images (``test_batch.bin``) for validation, if present,
    normalized as the training images are.

    Example:
        >>> cifar_test_set("/nowhere") is None
        True
    """
    location = Path(directory)
    if location.is_dir():
        location = find_cifar_directory(location)
    if not (location / TEST_FILE).is_file():
        return None
    images, labels = _images_and_labels(read_records(location / TEST_FILE), location)
    return FixedSamples(normalized(images), labels)


def normalized(images: Tensor) -> Tensor:
    """uint8 images [n, 3, 32, 32] as float, per channel with the training set's statistics."""
    mean = torch.tensor(CHANNEL_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CHANNEL_STD).view(1, 3, 1, 1)
    return (images.float() / 255.0 - mean) / std


def _images_and_labels(records: Tensor, location: Path) -> tuple[Tensor, Tensor]:
    labels = records[:, 0].long()
    if int(labels.max()) >= NUM_CLASSES:
        raise UserError(
            f"CIFAR-10 labels in {location} go up to {int(labels.max())}, expected 0-9; "
            f"the files are not CIFAR-10 (CIFAR-100 has two label bytes), {_HOW_TO_FIX}"
        )
    return records[:, 1:].reshape(-1, *IMAGE_SHAPE), labels
