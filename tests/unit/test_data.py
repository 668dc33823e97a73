"""Synthetic data and the real-file readers (MNIST idx, CIFAR-10 binary, PTB, parallel text)."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import pytest
import torch

from gradsync.data.base import Dataset
from gradsync.data.cifar import CHANNEL_MEAN, CHANNEL_STD, CIFAR10Images
from gradsync.data.mnist import MNISTImages
from gradsync.data.synthetic import (
    MarkovTokens,
    SyntheticImages,
    SyntheticTranslation,
    check_slice,
)
from gradsync.data.text import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, ParallelText, PTBCorpus
from gradsync.errors import UserError
from gradsync.models import lstm_lm, mnist_cnn, resnet, transformer, vgg
from gradsync.models.base import BuildRequest, ModelSpec, Workload

# ---------------------------------------------------------------- fake files


def write_idx(
    path: Path, magic: int, dims: tuple[int, ...], payload: bytes, *, zipped: bool = False
) -> None:
    content = struct.pack(f">{1 + len(dims)}I", magic, *dims) + payload
    if zipped:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(content))
    else:
        path.write_bytes(content)


def write_mnist(
    directory: Path, *, count: int = 6, size: int = 28, zipped: bool = False
) -> torch.Tensor:
    """Fake MNIST idx files; returns the images as uint8 ``[count, size, size]``."""
    images = torch.randint(
        256, (count, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    labels = bytes(index % 10 for index in range(count))
    write_idx(
        directory / "train-images-idx3-ubyte",
        0x803,
        (count, size, size),
        images.numpy().tobytes(),
        zipped=zipped,
    )
    write_idx(directory / "train-labels-idx1-ubyte", 0x801, (count,), labels, zipped=zipped)
    return images


def write_cifar(directory: Path, *, records_per_file: int = 2) -> list[bytes]:
    """Five fake CIFAR-10 batch files; returns every record in order."""
    directory.mkdir(parents=True, exist_ok=True)
    records = []
    for number in range(1, 6):
        content = b""
        for index in range(records_per_file):
            label = (number + index) % 10
            pixels = bytes((label * 7 + position) % 256 for position in range(3072))
            content += bytes([label]) + pixels
            records.append(bytes([label]) + pixels)
        (directory / f"data_batch_{number}.bin").write_bytes(content)
    return records


PTB_TEXT = " the cat sat on the mat \n the dog sat \n a cat ran on the road \n" * 3


def write_parallel(directory: Path, sources: list[str], targets: list[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "train.src").write_text("\n".join(sources) + "\n", encoding="utf-8")
    (directory / "train.tgt").write_text("\n".join(targets) + "\n", encoding="utf-8")
    return directory


def assert_halves_concatenate(dataset: Dataset, step: int = 0) -> None:
    whole = dataset.batch(step=step, size=8, start=0, stop=8)
    halves = [dataset.batch(step=step, size=8, start=a, stop=a + 4) for a in (0, 4)]
    for index, inputs in enumerate(whole.inputs):
        assert torch.equal(inputs, torch.cat([half.inputs[index] for half in halves]))
    assert torch.equal(whole.targets, torch.cat([half.targets for half in halves]))


def build(spec: ModelSpec, data: Path | str, preset: str = "tiny", **options: str) -> Workload:
    torch.manual_seed(0)
    return spec.build(BuildRequest(preset=preset, data=str(data), options=options))


def run_forward(workload: Workload) -> torch.Tensor:
    batch = workload.dataset.batch(step=0, size=workload.global_batch, start=0, stop=4)
    loss = workload.loss(workload.model(*batch.inputs, **batch.shared), batch.targets)
    assert torch.isfinite(loss)
    return loss


# ---------------------------------------------------------------- synthetic data


def test_synthetic_shards_are_slices_of_the_global_batch_at_any_boundary() -> None:
    datasets = [
        SyntheticImages(seed=0, num_classes=10, image_shape=(3, 32, 32)),
        MarkovTokens(seed=0, vocab_size=50, seq_len=7),
        SyntheticTranslation(seed=0, vocab_size=30, seq_len=9),
    ]
    for dataset in datasets:
        whole = dataset.batch(step=2, size=12, start=0, stop=12)
        middle = dataset.batch(step=2, size=12, start=3, stop=10)
        for index, inputs in enumerate(whole.inputs):
            assert torch.equal(inputs[3:10], middle.inputs[index])
        assert torch.equal(whole.targets[3:10], middle.targets)


def test_a_shard_outside_the_global_batch_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"samples \[6, 10\) are not inside a global batch of 8"):
        check_slice(size=8, start=6, stop=10)


def test_synthetic_images_of_a_class_share_a_prototype() -> None:
    data = SyntheticImages(seed=0, num_classes=3, image_shape=(1, 28, 28))
    batch = data.batch(step=0, size=60, start=0, stop=60)
    images, labels = batch.inputs[0].flatten(1), batch.targets
    assert images.shape == (60, 784)
    assert set(labels.tolist()) == {0, 1, 2}
    assert abs(float(images.std()) - 1.0) < 0.2
    centroids = torch.stack([images[labels == c].mean(0) for c in range(3)])
    nearest = torch.cdist(images, centroids).argmin(dim=1)
    assert (nearest == labels).float().mean() > 0.95


def test_synthetic_images_at_imagenet_size_stay_small() -> None:
    data = SyntheticImages(seed=0, num_classes=1000, image_shape=(3, 224, 224))
    assert data._coarse_prototypes.numel() == 1000 * 3 * 8 * 8
    assert data.batch(step=0, size=4, start=0, stop=2).inputs[0].shape == (2, 3, 224, 224)


def test_markov_tokens_follow_the_chain_nine_times_in_ten() -> None:
    data = MarkovTokens(seed=1, vocab_size=40, seq_len=20)
    batch = data.batch(step=0, size=64, start=0, stop=64)
    tokens, next_tokens = batch.inputs[0], batch.targets
    assert tokens.shape == next_tokens.shape == (64, 20)
    assert torch.equal(tokens[:, 1:], next_tokens[:, :-1])
    followed = (data.successor[tokens] == next_tokens).float().mean()
    assert 0.85 < float(followed) < 0.95
    assert int(tokens.min()) >= 0
    assert int(tokens.max()) < 40


def test_synthetic_translation_is_the_reversed_source_under_a_permutation() -> None:
    data = SyntheticTranslation(seed=0, vocab_size=30, seq_len=9)
    batch = data.batch(step=0, size=16, start=0, stop=16)
    source, target_in = batch.inputs
    target_out = batch.targets
    for row in range(16):
        length = int((source[row] != PAD_ID).sum()) - 1  # words, then <eos>
        assert 4 <= length <= 8
        words = source[row, :length]
        assert int(source[row, length]) == EOS_ID
        assert bool((words >= 4).all())
        translated = data.translation[words.flip(0)]
        assert torch.equal(target_out[row, :length], translated)
        assert int(target_out[row, length]) == EOS_ID
        assert torch.equal(
            target_in[row, : length + 1], torch.cat([torch.tensor([BOS_ID]), translated])
        )
        assert bool((target_out[row, length + 1 :] == PAD_ID).all())
        assert bool((target_in[row, length + 1 :] == PAD_ID).all())


# ---------------------------------------------------------------- MNIST


@pytest.mark.parametrize("zipped", [False, True], ids=["plain", "gz"])
def test_mnist_reader_loads_idx_files(tmp_path: Path, zipped: bool) -> None:
    images = write_mnist(tmp_path, zipped=zipped)
    data = MNISTImages(tmp_path, seed=0)
    assert data.num_samples == 6
    assert data.image_shape == (1, 28, 28)
    batch = data.batch(step=0, size=6, start=0, stop=6)
    order = data.indices(step=0, size=6, start=0, stop=6)
    assert sorted(order.tolist()) == list(range(6))  # one epoch visits every sample once
    torch.testing.assert_close(batch.inputs[0][:, 0], images[order].float() / 255)
    assert torch.equal(batch.targets, order % 10)


def test_mnist_shards_are_slices_of_the_global_batch(tmp_path: Path) -> None:
    write_mnist(tmp_path, count=20)
    assert_halves_concatenate(MNISTImages(tmp_path, seed=3), step=4)


def test_mnist_missing_files_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no MNIST directory at"):
        MNISTImages(tmp_path / "absent", seed=0)
    with pytest.raises(
        UserError, match=r"no MNIST images at .*train-images-idx3-ubyte\(\.gz\); pass --data"
    ):
        MNISTImages(tmp_path, seed=0)


def test_mnist_malformed_files_are_user_errors(tmp_path: Path) -> None:
    write_mnist(tmp_path)
    images_file = tmp_path / "train-images-idx3-ubyte"
    labels_file = tmp_path / "train-labels-idx1-ubyte"
    good_images = images_file.read_bytes()

    images_file.write_bytes(b"\x00\x00\x08\x01" + good_images[4:])
    with pytest.raises(UserError, match="magic number 0x00000801, expected 0x00000803"):
        MNISTImages(tmp_path, seed=0)

    images_file.write_bytes(good_images[:-10])
    with pytest.raises(UserError, match="truncated or corrupt"):
        MNISTImages(tmp_path, seed=0)

    images_file.write_bytes(b"\x00\x00")
    with pytest.raises(UserError, match="too short for an idx header"):
        MNISTImages(tmp_path, seed=0)

    images_file.write_bytes(good_images)
    write_idx(labels_file, 0x801, (5,), bytes(5))
    with pytest.raises(UserError, match="6 images but 5 labels"):
        MNISTImages(tmp_path, seed=0)

    write_idx(labels_file, 0x801, (6,), bytes([0, 1, 2, 3, 4, 12]))
    with pytest.raises(UserError, match="go up to 12"):
        MNISTImages(tmp_path, seed=0)

    labels_file.unlink()
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(UserError, match="not valid gzip"):
        MNISTImages(tmp_path, seed=0)


def test_mnist_cnn_trains_on_mnist_files(tmp_path: Path) -> None:
    write_mnist(tmp_path, count=10, zipped=True)
    workload = build(mnist_cnn.SPEC, tmp_path)
    run_forward(workload).backward()
    assert "MNIST at" in workload.description


def test_mnist_cnn_rejects_images_of_another_size(tmp_path: Path) -> None:
    write_mnist(tmp_path, size=14)
    with pytest.raises(
        UserError, match=r"are \(1, 14, 14\), model 'mnist-cnn' takes \(1, 28, 28\)"
    ):
        build(mnist_cnn.SPEC, tmp_path)


# ---------------------------------------------------------------- CIFAR-10


def test_cifar_reader_loads_and_normalizes_binary_batches(tmp_path: Path) -> None:
    records = write_cifar(tmp_path)
    data = CIFAR10Images(tmp_path, seed=0)
    assert data.num_samples == 10
    batch = data.batch(step=0, size=10, start=0, stop=10)
    order = data.indices(step=0, size=10, start=0, stop=10)
    for row, index in enumerate(order.tolist()):
        record = records[index]
        assert int(batch.targets[row]) == record[0]
        # Red plane first: pixel (channel 1, y 0, x 5) is byte 1 + 1024 + 5.
        expected = (record[1 + 1024 + 5] / 255 - CHANNEL_MEAN[1]) / CHANNEL_STD[1]
        assert abs(float(batch.inputs[0][row, 1, 0, 5]) - expected) < 1e-5
    assert batch.inputs[0].shape == (10, 3, 32, 32)
    assert_halves_concatenate(data, step=3)


def test_cifar_reader_finds_the_extracted_folder(tmp_path: Path) -> None:
    write_cifar(tmp_path / "cifar-10-batches-bin")
    assert CIFAR10Images(tmp_path, seed=0).num_samples == 10


def test_cifar_missing_and_malformed_files_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no CIFAR-10 directory at"):
        CIFAR10Images(tmp_path / "absent", seed=0)
    write_cifar(tmp_path)
    (tmp_path / "data_batch_4.bin").unlink()
    with pytest.raises(
        UserError, match=r"no CIFAR-10 batch file at .*data_batch_4\.bin; pass --data"
    ):
        CIFAR10Images(tmp_path, seed=0)
    (tmp_path / "data_batch_4.bin").write_bytes(bytes(3073 + 100))
    with pytest.raises(
        UserError, match="holds 3173 bytes, not a positive multiple of the 3073-byte"
    ):
        CIFAR10Images(tmp_path, seed=0)
    (tmp_path / "data_batch_4.bin").write_bytes(bytes([42]) + bytes(3072))
    with pytest.raises(UserError, match="go up to 42"):
        CIFAR10Images(tmp_path, seed=0)


@pytest.mark.parametrize("spec", [resnet.SPEC, vgg.SPEC], ids=lambda spec: spec.name)
def test_cifar_models_train_on_cifar_files(tmp_path: Path, spec: ModelSpec) -> None:
    write_cifar(tmp_path)
    run_forward(build(spec, tmp_path)).backward()


@pytest.mark.parametrize("name", ["resnet56", "vgg16"])
def test_cifar_data_gives_iterations_per_epoch_and_the_test_batch_validates(
    tmp_path: Path, name: str
) -> None:
    """Only mnist-cnn reported either: CIFAR-10's five batch files and its test_batch.bin
    gave iters/epoch None and validation accuracy None (seed 004's ResNet-56 on CIFAR-10)."""
    from gradsync.evaluate import validation_accuracy
    from gradsync.models import build_workload

    write_cifar(tmp_path)
    assert build_workload(name, preset="tiny", data=str(tmp_path)).validation is None
    (tmp_path / "test_batch.bin").write_bytes(b"".join(write_cifar(tmp_path / "t")[:3]))
    workload = build_workload(name, preset="tiny", data=str(tmp_path))
    assert workload.num_train_samples == 10 and workload.num_validation == 3
    accuracy = validation_accuracy(workload.model, workload, torch.device("cpu"))
    assert accuracy is not None and 0.0 <= accuracy <= 1.0


def test_ptb_data_gives_iterations_per_epoch(tmp_path: Path) -> None:
    from gradsync.models import build_workload

    (tmp_path / "ptb.train.txt").write_text(PTB_TEXT * 4, encoding="utf-8")
    workload = build_workload("lstm-lm", preset="tiny", data=str(tmp_path))
    assert workload.num_train_samples == workload.dataset.num_samples > 0


def test_vgg_at_imagenet_size_rejects_cifar_data(tmp_path: Path) -> None:
    write_cifar(tmp_path)
    with pytest.raises(UserError, match=r"preset \'paper\' takes 224x224 images .* reads CIFAR-10"):
        build(vgg.SPEC, tmp_path, preset="paper")


# ---------------------------------------------------------------- PTB


def test_ptb_reader_makes_contiguous_windows_with_a_frequency_ordered_vocabulary(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ptb.train.txt"
    path.write_text(PTB_TEXT, encoding="utf-8")
    corpus = PTBCorpus(path, seq_len=5, seed=0)
    words = corpus.vocabulary.words
    # Counts the 4, <eos> 3, cat/on/sat 2 (ties alphabetical), then the words seen once.
    assert words[:6] == ("the", "<eos>", "cat", "on", "sat", "a")
    assert len(words) == 10
    assert len(corpus.tokens) == 3 * (6 + 3 + 6 + 3)
    stream = [corpus.vocabulary.words[i] for i in corpus.tokens[:8].tolist()]
    assert stream == ["the", "cat", "sat", "on", "the", "mat", "<eos>", "the"]
    assert corpus.num_samples == (len(corpus.tokens) - 1) // 5
    batch = corpus.batch(step=0, size=8, start=0, stop=8)
    order = corpus.indices(step=0, size=8, start=0, stop=8)
    for row, index in enumerate(order.tolist()):
        window = corpus.tokens[index * 5 : index * 5 + 6]
        assert torch.equal(batch.inputs[0][row], window[:-1])
        assert torch.equal(batch.targets[row], window[1:])
    assert_halves_concatenate(corpus, step=1)


@pytest.mark.parametrize("name", ["ptb.train.txt", "train.txt"])
def test_ptb_reader_accepts_a_directory(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_text(PTB_TEXT, encoding="utf-8")
    assert PTBCorpus(tmp_path, seq_len=5, seed=0).num_samples > 0


def test_ptb_missing_short_and_binary_files_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"no PTB training text at .*ptb\.train\.txt or train\.txt"):
        PTBCorpus(tmp_path, seq_len=5, seed=0)
    short = tmp_path / "short.txt"
    short.write_text("a b\n", encoding="utf-8")
    with pytest.raises(UserError, match="holds 3 tokens, fewer than one sequence of 6"):
        PTBCorpus(short, seq_len=5, seed=0)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(UserError, match="is not UTF-8 text"):
        PTBCorpus(binary, seq_len=5, seed=0)


def test_lstm_lm_trains_on_ptb_text_with_its_vocabulary(tmp_path: Path) -> None:
    (tmp_path / "ptb.train.txt").write_text(PTB_TEXT * 4, encoding="utf-8")
    full = build(lstm_lm.SPEC, tmp_path)
    assert full.model.decoder.out_features == 10  # 9 words + <eos>
    run_forward(full).backward()
    sampled = build(lstm_lm.SPEC, tmp_path, sampled_softmax="4", vocab="50")
    assert sampled.model.softmax_weight.num_embeddings == 50
    run_forward(sampled).backward()
    with pytest.raises(UserError, match="vocab=5 is smaller than the 10 words"):
        build(lstm_lm.SPEC, tmp_path, vocab="5")


# ---------------------------------------------------------------- parallel text


def test_parallel_text_reader_pads_truncates_and_shares_a_vocabulary(tmp_path: Path) -> None:
    write_parallel(tmp_path, ["a b c", "b", "a a a a a a a a a"], ["x y", "y z", "z"])
    pairs = ParallelText(tmp_path, seq_len=5, seed=0)
    vocabulary = pairs.vocabulary
    assert vocabulary.words[:4] == SPECIAL_TOKENS
    assert vocabulary.words[4] == "a"
    assert len(vocabulary) == 4 + 6
    a, b, c, x, y = (vocabulary.ids[w] for w in "abcxy")
    assert pairs.source[0].tolist() == [a, b, c, EOS_ID, PAD_ID]
    assert pairs.source[2].tolist() == [a, a, a, a, EOS_ID]  # cut to seq_len - 1 words
    assert pairs.target_in[0].tolist() == [BOS_ID, x, y, PAD_ID, PAD_ID]
    assert pairs.target_out[0].tolist() == [x, y, EOS_ID, PAD_ID, PAD_ID]
    batch = pairs.batch(step=0, size=3, start=0, stop=3)
    order = pairs.indices(step=0, size=3, start=0, stop=3)
    assert torch.equal(batch.inputs[0], pairs.source[order])
    assert torch.equal(batch.targets, pairs.target_out[order])


def test_parallel_text_unknown_words_map_to_unk(tmp_path: Path) -> None:
    write_parallel(tmp_path, ["<unk> q"], ["r"])
    pairs = ParallelText(tmp_path, seq_len=4, seed=0)
    assert int(pairs.source[0, 0]) == 1
    assert pairs.vocabulary.encode(["never-seen"]) == [1]


def test_parallel_text_problems_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(
        UserError, match=r"no parallel-text directory at .*train\.src and train\.tgt"
    ):
        ParallelText(tmp_path / "absent", seq_len=5, seed=0)
    (tmp_path / "train.src").write_text("a\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"no target text \(train.tgt\) at"):
        ParallelText(tmp_path, seq_len=5, seed=0)
    write_parallel(tmp_path, ["a", "b"], ["c"])
    with pytest.raises(UserError, match=r"train\.src has 2 lines but train\.tgt has 1"):
        ParallelText(tmp_path, seq_len=5, seed=0)


def test_transformer_takes_its_vocabulary_from_parallel_text(tmp_path: Path) -> None:
    sources = ["a b c d", "b c", "d a b"] * 4
    targets = ["w x y", "x y z", "z w"] * 4
    write_parallel(tmp_path, sources, targets)
    workload = build(transformer.SPEC, tmp_path)
    assert workload.model.embedding.num_embeddings == 4 + 8
    run_forward(workload).backward()
    assert_halves_concatenate(workload.dataset)
