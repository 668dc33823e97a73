"""Optimizers (SGD with momentum, Adam) and the learning-rate schedule.

:class:`Updater` wraps a ``torch.optim`` optimizer and its warm-up schedule. Servers, which
update many small slices one at a time, use :meth:`Updater.update_params_at`: the same
arithmetic as ``optimizer.step()`` (torch's functional ``sgd``/``adam`` with the group's
own flags, so torch picks the same single-tensor or foreach implementation) and the same
per-parameter state, without ``step()``'s per-call bookkeeping.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.adam import adam
from torch.optim.sgd import sgd

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


def warmup_factor(step: int, warmup_steps: int) -> float:
    """The share of the peak learning rate that update ``step`` (0-based) uses: gradual
    warm-up (Goyal et al. 2017, §2.2) ramps it linearly over the first ``warmup_steps``.

    Example:
        >>> [warmup_factor(step, 4) for step in range(5)], warmup_factor(0, 0)
        ([0.25, 0.5, 0.75, 1.0, 1.0], 1.0)
    """
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0


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
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: warmup_factor(step, warmup)
        )
        self._direct_step = direct_step_of(self.optimizer)

    def wrap(self, wrapper: Callable[[torch.optim.Optimizer], torch.optim.Optimizer]) -> None:
        """Replace the optimizer with ``wrapper(optimizer)`` (Horovod's DistributedOptimizer)
        before the first update, the warm-up schedule moved onto it.

        Example:
            >>> model = nn.Linear(2, 1)
            >>> updater = Updater(model.parameters(), OptimConfig(lr=0.1), lr=0.1)
            >>> updater.wrap(lambda optimizer: torch.optim.SGD(optimizer.param_groups))
            >>> updater.schedule.optimizer is updater.optimizer
            True
        """
        lr_lambda = self.schedule.lr_lambdas[0]
        self.optimizer = wrapper(self.optimizer)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda)
        self._direct_step = direct_step_of(self.optimizer)

    def update(self) -> None:
        with self.timeline.span(COMPUTE, Phase.OPTIMIZER_STEP):
            dense_momentum_for_sparse_grads(self.optimizer)
            self.optimizer.step()
            self.schedule.step()
            # set_to_none, torch's default since 2.0; Horovod's DistributedOptimizer takes
            # no argument here
            self.optimizer.zero_grad()

    def update_at(self, step: int) -> None:
        """Update with the learning rate the schedule gives ``step``, then zero the grads.

        Parameter servers use it: asynchronous pushes arrive out of step order.
        """
        self._set_lr_of(step)
        dense_momentum_for_sparse_grads(self.optimizer)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def update_params_at(
        self, step: int, params: Sequence[nn.Parameter], grads: Sequence[Tensor]
    ) -> None:
        """Update ``params`` (some of this optimizer's) with ``grads`` and the learning rate
        the schedule gives ``step``; every other parameter is skipped, as ``step()`` skips
        one whose ``.grad`` is None (no momentum, no weight decay, no Adam step).

        Bit for bit :meth:`update_at` with ``params``' grads set to ``grads``, and faster:
        SGD and Adam call torch's functional form directly, with the group's flags and the
        optimizer's own state (see :func:`step_params`).

        Example:
            >>> slots = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1))]
            >>> updater = Updater(slots, OptimConfig(lr=0.5), lr=0.5)
            >>> updater.update_params_at(0, slots[:1], [torch.ones(2)]); slots[0].tolist()
            [-0.5, -0.5]
        """
        self._set_lr_of(step)
        if params:
            step_params(self.optimizer, params, grads, direct=self._direct_step)

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


def dense_momentum_for_sparse_grads(
    optimizer: torch.optim.Optimizer,
    params: Sequence[nn.Parameter] | None = None,
    grads: Sequence[Tensor] | None = None,
) -> None:
    """Give every SGD-with-momentum parameter whose gradient is sparse a dense momentum
    buffer before it is stepped (``params`` with ``grads``, or every parameter with its
    ``.grad``).

    ``torch.optim.SGD`` (2.13) starts the buffer as a copy of the first gradient: sparse and
    never coalesced. ``buf.mul_(m).add_(g)`` then appends each step's rows to it, so its
    size, the memory it holds and the cost of every step grow with the steps taken:
    lstm-lm (sparse, 50k words) spent 4 ms in the optimizer at step 0 and 119 ms at step 59,
    and a run's throughput depended on its length. A buffer of zeros gives the same first
    step (0·m + g = g) and the same arithmetic after it, but for the order in which a row's
    duplicate entries are summed; it costs one pass over the parameter every step, the
    same at step 5 and step 5000 (PyTorch's own fix, pytorch#3139, until the buffer became
    a copy of the gradient again).

    Example:
        >>> table = nn.Embedding(4, 2, sparse=True)
        >>> sgd_ = torch.optim.SGD(table.parameters(), lr=0.1, momentum=0.9)
        >>> table(torch.tensor([1, 1])).sum().backward()
        >>> dense_momentum_for_sparse_grads(sgd_); sgd_.step()
        >>> sgd_.state[table.weight]["momentum_buffer"][1].tolist()
        [2.0, 2.0]
    """
    if not isinstance(optimizer, torch.optim.SGD):
        return
    if params is None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params]
    assert grads is not None
    sparse = [p for p, g in zip(params, grads, strict=True) if g is not None and g.is_sparse]
    if not sparse:  # every dense step (a server's slice, say) stops here
        return
    groups = optimizer.param_groups
    momentum_of = {id(p): group["momentum"] for group in groups for p in group["params"]}
    for param in sparse:
        if not momentum_of.get(id(param)):
            continue
        state = optimizer.state[param]
        buffer = state.get("momentum_buffer")
        if buffer is None:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        elif buffer.is_sparse:
            state["momentum_buffer"] = buffer.to_dense()


# -- torch.optim's step without its per-call bookkeeping ---------------------------------------

DirectStep = Callable[[torch.optim.Optimizer, Sequence[nn.Parameter], Sequence[Tensor]], None]


def step_params(
    optimizer: torch.optim.Optimizer,
    params: Sequence[nn.Parameter],
    grads: Sequence[Tensor],
    *,
    direct: DirectStep | bool | None = True,
) -> None:
    """``optimizer.step()`` for ``params`` (some of its parameters) with ``grads``, every
    other parameter skipped as ``step()`` skips one whose ``.grad`` is None.

    For ``torch.optim.SGD`` and ``torch.optim.Adam`` with one parameter group this calls
    torch's functional ``sgd``/``adam`` itself, as their ``step()`` does: the group's flags
    (``foreach``/``fused`` None: torch picks the implementation, the same as ``step()``'s),
    the optimizer's state (``optimizer.state[param]``, created as ``step()`` creates it),
    the same bits — without ``step()``'s per-call cost (hooks, profiling, grad bookkeeping).
    Other optimizers, several groups and differentiable/capturable/fused groups go through
    ``step()`` itself (``params``' grads set, then set to None). ``direct``: True to choose
    per call, else the choice of :func:`direct_step_of` made beforehand.

    Example:
        >>> slot = nn.Parameter(torch.zeros(2))
        >>> sgd_ = torch.optim.SGD([slot], lr=0.5, momentum=0.9)
        >>> step_params(sgd_, [slot], [torch.ones(2)]); slot.tolist()
        [-0.5, -0.5]
    """
    run = direct_step_of(optimizer) if direct is True else direct
    dense_momentum_for_sparse_grads(optimizer, params, grads)
    if callable(run):
        with torch.no_grad():
            run(optimizer, params, grads)
        return
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad
    optimizer.step()
    for param in params:
        param.grad = None


def direct_step_of(optimizer: torch.optim.Optimizer) -> DirectStep | None:
    """The direct form of ``optimizer.step()`` used by :func:`step_params`, or None where
    only ``step()`` itself is known to be right.

    Example:
        >>> direct_step_of(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)) is None
        False
    """
    if len(optimizer.param_groups) != 1:
        return None
    group = optimizer.param_groups[0]
    if any(group.get(flag) for flag in ("differentiable", "capturable", "fused")):
        return None
    if type(optimizer) is torch.optim.SGD:
        return _sgd_step
    if type(optimizer) is torch.optim.Adam:
        return _adam_step
    return None


def _sgd_step(
    optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter], grads: Sequence[Tensor]
) -> None:
    """``torch.optim.SGD.step`` (torch 2.3–2.13) for ``params`` with ``grads``."""
    group, state = optimizer.param_groups[0], optimizer.state
    momentum = group["momentum"]
    buffers = [state[p].get("momentum_buffer") for p in params] if momentum != 0 else []
    sgd(
        list(params),
        list(grads),
        buffers,
        has_sparse_grad=any(g.is_sparse for g in grads),
        foreach=group["foreach"],
        fused=group["fused"],
        grad_scale=getattr(optimizer, "grad_scale", None),
        found_inf=getattr(optimizer, "found_inf", None),
        weight_decay=group["weight_decay"],
        momentum=momentum,
        lr=group["lr"],
        dampening=group["dampening"],
        nesterov=group["nesterov"],
        maximize=group["maximize"],
    )
    if momentum != 0:
        for param, buffer in zip(params, buffers, strict=True):
            state[param]["momentum_buffer"] = buffer


def _adam_state(param: Tensor, amsgrad: bool) -> dict[str, Any]:
    """A parameter's Adam state as ``torch.optim.Adam`` creates it on its first step."""
    # torch's _get_scalar_dtype(): the step counter follows the default float64, if set
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    state: dict[str, Any] = {
        "step": torch.tensor(0.0, dtype=scalar),
        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
    }
    if amsgrad:
        state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


def _adam_step(
    optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter], grads: Sequence[Tensor]
) -> None:
    """``torch.optim.Adam.step`` (torch 2.3–2.13) for ``params`` with ``grads``."""
    group, state = optimizer.param_groups[0], optimizer.state
    amsgrad = group["amsgrad"]
    states = []
    for param in params:
        if len(state[param]) == 0:
            state[param] = _adam_state(param, amsgrad)
        states.append(state[param])
    beta1, beta2 = group["betas"]
    newer: dict[str, Any] = {}  # flags of later torch versions
    if "decoupled_weight_decay" in group:
        newer["decoupled_weight_decay"] = group["decoupled_weight_decay"]
    adam(
        list(params),
        list(grads),
        [s["exp_avg"] for s in states],
        [s["exp_avg_sq"] for s in states],
        [s["max_exp_avg_sq"] for s in states] if amsgrad else [],
        [s["step"] for s in states],
        foreach=group["foreach"],
        capturable=group["capturable"],
        differentiable=group["differentiable"],
        fused=group["fused"],
        grad_scale=getattr(optimizer, "grad_scale", None),
        found_inf=getattr(optimizer, "found_inf", None),
        has_complex=any(torch.is_complex(p) for p in params),
        amsgrad=amsgrad,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group["maximize"],
        **newer,
    )
