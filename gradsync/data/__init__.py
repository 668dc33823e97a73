"""Data: one global batch per (seed, step), handed out in contiguous shards.

``base`` holds the contract (:class:`Batch`, :class:`Dataset`, seeding, sharding),
``synthetic`` the learnable synthetic datasets every model uses by default, and ``mnist``,
``cifar`` and ``text`` the readers for real files passed with ``--data``.

Example:
    >>> from gradsync.data import MarkovTokens
    >>> data = MarkovTokens(seed=0, vocab_size=50, seq_len=4)
    >>> len(data.batch(step=0, size=8, start=2, stop=6))
    4
"""

from gradsync.data.base import Batch, Dataset, IndexedSamples, shard_bounds
from gradsync.data.cifar import CIFAR10Images
from gradsync.data.mnist import MNISTImages
from gradsync.data.synthetic import MarkovTokens, SyntheticImages, SyntheticTranslation
from gradsync.data.text import ParallelText, PTBCorpus, Vocabulary

__all__ = [
    "Batch",
    "CIFAR10Images",
    "Dataset",
    "IndexedSamples",
    "MNISTImages",
    "MarkovTokens",
    "PTBCorpus",
    "ParallelText",
    "SyntheticImages",
    "SyntheticTranslation",
    "Vocabulary",
    "shard_bounds",
]
