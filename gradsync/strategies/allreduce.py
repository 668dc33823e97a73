"""``allreduce``: Horovod-style ring allreduce (Sergeev & Del Balso 2018).

Gradient-ready hooks feed fusion buffers; each full buffer is allreduced asynchronously
while backward continues; ``step`` waits, averages and updates. With fp16 compression the
buffers travel as float16 (Horovod's ``Compression.fp16``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from gradsync.comm.fusion import FusedAllreduce
from gradsync.config import TrainConfig
from gradsync.options import StrategyOptions, option
from gradsync.strategies.base import Context, Strategy, broadcast_parameters


@dataclass(frozen=True, kw_only=True)
class AllreduceOptions(StrategyOptions):
    """Horovod's fusion buffer and gradient compression."""

    fusion_threshold_mb: float = option(
        64.0, help="fusion buffer size in MB; 0 disables fusion", metavar="MB", at_least=0
    )
    fp16_compression: bool = option(False, help="allreduce gradients as float16")


class HorovodAllreduce(Strategy):
    """Fusion buckets + asynchronous allreduce overlapping backward."""

    name = "allreduce"
    summary = "Horovod: gradient hooks, fusion buffers, async ring allreduce"
    Options = AllreduceOptions

    def setup(self, model: nn.Module, context: Context) -> nn.Module:
        self.context, self.model = context, model
        broadcast_parameters(model, context.worker_group)
        options = context.config.strategy_options
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.fused = FusedAllreduce(
            [p for _, p in named],
            names=[name for name, _ in named],
            timeline=context.timeline,
            threshold_bytes=int(options.fusion_threshold_mb * 2**20),
            group=context.worker_group,
            world_size=context.num_workers,
            stats=self.counters,
            fp16=options.fp16_compression,
        )
        self.fused.attach()
        self.updater = context.make_updater(model.parameters())
        return model

    def step(self) -> None:
        assert self.updater is not None
        self.fused.finish()
        self.updater.update()

    def expected_difference(self, config: TrainConfig) -> str | None:
        if config.strategy_options.fp16_compression:
            return "fp16 compression rounds every gradient to half precision"
        return None
