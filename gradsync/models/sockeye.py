"""Sockeye's RNN translation model: the attentional LSTM encoder-decoder of Hieber, Domhan,
Denkowski, Vilar, Sokolov, Clifton & Post (2017), "Sockeye: A Toolkit for Neural Machine
Translation" (arXiv:1712.05690), after Bahdanau, Cho & Bengio (2015), "Neural Machine
Translation by Jointly Learning to Align and Translate" (ICLR) and Luong, Pham & Manning
(2015), "Effective Approaches to Attention-based Neural Machine Translation" (EMNLP).
This is the Sockeye model of the P3 artifact (IWSLT'15 English-Vietnamese).

* Source and target embeddings (``--model-option sparse=true`` gives them sparse
  gradients, the embedding rows a batch touched; with ``tied=true`` the target embedding
  stays dense, since the output layer reads all of it).
* Encoder: one bidirectional LSTM layer, each direction half the hidden size (Sockeye's
  default encoder), run over the real tokens only (packed), so padding changes nothing.
* Decoder: an LSTM whose initial state is tanh(W x the encoder state of the last source
  token) (Sockeye's ``last`` initialization), fed the previous target word's embedding and
  the previous attentional hidden state (input feeding). Its state queries an MLP
  (Bahdanau) attention over the encoder states, v . tanh(W_s s_t + W_h h_j), padding
  masked; the attentional hidden state is tanh(W_c [s_t; context]).
* Output: a softmax layer over the vocabulary, untied by default (Sockeye's default);
  ``tied=true`` ties it to the target embedding (Sockeye's ``trg_softmax`` weight tying;
  the attentional hidden state then has the embedding size).

Inputs are ``(source, target_in)`` token ids, targets ``target_out``, with id 0 padding
(the data of ``transformer``: synthetic pairs or ``--data`` with ``train.src``/``train.tgt``,
one vocabulary for both sides). The loss averages each sentence's cross-entropy over its
target tokens, then averages sentences. Initialization: Xavier uniform for matrices, zero
biases (Sockeye's default ``xavier`` initializer). Sockeye leaves dropout off by default;
gradsync applies 0.1 to the embeddings and to the attentional hidden state (``verify``
turns it off).

Presets: ``paper`` is Sockeye 1.x's RNN default (embeddings 512, LSTM 1024 with 512 per
encoder direction, attention 1024, batch 64 sentences) with a vocabulary of 17,700 (about
the English side of IWSLT'15 en-vi) and 64-token sentences; ``default`` is embeddings 256,
LSTM 512, vocabulary 8000, 32-token sentences, batch 32; ``tiny`` is embeddings 8, LSTM
16, vocabulary 24, 8-token sentences, batch 8.

Example:
    >>> from gradsync.models.base import BuildRequest
    >>> workload = build(BuildRequest(preset="tiny"))
    >>> batch = workload.dataset.batch(step=0, size=8, start=0, stop=8)
    >>> logits = workload.model(*batch.inputs)
    >>> tuple(logits.shape)
    (8, 8, 24)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from gradsync.data.text import PAD_ID
from gradsync.models.base import BuildRequest, ModelSpec, Workload, check_preset, parse_options
from gradsync.models.transformer import SmoothedSentenceLoss, translation_data

NAME = "sockeye"


@dataclass(frozen=True, kw_only=True)
class SockeyeConfig:
    """Sizes (the encoder's two directions share ``hidden_size``), dropout, sentence, batch."""

    vocab_size: int = 17_700
    embed_dim: int = 512
    hidden_size: int = 1024
    attention_dim: int = 1024
    dropout: float = 0.1
    seq_len: int = 64
    global_batch: int = 64


PAPER = SockeyeConfig()
PRESETS: dict[str, SockeyeConfig] = {
    "paper": PAPER,
    "default": dataclasses.replace(
        PAPER,
        vocab_size=8000,
        embed_dim=256,
        hidden_size=512,
        attention_dim=512,
        seq_len=32,
        global_batch=32,
    ),
    "tiny": dataclasses.replace(
        PAPER,
        vocab_size=24,
        embed_dim=8,
        hidden_size=16,
        attention_dim=16,
        seq_len=8,
        global_batch=8,
    ),
}


@dataclass
class SockeyeOptions:
    """``--model-option`` keys of sockeye: ``sparse`` embeddings, ``tied`` output layer."""

    sparse: bool = False
    tied: bool = False


class MLPAttention(nn.Module):
    """Bahdanau's additive attention: scores v . tanh(W_s query + W_h key), padding masked.

    Example:
        >>> attention = MLPAttention(query_dim=4, key_dim=6, attention_dim=5)
        >>> keys = attention.project_keys(torch.zeros(2, 3, 6))
        >>> context = attention(torch.zeros(2, 4), keys, torch.zeros(2, 3, 6),
        ...                     torch.tensor([[False, False, True]] * 2))
        >>> tuple(context.shape)
        (2, 6)
    """

    def __init__(self, *, query_dim: int, key_dim: int, attention_dim: int) -> None:
        super().__init__()
        self.key_projection = nn.Linear(key_dim, attention_dim, bias=False)
        self.query_projection = nn.Linear(query_dim, attention_dim)
        self.score = nn.Linear(attention_dim, 1, bias=False)

    def project_keys(self, encoded: Tensor) -> Tensor:
        """W_h h_j for every source position, computed once per sentence."""
        return self.key_projection(encoded)

    def forward(self, query: Tensor, keys: Tensor, values: Tensor, padding: Tensor) -> Tensor:
        hidden = torch.tanh(keys + self.query_projection(query)[:, None, :])
        scores = self.score(hidden).squeeze(-1).masked_fill(padding, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        return (weights[:, :, None] * values).sum(dim=1)


class OutputLayer(nn.Module):
    """Logits over the vocabulary: its own weight (``input_dim``) or, tied, the embedding's.

    Example:
        >>> tied = OutputLayer(10, None)
        >>> tuple(tied(torch.zeros(2, 4), torch.zeros(10, 4)).shape), tied.weight
        ((2, 10), None)
    """

    def __init__(self, vocab_size: int, input_dim: int | None) -> None:
        super().__init__()
        self.weight = (
            None if input_dim is None else nn.Parameter(torch.empty(vocab_size, input_dim))
        )
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, hidden: Tensor, embedding_weight: Tensor) -> Tensor:
        weight = embedding_weight if self.weight is None else self.weight
        return hidden @ weight.T + self.bias


class SockeyeRNN(nn.Module):
    """Bidirectional-LSTM encoder, attentional LSTM decoder; logits ``[batch, length, vocab]``.

    Example:
        >>> model = SockeyeRNN(PRESETS["tiny"])
        >>> source = torch.tensor([[5, 6, 3, 0]])
        >>> target_in = torch.tensor([[2, 7, 8, 0]])
        >>> tuple(model(source, target_in).shape)
        (1, 4, 24)
    """

    def __init__(self, config: SockeyeConfig, *, sparse: bool = False, tied: bool = False) -> None:
        super().__init__()
        if config.hidden_size % 2:
            raise ValueError(f"hidden_size must be even (got {config.hidden_size})")
        hidden, embed = config.hidden_size, config.embed_dim
        output_dim = embed if tied else hidden
        self.source_embedding = nn.Embedding(config.vocab_size, embed, sparse=sparse)
        self.target_embedding = nn.Embedding(config.vocab_size, embed, sparse=sparse and not tied)
        self.dropout = nn.Dropout(config.dropout)
        self.encoder = nn.LSTM(embed, hidden // 2, batch_first=True, bidirectional=True)
        self.init_state = nn.Linear(hidden, 2 * hidden)
        self.decoder = nn.LSTMCell(embed + output_dim, hidden)
        self.attention = MLPAttention(
            query_dim=hidden, key_dim=hidden, attention_dim=config.attention_dim
        )
        self.attentional_hidden = nn.Linear(2 * hidden, output_dim)
        self.output = OutputLayer(config.vocab_size, None if tied else hidden)
        self.output_dim = output_dim
        for name, parameter in self.named_parameters():
            if parameter.dim() >= 2:
                nn.init.xavier_uniform_(parameter)
            elif "bias" in name:
                nn.init.zeros_(parameter)

    def encode(self, source: Tensor) -> tuple[Tensor, Tensor]:
        """Encoder states ``[batch, source_len, hidden]`` and each sentence's last real one."""
        lengths = (source != PAD_ID).sum(dim=1).clamp(min=1)
        packed = pack_padded_sequence(
            self.dropout(self.source_embedding(source)),
            lengths.cpu(),
            batch_first=True,
            enforce_sorted=False,
        )
        encoded, _ = pad_packed_sequence(
            self.encoder(packed)[0], batch_first=True, total_length=source.shape[1]
        )
        last = encoded[torch.arange(len(source)), lengths - 1]
        return encoded, last

    def forward(self, source: Tensor, target_in: Tensor) -> Tensor:
        encoded, last = self.encode(source)
        padding = source == PAD_ID
        keys = self.attention.project_keys(encoded)
        state, cell = torch.tanh(self.init_state(last)).chunk(2, dim=-1)
        attentional = encoded.new_zeros(len(source), self.output_dim)
        embedded = self.dropout(self.target_embedding(target_in))
        outputs = []
        for position in range(target_in.shape[1]):
            step_input = torch.cat([embedded[:, position], attentional], dim=-1)
            state, cell = self.decoder(step_input, (state, cell))
            context = self.attention(state, keys, encoded, padding)
            attentional = torch.tanh(self.attentional_hidden(torch.cat([state, context], dim=-1)))
            outputs.append(attentional)
        hidden = self.dropout(torch.stack(outputs, dim=1))
        return self.output(hidden, self.target_embedding.weight)


def build(request: BuildRequest) -> Workload:
    """Sockeye's RNN model of ``request.preset`` on synthetic pairs or ``request.data``.

    With real data (``train.src``/``train.tgt``) the vocabulary comes from the files.

    Example:
        >>> build(BuildRequest(preset="tiny", options={"tied": "true"})).model.output.weight
    """
    check_preset(request.preset, NAME)
    options: SockeyeOptions = parse_options(SockeyeOptions, request.options, NAME)
    config = PRESETS[request.preset]
    if not request.dropout:
        config = dataclasses.replace(config, dropout=0.0)
    dataset, vocab_size, data_description = translation_data(
        request, vocab_size=config.vocab_size, seq_len=config.seq_len
    )
    config = dataclasses.replace(config, vocab_size=vocab_size)
    model = SockeyeRNN(config, sparse=options.sparse, tied=options.tied)
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    return Workload(
        model=model,
        dataset=dataset,
        loss=SmoothedSentenceLoss(label_smoothing=0.0),
        global_batch=config.global_batch,
        description=(
            f"{NAME} ({request.preset}): embeddings {config.embed_dim}, LSTM "
            f"{config.hidden_size} (bidirectional encoder), MLP attention "
            f"{config.attention_dim}, vocabulary {config.vocab_size}, "
            f"{'tied' if options.tied else 'untied'} output, "
            f"{'sparse' if options.sparse else 'dense'} embedding gradients, "
            f"{config.seq_len}-token sentences, {num_parameters:,} parameters, {data_description}"
        ),
    )


SPEC = ModelSpec(
    name=NAME,
    summary="Sockeye RNN (Hieber et al. 2017): biLSTM encoder, MLP attention; sparse, tied",
    build=build,
    presets=PRESETS,
    options=SockeyeOptions,
)
