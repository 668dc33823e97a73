"""Batch normalization over the global batch, across ranks, on any device (Gloo included).

``--batchnorm global`` (the default) converts every BatchNorm layer of a multi-worker job;
``--batchnorm local`` leaves them alone, so each worker normalizes its own shard, as DDP's
and Horovod's users get by default (``verify`` reports it as an expected difference).

torch's ``nn.SyncBatchNorm`` runs on GPUs only. This module gives every strategy that splits
a global batch over workers the same statistics the single-process reference computes over
the whole batch (Ioffe & Szegedy 2015), so BatchNorm models stay verifiable. Forward
all-gathers per-channel (count, mean, M2); backward allreduces (Σ dy, Σ dy·x̂).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradsync.errors import UserError


def _combine_moments(local: Tensor, group: Any) -> tuple[Tensor, Tensor, Tensor]:
    """Global (mean, biased variance, count) from every rank's float64 (count, mean, M2) rows.

    Chan et al.'s pairwise formula: no E[x²]−E[x]² cancellation, so the result matches a
    single-process BatchNorm over the whole batch to rounding. A group of one rank has
    nothing to gather (``gradsync profile`` times the layer that way).
    """
    if dist.get_world_size(group) == 1:
        counts, means, m2s = local.unsqueeze(1).unbind(0)
    else:
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
        counts, means, m2s = torch.stack(gathered).unbind(1)
    total = counts.sum(0)
    mean = (counts * means).sum(0) / total
    m2 = (m2s + counts * (means - mean) ** 2).sum(0)
    return mean, m2 / total, total[0]


def _per_channel(values: Tensor, like: Tensor) -> Tensor:
    """``values`` (one per channel) shaped to broadcast over ``like`` (N, C, ...)."""
    return values.view(1, -1, *[1] * (like.dim() - 2))


class _GlobalBatchNorm(torch.autograd.Function):
    """y = x̂·weight + bias over the global batch; ``weight``/``bias`` None when not affine.

    Every pass over the activations is one of torch's fused BatchNorm kernels (the batch
    moments, the normalization, the two per-channel gradient sums) or one fused
    multiply-add: the Python around them only touches per-channel vectors.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, group: Any
    ) -> tuple[Tensor, Tensor, Tensor]:
        count = x.numel() // x.shape[1]
        local_mean, local_var = torch.batch_norm_update_stats(x, None, None, 0.0)
        moments = torch.stack([torch.full_like(local_mean, count), local_mean, local_var * count])
        mean, var, total = _combine_moments(moments.double(), group)
        mean, var = mean.to(x.dtype), var.to(x.dtype)
        # Inference-mode BatchNorm with the global moments as its statistics: x̂·w + b.
        y = torch.batch_norm(x, weight, bias, mean, var, False, 0.0, eps, False)
        ctx.save_for_backward(x, weight, mean, var, total.to(x.dtype))
        ctx.group, ctx.eps = group, eps
        unbiased = (var.double() * total / (total - 1).clamp(min=1)).to(x.dtype)
        ctx.mark_non_differentiable(mean, unbiased)
        return y, mean, unbiased

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight, mean, var, total = ctx.saved_tensors
        invstd = torch.rsqrt(var + ctx.eps)
        # Σ dy·x̂ and Σ dy per channel, in one pass: the parameter gradients. They stay
        # local (the strategy averages them like every other gradient); the input gradient
        # needs their global sums. The global moments are given as the saved batch moments
        # (training mode), which every device's kernel accepts; CUDA's refuses them as
        # running statistics.
        # Σ dy·x̂ does not depend on the weight; CUDA's kernel needs one to size its output.
        some_weight = weight if weight is not None else torch.ones_like(mean)
        _, grad_weight, grad_bias = torch.ops.aten.native_batch_norm_backward(
            grad_out, x, some_weight, None, None, mean, invstd, True, ctx.eps, [False, True, True]
        )
        sums = torch.cat([grad_bias, grad_weight])
        if dist.get_world_size(ctx.group) > 1:
            dist.all_reduce(sums, group=ctx.group)
        mean_dy, mean_dy_xhat = (sums / total).view(2, -1)
        scale = invstd if weight is None else invstd * weight
        # grad_x = scale·(dy − mean(dy) − x̂·mean(dy·x̂)), with x̂ = (x − mean)·invstd,
        # is per channel scale·dy + slope·x + offset.
        slope = -scale * invstd * mean_dy_xhat
        offset = -scale * mean_dy - slope * mean
        grad_x = torch.addcmul(_per_channel(offset, x), x, _per_channel(slope, x))
        grad_x.addcmul_(grad_out, _per_channel(scale, x))
        if weight is None:
            return grad_x, None, None, None, None
        return grad_x, grad_weight, grad_bias, None, None


