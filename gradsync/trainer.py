"""The training loop: batch → forward → backward → strategy.step → metrics.

It knows nothing of any particular strategy; the strategy owns communication and the
optimizer update.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from gradsync.data.base import shard_bounds
from gradsync.metrics import StepRecord
from gradsync.models.base import Workload
from gradsync.strategies.base import Context, Strategy
from gradsync.trace import COMPUTE, Phase


def train(
    workload: Workload,
    strategy: Strategy,
    context: Context,
    *,
    global_batch: int,
    on_step: Callable[[StepRecord], None],
) -> None:
    """Run ``context.config.steps`` steps of ``workload`` under ``strategy`` on this worker.

    Example:
        >>> # train(workload, SingleProcess(), context, global_batch=32, on_step=print)
    """
    config = context.config
    timeline = context.timeline
    module = strategy.setup(workload.model, context)
    timeline.instrument_forward(workload.model)
    module.train()
    # Worker k of N takes the k-th contiguous shard of every step's global batch.
    start, stop = shard_bounds(global_batch, context.num_workers, context.worker_index)
    before = strategy.stats()
    for step in range(config.steps):
        timeline.start_step(step)
        started = time.perf_counter()
        batch = workload.dataset.batch(step=step, size=global_batch, start=start, stop=stop)
        batch = batch.to(context.device, torch.get_default_dtype())
        with timeline.span(COMPUTE, Phase.FORWARD):
            output = module(*batch.inputs, **batch.shared)
            loss = workload.loss(output, batch.targets)
        with timeline.span(COMPUTE, Phase.BACKWARD):
            loss.backward()
        # Sync point: communication completes and the parameters are updated here.
        strategy.step()
        elapsed = time.perf_counter() - started
        timeline.record_step(step, started, elapsed)

        after = strategy.stats()
        on_step(
            StepRecord(
                step=step,
                rank=context.rank,
                loss=float(loss.item()),
                step_time_s=elapsed,
                samples_per_s=global_batch / elapsed,
                bytes_sent=after.bytes_sent - before.bytes_sent,
                bytes_recv=after.bytes_recv - before.bytes_recv,
                exposed_comm_s=after.exposed_comm_s - before.exposed_comm_s,
                lr=strategy.current_lr(),
            )
        )
        before = after
