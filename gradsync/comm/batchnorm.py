"""Batch normalization over the global batch, across ranks, on any device (Gloo included).

``--batchnorm global`` (the default) converts every BatchNorm layer of a multi-worker job;
``--batchnorm local`` leaves them alone, so each worker normalizes its own shard, as DDP's
and Horovod's users get by default (``verify`` reports it as an expected difference).

torch's ``nn.SyncBatchNorm`` runs on GPUs only. This module gives every strategy that splits
a global batch over workers the same statistics the single-process reference computes over
the whole batch (Ioffe & Szegedy 2015), so BatchNorm models stay verifiable. Forward
all-gathers per-channel (count, mean, M2); backward allreduces (Σ dy, Σ dy·x̂). A worker
whose shard gives a layer no rows sends count 0 and zero sums, and still joins both.

Every worker must run every layer the same number of times in a step: a collective of one
layer would otherwise pair with another layer's, or with a gradient bucket, on the other
workers. So each collective also carries the identity of its call (layer, forward or
backward, call number), and every rank checks after it that all ranks sent the same one.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradsync.errors import UserError

# Call numbers wrap here, so that a tag's square summed over up to 2¹³ ranks stays an exact
# float64 integer. Ranks that drift apart are caught at the first call where they differ.
CALL_MODULUS = 1 << 20
ONE_RUN_EACH = (
    "global BatchNorm needs every worker to run every BatchNorm layer the same number of "
    "times in a step; use --batchnorm local"
)


@dataclass(frozen=True)
class _Call:
    """Which call of which global BatchNorm layer a collective belongs to.

    Example:
        >>> _Call("layer1.bn", index=2, number=5).tag(backward=True)
        [-3.0, 5.0]
    """

    layer: str  # the layer's name in the model, for messages
    index: int  # its position among the model's global BatchNorm layers
    number: int  # its forward calls so far, this one included (modulo CALL_MODULUS)

    def tag(self, *, backward: bool) -> list[float]:
        """Two small integers naming this call's forward or backward collective; never 0,
        so a rank that sent zeros (or nothing of this call) cannot match it."""
        layer = float(self.index + 1)
        return [-layer if backward else layer, float(self.number)]

    def mismatch(self, phase: str, others: list[int]) -> UserError:
        """The one-line error of a collective that other ranks (``others``, when known) did
        not run for this call."""
        where = f"; worker(s) {', '.join(map(str, others))} in another collective" if others else ""
        return UserError(
            f"BatchNorm layer {self.layer} ran on some workers only: {ONE_RUN_EACH} ({phase} "
            f"call {self.number}{where})"
        )


@contextlib.contextmanager
def _collective_of(call: _Call, phase: str) -> Iterator[None]:
    """Name the layer when its collective times out: the usual cause is a worker that
    skipped the layer and will never join (any other failure, a peer that died first
    included, keeps its own message)."""
    try:
        yield
    except RuntimeError as error:
        # Gloo's words: "Timed out waiting 300000ms for recv operation to complete".
        timeout = re.search(r"timed out(?: waiting (\d+) ?ms)?", str(error), re.IGNORECASE)
        if timeout is None:
            raise
        after = f" after {int(timeout[1]) / 1000:g} s" if timeout[1] else ""
        raise UserError(
            f"BatchNorm layer {call.layer} timed out{after} waiting for the other workers: if "
            f"one skipped it, {ONE_RUN_EACH} ({phase} call {call.number})"
        ) from error


def _checked(values: Tensor, agree: Tensor, call: _Call, phase: str) -> Tensor:
    """``values`` when ``agree`` holds everywhere (every rank sent ``call``'s tag; one flag,
    or one per rank), else a UserError.

    On the CPU the check is free. On an accelerator reading ``agree`` would stall the
    device at every layer, so there a mismatch turns ``values`` into NaN instead: the loss
    stops the run rather than train on another collective's numbers.
    """
    if agree.device.type != "cpu":
        return torch.where(agree.all(), values, torch.nan)
    if not bool(agree.all()):
        flags = agree.tolist() if agree.dim() else []
        raise call.mismatch(phase, [rank for rank, same in enumerate(flags) if not same])
    return values


def _local_moments(x: Tensor) -> Tensor:
    """This rank's per-channel float64 (count, mean, M2) rows, shape (3, C); zeros when its
    shard gives the layer no rows (torch's moments kernel refuses an empty input)."""
    count = x.numel() // x.shape[1]
    if count == 0:
        return x.new_zeros(3, x.shape[1], dtype=torch.float64)
    mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)
    return torch.stack([torch.full_like(mean, count), mean, var * count]).double()


