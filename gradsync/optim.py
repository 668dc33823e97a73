"""Optimizers (SGD with momentum, Adam) and the learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from gradsync.config import OptimConfig
from gradsync.trace import COMPUTE, NullTimeline, Phase, Timeline


def effective_lr(config: OptimConfig, global_batch: int, base_batch: int) -> float:
    """The peak learning rate after the batch-size scaling rule.

    ``linear`` (Goyal et al. 2017, "Accurate, Large Minibatch SGD"): lr × B/B₀;
    ``sqrt`` (Krizhevsky 2014): lr × √(B/B₀).

    Example:
        >>> effective_lr(OptimConfig(lr=0.1, lr_scaling="linear"), 512, 256)
        0.2
    """
    ratio = global_batch / (config.lr_base_batch or base_batch)
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[config.lr_scaling]
    return config.base_lr() * factor


class Updater:
    """An optimizer plus its warm-up schedule: ``update()`` steps, schedules and zeroes grads.

    Example:
        >>> model = nn.Linear(2, 1)
        >>> updater = Updater(model.parameters(), OptimConfig(name="sgd", lr=0.1), lr=0.1)
        >>> model(torch.ones(1, 2)).sum().backward(); updater.update()
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        config: OptimConfig,
        *,
        lr: float,
        timeline: Timeline | None = None,
    ) -> None:
        params = list(params)
        self.timeline = timeline or NullTimeline()
        if config.name == "sgd":
            self.optimizer: torch.optim.Optimizer = torch.optim.SGD(
                params, lr=lr, momentum=config.momentum, weight_decay=config.weight_decay
            )
        else:
            self.optimizer = torch.optim.Adam(params, lr=lr, weight_decay=config.weight_decay)
        warmup = config.lr_warmup_steps
        # Gradual warm-up (Goyal et al. 2017, §2.2): ramp linearly over the first steps.
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )

    def update(self) -> None:
        with self.timeline.span(COMPUTE, Phase.OPTIMIZER_STEP):
            self.optimizer.step()
            self.schedule.step()
            self.optimizer.zero_grad(set_to_none=True)

    def update_at(self, step: int) -> None:
        """Update with the learning rate the schedule gives ``step``, then zero the grads.

        Parameter servers use it: asynchronous pushes arrive out of step order.
        """
        self._set_lr_of(step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def resume_at(self, steps_done: int) -> None:
        """Move the schedule to where it was after ``steps_done`` updates (``--resume``).

        Example:
            >>> model = nn.Linear(2, 1)
            >>> config = OptimConfig(lr=0.1, lr_warmup_steps=4)
            >>> updater = Updater(model.parameters(), config, lr=0.1)
            >>> updater.resume_at(2); round(updater.lr, 6)
            0.075
        """
        self.schedule.last_epoch = steps_done
        self._set_lr_of(steps_done)
        self.schedule._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def _set_lr_of(self, step: int) -> None:
        """Give every parameter group the rate the schedule gives ``step``."""
        for group, base, factor in zip(
            self.optimizer.param_groups,
            self.schedule.base_lrs,
            self.schedule.lr_lambdas,
            strict=True,
        ):
            group["lr"] = base * factor(step)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])
