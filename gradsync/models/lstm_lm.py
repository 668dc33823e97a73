"""Word-level LSTM language model: Zaremba, Sutskever & Vinyals (2014), "Recurrent Neural
Network Regularization" (arXiv:1409.2329), with optional sampled softmax after Jean, Cho,
Memisevic & Bengio (2015), "On Using Very Large Target Vocabulary for Neural Machine
Translation" (ACL), as used by the LM1B model of Jozefowicz et al. (2016).

Embedding -> dropout -> stacked LSTM (dropout on the non-recurrent connections between
layers) -> dropout -> softmax over the vocabulary; every parameter is initialized uniformly
in [-init_scale, init_scale]. Each step's sequences start from a zero hidden state: batches
of different steps are independent samples, so no state is carried between steps.

Two output modes:

* full softmax (``sampled_softmax=0``): ``inputs = (tokens,)``, the model returns logits
  ``[batch, time, vocab]``;
* sampled softmax (``sampled_softmax=k``): ``inputs = (tokens, targets)`` and
  ``Batch.shared = {"sampled": ids, "sampled_tries": tries}``: ``k`` distinct candidate ids
  drawn per step, for the whole global batch, by a log-uniform (Zipfian) sampler like
  TensorFlow's ``log_uniform_candidate_sampler`` (``unique=True``, which took ``tries``
  draws). The model returns logits ``[batch * time, 1 + k]`` with **the true class in
  column 0** and the candidates after it, each corrected by minus the log of its expected
  count (logQ correction); a candidate equal to the true class of a row ("accidental hit")
  gets a very negative logit. The softmax weight and bias are ``nn.Embedding(sparse=True)``
  modules, so their gradients are sparse. The loss is then cross-entropy against column 0.

Presets: ``paper`` is the "large" model (2 layers of 1500, 35 steps, vocabulary 10000,
batch 20, dropout 0.65, init 0.04); ``default`` is the paper's "small" model (2 layers
of 200, 20 steps, batch 20, init 0.1; the paper trains it without dropout); ``tiny`` is
2 layers of 16 over 32 words, 8 steps, batch 8, dropout 0.3, init 0.5.

Options (``--model-option``): ``sparse`` (sparse gradient for the input embedding),
``sampled_softmax`` (number of candidates, 0 = full softmax), ``vocab`` (vocabulary size
override, e.g. >= 50000 for benchmarks; with ``--data`` it may only enlarge the file's).

Example:
    >>> from gradsync.models.base import BuildRequest
    >>> workload = build(BuildRequest(preset="tiny", options={"sampled_softmax": "5"}))
    >>> batch = workload.dataset.batch(step=0, size=8, start=0, stop=8)
    >>> tuple(workload.model(*batch.inputs, **batch.shared).shape)
    (64, 6)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradsync.data.base import Batch, Dataset, generator, mix_seed
from gradsync.data.synthetic import MarkovTokens
from gradsync.data.text import PTBCorpus
from gradsync.errors import UserError
from gradsync.models.base import BuildRequest, ModelSpec, Workload, check_preset, parse_options

NAME = "lstm-lm"
_CANDIDATE_STREAM = 11


@dataclass(frozen=True, kw_only=True)
class LSTMConfig:
    """Sizes (embedding size = hidden size, as in the paper), regularization, default batch."""

    vocab_size: int = 10000
    hidden_size: int = 1500
    num_layers: int = 2
    seq_len: int = 35
    dropout: float = 0.65
    init_scale: float = 0.04
    global_batch: int = 20


PAPER = LSTMConfig()
PRESETS: dict[str, LSTMConfig] = {
    "paper": PAPER,
    "default": dataclasses.replace(PAPER, hidden_size=200, seq_len=20, dropout=0.0, init_scale=0.1),
    "tiny": dataclasses.replace(
        PAPER, vocab_size=32, hidden_size=16, seq_len=8, dropout=0.3, init_scale=0.5, global_batch=8
    ),
}


@dataclass
class LSTMOptions:
    """``--model-option`` keys of lstm-lm (see the module docstring)."""

    sparse: bool = False
    sampled_softmax: int = 0
    vocab: int = 0


class LogUniformSampler:
    """Distinct candidate ids from P(id) = log((id + 2) / (id + 1)) / log(vocab_size + 1).

    Ids are assumed sorted by decreasing frequency (Zipf's law). Sampling without
    replacement repeats draws until ``num_sampled`` distinct ids appeared; the expected
    count of ``id`` among the ``tries`` draws is ``1 - (1 - P(id))**tries``, as in
    TensorFlow's ``log_uniform_candidate_sampler`` with ``unique=True``.

    Example:
        >>> sampler = LogUniformSampler(1000)
        >>> ids, tries = sampler.sample(10, torch.Generator().manual_seed(0))
        >>> len(set(ids.tolist())), tries >= 10
        (10, True)
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._log_range = math.log(vocab_size + 1)

    def probability(self, ids: Tensor) -> Tensor:
        return torch.log1p(1.0 / (ids.double() + 1.0)) / self._log_range

    def log_expected_count(self, ids: Tensor, tries: Tensor) -> Tensor:
        """log(1 - (1 - P(id))**tries), in float64 for small probabilities, in the default dtype."""
        expected = -torch.expm1(tries.double() * torch.log1p(-self.probability(ids)))
        return expected.log().to(torch.get_default_dtype())

    def _draw(self, count: int, rng: torch.Generator) -> Tensor:
        uniform = torch.rand(count, generator=rng, dtype=torch.float64)
        ids = torch.exp(uniform * self._log_range).long() - 1
        return ids.clamp_(0, self.vocab_size - 1)

    def sample(self, num_sampled: int, rng: torch.Generator) -> tuple[Tensor, int]:
        """``num_sampled`` distinct ids in order of first appearance, and the draws it took."""
        if not 0 < num_sampled < self.vocab_size:
            raise ValueError(f"cannot sample {num_sampled} distinct ids of {self.vocab_size}")
        draws = self._draw(2 * num_sampled, rng)
        while True:
            distinct, inverse = torch.unique(draws, return_inverse=True)
            if len(distinct) >= num_sampled:
                break
            draws = torch.cat([draws, self._draw(2 * num_sampled, rng)])
        first_seen = torch.full((len(distinct),), len(draws), dtype=torch.long)
        first_seen.scatter_reduce_(0, inverse, torch.arange(len(draws)), reduce="amin")
        positions = first_seen.sort().values[:num_sampled]
        return draws[positions], int(positions[-1]) + 1


class WithSampledCandidates:
    """Adds the step's sampled-softmax candidates to every shard of a language-model dataset.

    The candidates come from a generator seeded by (seed, step) only, so every shard of a
    step gets the same ids. Inputs become ``(tokens, targets)``.

    Example:
        >>> data = WithSampledCandidates(
        ...     MarkovTokens(seed=0, vocab_size=50, seq_len=4), vocab_size=50, num_sampled=8, seed=0
        ... )
        >>> first, second = (data.batch(step=1, size=4, start=a, stop=a + 2) for a in (0, 2))
        >>> bool((first.shared["sampled"] == second.shared["sampled"]).all())
        True
    """

    def __init__(self, tokens: Dataset, *, vocab_size: int, num_sampled: int, seed: int) -> None:
        self.tokens = tokens
        self.sampler = LogUniformSampler(vocab_size)
        self.num_sampled = num_sampled
        self.seed = seed

    def batch(self, *, step: int, size: int, start: int, stop: int) -> Batch:
        plain = self.tokens.batch(step=step, size=size, start=start, stop=stop)
        rng = generator(mix_seed(self.seed, _CANDIDATE_STREAM), step)
        sampled, tries = self.sampler.sample(self.num_sampled, rng)
        return Batch(
            inputs=(plain.inputs[0], plain.targets),
            targets=plain.targets,
            shared={"sampled": sampled, "sampled_tries": torch.tensor(tries)},
        )


class LSTMLanguageModel(nn.Module):
    """Zaremba et al.'s LSTM LM with a full or a sampled softmax (see the module docstring).

    Example:
        >>> model = LSTMLanguageModel(PRESETS["tiny"])
        >>> tuple(model(torch.zeros(2, 8, dtype=torch.long)).shape)
        (2, 8, 32)
    """

    def __init__(
        self, config: LSTMConfig, *, sparse_embedding: bool = False, num_sampled: int = 0
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.embedding = nn.Embedding(config.vocab_size, hidden, sparse=sparse_embedding)
        self.input_dropout = nn.Dropout(config.dropout)
        self.lstm = nn.LSTM(
            hidden,
            hidden,
            config.num_layers,
            batch_first=True,
            dropout=config.dropout if config.num_layers > 1 else 0.0,
        )
        self.output_dropout = nn.Dropout(config.dropout)
        self.num_sampled = num_sampled
        if num_sampled:
            self.sampler = LogUniformSampler(config.vocab_size)
            self.softmax_weight = nn.Embedding(config.vocab_size, hidden, sparse=True)
            self.softmax_bias = nn.Embedding(config.vocab_size, 1, sparse=True)
        else:
            self.decoder = nn.Linear(hidden, config.vocab_size)
        for parameter in self.parameters():
            nn.init.uniform_(parameter, -config.init_scale, config.init_scale)

    def forward(
        self,
        tokens: Tensor,
        targets: Tensor | None = None,
        *,
        sampled: Tensor | None = None,
        sampled_tries: Tensor | None = None,
    ) -> Tensor:
        # hx omitted: every sequence starts from a zero hidden state.
        hidden, _ = self.lstm(self.input_dropout(self.embedding(tokens)))
        hidden = self.output_dropout(hidden)
        if not self.num_sampled:
            return self.decoder(hidden)
        if targets is None or sampled is None or sampled_tries is None:
            raise ValueError("sampled softmax needs targets, sampled and sampled_tries")
        return self.sampled_logits(
            hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1), sampled, sampled_tries
        )

    def sampled_logits(
        self, hidden: Tensor, targets: Tensor, sampled: Tensor, tries: Tensor
    ) -> Tensor:
        """``[N, 1 + k]`` logQ-corrected logits: true class first, then the k candidates."""
        ids = torch.cat([targets, sampled])
        weights = self.softmax_weight(ids)
        biases = self.softmax_bias(ids).squeeze(-1)
        log_expected = self.sampler.log_expected_count(ids, tries)
        num_rows = len(targets)
        true_logits = (hidden * weights[:num_rows]).sum(-1) + biases[:num_rows]
        true_logits = true_logits - log_expected[:num_rows]
        candidate_logits = hidden @ weights[num_rows:].T + (biases - log_expected)[num_rows:]
        accidental_hits = targets[:, None] == sampled[None, :]
        candidate_logits = candidate_logits.masked_fill(
            accidental_hits, torch.finfo(candidate_logits.dtype).min
        )
        return torch.cat([true_logits[:, None], candidate_logits], dim=1)


def full_softmax_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy averaged over each sequence's tokens, then over sequences.

    Example:
        >>> targets = torch.zeros(1, 2, dtype=torch.long)
        >>> round(float(full_softmax_loss(torch.zeros(1, 2, 4), targets)), 4)  # log 4
        1.3863
    """
    token_losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(
        targets.shape
    )
    return token_losses.mean(dim=1).mean()


def sampled_softmax_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy of the true class (column 0 of ``[B*T, 1+k]`` logits), per sequence then mean.

    Example:
        >>> targets = torch.zeros(1, 2, dtype=torch.long)
        >>> round(float(sampled_softmax_loss(torch.zeros(2, 4), targets)), 4)  # log 4
        1.3863
    """
    true_class = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    token_losses = F.cross_entropy(logits, true_class, reduction="none").view(targets.shape)
    return token_losses.mean(dim=1).mean()


def build(request: BuildRequest) -> Workload:
    """The LSTM LM of ``request.preset`` on a synthetic Markov chain or PTB text (``request.data``).

    Example:
        >>> build(BuildRequest(preset="tiny", options={"sparse": "true"})).global_batch
        8
    """
    check_preset(request.preset, NAME)
    options: LSTMOptions = parse_options(LSTMOptions, request.options, NAME)
    config = PRESETS[request.preset]
    if not request.dropout:
        config = dataclasses.replace(config, dropout=0.0)
    if options.vocab < 0 or options.sampled_softmax < 0:
        raise UserError(
            f"--model-option vocab={options.vocab} sampled_softmax={options.sampled_softmax}: "
            "both must be >= 0"
        )
    tokens: Dataset
    if request.data is None:
        config = dataclasses.replace(config, vocab_size=options.vocab or config.vocab_size)
        tokens = MarkovTokens(
            seed=request.seed, vocab_size=config.vocab_size, seq_len=config.seq_len
        )
        data_description = "synthetic Markov-chain text"
    else:
        corpus = PTBCorpus(request.data, seq_len=config.seq_len, seed=request.seed)
        data_vocab = len(corpus.vocabulary)
        if options.vocab and options.vocab < data_vocab:
            raise UserError(
                f"--model-option vocab={options.vocab} is smaller than the {data_vocab} words of "
                f"{request.data}; drop the option or pass vocab >= {data_vocab}"
            )
        config = dataclasses.replace(config, vocab_size=max(options.vocab, data_vocab))
        tokens = corpus
        data_description = f"PTB text at {request.data}"
    if options.sampled_softmax >= config.vocab_size:
        raise UserError(
            f"--model-option sampled_softmax={options.sampled_softmax} must be smaller than the "
            f"vocabulary ({config.vocab_size}); pass fewer candidates"
        )
    model = LSTMLanguageModel(
        config, sparse_embedding=options.sparse, num_sampled=options.sampled_softmax
    )
    dataset: Dataset = tokens
    loss = full_softmax_loss
    if options.sampled_softmax:
        dataset = WithSampledCandidates(
            tokens,
            vocab_size=config.vocab_size,
            num_sampled=options.sampled_softmax,
            seed=request.seed,
        )
        loss = sampled_softmax_loss
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    softmax = (
        f"sampled softmax ({options.sampled_softmax})"
        if options.sampled_softmax
        else "full softmax"
    )
    return Workload(
        model=model,
        dataset=dataset,
        loss=loss,
        global_batch=config.global_batch,
        description=(
            f"{NAME} ({request.preset}): {config.num_layers}x{config.hidden_size} LSTM, "
            f"{config.seq_len} steps, vocabulary {config.vocab_size}, {softmax}, "
            f"{'sparse' if options.sparse else 'dense'} embedding gradient, "
            f"{num_parameters:,} parameters, {data_description}"
        ),
    )


SPEC = ModelSpec(
    name=NAME,
    summary="Zaremba et al. 2014 LSTM LM; options sparse, sampled_softmax, vocab",
    build=build,
    presets=PRESETS,
    options=LSTMOptions,
)