def _gather_moments(local: Tensor, call: _Call, group: Any) -> Tensor:
    """Every rank's (count, mean, M2) rows, stacked by rank: shape (world size, 3, C).

    The call's tag travels as two extra elements: all ranks see all tags, so each rank
    checks that every other rank gathered for the same call.
    """
    world_size = dist.get_world_size(group)
    if world_size == 1:  # nothing to gather (``gradsync profile`` times the layer that way)
        return local.unsqueeze(0)
    tag = local.new_tensor(call.tag(backward=False))
    payload = torch.cat([local.flatten(), tag])
    gathered = [torch.empty_like(payload) for _ in range(world_size)]
    with _collective_of(call, "forward"):
        dist.all_gather(gathered, payload, group=group)
    rows = torch.stack(gathered)
    agree = (rows[:, -2:] == tag).all(1)  # per rank
    return _checked(rows[:, :-2].view(world_size, *local.shape), agree, call, "forward")


def _combine_moments(rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Global (mean, biased variance, count) from every rank's float64 (count, mean, M2).

    Chan et al.'s pairwise formula: no E[x²]−E[x]² cancellation, so the result matches a
    single-process BatchNorm over the whole batch to rounding. A rank with no rows adds
    nothing; with no rows anywhere, the mean and variance are NaN (and unused).
    """
    counts, means, m2s = rows.unbind(1)
    total = counts.sum(0)
    mean = (counts * means).sum(0) / total
    m2 = (m2s + counts * (means - mean) ** 2).sum(0)
    return mean, m2 / total, total[0]


def _sum_over_ranks(sums: Tensor, call: _Call, group: Any) -> Tensor:
    """``sums`` (float64) summed over the ranks of ``group``.

    The call's tag and its square ride along; every rank checks Σ tag = world·tag and
    Σ tag² = world·tag², which together hold only when all ranks sent the same tag (a
    rank that passes both has a tag of zero spread). Exact: small integers in float64.
    """
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return sums
    tag = sums.new_tensor(call.tag(backward=True))
    payload = torch.cat([sums, tag, tag * tag])
    with _collective_of(call, "backward"):
        dist.all_reduce(payload, group=group)
    agree = (payload[-4:] == world_size * torch.cat([tag, tag * tag])).all()
    return _checked(payload[:-4], agree, call, "backward")


def _per_channel(values: Tensor, like: Tensor) -> Tensor:
    """``values`` (one per channel) shaped to broadcast over ``like`` (N, C, ...)."""
    return values.view(1, -1, *[1] * (like.dim() - 2))


def _local_grad_sums(
    grad_out: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, invstd: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Σ dy·x̂ and Σ dy per channel over this rank's rows, in one fused pass; zeros when it
    has none (torch's kernel divides by the row count: SIGFPE on an empty input).

    The global moments are given as the saved batch moments (training mode), which every
    device's kernel accepts; CUDA's refuses them as running statistics. Σ dy·x̂ does not
    depend on the weight; CUDA's kernel needs one to size its output.
    """
    if x.numel() == 0:
        return torch.zeros_like(mean), torch.zeros_like(mean)
    some_weight = weight if weight is not None else torch.ones_like(mean)
    _, grad_weight, grad_bias = torch.ops.aten.native_batch_norm_backward(
        grad_out, x, some_weight, None, None, mean, invstd, True, eps, [False, True, True]
    )
    return grad_weight, grad_bias


class _GlobalBatchNorm(torch.autograd.Function):
    """y = x̂·weight + bias over the global batch; ``weight``/``bias`` None when not affine.

    Every pass over the activations is one of torch's fused BatchNorm kernels (the batch
    moments, the normalization, the two per-channel gradient sums) or one fused
    multiply-add: the Python around them only touches per-channel vectors.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        eps: float,
        group: Any,
        call: _Call,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        rows = _gather_moments(_local_moments(x), call, group)
        mean, var, total = _combine_moments(rows)
        mean, var = mean.to(x.dtype), var.to(x.dtype)
        # Inference-mode BatchNorm with the global moments as its statistics: x̂·w + b.
        y = torch.batch_norm(x, weight, bias, mean, var, False, 0.0, eps, False)
        ctx.save_for_backward(x, weight, mean, var, total)
        ctx.group, ctx.eps, ctx.call = group, eps, call
        unbiased = (var.double() * total / (total - 1).clamp(min=1)).to(x.dtype)
        ctx.mark_non_differentiable(mean, unbiased, total)
        return y, mean, unbiased, total

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight, mean, var, total = ctx.saved_tensors
        invstd = torch.rsqrt(var + ctx.eps)
        # The parameter gradients stay local (the strategy averages them like every other
        # gradient); the input gradient needs their global sums.
        grad_weight, grad_bias = _local_grad_sums(grad_out, x, weight, mean, invstd, ctx.eps)
        sums = _sum_over_ranks(torch.cat([grad_bias, grad_weight]).double(), ctx.call, ctx.group)
        mean_dy, mean_dy_xhat = (sums / total).to(x.dtype).view(2, -1)
        scale = invstd if weight is None else invstd * weight
        # grad_x = scale·(dy − mean(dy) − x̂·mean(dy·x̂)), with x̂ = (x − mean)·invstd,
        # is per channel scale·dy + slope·x + offset.
        slope = -scale * invstd * mean_dy_xhat
        offset = -scale * mean_dy - slope * mean
        grad_x = torch.addcmul(_per_channel(offset, x), x, _per_channel(slope, x))
        grad_x.addcmul_(grad_out, _per_channel(scale, x))
        if weight is None:
            return grad_x, None, None, None, None, None
        return grad_x, grad_weight, grad_bias, None, None, None


class GlobalBatchNorm(nn.Module):
    """A BatchNorm layer whose statistics span the global batch of all ranks in ``group``.

    Built from an existing BatchNorm layer of any kind (1d/2d/3d, with or without affine
    parameters or running statistics); parameters and running buffers are shared. Without
    running statistics, eval mode normalizes with the batch's statistics, as torch does,
    so those are global too. ``name`` and ``index`` (the layer's name in its model and its
    position among the model's global layers) tell its collectives from those of other
    layers; :func:`convert_batchnorm` sets both.

    Example:
        >>> bn = GlobalBatchNorm(nn.BatchNorm2d(4), group=None)  # needs an initialized group
    """

    def __init__(self, source: _BatchNorm, group: Any, *, name: str = "", index: int = 0) -> None:
        super().__init__()
        self.weight = source.weight
        self.bias = source.bias
        self.register_buffer("running_mean", source.running_mean)
        self.register_buffer("running_var", source.running_var)
        self.register_buffer("num_batches_tracked", source.num_batches_tracked)
        self.eps = source.eps
        self.momentum = source.momentum
        self.group = group
        self.name = name or type(source).__name__
        self.index = index
        self.num_calls = 0  # forwards with collectives so far: the same on every rank
        self.train(source.training)

    def forward(self, x: Tensor) -> Tensor:
        tracking = self.running_mean is not None
        if not self.training and tracking:
            return nn.functional.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        self.num_calls = self.num_calls % CALL_MODULUS + 1
        call = _Call(self.name, self.index, self.num_calls)
        y, mean, unbiased_var, total = _GlobalBatchNorm.apply(
            x, self.weight, self.bias, self.eps, self.group, call
        )
        if self.training and tracking:
            self._track(mean, unbiased_var, seen=total > 0)
        return y

    @torch.no_grad()
    def _track(self, mean: Tensor, unbiased_var: Tensor, seen: Tensor) -> None:
        """Move the running statistics towards the batch's, as torch's layer does; a global
        batch of no rows (``seen`` false) only counts the batch."""
        self.num_batches_tracked.add_(1)
        momentum = (
            self.momentum if self.momentum is not None else (1.0 / float(self.num_batches_tracked))
        )
        for running, batch in ((self.running_mean, mean), (self.running_var, unbiased_var)):
            running.copy_(torch.where(seen, running.lerp(batch, momentum), running))


def convert_batchnorm(module: nn.Module, group: Any) -> int:
    """Replace every BatchNorm layer inside ``module`` by a :class:`GlobalBatchNorm` in place.

    Returns the number of layers replaced. Parameter names and identities do not change; a
    layer reachable under several names becomes one global layer under all of them (named
    by the first). UserError for a subclass with a forward of its own (see
    :func:`unconvertible_batchnorm`).

    Example:
        >>> norm = nn.BatchNorm1d(2)
        >>> model = nn.ModuleDict({"a": norm, "b": norm})
        >>> convert_batchnorm(model, group=None), model["a"] is model["b"], model["b"].name
        (1, True, 'a')
    """
    problem = unconvertible_batchnorm(module)
    if problem:
        raise UserError(problem)
    converted: dict[int, GlobalBatchNorm] = {}
    for prefix, parent in list(module.named_modules(remove_duplicate=False)):
        for name, child in list(parent._modules.items()):  # named_children skips aliases
            if isinstance(child, _BatchNorm):
                if id(child) not in converted:
                    path = f"{prefix}.{name}" if prefix else name
                    layer = GlobalBatchNorm(child, group, name=path, index=len(converted))
                    converted[id(child)] = layer
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
