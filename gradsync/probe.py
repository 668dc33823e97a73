"""Which parameters get a gradient: one forward and backward of step 0, on a copy.

DDP must know before its first step whether some parameter will get no gradient on some
worker (its ``find_unused_parameters``); a data-dependent branch, a never-used layer or a
gated expert all cause that. The probe runs this worker's shard of step 0 through a deep
copy of the model and of the loss (one copy, so a loss object that holds the model reads
the copy), with the random number generators restored afterwards, so training itself is
unchanged: a loss object that counts its calls, or a model that keeps state in forward,
sees the probe's call on its copy.

What a copy cannot protect: state outside the model and loss objects gradsync is given (a
module-level global, or an object that a plain function closes over) is touched once more
by the probe. ``ddp``'s ``--find-unused-parameters`` skips the probe for such a model.

When the probe cannot run (:class:`ProbeUnavailable`: the model or loss cannot be
deep-copied, or their forward and backward fail on the copy) the caller takes the safe
answer, :class:`UnknownGradients`, and training itself raises any error that is real.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.comm.batchnorm import GlobalBatchNorm
from gradsync.errors import UserError
from gradsync.models.base import Workload


class ProbeUnavailable(Exception):
    """The probe could not run on a copy of the model; the message says why, in one line."""


class UnknownGradients(frozenset[str]):
    """The answer when the probe could not run on some worker: every trainable parameter,
    since any may get no gradient (for ``ddp``: ``find_unused_parameters`` on), with
    ``reason`` saying why the probe did not run.

    Example:
        >>> unknown = UnknownGradients({"0.weight"}, reason="the model cannot be deep-copied")
        >>> sorted(unknown), unknown.reason
        (['0.weight'], 'the model cannot be deep-copied')
    """

    reason: str

    def __new__(cls, names: Iterable[str], *, reason: str) -> UnknownGradients:
        unknown = super().__new__(cls, names)
        unknown.reason = reason
        return unknown


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
    step 0 (``model`` and ``workload.loss`` are not touched).

    ProbeUnavailable when the model or loss cannot be deep-copied, or their forward and
    backward raise on the copy (training then raises a real error itself). Not when the
    copy holds cross-rank BatchNorm: the other workers may wait in its collective, so the
    error is raised here, as training would raise it. An error of the data is raised too.

    Example:
        >>> from gradsync.models import build_workload
        >>> workload = build_workload("mnist-cnn", preset="tiny")
        >>> params_without_gradient(workload, workload.model, global_batch=8, start=0, stop=4,
        ...                         device=torch.device("cpu"))
        set()
    """
    probe, loss = _copy_model_and_loss(model, workload.loss)
    probe.train()
    # A loss that reads the model's own parameters (a penalty written in a function, which
    # a deep copy shares) reaches the real model, not the copy: its gradients there are
    # kept apart and put back.
    real = dict(model.named_parameters())
    kept = {name: param.grad for name, param in real.items()}
    for param in real.values():
        param.grad = None
    try:
        with torch.random.fork_rng(devices=[]):
            batch = workload.dataset.batch(step=0, size=global_batch, start=start, stop=stop)
            batch = batch.to(device, torch.get_default_dtype())
            try:
                loss(probe(*batch.inputs, **batch.shared), batch.targets).backward()
            except UserError:
                raise
            except Exception as error:
                if any(isinstance(layer, GlobalBatchNorm) for layer in probe.modules()):
                    raise
                raise ProbeUnavailable(
                    f"its forward and backward failed on the copy ({_brief(error)})"
                ) from error
        read_by_loss = {name for name, param in real.items() if param.grad is not None}
    finally:
        for name, param in real.items():
            param.grad = kept[name]
    return {
        n
        for n, p in probe.named_parameters()
        if p.requires_grad and p.grad is None and n not in read_by_loss
    }


def _copy_model_and_loss(model: nn.Module, loss: Any) -> tuple[nn.Module, Any]:
    """Deep copies of ``model`` and ``loss`` that share one memo (a plain function is shared,
    as deepcopy shares functions). Process groups are shared, not copied (they cannot be), and a
    tensor attribute that is not a graph leaf (the legacy hook-based ``weight_norm``'s
    ``weight``, recomputed before each forward) is copied detached (deepcopy refuses it).
    ProbeUnavailable when the copy fails anyway (a lock, an open file, ...)."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, _PROCESS_GROUP):
                memo[id(value)] = value
            elif isinstance(value, torch.Tensor) and not value.is_leaf:
                memo[id(value)] = value.detach().clone()
    what = "the model"
    try:
        probe = copy.deepcopy(model, memo)
        what = "its loss"
        return probe, copy.deepcopy(loss, memo)  # one memo: the loss's model is the copy
    except Exception as error:
        raise ProbeUnavailable(f"{what} cannot be deep-copied ({_brief(error)})") from error


_PROCESS_GROUP = getattr(dist, "ProcessGroup", ())  # () where torch has no distributed


def _brief(error: BaseException) -> str:
    """``Type: message``, on one line and cut to 160 characters."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:157] + '...' if len(text) > 160 else text}"


def missing_on_any_worker(
    model: nn.Module, missing_here: set[str] | None, group: object | None
) -> set[str] | None:
    """The union over the workers of ``group`` of their ``missing_here`` (collective); None
    when some worker's probe could not run (its ``missing_here`` is None)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    unknown = missing_here is None
    flags = torch.tensor(
        [float(unknown or n in missing_here) for n in names] + [float(unknown)],
        dtype=torch.float64,
    )
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    *flags_of_names, some_unknown = flags.tolist()
    if some_unknown:
        return None
    return {n for n, flag in zip(names, flags_of_names, strict=True) if flag}


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


def read_whole_elsewhere(model: nn.Module) -> set[str]:
    """Of the sparse lookup tables' weights, those a layer other than a sparse lookup also
    registers (a tied output layer reads the whole table, so its gradient is dense); a
    table shared only by sparse lookups (tied source and target embeddings) is not.

    Example:
        >>> src, tgt = nn.Embedding(5, 3, sparse=True), nn.Embedding(5, 3, sparse=True)
        >>> out = nn.Linear(3, 5, bias=False)
        >>> tgt.weight = src.weight
        >>> read_whole_elsewhere(nn.ModuleDict({"src": src, "tgt": tgt}))
        set()
        >>> out.weight = src.weight
        >>> read_whole_elsewhere(nn.ModuleDict({"src": src, "tgt": tgt, "out": out}))
        {'src.weight'}
    """
    readers: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            readers.setdefault(id(param), []).append(module)
    names = {id(p): n for n, p in model.named_parameters()}
    sparse = sparse_lookup_weights(model)
    return {
        names[key]
        for key, modules in readers.items()
        if names.get(key) in sparse
        and not all(isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse for m in modules)
    }


def sparse_lookup_weights(model: nn.Module) -> set[str]:
    """Names of the lookup-table weights with sparse gradients (``sparse=True``).

    Example:
        >>> sparse_lookup_weights(nn.Sequential(nn.Embedding(4, 2, sparse=True), nn.Linear(2, 1)))
        {'0.weight'}
    """
    return {name for name, table in lookup_tables(model).items() if table.sparse}
