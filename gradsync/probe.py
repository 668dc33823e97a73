"""Which parameters get a gradient: one forward and backward of step 0, on a copy.

DDP must know before its first step whether some parameter will get no gradient on some
worker (its ``find_unused_parameters``); a data-dependent branch, a never-used layer or a
gated expert all cause that. The probe runs this worker's shard of step 0 through a deep
copy of the model, with the random number generators restored afterwards, so training
itself is unchanged.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from gradsync.models.base import Workload


def params_without_gradient(
    workload: Workload,
    model: nn.Module,
    *,
    global_batch: int,
    start: int,
    stop: int,
    device: torch.device,
) -> set[str]:
    """Names of trainable parameters that get no gradient from samples ``start:stop`` of
    step 0 (``model`` is not touched).

    Example:
        >>> from gradsync.models import build_workload
        >>> workload = build_workload("mnist-cnn", preset="tiny")
        >>> params_without_gradient(workload, workload.model, global_batch=8, start=0, stop=4,
        ...                         device=torch.device("cpu"))
        set()
    """
    probe = copy.deepcopy(model)
    probe.train()
    # A loss that reads the model's own parameters (a penalty written in the loss) reaches
    # the real model, not the copy: its gradients there are kept apart and put back.
    real = dict(model.named_parameters())
    kept = {name: param.grad for name, param in real.items()}
    for param in real.values():
        param.grad = None
    try:
        with torch.random.fork_rng(devices=[]):
            batch = workload.dataset.batch(step=0, size=global_batch, start=start, stop=stop)
            batch = batch.to(device, torch.get_default_dtype())
            workload.loss(probe(*batch.inputs, **batch.shared), batch.targets).backward()
        read_by_loss = {name for name, param in real.items() if param.grad is not None}
    finally:
        for name, param in real.items():
            param.grad = kept[name]
    return {
        n
        for n, p in probe.named_parameters()
        if p.requires_grad and p.grad is None and n not in read_by_loss
    }


def missing_on_any_worker(
    model: nn.Module, missing_here: set[str], group: object | None
) -> set[str]:
    """The union over the workers of ``group`` of their ``missing_here`` (collective)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    flags = torch.tensor([float(n in missing_here) for n in names], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return {n for n, flag in zip(names, flags.tolist(), strict=True) if flag}


def lookup_tables(model: nn.Module) -> dict[str, nn.Embedding | nn.EmbeddingBag]:
    """Weight name → its ``nn.Embedding``/``nn.EmbeddingBag`` layer.

    Example:
        >>> list(lookup_tables(nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 1))))
        ['0.weight']
    """
    return {
        (f"{prefix}.weight" if prefix else "weight"): module
        for prefix, module in model.named_modules()
        if isinstance(module, nn.Embedding | nn.EmbeddingBag)
    }


def tied_names(model: nn.Module) -> set[str]:
    """Names (as ``named_parameters`` gives them) of parameters registered more than once.

    Example:
        >>> emb, out = nn.Embedding(5, 3, sparse=True), nn.Linear(3, 5, bias=False)
        >>> out.weight = emb.weight
        >>> sorted(tied_names(nn.ModuleDict({"emb": emb, "out": out})))
        ['emb.weight']
    """
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    return {names[0] for names in names_of.values() if len(names) > 1}


def sparse_lookup_weights(model: nn.Module) -> set[str]:
    """Names of the lookup-table weights with sparse gradients (``sparse=True``).

    Example:
        >>> sparse_lookup_weights(nn.Sequential(nn.Embedding(4, 2, sparse=True), nn.Linear(2, 1)))
        {'0.weight'}
    """
    return {name for name, table in lookup_tables(model).items() if table.sparse}
