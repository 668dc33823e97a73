"""Server update rules without processes: synchronous rounds and the staleness bound."""

from __future__ import annotations

import torch

from gradsync.comm.pushpull import HEADER, PUSH, Message
from gradsync.comm.server import BoundedStaleness, RoundLog, ServerRound, ShardState, SyncRounds
from gradsync.config import OptimConfig
from gradsync.optim import Updater


class FakeOutbox:
    def __init__(self) -> None:
        self.sent: list[tuple[int, int]] = []  # (worker, step applied)

    def send(self, worker: int, tensor: torch.Tensor, tag: int = 0) -> int:
        self.sent.append((worker, int(tensor[0])))
        return tensor.numel() * 4


def _state(lr: float = 0.1) -> ShardState:
    return ShardState(
        torch.zeros(2), lambda ps: Updater(ps, OptimConfig(lr=lr, momentum=0.0), lr=lr)
    )


def _push(worker: int, step: int, grad: list[float], flags: tuple[float, ...] = (1.0,)) -> Message:
    """A push of one slot's gradient followed by its had-a-gradient flag(s)."""
    payload = torch.tensor([*grad, *flags])
    return Message(PUSH, worker, step, payload, wire_bytes=4 * (HEADER + len(payload)))


def test_sync_rounds_average_all_workers_then_answer_everyone() -> None:
    state, outbox, rounds = _state(), FakeOutbox(), []
    log = RoundLog(3, rounds.append)
    rule = SyncRounds(state, outbox, log)  # type: ignore[arg-type]
    for worker, grad in enumerate([[3.0, 0.0], [0.0, 3.0], [3.0, 3.0]]):
        log.tally(0).pushes += 1
        rule.on_push(_push(worker, 0, grad))
        if worker < 2:
            assert outbox.sent == []  # nothing is applied before the last worker pushed
    log.report_complete()
    assert torch.allclose(state.values.detach(), torch.tensor([-0.2, -0.2]))
    assert outbox.sent == [(0, 0), (1, 0), (2, 0)]
    assert [r.step for r in rounds] == [0] and isinstance(rounds[0], ServerRound)


def test_staleness_bound_holds_back_a_fast_worker() -> None:
    state, outbox = _state(), FakeOutbox()
    rule = BoundedStaleness(state, outbox, RoundLog(2, lambda _: None), staleness=2)  # type: ignore[arg-type]
    for step in range(3):  # worker 0 runs ahead while worker 1 is still in step 0
        rule.on_push(_push(0, step, [1.0, 1.0]))
    # After step 1 it may start step 2 (2 ahead of worker 1); step 3 would be 3 ahead.
    assert outbox.sent == [(0, 0), (0, 1)]
    rule.on_push(_push(1, 0, [1.0, 1.0]))
    assert outbox.sent[2:] == [(0, 2), (1, 0)]
    assert state.num_updates == 4  # every push applied on arrival


def test_async_never_holds_an_answer() -> None:
    outbox = FakeOutbox()
    rule = BoundedStaleness(_state(), outbox, RoundLog(2, lambda _: None), staleness=None)  # type: ignore[arg-type]
    for step in range(5):
        rule.on_push(_push(0, step, [1.0, 1.0]))
    assert [step for _, step in outbox.sent] == [0, 1, 2, 3, 4]


def test_state_tensors_hold_values_and_optimizer_state() -> None:
    state = ShardState(
        torch.ones(3), lambda ps: Updater(ps, OptimConfig(name="adam", lr=1e-3), lr=1e-3)
    )
    state.apply(torch.ones(3), step=0)
    tensors = state.state_tensors()
    assert set(tensors) == {"values", "optim/step@scalar", "optim/exp_avg", "optim/exp_avg_sq"}
    assert tensors["optim/step@scalar"].tolist() == [1.0] * 3  # one per element, like values
    assert tensors["optim/exp_avg"].shape == (3,)


def _momentum_state(sizes: list[int]) -> ShardState:
    config = OptimConfig(lr=0.1, momentum=0.9, weight_decay=0.5)
    return ShardState(torch.ones(sum(sizes)), lambda ps: Updater(ps, config, lr=0.1), sizes)


def test_a_slot_without_a_gradient_anywhere_is_not_moved() -> None:
    """single's optimizer skips a parameter whose grad is None: no weight decay, no
    momentum; so does the server for a slot every worker flagged as without gradient."""
    state, outbox = _momentum_state([1, 2]), FakeOutbox()
    rule = SyncRounds(state, outbox, RoundLog(2, lambda _: None))  # type: ignore[arg-type]
    for step in range(3):
        for worker in range(2):
            present = 1.0 if step == 0 else 0.0  # slot 1 used in step 0 only
            rule.on_push(_push(worker, step, [1.0, 0.0, 0.0], flags=(1.0, present)))
        if step == 0:
            after_first = state.values[1:].clone()
    assert torch.equal(state.values[1:], after_first)  # momentum did not carry it on
    assert not torch.equal(state.values[:1], torch.ones(1))


def test_a_gradient_on_some_workers_only_is_averaged_with_zeros() -> None:
    state, outbox = _momentum_state([2]), FakeOutbox()
    rule = SyncRounds(state, outbox, RoundLog(2, lambda _: None))  # type: ignore[arg-type]
    rule.on_push(_push(0, 0, [4.0, 4.0], flags=(1.0,)))
    rule.on_push(_push(1, 0, [0.0, 0.0], flags=(0.0,)))
    # grad (4 + 0) / 2 = 2, plus weight decay 0.5 · 1: 1 - 0.1 · 2.5
    assert torch.allclose(state.values, torch.tensor([0.75, 0.75]))
