"""Which lookup tables a forward reads other than by looking up its module's input.

A strategy that keeps a lookup table on servers and brings each worker only the rows its
lookups read (``hybrid``) is right only if the table is read in no other way: a
``.detach()`` of the whole table, an index under ``no_grad``, an ``F.embedding`` on other
indices, or an ``nn.Embedding`` subclass whose forward looks up rows other than its input
(learned positions) would read rows nobody brought up to date. :class:`LookupReads` runs
one forward and names the tables read so.

Example:
    >>> from torch import nn
    >>> table = nn.Embedding(5, 2)
    >>> with LookupReads({"weight": table}) as reads:
    ...     _ = table(torch.tensor([1, 2])) + table.weight.detach().mean(0)
    >>> reads.elsewhere
    {'weight'}
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

_LOOKUPS = {torch.nn.functional.embedding, torch.nn.functional.embedding_bag, torch.embedding}
# What a tensor says of itself, never its values (``torch.arange(n, device=w.device)``).
_METADATA_PROPERTIES = frozenset(
    {"dtype", "shape", "device", "layout", "ndim", "requires_grad", "is_sparse", "is_cuda",
     "is_leaf", "is_meta", "is_quantized", "itemsize", "nbytes", "names"}
)  # fmt: skip
_METADATA_METHODS = frozenset(
    {"size", "dim", "ndimension", "numel", "nelement", "stride", "element_size",
     "is_contiguous", "is_floating_point", "is_complex", "get_device"}
)  # fmt: skip


def reads_metadata_only(func: Any) -> bool:
    """Whether ``func`` (as a TorchFunctionMode sees it) reads a tensor's metadata only.

    Example:
        >>> reads_metadata_only(torch.Tensor.size), reads_metadata_only(torch.Tensor.detach)
        (True, False)
    """
    if getattr(func, "__name__", None) == "__get__":  # a property: .dtype, but not .data
        return getattr(getattr(func, "__self__", None), "__name__", None) in _METADATA_PROPERTIES
    return getattr(func, "__name__", None) in _METADATA_METHODS and "Tensor" in repr(func)


class LookupReads(TorchFunctionMode):
    """While active, records in :attr:`elsewhere` the names of ``tables`` whose weight an
    operation reads other than their module's lookup of its own input."""

    def __init__(self, tables: dict[str, nn.Embedding | nn.EmbeddingBag]) -> None:
        super().__init__()
        self.name_of = {id(module.weight): name for name, module in tables.items()}
        self.module_of = {id(module.weight): module for module in tables.values()}
        self.elsewhere: set[str] = set()
        self._inputs: dict[int, Tensor] = {}  # id(module) → its input while it runs
        self._handles = [
            handle
            for module in tables.values()
            for handle in (
                module.register_forward_pre_hook(self._enter, with_kwargs=True),
                module.register_forward_hook(self._leave, always_call=True),
            )
        ]

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = args[0] if args else kwargs.get("input")
        if isinstance(ids, Tensor):
            self._inputs[id(module)] = ids

    def _leave(self, module: nn.Module, _args: Any, _output: Any) -> None:
        self._inputs.pop(id(module), None)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if reads_metadata_only(func):
            return func(*args, **kwargs)
        for leaf in tree_leaves((args, kwargs)):
            name = self.name_of.get(id(leaf)) if isinstance(leaf, Tensor) else None
            if name is not None and not self._own_lookup(func, leaf, args, kwargs):
                self.elsewhere.add(name)
        return func(*args, **kwargs)

    def _own_lookup(self, func: Any, weight: Tensor, args: tuple[Any, ...], kwargs: Any) -> bool:
        """Whether ``func`` looks up, in ``weight``, the rows its module was called with."""
        if func not in _LOOKUPS:
            return False
        ids = args[0] if args else kwargs.get("input")
        if func is torch.embedding:  # torch.embedding(weight, indices)
            ids = args[1] if len(args) > 1 else kwargs.get("indices")
        running = self._inputs.get(id(self.module_of[id(weight)]))
        return running is not None and ids is running

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        super().__exit__(*exc)


__all__ = ["LookupReads"]
