"""Which layer uses each parameter first in the forward pass, found by running it once.

P3 sends the gradients of layer i with priority i, input side first, because the next
forward pass needs the first layers first. The order is read off the model, not listed
by hand: forward pre-hooks on every module record the order in which modules are first
called during the first forward pass, and a torch function mode records, for every
parameter, the module running (innermost) when an operation first reads it. That module
is the parameter's *using module*: its owner for a plain layer; the parent that reads it
where the owner is never called (``nn.MultiheadAttention`` reads ``out_proj.weight``);
the first caller of a tied one; the model itself for a weight its forward reads before
calling the owner. A parameter read in no operation of the forward (one the loss alone
reads) belongs to its owner, or to the owner's nearest called ancestor. Each using module
is one layer, numbered in call order; waiting for a layer's parameters in a forward
pre-hook that runs before the module's other pre-hooks (``prepend``: a hook-based
``spectral_norm`` reads ``weight_orig`` in one) is then early enough for every read.

Example:
    >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    >>> recorder = LayerOrder(model)
    >>> _ = model(torch.ones(1, 2))
    >>> layers = recorder.finish()
    >>> layers.layer_of, layers.names
    ({'0.weight': 0, '0.bias': 0, '2.weight': 1, '2.bias': 1}, ['0', '2'])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch  # noqa: F401 - used by the doctest
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True)
class Layers:
    """``layer_of`` parameter name → layer index; ``modules[i]`` waits for layer i, and
    each module of ``owners`` also waits for the layers of the parameters it owns: a later
    forward may call it before their layer (a tied copy the first forward skipped, a
    branch taken on other data)."""

    layer_of: dict[str, int]
    names: list[str]
    modules: list[nn.Module]
    owners: list[tuple[nn.Module, tuple[int, ...]]] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        return len(self.names)


class LayerOrder:
    """Records the next forward: module call order and each parameter's first reader;
    :meth:`finish` assigns the layers."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._calls: dict[int, int] = {}  # id(module) → call index
        self._running: list[int] = []  # ids of the modules in forward, innermost last
        self._unread = {id(p) for p in model.parameters() if p.requires_grad}
        self._first_reader: dict[int, int] = {}  # id(param) → id(module)
        self._reads = _FirstReads(self)
        self._recording = True
        self._handles = []
        for module in model.modules():
            self._handles.append(module.register_forward_pre_hook(self._enter, prepend=True))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))

    def _enter(self, module: nn.Module, _args: Any) -> None:
        if not self._recording:
            return
        self._calls.setdefault(id(module), len(self._calls))
        if module is self.model:
            self._reads.__enter__()
        self._running.append(id(module))

    def _leave(self, module: nn.Module, _args: Any, _output: Any) -> None:
        if not self._recording or not self._running:
            return
        self._running.pop()
        if module is self.model:  # the first forward is over
            self._reads.__exit__(None, None, None)
            self._recording = False

    def read(self, tensors: list[Any]) -> None:
        """An operation in forward reads ``tensors``: note the first reader of each
        parameter among them."""
        for tensor in tensors:
            key = id(tensor)
            if key in self._unread and self._running:
                self._unread.discard(key)
                self._first_reader[key] = self._running[-1]

    def finish(self) -> Layers:
        """Remove the recording hooks and number the layers of the trainable parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._recording = False  # the root's forward hook (always called) left the mode
        modules = dict(self.model.named_modules(remove_duplicate=False))
        name_of: dict[int, str] = {}
        for module_name, module in modules.items():
            name_of.setdefault(id(module), module_name)
        calls = self._calls
        owners: dict[int, list[str]] = {}
        for module_name, module in modules.items():
            for param in module.parameters(recurse=False):
                owners.setdefault(id(param), []).append(module_name)

        def called_ancestor(name: str) -> str:
            while name and id(modules[name]) not in calls:
                name = name.rpartition(".")[0]
            return name  # "" is the model itself (always called by the forward)

        users: dict[str, str] = {}
        for param_name, param in self.model.named_parameters():
            if not param.requires_grad:
                continue
            if id(param) in self._first_reader:
                users[param_name] = name_of[self._first_reader[id(param)]]
                continue
            called = [n for n in owners[id(param)] if id(modules[n]) in calls]
            if called:
                users[param_name] = min(called, key=lambda n: calls[id(modules[n])])
            else:
                users[param_name] = called_ancestor(owners[id(param)][0])
        order = sorted(set(users.values()), key=lambda n: calls.get(id(modules[n]), -1))
        index = {name: i for i, name in enumerate(order)}
        layer_of = {p: index[u] for p, u in users.items()}
        return Layers(
            layer_of=layer_of,
            names=[n or "(model)" for n in order],
            modules=[modules[n] for n in order],
            owners=self._owners(layer_of, {id(modules[n]): i for i, n in enumerate(order)}),
        )

    def _owners(
        self, layer_of: dict[str, int], own_layer: dict[int, int]
    ) -> list[tuple[nn.Module, tuple[int, ...]]]:
        """Each module that owns a parameter of a layer not its own, with those layers."""
        name_of = {id(p): n for n, p in self.model.named_parameters()}
        owners = []
        for module in dict.fromkeys(self.model.modules()):
            layers = {
                layer_of[name_of[id(param)]]
                for param in module.parameters(recurse=False)
                if name_of.get(id(param)) in layer_of
            }
            layers.discard(own_layer.get(id(module), -1))
            if layers:
                owners.append((module, tuple(sorted(layers))))
        return owners


class _FirstReads(TorchFunctionMode):
    """Passes every operation of the forward through, telling ``order`` what it reads."""

    def __init__(self, order: LayerOrder) -> None:
        super().__init__()
        self.order = order

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        self.order.read(tree_leaves((args, kwargs)))
        return func(*args, **kwargs)


__all__ = ["LayerOrder", "Layers"]