class GlobalBatchNorm(nn.Module):
    """A BatchNorm layer whose statistics span the global batch of all ranks in ``group``.

    Built from an existing BatchNorm layer of any kind (1d/2d/3d, with or without affine
    parameters or running statistics); parameters and running buffers are shared. Without
    running statistics, eval mode normalizes with the batch's statistics, as torch does,
    so those are global too.

    Example:
        >>> bn = GlobalBatchNorm(nn.BatchNorm2d(4), group=None)  # needs an initialized group
    """

    def __init__(self, source: _BatchNorm, group: Any) -> None:
        super().__init__()
        self.weight = source.weight
        self.bias = source.bias
        self.register_buffer("running_mean", source.running_mean)
        self.register_buffer("running_var", source.running_var)
        self.register_buffer("num_batches_tracked", source.num_batches_tracked)
        self.eps = source.eps
        self.momentum = source.momentum
        self.group = group
        self.train(source.training)

    def forward(self, x: Tensor) -> Tensor:
        tracking = self.running_mean is not None
        if not self.training and tracking:
            return nn.functional.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        y, mean, unbiased_var = _GlobalBatchNorm.apply(
            x, self.weight, self.bias, self.eps, self.group
        )
        if not (self.training and tracking):
            return y
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            momentum = (
                self.momentum
                if self.momentum is not None
                else (1.0 / float(self.num_batches_tracked))
            )
            self.running_mean.lerp_(mean, momentum)
            self.running_var.lerp_(unbiased_var, momentum)
        return y


def convert_batchnorm(module: nn.Module, group: Any) -> int:
    """Replace every BatchNorm layer inside ``module`` by a :class:`GlobalBatchNorm` in place.

    Returns the number of layers replaced. Parameter names and identities do not change; a
    layer reachable under several names becomes one global layer under all of them.
    UserError for a subclass with a forward of its own (see :func:`unconvertible_batchnorm`).

    Example:
        >>> norm = nn.BatchNorm1d(2)
        >>> model = nn.ModuleDict({"a": norm, "b": norm})
        >>> convert_batchnorm(model, group=None), model["a"] is model["b"]
        (1, True)
    """
    problem = unconvertible_batchnorm(module)
    if problem:
        raise UserError(problem)
    converted: dict[int, GlobalBatchNorm] = {}
    for parent in list(module.modules()):
        for name, child in list(parent._modules.items()):  # named_children skips aliases
            if isinstance(child, _BatchNorm):
                if id(child) not in converted:
                    converted[id(child)] = GlobalBatchNorm(child, group)
                setattr(parent, name, converted[id(child)])
    return len(converted)


# BatchNorm classes whose forward is BatchNorm's own: global statistics replace it whole.
_PLAIN_FORWARDS = (_BatchNorm.forward, nn.SyncBatchNorm.forward)


def unconvertible_batchnorm(module: nn.Module) -> str | None:
    """Why ``--batchnorm global`` cannot take ``module``'s BatchNorm layers, or None: a
    subclass that overrides ``forward`` would lose what its forward adds.

    Example:
        >>> class Scaled(nn.BatchNorm1d):
        ...     def forward(self, x):
        ...         return 2 * super().forward(x)
        >>> print(unconvertible_batchnorm(nn.Sequential(Scaled(2))))  # doctest: +ELLIPSIS
        layer 0 is a Scaled, a BatchNorm subclass with a forward of its own, ...
    """
    for name, layer in module.named_modules():
        if isinstance(layer, _BatchNorm) and type(layer).forward not in _PLAIN_FORWARDS:
            return (
                f"layer {name} is a {type(layer).__name__}, a BatchNorm subclass with a forward "
                "of its own, which global BatchNorm would replace; use --batchnorm local (each "
                "worker normalizes its shard, as DDP does)"
            )
    return None


def has_batchnorm(module: nn.Module) -> bool:
    """Whether ``module`` holds a BatchNorm layer (whose statistics ``--batchnorm`` sets).

    Example:
        >>> has_batchnorm(nn.Sequential(nn.Linear(2, 2))), has_batchnorm(nn.BatchNorm1d(2))
        (False, True)
    """
    return any(isinstance(m, _BatchNorm) for m in module.modules())
