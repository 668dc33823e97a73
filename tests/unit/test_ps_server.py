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


def _push(worker: int, step: int, grad: list[float]) -> Message:
    return Message(PUSH, worker, step, torch.tensor(grad), wire_bytes=4 * (HEADER + len(grad)))


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
    assert set(tensors) == {"values", "optim/step", "optim/exp_avg", "optim/exp_avg_sq"}
    assert tensors["optim/step"].dim() == 0 and tensors["optim/exp_avg"].shape == (3,)
