"""The training loop: batch → forward → backward → strategy.step → metrics.

It knows nothing of any particular strategy; the strategy owns communication and the
optimizer update.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from gradsync.data.base import shard_bounds
from gradsync.errors import UserError
from gradsync.heartbeat import beat
from gradsync.metrics import StepRecord
from gradsync.models.base import Workload
from gradsync.strategies.base import Context, Strategy, lost_edit
from gradsync.trace import COMPUTE, Phase


def train(
    workload: Workload,
    strategy: Strategy,
    context: Context,
    *,
    global_batch: int,
    on_step: Callable[[StepRecord], None],
    restore: Callable[[Strategy], int] | None = None,
) -> None:
    """Run ``context.config.steps`` steps of ``workload`` under ``strategy`` on this worker.

    ``restore`` (``--resume``) loads a checkpoint into the set-up strategy and returns the
    steps already done; training goes on from there. A loss that is not finite stops the
    job at that step (:class:`LossNotFinite`).

    Example:
        >>> # train(workload, SingleProcess(), context, global_batch=32, on_step=print)
    """
    config = context.config
    timeline = context.timeline
    beat("setup")
    module = strategy.setup(workload.model, context)
    frozen = FrozenParameters(workload.model)
    first_step = restore(strategy) if restore is not None else 0
    edits = InPlaceEditGuard(workload.model, strategy.overwritten_by_servers(), strategy.name)
    timeline.instrument_forward(workload.model)
    module.train()
    # Worker k of N takes the k-th contiguous shard of every step's global batch.
    start, stop = shard_bounds(global_batch, context.num_workers, context.worker_index)
    before = strategy.stats()
    cpu_mark = time.process_time()  # a step's CPU runs from the previous record to its own
    for step in range(first_step, config.steps):
        beat("forward", step)
        timeline.start_step(step)
        started = time.perf_counter()
        batch = workload.dataset.batch(step=step, size=global_batch, start=start, stop=stop)
        batch = batch.to(context.device, torch.get_default_dtype())
        with timeline.span(COMPUTE, Phase.FORWARD):
            output = module(*batch.inputs, **batch.shared)
            loss = workload.loss(output, batch.targets)
        check_loss(loss, step, context.rank)
        edits.check(step, context.rank)
        beat("backward", step)
        with timeline.span(COMPUTE, Phase.BACKWARD):
            loss.backward()
        frozen.check(step, context.rank)
        beat("sync", step)
        # Sync point: communication completes and the parameters are updated here.
        strategy.step()
        edits.mark()  # the servers' values, just installed
        elapsed = time.perf_counter() - started
        timeline.record_step(step, started, elapsed)

        after = strategy.stats()
        cpu_now = time.process_time()
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
                lr=strategy.lr_of(step),
                cpu_s=cpu_now - cpu_mark,
            )
        )
        before, cpu_mark = after, cpu_now


class FrozenParameters:
    """The parameters frozen (``requires_grad=False``) when training starts, which must stay
    so: every strategy synchronizes the parameters trainable at set-up, so one unfrozen
    later (in ``forward``, say) would be updated with this worker's gradient alone and the
    workers' copies would drift apart without a word.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> model.bias.requires_grad_(False)  # doctest: +ELLIPSIS
        Parameter containing:...
        >>> frozen = FrozenParameters(model)
        >>> model.bias.requires_grad_(True)  # doctest: +ELLIPSIS
        Parameter containing:...
        >>> frozen.check(step=3, rank=0)
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: parameter 'bias' was frozen when training started ...
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.frozen = [
            (name, param, param.grad is not None)
            for name, param in model.named_parameters()
            if not param.requires_grad
        ]

    def check(self, step: int, rank: int) -> None:
        """UserError when a parameter frozen at the start has become trainable."""
        for name, param, had_grad in self.frozen:
            if param.requires_grad or (param.grad is not None and not had_grad):
                raise UserError(
                    f"parameter '{name}' was frozen when training started and is trainable "
                    f"at step {step} on rank {rank}: every strategy synchronizes the "
                    "parameters trainable at the start, so its copies would differ between "
                    "workers; set requires_grad before training, not during it"
                )


class InPlaceEditGuard:
    """A guard over the parameters whose values the strategy's servers hold, which the
    model must not change in place: the next step's values from the servers would undo the
    change without a word. The launcher's check sees one trial forward; this one sees every
    step's forward and loss, so a change that depends on the data or the step is caught
    where it happens.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> guard = InPlaceEditGuard(model, {"weight"}, "ps")
        >>> with torch.no_grad():
        ...     model.weight.clamp_(-0.1, 0.1)  # doctest: +ELLIPSIS
        Parameter containing:...
        >>> guard.check(step=3, rank=0)
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: the model changes parameter weight in place during forward ...
    """

    def __init__(self, model: torch.nn.Module, names: set[str], strategy: str) -> None:
        self.params = [(n, p) for n, p in model.named_parameters() if n in names]
        self.strategy = strategy
        self.mark()

    def mark(self) -> None:
        """The versions to compare with: the values as the strategy has just set them."""
        self.versions = [param._version for _, param in self.params]

    def check(self, step: int, rank: int) -> None:
        """UserError when forward or the loss changed one of them in place since :meth:`mark`."""
        for (name, param), version in zip(self.params, self.versions, strict=True):
            if param._version != version:
                where = f" at step {step} on rank {rank}"
                raise UserError(lost_edit(name, self.strategy, where))


class LossNotFinite(Exception):
    """The loss became NaN or infinite: the run stops at that step (exit 1)."""


def check_loss(loss: torch.Tensor, step: int, rank: int) -> None:
    """Raise :class:`LossNotFinite` naming the step when ``loss`` is NaN or infinite.

    Example:
        >>> check_loss(torch.tensor(float("nan")), 7, 0)
        Traceback (most recent call last):
        ...
        gradsync.trainer.LossNotFinite: loss is nan at step 7 on rank 0; ...
    """
    value = float(loss.detach().item())
    if not math.isfinite(value):
        raise LossNotFinite(
            f"loss is {value} at step {step} on rank {rank}; the run stops here (lower --lr, "
            "check the data, or use --dtype float64)"
        )
