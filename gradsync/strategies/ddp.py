"""``ddp``: PyTorch DistributedDataParallel, untouched: the native baseline."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradsync.comm.counters import ring_allreduce_bytes
from gradsync.strategies.base import Context, Strategy


class NativeDDP(Strategy):
    """DDP with its default buckets (25 MB) and comm hook; nothing replaced.

    Bytes are counted with the ring model from the gradient size, since DDP's reducer is
    not instrumented (registering a hook would no longer be "untouched").
    """

    name = "ddp"
    summary = "torch DistributedDataParallel, untouched (native baseline)"

    def setup(self, model: nn.Module, context: Context) -> nn.Module:
        self.context, self.model = context, model
        device_ids = [context.device.index] if context.device.type == "cuda" else None
        wrapped = DistributedDataParallel(
            model, device_ids=device_ids, process_group=context.worker_group
        )
        self.updater = context.make_updater(model.parameters())
        self._grad_bytes = sum(
            p.numel() * p.element_size() for p in model.parameters() if p.requires_grad
        )
        return wrapped

    def step(self) -> None:
        assert self.updater is not None and self.context is not None
        # DDP has already averaged the gradients during backward.
        moved = ring_allreduce_bytes(self._grad_bytes, self.context.num_workers)
        self.counters.bytes_sent += moved
        self.counters.bytes_recv += moved
        self.updater.update()
