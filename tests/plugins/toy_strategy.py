"""A strategy from outside gradsync: one file and one ``register`` line, nothing else edited.

``toy`` averages each gradient with a plain ``all_reduce`` after backward, in chunks of at
most ``chunk_values`` values: no fusion, no overlap, but correct, so ``verify`` holds it to
``single``. Tests load it with ``GRADSYNC_STRATEGIES=tests.plugins.toy_strategy``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from gradsync.options import StrategyOptions, option
from gradsync.strategies import register
from gradsync.strategies.base import Context, Strategy, broadcast_parameters


@dataclass(frozen=True, kw_only=True)
class ToyOptions(StrategyOptions):
    """How the toy strategy cuts its messages."""

    chunk_values: int = option(1000, help="values per all_reduce call", metavar="N", at_least=1)


@register
class ToyAllreduce(Strategy):
    """Averages every gradient, chunk by chunk, once backward is done."""

    name = "toy"
    summary = "a test plugin: chunked all_reduce after backward"
    Options = ToyOptions

    def setup(self, model: nn.Module, context: Context) -> nn.Module:
        self.context, self.model = context, model
        broadcast_parameters(model, context.worker_group)
        self.updater = context.make_updater(model.parameters())
        return model

    def step(self) -> None:
        assert self.model is not None and self.updater is not None and self.context is not None
        chunk = self.context.config.strategy_options.chunk_values
        for param in self.model.parameters():
            if param.grad is None:
                continue
            flat = param.grad.view(-1)
            for start in range(0, flat.numel(), chunk):
                piece = flat[start : start + chunk]
                dist.all_reduce(piece, group=self.context.worker_group)
                piece /= self.context.num_workers
                self.counters.bytes_sent += piece.numel() * piece.element_size()
        self.updater.update()
