"""Which layer uses each parameter first in the forward pass, found by running it once.

P3 sends the gradients of layer i with priority i, input side first, because the next
forward pass needs the first layers first. The order is read off the model, not listed
by hand: forward pre-hooks on every module record the order in which modules are first
called during the first forward pass. A parameter belongs to the module that holds it; if
that module is never called (its weight is read by its parent, as ``nn.MultiheadAttention``
reads ``out_proj.weight``), to its nearest called ancestor; a parameter shared by several
modules (tied embeddings), to the one called first. Each such *using module* is one layer,
numbered in call order; waiting for a layer's parameters in that module's forward pre-hook
is then early enough for every read of them.

Example:
    >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    >>> recorder = LayerOrder(model)
    >>> _ = model(torch.ones(1, 2))
    >>> layers = recorder.finish()
    >>> layers.layer_of, layers.names
    ({'0.weight': 0, '0.bias': 0, '2.weight': 1, '2.bias': 1}, ['0', '2'])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch  # noqa: F401 - used by the doctest
from torch import nn


@dataclass(frozen=True)
class Layers:
    """``layer_of`` parameter name → layer index; ``modules[i]`` waits for layer i."""

    layer_of: dict[str, int]
    names: list[str]
    modules: list[nn.Module]

    @property
    def num_layers(self) -> int:
        return len(self.names)


class LayerOrder:
    """Records module call order during the next forward; :meth:`finish` assigns layers."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._calls: dict[int, int] = {}
        self._handles = [m.register_forward_pre_hook(self._record) for m in model.modules()]

    def _record(self, module: nn.Module, _args: Any) -> None:
        self._calls.setdefault(id(module), len(self._calls))

    def finish(self) -> Layers:
        """Remove the recording hooks and number the layers of the trainable parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        modules = dict(self.model.named_modules(remove_duplicate=False))
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
            called = [n for n in owners[id(param)] if id(modules[n]) in calls]
            if called:
                users[param_name] = min(called, key=lambda n: calls[id(modules[n])])
            else:
                users[param_name] = called_ancestor(owners[id(param)][0])
        order = sorted(set(users.values()), key=lambda n: calls.get(id(modules[n]), -1))
        index = {name: i for i, name in enumerate(order)}
        return Layers(
            layer_of={p: index[u] for p, u in users.items()},
            names=[n or "(model)" for n in order],
            modules=[modules[n] for n in order],
        )


__all__ = ["LayerOrder", "Layers"]
