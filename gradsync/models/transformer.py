"""The Transformer encoder-decoder for translation: Vaswani, Shazeer, Parmar, Uszkoreit,
Jones, Gomez, Kaiser & Polosukhin (2017), "Attention Is All You Need" (NeurIPS).

As in the paper: sinusoidal positional encodings added to embeddings scaled by
sqrt(d_model) (section 3.5), one embedding matrix shared by source, target and the
pre-softmax projection (section 3.4), post-layer-norm residual sub-layers
``LayerNorm(x + Dropout(Sublayer(x)))`` (section 3.1), dropout on embeddings and sub-layer
outputs, and label smoothing 0.1 (section 5.4). The layers are PyTorch's
``nn.TransformerEncoderLayer``/``nn.TransformerDecoderLayer`` (ReLU, post-norm), which also
apply the dropout rate to the attention weights and the feed-forward hidden layer.

Inputs are ``(source, target_in)`` token ids, targets ``target_out``; id 0 is padding:
masked as attention keys and left out of the loss. The loss averages each sentence's
smoothed cross-entropy over its target tokens, then averages sentences.

Presets: ``paper`` is the base model (d_model 512, 6+6 layers, feed-forward 2048, 8 heads,
dropout 0.1, vocabulary 37000) on 64-token sentences, batch 384 (~25k target tokens, as
the paper's batches); ``default`` is d_model 256, 2+2 layers, feed-forward 1024,
4 heads, vocabulary 8000, 32-token sentences, batch 32; ``tiny`` is d_model 16, 1+1 layers.

Example:
    >>> from gradsync.models.base import BuildRequest
    >>> workload = build(BuildRequest(preset="tiny"))
    >>> batch = workload.dataset.batch(step=0, size=8, start=0, stop=8)
    >>> logits = workload.model(*batch.inputs)
    >>> tuple(logits.shape)
    (8, 8, 24)
    >>> bool(workload.loss(logits, batch.targets).isfinite())
    True
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradsync.data.base import Dataset
from gradsync.data.synthetic import SyntheticTranslation
from gradsync.data.text import PAD_ID, ParallelText
from gradsync.models.base import BuildRequest, ModelSpec, Workload, check_preset, parse_options

NAME = "transformer"


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Model sizes, regularization, sentence length and default global batch."""

    vocab_size: int = 37000
    model_dim: int = 512
    num_heads: int = 8
    feedforward_dim: int = 2048
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    dropout: float = 0.1
    label_smoothing: float = 0.1
    seq_len: int = 64
    global_batch: int = 384


PAPER = TransformerConfig()
PRESETS: dict[str, TransformerConfig] = {
    "paper": PAPER,
    "default": dataclasses.replace(
        PAPER,
        vocab_size=8000,
        model_dim=256,
        num_heads=4,
        feedforward_dim=1024,
        num_encoder_layers=2,
        num_decoder_layers=2,
        seq_len=32,
        global_batch=32,
    ),
    "tiny": dataclasses.replace(
        PAPER,
        vocab_size=24,
        model_dim=16,
        num_heads=2,
        feedforward_dim=32,
        num_encoder_layers=1,
        num_decoder_layers=1,
        seq_len=8,
        global_batch=8,
    ),
}


def sinusoidal_positions(length: int, dim: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...), shape ``[length, dim]``.

    Example:
        >>> sinusoidal_positions(3, 4)[0].tolist()
        [0.0, 1.0, 0.0, 1.0]
    """
    positions = torch.arange(length, dtype=torch.get_default_dtype())[:, None]
    frequencies = torch.exp(
        torch.arange(0, dim, 2, dtype=torch.get_default_dtype()) * (-math.log(10000.0) / dim)
    )
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(positions * frequencies)
    table[:, 1::2] = torch.cos(positions * frequencies)
    return table


class Transformer(nn.Module):
    """Encoder-decoder Transformer with tied embeddings; logits ``[batch, target_len, vocab]``.

    Example:
        >>> model = Transformer(PRESETS["tiny"])
        >>> source = torch.tensor([[5, 6, 3, 0]])
        >>> target_in = torch.tensor([[2, 7, 8, 0]])
        >>> tuple(model(source, target_in).shape)
        (1, 4, 24)
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.model_dim = config.model_dim
        self.embedding = nn.Embedding(config.vocab_size, config.model_dim)
        # Unit-variance inputs after the sqrt(d_model) scaling of section 3.4.
        nn.init.normal_(self.embedding.weight, std=config.model_dim**-0.5)
        self.register_buffer(
            "positions", sinusoidal_positions(config.seq_len, config.model_dim), persistent=False
        )
        self.embedding_dropout = nn.Dropout(config.dropout)
        encoder_layer = nn.TransformerEncoderLayer(
            config.model_dim,
            config.num_heads,
            config.feedforward_dim,
            config.dropout,
            batch_first=True,
            norm_first=False,
        )
        decoder_layer = nn.TransformerDecoderLayer(
            config.model_dim,
            config.num_heads,
            config.feedforward_dim,
            config.dropout,
            batch_first=True,
            norm_first=False,
        )
        self.encoder = nn.TransformerEncoder(
            encoder_layer, config.num_encoder_layers, enable_nested_tensor=False
        )
        self.decoder = nn.TransformerDecoder(decoder_layer, config.num_decoder_layers)

    def embed(self, tokens: Tensor) -> Tensor:
        length = tokens.shape[1]
        if length > self.positions.shape[0]:
            raise ValueError(
                f"sentences of {length} tokens exceed the {self.positions.shape[0]} positions"
            )
        scaled = self.embedding(tokens) * math.sqrt(self.model_dim)
        return self.embedding_dropout(scaled + self.positions[:length])

    def forward(self, source: Tensor, target_in: Tensor) -> Tensor:
        source_padding = source == PAD_ID
        target_padding = target_in == PAD_ID
        length = target_in.shape[1]
        future = torch.ones(length, length, dtype=torch.bool, device=target_in.device).triu(1)
        memory = self.encoder(self.embed(source), src_key_padding_mask=source_padding)
        hidden = self.decoder(
            self.embed(target_in),
            memory,
            tgt_mask=future,
            tgt_key_padding_mask=target_padding,
            memory_key_padding_mask=source_padding,
        )
        return hidden @ self.embedding.weight.T


