"""Text read from files: the Penn Treebank language-model corpus and aligned parallel text.

PTB (Marcus et al. 1993, in the preprocessed form of Mikolov et al. 2010, as used by
Zaremba et al. 2014): whitespace-separated words, one sentence per line, ``<eos>`` appended
to every line; the vocabulary is built from the training file, most frequent word first
(id order matters to the log-uniform sampler of sampled softmax).

Parallel text (as for the Transformer): ``train.src`` and ``train.tgt``, one sentence per
line, aligned line by line, whitespace-tokenized; one vocabulary shared by both sides,
starting with the reserved ``<pad>`` = 0, ``<unk>``, ``<bos>``, ``<eos>``.

Example:
    >>> vocabulary = Vocabulary.from_sentences([["b", "a", "b"]], specials=SPECIAL_TOKENS)
    >>> vocabulary.words
    ('<pad>', '<unk>', '<bos>', '<eos>', 'b', 'a')
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from gradsync.data.base import Batch, IndexedSamples
from gradsync.errors import UserError

# Reserved ids of every gradsync token vocabulary with specials (synthetic and from files).
PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3
SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>")
NUM_SPECIAL_TOKENS = len(SPECIAL_TOKENS)

PTB_END_OF_SENTENCE = "<eos>"
PTB_FILE_NAMES = ("ptb.train.txt", "train.txt")
PARALLEL_FILE_NAMES = ("train.src", "train.tgt")


class Vocabulary:
    """Words ↔ ids: ``specials`` first, then words by decreasing count (ties alphabetical).

    Example:
        >>> vocabulary = Vocabulary.from_sentences([["x", "y", "y"]])
        >>> vocabulary.encode(["y", "x"]), len(vocabulary)
        ([0, 1], 2)
    """

    def __init__(self, words: Sequence[str], unknown_id: int | None = None) -> None:
        self.words = tuple(words)
        self.ids = {word: index for index, word in enumerate(self.words)}
        self.unknown_id = unknown_id

    @classmethod
    def from_sentences(
        cls, sentences: Iterable[Sequence[str]], specials: Sequence[str] = ()
    ) -> Vocabulary:
        counts = Counter(word for sentence in sentences for word in sentence)
        for special in specials:
            counts.pop(special, None)
        ranked = sorted(counts, key=lambda word: (-counts[word], word))
        unknown_id = list(specials).index("<unk>") if "<unk>" in specials else None
        return cls([*specials, *ranked], unknown_id=unknown_id)

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, words: Sequence[str]) -> list[int]:
        """Ids of ``words``; unknown words become ``<unk>`` (a KeyError without one)."""
        if self.unknown_id is None:
            return [self.ids[word] for word in words]
        return [self.ids.get(word, self.unknown_id) for word in words]


def read_lines(path: Path, what: str) -> list[list[str]]:
    """Whitespace-split lines of a UTF-8 text file, with UserErrors for missing/unreadable files."""
    if not path.is_file():
        raise UserError(f"no {what} at {path}; pass --data pointing at the {what}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise UserError(
            f"{what} {path} is not UTF-8 text ({error.reason} at byte {error.start}); "
            "pass a plain-text, whitespace-tokenized file"
        ) from None
    except OSError as error:
        raise UserError(f"cannot read {what} {path}: {error.strerror}; check the file") from None
    return [line.split() for line in text.splitlines()]


def find_ptb_file(path: str | Path) -> Path:
    """``path`` itself if it is a file, else ``ptb.train.txt`` or ``train.txt`` inside it.

    Example:
        >>> find_ptb_file("/nowhere")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: no PTB training text at /nowhere; pass --data a ptb.train.txt-...
    """
    location = Path(path)
    if location.is_file():
        return location
    if location.is_dir():
        for name in PTB_FILE_NAMES:
            if (location / name).is_file():
                return location / name
    raise UserError(
        f"no PTB training text at {location}; pass --data a ptb.train.txt-style file "
        f"or a directory holding {' or '.join(PTB_FILE_NAMES)}"
    )


class PTBCorpus(IndexedSamples):
    """Contiguous windows of ``seq_len + 1`` tokens of a PTB-format training file.

    Window ``j`` starts at token ``j * seq_len`` (windows overlap by one token, so every
    token is a target once). ``inputs = (window[:, :-1],)``, ``targets = window[:, 1:]``.

    Example:
        >>> corpus = PTBCorpus("data/ptb", seq_len=35, seed=0)  # doctest: +SKIP
        >>> corpus.batch(step=0, size=20, start=0, stop=10).inputs[0].shape  # doctest: +SKIP
        torch.Size([10, 35])
    """

    def __init__(self, path: str | Path, *, seq_len: int, seed: int) -> None:
        file = find_ptb_file(path)
        sentences = [[*words, PTB_END_OF_SENTENCE] for words in read_lines(file, "PTB text")]
        self.vocabulary = Vocabulary.from_sentences(sentences)
        self.tokens = torch.tensor(
            [index for sentence in sentences for index in self.vocabulary.encode(sentence)],
            dtype=torch.long,
        )
        self.seq_len = seq_len
        num_windows = (len(self.tokens) - 1) // seq_len
        if num_windows < 1:
            raise UserError(
                f"PTB text {file} holds {len(self.tokens)} tokens, fewer than one sequence of "
                f"{seq_len + 1}; pass a longer file or use a preset with shorter sequences"
            )
        super().__init__(num_windows, seed)

    def gather(self, indices: Tensor) -> Batch:
        offsets = indices[:, None] * self.seq_len + torch.arange(self.seq_len + 1)
        windows = self.tokens[offsets]
        return Batch(inputs=(windows[:, :-1],), targets=windows[:, 1:])


class ParallelText(IndexedSamples):
    """Aligned sentence pairs from ``train.src`` / ``train.tgt`` in ``directory``.

    Sentences are cut to ``seq_len - 1`` words and padded with ``<pad>`` = 0 to ``seq_len``:
    source = words + ``<eos>``, target input = ``<bos>`` + words, target output = words +
    ``<eos>``. ``inputs = (source, target_in)``, ``targets = target_out``.

    Example:
        >>> pairs = ParallelText("data/wmt", seq_len=64, seed=0)  # doctest: +SKIP
        >>> batch = pairs.batch(step=0, size=8, start=0, stop=8)  # doctest: +SKIP
    """

    def __init__(self, directory: str | Path, *, seq_len: int, seed: int) -> None:
        location = Path(directory)
        if not location.is_dir():
            raise UserError(
                f"no parallel-text directory at {location}; pass --data a directory holding "
                f"{' and '.join(PARALLEL_FILE_NAMES)}"
            )
        source_lines = read_lines(location / PARALLEL_FILE_NAMES[0], "source text (train.src)")
        target_lines = read_lines(location / PARALLEL_FILE_NAMES[1], "target text (train.tgt)")
        if len(source_lines) != len(target_lines):
            raise UserError(
                f"{location}/train.src has {len(source_lines)} lines but train.tgt has "
                f"{len(target_lines)}; the files must be aligned line by line"
            )
        self.vocabulary = Vocabulary.from_sentences(
            [*source_lines, *target_lines], specials=SPECIAL_TOKENS
        )
        self.seq_len = seq_len
        max_words = seq_len - 1
        source_words = [self.vocabulary.encode(words[:max_words]) for words in source_lines]
        target_words = [self.vocabulary.encode(words[:max_words]) for words in target_lines]
        self.source = _pad_rows([[*ids, EOS_ID] for ids in source_words], seq_len)
        self.target_in = _pad_rows([[BOS_ID, *ids] for ids in target_words], seq_len)
        self.target_out = _pad_rows([[*ids, EOS_ID] for ids in target_words], seq_len)
        super().__init__(len(source_lines), seed)

    def gather(self, indices: Tensor) -> Batch:
        return Batch(
            inputs=(self.source[indices], self.target_in[indices]),
            targets=self.target_out[indices],
        )


def _pad_rows(rows: Sequence[Sequence[int]], width: int) -> Tensor:
    padded = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    for index, row in enumerate(rows):
        padded[index, : len(row)] = torch.tensor(row, dtype=torch.long)
    return padded
