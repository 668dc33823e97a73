"""``single``: one process trains on the whole global batch. The reference."""

from __future__ import annotations

from torch import nn

from gradsync.strategies.base import Context, Strategy


class SingleProcess(Strategy):
    """Plain local training; every other strategy is checked against it."""

    name = "single"
    summary = "one process, the whole global batch: the reference"

    def setup(self, model: nn.Module, context: Context) -> nn.Module:
        self.context, self.model = context, model
        self.updater = context.make_updater(model.parameters())
        return model

    def step(self) -> None:
        assert self.updater is not None
        self.updater.update()
