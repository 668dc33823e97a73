"""Batch normalization over the global batch, across ranks, on any device (Gloo included).

torch's ``nn.SyncBatchNorm`` runs on GPUs only. This module gives every strategy that splits
a global batch over workers the same statistics the single-process reference computes over
the whole batch (Ioffe & Szegedy 2015), so BatchNorm models stay verifiable. Forward
allreduces per-channel (sum, sum of squares, count); backward allreduces (Σ dy, Σ dy·x̂).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm


class _GlobalBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor, eps: float, group: Any
    ) -> tuple[Tensor, Tensor, Tensor]:
        dims = [0, *range(2, x.dim())]
        count = torch.tensor([x.numel() // x.shape[1]], dtype=x.dtype, device=x.device)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        dist.all_reduce(stats, group=group)
        channels = x.shape[1]
        total = stats[-1]
        mean = stats[:channels] / total
        var = (stats[channels : 2 * channels] / total - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        shape = [1, channels] + [1] * (x.dim() - 2)
        x_hat = (x - mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(x_hat, weight, invstd, total)
        ctx.group = group
        return x_hat * weight.view(shape) + bias.view(shape), mean, var * total / (total - 1)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x_hat, weight, invstd, total = ctx.saved_tensors
        dims = [0, *range(2, grad_out.dim())]
        channels = grad_out.shape[1]
        shape = [1, channels] + [1] * (grad_out.dim() - 2)
        grad_bias = grad_out.sum(dims)
        grad_weight = (grad_out * x_hat).sum(dims)
        # The input gradient needs the global sums; the parameter gradients stay local and
        # are averaged by the strategy like every other gradient.
        sums = torch.cat([grad_bias, grad_weight])
        dist.all_reduce(sums, group=ctx.group)
        mean_dy = (sums[:channels] / total).view(shape)
        mean_dy_xhat = (sums[channels:] / total).view(shape)
        grad_x = (grad_out - mean_dy - x_hat * mean_dy_xhat) * (invstd * weight).view(shape)
        return grad_x, grad_weight, grad_bias, None, None


class GlobalBatchNorm(nn.Module):
    """A BatchNorm layer whose statistics span the global batch of all ranks in ``group``.

    Built from an existing BatchNorm layer (parameters and running buffers are shared).

    Example:
        >>> bn = GlobalBatchNorm(nn.BatchNorm2d(4), group=None)  # needs an initialized group
    """

    def __init__(self, source: _BatchNorm, group: Any) -> None:
        super().__init__()
        if not (source.affine and source.track_running_stats):
            raise ValueError("GlobalBatchNorm supports affine BatchNorm with running stats")
        self.weight = source.weight
        self.bias = source.bias
        self.register_buffer("running_mean", source.running_mean)
        self.register_buffer("running_var", source.running_var)
        self.register_buffer("num_batches_tracked", source.num_batches_tracked)
        self.eps = source.eps
        self.momentum = source.momentum
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight,
                                            self.bias, False, 0.0, self.eps)
        y, mean, unbiased_var = _GlobalBatchNorm.apply(x, self.weight, self.bias, self.eps,
                                                       self.group)
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            momentum = self.momentum if self.momentum is not None else (
                1.0 / float(self.num_batches_tracked))
            self.running_mean.lerp_(mean, momentum)
            self.running_var.lerp_(unbiased_var, momentum)
        return y


def convert_batchnorm(module: nn.Module, group: Any) -> int:
    """Replace every BatchNorm layer inside ``module`` by a :class:`GlobalBatchNorm` in place.

    Returns the number of layers replaced. Parameter names and identities do not change.
    """
    replaced = 0
    for name, child in module.named_children():
        if isinstance(child, _BatchNorm):
            setattr(module, name, GlobalBatchNorm(child, group))
            replaced += 1
        else:
            replaced += convert_batchnorm(child, group)
    return replaced
