"""Server update rules without processes: synchronous rounds and the staleness bound."""

from __future__ import annotations

import torch

from gradsync.comm.pushpull import DenseServer, plan_chunks
from gradsync.comm.server import ServerMetrics, ShardState, split_variable
from gradsync.comm.wire import Header, Kind, Message
from gradsync.config import OptimConfig
from gradsync.metrics import ServerRecord
from gradsync.optim import Updater


class FakeOutbox:
    def __init__(self) -> None:
        self.sent: list[tuple[int, int]] = []  # (worker, step applied)
        self.replies: list[tuple[int, int, int, list[float]]] = []  # (worker, step, chunk, values)

    def send(self, worker: int, header: Header, tensors: list[torch.Tensor]) -> int:
        self.sent.append((worker, header.step))
        self.replies.append((worker, header.step, header.index, tensors[0].tolist()))
        return sum(t.numel() * 8 for t in tensors)

    def flush(self) -> None:
        pass


def _state(lr: float = 0.1) -> ShardState:
    return ShardState(
        torch.zeros(2), lambda ps: Updater(ps, OptimConfig(lr=lr, momentum=0.0), lr=lr)
    )


def _server(state: ShardState, outbox: FakeOutbox, workers: int, **rule) -> DenseServer:
    records: list[ServerRecord] = []
    server = DenseServer(
        state, outbox, ServerMetrics(write=records.append), num_workers=workers, **rule
    )  # type: ignore[arg-type]
    server.records = records  # type: ignore[attr-defined]
    return server


def _push(
    server: DenseServer, worker: int, step: int, grad: list[float], flags=(1.0,), chunk: int = 0
) -> None:
    """A push of a chunk's gradients followed by its had-a-gradient flag(s), counted as the
    server loop counts it."""
    payload = torch.tensor([*grad, *flags])
    server.metrics.tally(step).pushes += 1
    header = Header(Kind.PUSH, worker=worker, step=step, index=chunk)
    server.on_push(Message(header, [payload], 64))


def test_sync_rounds_average_all_workers_then_answer_everyone() -> None:
    state, outbox = _state(), FakeOutbox()
    server = _server(state, outbox, 3, synchronous=True)
    for worker, grad in enumerate([[3.0, 0.0], [0.0, 3.0], [3.0, 3.0]]):
        _push(server, worker, 0, grad)
        if worker < 2:
            assert outbox.sent == []  # nothing is applied before the last worker pushed
    assert torch.allclose(state.values.detach(), torch.tensor([-0.2, -0.2]))
    assert outbox.sent == [(0, 0), (1, 0), (2, 0)]
    assert [r.step for r in server.records] == [0]  # type: ignore[attr-defined]


def test_staleness_bound_holds_back_a_fast_worker() -> None:
    state, outbox = _state(), FakeOutbox()
    server = _server(state, outbox, 2, synchronous=False, staleness=2)
    for step in range(3):  # worker 0 runs ahead while worker 1 is still in step 0
        _push(server, 0, step, [1.0, 1.0])
    # After step 1 it may start step 2 (2 ahead of worker 1); step 3 would be 3 ahead.
    assert outbox.sent == [(0, 0), (0, 1)]
    _push(server, 1, 0, [1.0, 1.0])
    assert outbox.sent[2:] == [(0, 2), (1, 0)]
    assert state.num_updates == 4  # every push applied on arrival


def test_async_never_holds_an_answer() -> None:
    outbox = FakeOutbox()
    server = _server(_state(), outbox, 2, synchronous=False, staleness=None)
    for step in range(5):
        _push(server, 0, step, [1.0, 1.0])
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


def test_a_loaded_state_continues_exactly_like_the_dumped_one() -> None:
    """Resume: a server loaded from another's dump takes the same next step, bit for bit."""
    config = OptimConfig(name="adam", lr=1e-2)
    make = lambda ps: Updater(ps, config, lr=1e-2)  # noqa: E731
    original = ShardState(torch.arange(5.0), make, sizes=[2, 3])
    for step in range(3):
        original.apply(torch.linspace(-1, 1, 5) * (step + 1), step)
    restored = ShardState(torch.zeros(5), make, sizes=[2, 3])
    restored.load_state_tensors(original.state_tensors())
    for state in (original, restored):
        state.apply(torch.ones(5), 3)
    assert torch.equal(original.values, restored.values)


