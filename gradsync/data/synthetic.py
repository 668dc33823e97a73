"""Synthetic, learnable data that is fixed by (seed, step, sample index).

Every dataset here draws sample ``i`` of step ``s`` from its own generator seeded by
``(seed, s, i)`` (:func:`gradsync.data.base.per_sample`), so a shard ``[a, b)`` of a global
batch is exactly the slice ``[a:b]`` of the whole batch, however many workers ask. The
structure the models learn (class prototypes, a Markov chain, a token mapping) is seeded
from the run's seed alone, so it is the same for every step and every worker.

Example:
    >>> data = SyntheticImages(seed=0, num_classes=10, image_shape=(1, 28, 28))
    >>> whole = data.batch(step=3, size=8, start=0, stop=8)
    >>> half = data.batch(step=3, size=8, start=4, stop=8)
    >>> bool((whole.inputs[0][4:] == half.inputs[0]).all())
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from gradsync.data.base import Batch, generator, mix_seed, per_sample
from gradsync.data.text import BOS_ID, EOS_ID, NUM_SPECIAL_TOKENS, PAD_ID

# Stream tags: one per kind of randomness, so no two streams of one seed coincide.
_PROTOTYPE_STREAM = 1
_LABEL_STREAM = 2
_NOISE_STREAM = 3
_CHAIN_STREAM = 4
_TOKEN_STREAM = 5
_MAPPING_STREAM = 6
_LENGTH_STREAM = 7

# Prototypes are drawn on a coarse grid and upsampled, so that even 224x224 images with
# 1000 classes need only a few hundred kilobytes of prototypes.
_PROTOTYPE_GRID = 8


def check_slice(*, size: int, start: int, stop: int) -> None:
    """Reject a sample range that is not inside a global batch of ``size`` samples.

    Example:
        >>> check_slice(size=8, start=4, stop=8)
    """
    if not 0 <= start <= stop <= size:
        raise ValueError(f"samples [{start}, {stop}) are not inside a global batch of {size}")


class SyntheticImages:
    """Classification images: the prototype of a uniformly drawn class plus Gaussian noise.

    Prototypes are N(0, 1) on an 8x8 grid (fewer cells for smaller images) upsampled to the
    image size; noise is N(0, ``noise``²) per pixel; images are scaled to unit variance.

    Example:
        >>> data = SyntheticImages(seed=1, num_classes=10, image_shape=(3, 32, 32))
        >>> batch = data.batch(step=0, size=4, start=0, stop=4)
        >>> tuple(batch.inputs[0].shape), tuple(batch.targets.shape)
        ((4, 3, 32, 32), (4,))
    """

    def __init__(
        self, *, seed: int, num_classes: int, image_shape: tuple[int, int, int], noise: float = 1.0
    ) -> None:
        channels, height, width = image_shape
        grid = (min(_PROTOTYPE_GRID, height), min(_PROTOTYPE_GRID, width))
        coarse = torch.randn(
            (num_classes, channels, *grid), generator=generator(seed, _PROTOTYPE_STREAM)
        )
        self.seed = seed
        self.num_classes = num_classes
        self.image_shape = image_shape
        self.noise = noise
        self._coarse_prototypes = coarse
        self._scale = 1.0 / (1.0 + noise * noise) ** 0.5

    def batch(self, *, step: int, size: int, start: int, stop: int) -> Batch:
        check_slice(size=size, start=start, stop=stop)
        labels = per_sample(
            mix_seed(self.seed, _LABEL_STREAM),
            step,
            start,
            stop,
            lambda g: torch.randint(self.num_classes, (), generator=g),
        )
        noise = per_sample(
            mix_seed(self.seed, _NOISE_STREAM),
            step,
            start,
            stop,
            lambda g: torch.randn(self.image_shape, generator=g),
        )
        prototypes = F.interpolate(
            self._coarse_prototypes[labels], size=self.image_shape[1:], mode="nearest"
        )
        images = (prototypes + self.noise * noise) * self._scale
        return Batch(inputs=(images,), targets=labels)


class MarkovTokens:
    """Language-model text from a fixed random Markov chain over ``vocab_size`` tokens.

    Each sequence starts at a uniform token; the next token is ``successor[token]`` with
    probability ``follow_probability`` and a uniform token otherwise. ``successor`` is a
    permutation seeded by ``seed``. A batch holds ``inputs = (tokens[:, :-1],)`` and
    ``targets = tokens[:, 1:]`` of sequences of ``seq_len + 1`` tokens.

    Example:
        >>> data = MarkovTokens(seed=0, vocab_size=100, seq_len=5)
        >>> batch = data.batch(step=0, size=4, start=0, stop=4)
        >>> tokens, next_tokens = batch.inputs[0], batch.targets
        >>> tuple(tokens.shape), bool((tokens[:, 1:] == next_tokens[:, :-1]).all())
        ((4, 5), True)
    """

    def __init__(
        self, *, seed: int, vocab_size: int, seq_len: int, follow_probability: float = 0.9
    ) -> None:
        self.seed = seed
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.follow_probability = follow_probability
        self.successor = torch.randperm(vocab_size, generator=generator(seed, _CHAIN_STREAM))

    def sequences(self, *, step: int, start: int, stop: int) -> Tensor:
        """Samples ``[start, stop)`` of step ``step``: int64 ``[stop - start, seq_len + 1]``."""
        length = self.seq_len + 1

        def draw(g: torch.Generator) -> Tensor:
            uniform_tokens = torch.randint(self.vocab_size, (length,), generator=g)
            follows = torch.rand(length, generator=g) < self.follow_probability
            return torch.stack([uniform_tokens, follows.long()])

        draws = per_sample(mix_seed(self.seed, _TOKEN_STREAM), step, start, stop, draw)
        uniform_tokens, follows = draws[:, 0], draws[:, 1].bool()
        # The chain is sequential in time but vectorized over the samples of the shard.
        columns = [uniform_tokens[:, 0]]
        for position in range(1, length):
            followed = self.successor[columns[-1]]
            columns.append(torch.where(follows[:, position], followed, uniform_tokens[:, position]))
        return torch.stack(columns, dim=1)

    def batch(self, *, step: int, size: int, start: int, stop: int) -> Batch:
        check_slice(size=size, start=start, stop=stop)
        tokens = self.sequences(step=step, start=start, stop=stop)
        return Batch(inputs=(tokens[:, :-1],), targets=tokens[:, 1:])


class SyntheticTranslation:
    """Sentence pairs where the target is the reversed source under a fixed token permutation.

    Sources hold between ``(seq_len - 1) // 2`` and ``seq_len - 1`` content tokens (ids
    ``4..vocab_size-1``) then ``<eos>``, padded with ``<pad>`` = 0 to ``seq_len``. The
    decoder input is ``<bos>`` + target words, the decoder output target words + ``<eos>``.
    ``inputs = (source, target_in)``, ``targets = target_out``, all int64 ``[n, seq_len]``.

    Example:
        >>> data = SyntheticTranslation(seed=0, vocab_size=20, seq_len=6)
        >>> batch = data.batch(step=0, size=4, start=0, stop=4)
        >>> source, target_in = batch.inputs
        >>> bool((target_in[:, 0] == BOS_ID).all()), tuple(batch.targets.shape)
        (True, (4, 6))
    """

    def __init__(self, *, seed: int, vocab_size: int, seq_len: int) -> None:
        if vocab_size <= NUM_SPECIAL_TOKENS or seq_len < 2:
            raise ValueError(
                f"synthetic translation needs vocab_size > {NUM_SPECIAL_TOKENS} and seq_len >= 2 "
                f"(got vocab_size={vocab_size}, seq_len={seq_len})"
            )
        self.seed = seed
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        num_words = vocab_size - NUM_SPECIAL_TOKENS
        word_permutation = torch.randperm(num_words, generator=generator(seed, _MAPPING_STREAM))
        specials = torch.arange(NUM_SPECIAL_TOKENS)
        self.translation = torch.cat([specials, word_permutation + NUM_SPECIAL_TOKENS])

    def batch(self, *, step: int, size: int, start: int, stop: int) -> Batch:
        check_slice(size=size, start=start, stop=stop)
        max_words = self.seq_len - 1
        min_words = max(1, max_words // 2)
        words = per_sample(
            mix_seed(self.seed, _TOKEN_STREAM),
            step,
            start,
            stop,
            lambda g: torch.randint(NUM_SPECIAL_TOKENS, self.vocab_size, (max_words,), generator=g),
        )
        lengths = per_sample(
            mix_seed(self.seed, _LENGTH_STREAM),
            step,
            start,
            stop,
            lambda g: torch.randint(min_words, max_words + 1, (), generator=g),
        )
        positions = torch.arange(max_words)
        is_word = positions[None, :] < lengths[:, None]
        source_words = torch.where(is_word, words, PAD_ID)
        reversed_index = (lengths[:, None] - 1 - positions[None, :]).clamp(min=0)
        target_words = torch.where(
            is_word, self.translation[words.gather(1, reversed_index)], PAD_ID
        )
        return Batch(
            inputs=(_append(source_words, lengths, EOS_ID), _prepend_bos(target_words)),
            targets=_append(target_words, lengths, EOS_ID),
        )


def _append(words: Tensor, lengths: Tensor, token: int) -> Tensor:
    """``words`` (padded), one column wider, with ``token`` right after each row's last word."""
    padded = F.pad(words, (0, 1), value=PAD_ID)
    return padded.scatter(1, lengths[:, None], token)


def _prepend_bos(words: Tensor) -> Tensor:
    bos = torch.full((words.shape[0], 1), BOS_ID, dtype=words.dtype)
    return torch.cat([bos, words], dim=1)
