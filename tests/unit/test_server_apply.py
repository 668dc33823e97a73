"""The servers' fast apply (issue 14): the same bits as ``torch.optim``'s ``step()``.

:meth:`ShardState.apply` goes through :meth:`Updater.update_params_at` (torch's functional
SGD/Adam on the slot views) instead of setting ``.grad`` and calling ``step()``. These tests
hold it to ``single``'s optimizer — one ``torch.optim`` optimizer over separate parameters,
a parameter without a gradient skipped — bit for bit, over several steps with warm-up and
slots missing a gradient, in float32 and float64; and the checkpoint state it dumps to the
one the old path dumped.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from gradsync.comm.server import ShardState, sum_in_order
from gradsync.config import OptimConfig
from gradsync.optim import Updater, direct_step_of, step_params

SIZES = [3, 5, 1, 4]  # four slots of one shard
STEPS = 6
LR = 0.05
CONFIGS = {
    "sgd momentum + weight decay": OptimConfig(
        name="sgd", lr=LR, momentum=0.9, weight_decay=0.01, lr_warmup_steps=3
    ),
    "sgd plain + weight decay": OptimConfig(name="sgd", lr=LR, momentum=0.0, weight_decay=0.1),
    "adam + weight decay": OptimConfig(name="adam", lr=LR, weight_decay=0.01, lr_warmup_steps=3),
}
DTYPES = [torch.float32, torch.float64]


def _present(step: int) -> list[bool]:
    """Which slots had a gradient in ``step``: slot 3 never, slot 1 only every other step,
    nothing at all in step 4."""
    if step == 4:
        return [False] * len(SIZES)
    return [True, step % 2 == 0, True, False]


def _grads(dtype: torch.dtype) -> list[Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(sum(SIZES), generator=generator, dtype=dtype) for _ in range(STEPS)]


def _initial(dtype: torch.dtype) -> Tensor:
    return torch.linspace(-1, 1, sum(SIZES), dtype=dtype)


def _shard(config: OptimConfig, dtype: torch.dtype) -> ShardState:
    return ShardState(
        _initial(dtype), lambda ps: Updater(ps, config, lr=config.base_lr()), sizes=SIZES
    )


def _old_apply(state: ShardState, grad: Tensor, step: int, present: list[bool]) -> None:
    """The apply every server used before: each slot's ``.grad``, then ``step()``."""
    for slot, piece, here in zip(state.slots, grad.split(state.sizes), present, strict=True):
        slot.grad = piece if here else None
    state.updater.update_at(step)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", CONFIGS)
def test_apply_equals_singles_optimizer_bit_for_bit(name: str, dtype: torch.dtype) -> None:
    """A shard of four slots against ``single``: separate parameters, one torch.optim
    optimizer, ``update()`` per step (its own warm-up schedule), a missing gradient None."""
    config = CONFIGS[name]
    params = [nn.Parameter(t.clone()) for t in _initial(dtype).split(SIZES)]
    single = Updater(params, config, lr=config.base_lr())
    state = _shard(config, dtype)
    for step, grad in enumerate(_grads(dtype)):
        present = _present(step)
        for param, piece, here in zip(params, grad.split(SIZES), present, strict=True):
            param.grad = piece.clone() if here else None
        lr = single.lr  # update() moves the schedule on to the next step's rate
        single.update()
        state.apply(grad, step, present=present)
        assert torch.equal(state.values, torch.cat([p.detach() for p in params])), step
        assert state.lr == lr
    for slot, param in zip(state.slots, params, strict=True):
        mine, theirs = state.updater.optimizer.state[slot], single.optimizer.state[param]
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            assert torch.equal(mine[key], value), key
            assert mine[key].dtype == value.dtype, key


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", CONFIGS)
def test_apply_dumps_the_state_the_old_path_dumped(name: str, dtype: torch.dtype) -> None:
    """The checkpoint layout is unchanged: the same keys and bits as ``.grad`` + ``step()``
    (a slot never updated: zeros; Adam's ``step`` repeated over its slot)."""
    config = CONFIGS[name]
    old, new = _shard(config, dtype), _shard(config, dtype)
    for step, grad in enumerate(_grads(dtype)):
        _old_apply(old, grad, step, _present(step))
        new.apply(grad, step, present=_present(step))
    before, after = old.state_tensors(), new.state_tensors()
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key


@pytest.mark.parametrize("name", CONFIGS)
def test_a_checkpoint_round_trip_continues_bit_for_bit(name: str) -> None:
    """Dump after some steps, load into a fresh shard, go on: the same values and state as
    the shard that never stopped, Adam's step counter included."""
    config, grads = CONFIGS[name], _grads(torch.float64)
    original = _shard(config, torch.float64)
    for step in range(3):
        original.apply(grads[step], step, present=_present(step))
    restored = ShardState(
        torch.zeros(sum(SIZES), dtype=torch.float64),
        lambda ps: Updater(ps, config, lr=config.base_lr()),
        sizes=SIZES,
    )
    restored.load_state_tensors(original.state_tensors())
    for step in range(3, STEPS):
        for state in (original, restored):
            state.apply(grads[step], step, present=_present(step))
    assert torch.equal(original.values, restored.values)
    dumped, reloaded = original.state_tensors(), restored.state_tensors()
    assert dumped.keys() == reloaded.keys()
    for key in dumped:
        assert torch.equal(dumped[key], reloaded[key]), key