@dataclass(frozen=True)
class SmoothedSentenceLoss:
    """Label-smoothed cross-entropy, averaged over each sentence's non-pad tokens, then sentences.

    Averaging per sentence first makes the loss a mean over samples, so the mean of the
    gradients of equal shards is the gradient of the whole batch.

    Example:
        >>> loss = SmoothedSentenceLoss(label_smoothing=0.0)
        >>> logits = torch.zeros(1, 2, 5)
        >>> round(float(loss(logits, torch.tensor([[3, PAD_ID]]))), 4) == round(math.log(5), 4)
        True
    """

    label_smoothing: float

    def __call__(self, logits: Tensor, target_out: Tensor) -> Tensor:
        token_losses = F.cross_entropy(
            logits.flatten(0, 1),
            target_out.flatten(),
            ignore_index=PAD_ID,
            label_smoothing=self.label_smoothing,
            reduction="none",
        ).view(target_out.shape)
        num_tokens = (target_out != PAD_ID).sum(dim=1).clamp(min=1)
        return (token_losses.sum(dim=1) / num_tokens).mean()


def translation_data(
    request: BuildRequest, *, vocab_size: int, seq_len: int
) -> tuple[Dataset, int, str]:
    """Sentence pairs for a translation model: (dataset, vocabulary size, description).

    Synthetic pairs over ``vocab_size`` tokens, or ``request.data``'s train.src/train.tgt,
    whose vocabulary then replaces ``vocab_size``.

    Example:
        >>> translation_data(BuildRequest(), vocab_size=20, seq_len=6)[1:]
        (20, 'synthetic pairs (reversed source, permuted tokens)')
    """
    if request.data is None:
        synthetic = SyntheticTranslation(seed=request.seed, vocab_size=vocab_size, seq_len=seq_len)
        return synthetic, vocab_size, "synthetic pairs (reversed source, permuted tokens)"
    parallel_text = ParallelText(request.data, seq_len=seq_len, seed=request.seed)
    return parallel_text, len(parallel_text.vocabulary), f"parallel text at {request.data}"


def build(request: BuildRequest) -> Workload:
    """The Transformer of ``request.preset`` on synthetic pairs or ``request.data``/train.src+tgt.

    With real data the vocabulary (and so the model's vocabulary size) comes from the files.

    Example:
        >>> build(BuildRequest(preset="tiny")).global_batch
        8
    """
    check_preset(request.preset, NAME)
    parse_options(None, request.options, NAME)
    config = PRESETS[request.preset]
    if not request.dropout:
        config = dataclasses.replace(config, dropout=0.0)
    dataset, vocab_size, data_description = translation_data(
        request, vocab_size=config.vocab_size, seq_len=config.seq_len
    )
    config = dataclasses.replace(config, vocab_size=vocab_size)
    model = Transformer(config)
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    return Workload(
        model=model,
        dataset=dataset,
        loss=SmoothedSentenceLoss(label_smoothing=config.label_smoothing),
        global_batch=config.global_batch,
        description=(
            f"{NAME} ({request.preset}): d_model {config.model_dim}, "
            f"{config.num_encoder_layers}+{config.num_decoder_layers} layers, "
            f"vocabulary {config.vocab_size}, {config.seq_len}-token sentences, "
            f"{num_parameters:,} parameters, {data_description}"
        ),
    )


SPEC = ModelSpec(
    name=NAME,
    summary="Transformer base (Vaswani et al. 2017) for translation, label smoothing 0.1",
    build=build,
    presets=PRESETS,
)
