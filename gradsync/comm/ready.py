"""Gradient hooks that may fire once per backward: a guard for the strategies that act on them.

``allreduce``, ``hybrid``'s dense path, ``ps`` and ``p3`` send a parameter's gradient from
its ``post_accumulate_grad`` hook, as soon as it is complete. That assumes each parameter's
gradient is accumulated once per backward. Reentrant activation checkpointing
(``torch.utils.checkpoint(..., use_reentrant=True)``) on a parameter also used outside the
checkpointed segment, or shared by two segments, accumulates it twice: the first part would
have left alone and the second would be lost. :class:`ReadyOnce` turns that into an error
naming the parameter and the way out, instead of wrong parameters.

Example:
    >>> ready = ReadyOnce("allreduce", "use_reentrant=False")
    >>> ready.mark("w"); ready.reset(); ready.mark("w")  # a new backward: fine
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

# The way out for a strategy that sends gradients from hooks: one that reads them after backward.
READ_AFTER_BACKWARD = "--strategy ps --no-overlap (it reads gradients after backward)"


class GradientAccumulatedTwice(RuntimeError):
    """A parameter's gradient hook fired twice in one backward."""


class ReadyOnce:
    """The parameters whose gradient hook fired in this backward (:meth:`reset` per step)."""

    def __init__(self, strategy: str, remedy: str) -> None:
        self.strategy = strategy
        self.remedy = remedy
        self.seen: set[str] = set()

    def mark(self, name: str) -> None:
        """``name``'s gradient is complete; raise if it already was in this backward."""
        if name in self.seen:
            raise GradientAccumulatedTwice(
                f"the gradient of '{name}' was accumulated twice in one backward (reentrant "
                f"activation checkpointing, or a parameter shared across checkpointed "
                f"segments): {self.strategy} sends a gradient as soon as its hook fires, so "
                f"the second part would be lost; use torch.utils.checkpoint(..., "
                f"use_reentrant=False), or {self.remedy}"
            )
        self.seen.add(name)

    def reset(self) -> None:
        self.seen.clear()


def guard_accumulations(strategy: str, named: Iterable[tuple[str, nn.Parameter]]) -> ReadyOnce:
    """A :class:`ReadyOnce` marked by a hook of its own on each of ``named``: for a strategy
    whose reduction runs in hooks gradsync does not own (torch's DDP reducer takes a second
    accumulation without a word, Horovod asserts with advice gradsync has no flag for).
    The strategy resets it every step.

    Example:
        >>> import torch
        >>> layer = nn.Linear(2, 1)
        >>> ready = guard_accumulations("ddp", layer.named_parameters())
        >>> layer(torch.ones(1, 2)).sum().backward(); sorted(ready.seen)
        ['bias', 'weight']
    """
    ready = ReadyOnce(strategy, READ_AFTER_BACKWARD)
    for name, param in named:
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(lambda _p, name=name: ready.mark(name))
    return ready


__all__ = ["READ_AFTER_BACKWARD", "GradientAccumulatedTwice", "ReadyOnce", "guard_accumulations"]