def test_a_slot_without_a_gradient_anywhere_is_not_moved() -> None:
    """single's optimizer skips a parameter whose grad is None: no weight decay, no
    momentum; so does the server for a slot every worker flagged as without gradient."""
    state, outbox = _momentum_state([1, 2]), FakeOutbox()
    server = _server(state, outbox, 2, synchronous=True)
    for step in range(3):
        for worker in range(2):
            present = 1.0 if step == 0 else 0.0  # slot 1 used in step 0 only
            _push(server, worker, step, [1.0, 0.0, 0.0], flags=(1.0, present))
        if step == 0:
            after_first = state.values[1:].clone()
    assert torch.equal(state.values[1:], after_first)  # momentum did not carry it on
    assert not torch.equal(state.values[:1], torch.ones(1))


def test_a_gradient_on_some_workers_only_is_averaged_with_zeros() -> None:
    state, outbox = _momentum_state([2]), FakeOutbox()
    server = _server(state, outbox, 2, synchronous=True)
    _push(server, 0, 0, [4.0, 4.0], flags=(1.0,))
    _push(server, 1, 0, [0.0, 0.0], flags=(0.0,))
    # grad (4 + 0) / 2 = 2, plus weight decay 0.5 · 1: 1 - 0.1 · 2.5
    assert torch.allclose(state.values, torch.tensor([0.75, 0.75]))


def test_split_variable_inverts_assembly() -> None:
    from gradsync.comm.server import Piece, assemble_checkpoint

    model = torch.nn.Linear(3, 2)
    pieces = [
        [Piece("weight", 0, 4)],
        [Piece("weight", 4, 6), Piece("bias", 0, 2, offset=2)],
    ]
    ckpt = {
        "param/weight": torch.arange(6.0).view(2, 3),
        "param/bias": torch.tensor([7.0, 8.0]),
        "optim/weight/momentum_buffer": -torch.arange(6.0).view(2, 3),
        "optim/bias/momentum_buffer": torch.tensor([-7.0, -8.0]),
    }
    states = [split_variable(ckpt, p) for p in pieces]
    assert states[1]["values"].tolist() == [4.0, 5.0, 7.0, 8.0]
    again = assemble_checkpoint(model, pieces, states)
    for key, value in ckpt.items():
        assert torch.equal(again[key], value), key


def _chunked(workers: int, **rule) -> tuple[ShardState, FakeOutbox, DenseServer]:
    """A server of slots [1, 2] cut into two chunks, one slot each."""
    state, outbox = _momentum_state([1, 2]), FakeOutbox()
    server = _server(state, outbox, workers, chunks=plan_chunks([1, 2], 1), **rule)
    return state, outbox, server


def test_each_chunk_is_applied_and_answered_as_soon_as_every_worker_pushed_it() -> None:
    state, outbox, server = _chunked(2, synchronous=True)
    reference = _momentum_state([1, 2])
    reference.apply(torch.tensor([2.0, 3.0, 3.0]), step=0)  # the whole step at once
    _push(server, 0, 0, [2.0], chunk=0)
    _push(server, 1, 0, [2.0], chunk=0)
    assert [(w, i) for w, _, i, _ in outbox.replies] == [(0, 0), (1, 0)]  # chunk 1 not yet
    assert outbox.replies[0][3] == reference.values[:1].tolist()
    assert torch.equal(state.values[1:], torch.ones(2))  # chunk 1 untouched so far
    assert server.records == []  # type: ignore[attr-defined]
    _push(server, 0, 0, [3.0, 3.0], chunk=1)
    _push(server, 1, 0, [3.0, 3.0], chunk=1)
    assert outbox.replies[2][2:] == (1, reference.values[1:].tolist())
    assert torch.equal(state.values, reference.values)  # chunks = one whole step
    assert [r.step for r in server.records] == [0]  # type: ignore[attr-defined]


def test_a_workers_clock_advances_with_its_last_chunk_only() -> None:
    """SSP counts steps, not chunks: worker 0's step 1 is held only once it finished step 0
    entirely and is 2 steps ahead of a worker still in step 0."""
    _, outbox, server = _chunked(2, synchronous=False, staleness=1)
    _push(server, 0, 0, [1.0], chunk=0)
    assert server.clocks == [0, 0]
    _push(server, 0, 0, [1.0, 1.0], chunk=1)
    assert server.clocks == [1, 0]
    assert [(s, i) for _, s, i, _ in outbox.replies] == [(0, 0), (0, 1)]
    _push(server, 0, 1, [1.0], chunk=0)  # step 2 would be 2 ahead of worker 1: held
    assert len(outbox.replies) == 2
    _push(server, 1, 0, [1.0], chunk=0)  # answered; worker 1 is still in step 0
    assert [(w, s, i) for w, s, i, _ in outbox.replies[2:]] == [(1, 0, 0)]
    _push(server, 1, 0, [1.0, 1.0], chunk=1)  # worker 1 done with step 0: release
    assert [(w, s, i) for w, s, i, _ in outbox.replies[3:]] == [(0, 1, 0), (1, 0, 1)]
