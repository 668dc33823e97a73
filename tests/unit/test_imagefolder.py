"""The ImageNet-style folder reader on small generated trees (Pillow-written images)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from gradsync.data.imagefolder import ImageFolder, load_image
from gradsync.errors import UserError
from gradsync.models import build_workload


def write_image(
    path: Path, size: tuple[int, int], colour: tuple[int, int, int], mode: str = "RGB"
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.new("RGB", size, colour)
    image.putpixel((0, 0), (255, 255, 255))
    image.convert(mode).save(path)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """Two classes, images of mixed sizes, formats and modes, plus a non-image file."""
    root = tmp_path / "images"
    write_image(root / "cat" / "a.jpg", (40, 30), (200, 10, 10))
    write_image(root / "cat" / "b.png", (64, 64), (190, 20, 20))
    write_image(root / "dog" / "c.JPEG", (30, 50), (10, 10, 200))
    write_image(root / "dog" / "d.png", (33, 33), (30, 30, 30), mode="L")
    (root / "dog" / "notes.txt").write_text("not an image")
    return root


def test_classes_are_sorted_folders_and_every_image_is_a_sample(tree: Path) -> None:
    folder = ImageFolder(tree, image_size=16, seed=0)
    assert folder.classes == ["cat", "dog"]
    assert folder.num_samples == 4
    assert folder.labels.tolist() == [0, 0, 1, 1]
    batch = folder.batch(step=0, size=4, start=0, stop=4)
    assert tuple(batch.inputs[0].shape) == (4, 3, 16, 16)
    assert batch.inputs[0].dtype == torch.float32
    assert sorted(batch.targets.tolist()) == [0, 0, 1, 1]  # one epoch: every sample once


def test_images_are_resized_and_centre_cropped_deterministically(tree: Path) -> None:
    wide = load_image(tree / "cat" / "a.jpg", 16)
    assert tuple(wide.shape) == (3, 16, 16)
    assert wide.dtype == torch.uint8
    assert torch.equal(wide, load_image(tree / "cat" / "a.jpg", 16))
    grey = load_image(tree / "dog" / "d.png", 16)
    assert torch.equal(grey[0], grey[1])  # a grayscale image becomes three equal channels
    red = load_image(tree / "cat" / "b.png", 16)
    assert int(red[0].float().mean()) > 150 > int(red[2].float().mean())


def test_shards_concatenate_to_the_global_batch(tree: Path) -> None:
    folder = ImageFolder(tree, image_size=16, seed=3)
    whole = folder.batch(step=1, size=4, start=0, stop=4)
    halves = [folder.batch(step=1, size=4, start=a, stop=a + 2) for a in (0, 2)]
    assert torch.equal(whole.inputs[0], torch.cat([h.inputs[0] for h in halves]))
    assert torch.equal(whole.targets, torch.cat([h.targets for h in halves]))


def test_a_corrupt_image_is_a_user_error_naming_the_file(tree: Path) -> None:
    (tree / "dog" / "broken.jpg").write_bytes(b"\x00\x01 not a jpeg at all")
    with pytest.raises(UserError, match=r"cannot read image .*broken\.jpg"):
        ImageFolder(tree, image_size=16, seed=0)


def test_a_truncated_image_is_named_when_decoded(tree: Path) -> None:
    whole = (tree / "cat" / "a.jpg").read_bytes()
    (tree / "cat" / "a.jpg").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(UserError, match=r"cannot decode image .*a\.jpg"):
        load_image(tree / "cat" / "a.jpg", 16)


def test_an_empty_class_is_a_user_error(tree: Path) -> None:
    (tree / "empty").mkdir()
    with pytest.raises(UserError, match=r"class folder .*empty holds no images"):
        ImageFolder(tree, image_size=16, seed=0)


def test_an_empty_tree_and_a_missing_folder_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="has no class sub-folders"):
        ImageFolder(tmp_path, image_size=16, seed=0)
    with pytest.raises(UserError, match="no image folder at"):
        ImageFolder(tmp_path / "missing", image_size=16, seed=0)


@pytest.mark.parametrize("name", ["resnet50", "vgg19", "inception-v3"])
def test_image_models_take_their_classes_from_the_tree(tree: Path, name: str) -> None:
    workload = build_workload(name, preset="tiny", data=str(tree))
    batch = workload.dataset.batch(step=0, size=4, start=0, stop=4)
    assert tuple(workload.model.eval()(*batch.inputs).shape) == (4, 2)
    assert "2 classes" in workload.description