def test_an_empty_variable_with_adam_dumps_assembles_and_reloads() -> None:
    """A parameter of no elements (``torch.empty(0)``) beside others: Adam's ``step`` is
    repeated over each slot's elements, so the empty one keeps none. The checkpoint leaves
    it out there, and a reload goes on with the same bits (before: an IndexError at the
    end of training under ps and p3)."""
    from gradsync.comm.server import assemble_variable, lay_out

    config, sizes = CONFIGS["adam + weight decay"], [3, 0, 2]
    make = lambda ps: Updater(ps, config, lr=config.base_lr())  # noqa: E731
    original = ShardState(torch.linspace(-1, 1, 5, dtype=torch.float64), make, sizes=sizes)
    grads = _grads(torch.float64)
    for step in range(2):
        original.apply(grads[step][:5], step)
    dumped = original.state_tensors()
    pieces = lay_out([("a", 0, 3), ("empty", 0, 0), ("b", 0, 2)])
    empty = assemble_variable([(pieces[1], dumped)], torch.Size([0]), "empty")
    assert empty["param/empty"].shape == (0,) and "optim/empty/step" not in empty
    assert assemble_variable([(pieces[2], dumped)], torch.Size([2]), "b")["optim/b/step"] == 2
    restored = ShardState(torch.zeros(5, dtype=torch.float64), make, sizes=sizes)
    restored.load_state_tensors(dumped)
    for state in (original, restored):
        state.apply(grads[2][:5], 2)
    assert torch.equal(original.values, restored.values)


def test_a_gradient_of_the_wrong_dtype_or_size_is_refused() -> None:
    """``.grad`` refused these; the direct path must not quietly promote them."""
    state = _shard(CONFIGS["sgd momentum + weight decay"], torch.float64)
    with pytest.raises(ValueError, match="float32"):
        state.apply(torch.ones(sum(SIZES)), 0)
    with pytest.raises(ValueError, match="gradient"):
        state.apply(torch.ones(2, dtype=torch.float64), 0)


OPTIMIZERS = {
    "sgd nesterov": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01
    ),
    "sgd dampening, maximize": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.5, dampening=0.3, maximize=True
    ),
    "adam amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True, weight_decay=0.1),
    "adam betas, eps": lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.99), eps=1e-6),
    "adamw (through step())": lambda ps: torch.optim.AdamW(ps, lr=0.01),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_step_params_equals_step_for_every_flag(name: str, dtype: torch.dtype) -> None:
    """Flags the configs do not set yet (nesterov, dampening, amsgrad, …) go through the
    same functional call; an optimizer without a direct form falls back to ``step()``."""
    make = OPTIMIZERS[name]
    mine = [nn.Parameter(t.clone()) for t in _initial(dtype).split(SIZES)]
    theirs = [nn.Parameter(t.clone()) for t in _initial(dtype).split(SIZES)]
    fast, reference = make(mine), make(theirs)
    assert (direct_step_of(fast) is None) == name.endswith("(through step())")
    for step, grad in enumerate(_grads(dtype)):
        present = _present(step)
        chosen = [i for i, here in enumerate(present) if here]
        pieces = grad.split(SIZES)
        step_params(fast, [mine[i] for i in chosen], [pieces[i] for i in chosen])
        for param, piece, here in zip(theirs, pieces, present, strict=True):
            param.grad = piece if here else None
        reference.step()
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a.detach(), b.detach()), step
    assert all(p.grad is None for p in mine)


def _old_sum_in_order(items: list[Tensor | None], scale: float) -> Tensor | None:
    """Aggregation as it was: a copy of the first, the others added, then scaled."""
    present = [t for t in items if t is not None]
    if not present:
        return None
    total = present[0].clone()
    for tensor in present[1:]:
        total += tensor
    if scale != 1.0:
        total *= scale
    return total


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
@pytest.mark.parametrize("pattern", ["1", "11", "101", "111", "1101", "0"])
def test_sum_in_order_keeps_the_old_bits(pattern: str, scale: float, dtype: torch.dtype) -> None:
    """One copy fewer, the same sum and scaling in the same order; inputs untouched."""
    generator = torch.Generator().manual_seed(3)
    items = [
        torch.randn(1000, generator=generator, dtype=dtype) if bit == "1" else None
        for bit in pattern
    ]
    copies = [None if t is None else t.clone() for t in items]
    expected = _old_sum_in_order(items, scale)
    total = sum_in_order(items, scale=scale)
    if expected is None:
        assert total is None
        return
    assert total is not None and total.dtype == dtype
    assert torch.equal(total, expected)
    assert all(t is None or torch.equal(t, c) for t, c in zip(items, copies, strict=True))
    assert all(t is None or t.data_ptr() != total.data_ptr() for t in items)
