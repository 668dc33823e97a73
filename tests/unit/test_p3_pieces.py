"""P3's pieces without processes: slicing, layer order from the forward, the priority sender."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gradsync.comm.layer_order import LayerOrder
from gradsync.comm.pieces import Piece
from gradsync.comm.priority import P3Server, PrioritySender, bundle_message, unbundle
from gradsync.comm.server import ServerMetrics, ShardState
from gradsync.comm.slicing import server_sizes, slice_bounds, slice_variables
from gradsync.comm.wire import Header, Kind, Message
from gradsync.config import OptimConfig
from gradsync.errors import UserError
from gradsync.models import build_workload
from gradsync.optim import Updater
from gradsync.strategies.p3 import PriorityPropagation

shapes = st.lists(
    st.lists(st.integers(1, 30), min_size=1, max_size=2).map(tuple), min_size=1, max_size=10
)


@settings(max_examples=100, deadline=None)
@given(shapes=shapes, slice_size=st.integers(4, 300), num_servers=st.integers(1, 4))
def test_slices_cover_every_variable_once_within_size_round_robin(
    shapes: list[tuple[int, ...]], slice_size: int, num_servers: int
) -> None:
    variables = [(f"v{i}", int(torch.Size(shape).numel())) for i, shape in enumerate(shapes)]
    try:
        slices = slice_variables(variables, slice_size=slice_size, num_servers=num_servers)
    except UserError:
        total = sum(len(slice_bounds(n, slice_size)) for _, n in variables)
        assert total < num_servers
        return
    for name, numel in variables:
        mine = [s for s in slices if s.name == name]
        covered = [i for s in mine for i in range(s.start, s.stop)]
        assert covered == list(range(numel))  # every value exactly once, in order
        assert all(0 < s.numel <= slice_size for s in mine)
        # "about" slice_size: near-equal pieces, never more than one piece too many
        assert len(mine) == -(-numel // slice_size)
    assert [s.index for s in slices] == list(range(len(slices)))
    assert [s.server for s in slices] == [i % num_servers for i in range(len(slices))]
    # Each server's buffer: its slices back to back in model order.
    for server in range(num_servers):
        offsets = [s.offset for s in slices if s.server == server]
        sizes = [s.numel for s in slices if s.server == server]
        assert offsets == [sum(sizes[:i]) for i in range(len(sizes))]
    assert sum(server_sizes(slices, num_servers)) == sum(n for _, n in variables)


def test_no_slicing_is_one_slice_per_variable_and_too_many_servers_is_an_error() -> None:
    slices = slice_variables([("a", 100_000), ("b", 3)], slice_size=None, num_servers=2)
    assert [(s.name, s.start, s.stop, s.server) for s in slices] == [
        ("a", 0, 100_000, 0),
        ("b", 0, 3, 1),
    ]
    with pytest.raises(UserError, match="3 parameter servers but only 2 slices"):
        slice_variables([("a", 10), ("b", 3)], slice_size=None, num_servers=3)


def test_default_slice_size_cuts_vgg16_into_about_40k_values() -> None:
    model = build_workload("vgg16", preset="default", seed=0, dropout=False).model
    variables = [(n, p.numel()) for n, p in model.named_parameters()]
    slices = slice_variables(variables, slice_size=40_000, num_servers=2)
    assert max(s.numel for s in slices) <= 40_000
    sizes = dict(variables)
    cut = [s for s in slices if sizes[s.name] > 40_000]
    assert cut and min(s.numel for s in cut) > 20_000  # near-equal pieces, no tiny remainders


def _first_forward(model: nn.Module, *inputs: torch.Tensor):
    recorder = LayerOrder(model)
    model(*inputs)
    return recorder.finish()


def test_layer_order_follows_the_forward_not_the_declaration() -> None:
    class Backwards(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.last = nn.Linear(3, 1)  # declared first, runs last
            self.first = nn.Linear(2, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.last(self.first(x))

    layers = _first_forward(Backwards(), torch.ones(1, 2))
    assert layers.names == ["first", "last"]
    assert layers.layer_of == {"last.weight": 1, "last.bias": 1, "first.weight": 0, "first.bias": 0}


def test_an_owner_the_first_forward_did_not_call_first_waits_for_its_parameters_layer() -> None:
    """A tied copy that a later forward calls before the layer that read the weight first
    (a branch skipped on the first forward): it must wait for that layer too."""

    class Skipping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.early = nn.Linear(2, 2)
            self.first = nn.Linear(2, 2)
            self.late = nn.Linear(2, 2)
            self.early.weight = self.late.weight  # tied
            self.take_early = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.take_early:
                x = self.early(x)
            return self.late(self.first(x))

    model = Skipping()
    layers = _first_forward(model, torch.ones(1, 2))
    # early.bias, never read, belongs to the nearest called ancestor: the model, layer 0.
    assert layers.names == ["(model)", "first", "late"] and layers.layer_of["early.weight"] == 2
    assert layers.owners == [(model.early, (0, 2))]


def test_layer_order_of_the_transformer_handles_tied_and_uncalled_owners() -> None:
    workload = build_workload("transformer", preset="tiny", seed=0, dropout=False)
    batch = workload.dataset.batch(step=0, size=2, start=0, stop=2)
    layers = _first_forward(workload.model, *batch.inputs)
    # The tied embedding is used first by the embedding (and last by the output projection).
    assert layers.layer_of["embedding.weight"] == 0
    # out_proj's forward is never called (MultiheadAttention reads its weight): its layer is
    # the attention module's.
    for name in ("in_proj_weight", "out_proj.weight"):
        key = f"encoder.layers.0.self_attn.{name}"
        assert layers.names[layers.layer_of[key]] == "encoder.layers.0.self_attn"
    encoder = layers.layer_of["encoder.layers.0.linear1.weight"]
    decoder = layers.layer_of["decoder.layers.0.linear1.weight"]
    assert 0 < encoder < decoder
    assert set(layers.layer_of) == {n for n, _ in workload.model.named_parameters()}


def test_a_parameter_read_before_its_layer_runs_belongs_to_the_reader() -> None:
    """A weight the model's forward reads before calling its owner, and a hook-based
    spectral_norm whose pre-hook reads ``weight_orig``: each parameter's layer is the
    module running at its first read, so a wait in that layer's pre-hook comes first."""

    class EarlyRead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(2, 3)
            self.head = nn.utils.spectral_norm(nn.Linear(3, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            shift = self.head.bias.sum()  # read before self.first and self.head run
            return self.head(self.first(x)) + shift

    layers = _first_forward(EarlyRead(), torch.ones(1, 2))
    assert layers.names == ["(model)", "first", "head"]
    assert layers.layer_of == {
        "first.weight": 1, "first.bias": 1, "head.bias": 0, "head.weight_orig": 2
    }  # fmt: skip
    assert not torch.overrides._is_torch_function_mode_enabled()  # the recording mode left


def _blocking_sender(fifo: bool):
    """A sender whose first send blocks until released: everything queued meanwhile waits."""
    release, sent = threading.Event(), []

    def send(items: list[tuple[int, int]], records) -> None:
        if not sent:
            release.wait(5)
        sent.extend(items)

    return PrioritySender(send, name="test-send", fifo=fifo), release, sent


@pytest.mark.parametrize("fifo", [False, True])
def test_an_early_layer_overtakes_queued_later_layers_unless_fifo(fifo: bool) -> None:
    sender, release, sent = _blocking_sender(fifo)
    # Backward order: the last layer's slices first; the first layer's arrive late.
    for layer in (3, 3, 2, 2, 1, 0, 0):
        sender.put((layer, len(sent)), priority=layer)
        time.sleep(0.01)  # the first item is on the wire (blocked) before the rest queue
    release.set()
    sender.close(timeout_s=5)
    layers = [layer for layer, _ in sent]
    if fifo:
        assert layers == [3, 3, 2, 2, 1, 0, 0]
        assert all(r.next_seq is None or r.seq < r.next_seq for r in sender.log)
    else:
        # Slice granularity: only the slice already on the wire goes before layer 0.
        assert layers == [3, 0, 0, 1, 2, 2, 3]
        # The send log: whenever several layers were queued, the lowest went first.
        for record in sender.log:
            assert record.next_priority is None or record.priority <= record.next_priority


SEND_LOGS = {
    # (priority, seq, num_waiting, next_priority, next_seq) of each send
    False: [(5, 0, 0, None, None), (0, 4, 3, 1, 1), (1, 2, 2, 3, 1), (3, 1, 1, 3, 3),
            (3, 3, 0, None, None)],
    True: [(5, 0, 0, None, None), (3, 1, 3, 0, 2), (1, 2, 2, 0, 3), (3, 3, 1, 0, 4),
           (0, 4, 0, None, None)],
}  # fmt: skip


@pytest.mark.parametrize("fifo", [False, True])
def test_the_send_log_records_what_was_left_waiting(fifo: bool) -> None:
    """The first send blocks until four more items are queued (and the stop marker, which
    is never counted): each record holds how many were left waiting, their lowest priority
    and their lowest arrival number, in priority or arrival order."""
    on_wire, release = threading.Event(), threading.Event()

    def send(items: list[str], records) -> None:
        on_wire.set()
        release.wait(5)

    sender = PrioritySender(send, name="test-log", fifo=fifo)
    sender.put("first", priority=5)
    assert on_wire.wait(5)
    for priority in (3, 1, 3, 0):
        sender.put(f"p{priority}", priority=priority)
    release.set()
    sender.close(timeout_s=5)
    log = [(r.priority, r.seq, r.num_waiting, r.next_priority, r.next_seq) for r in sender.log]
    assert log == SEND_LOGS[fifo]


BUNDLED = {
    # window (items in flight, here the room of every take): the messages after the first
    4: [
        # Taken together in priority order: b1, a1, a2 — a's second a2 would be its third.
        [("b", 1)],
        [("a", 1), ("a", 2)],
        # The control item stops a bundle and goes alone.
        [("a", 2)],
        [("control", 2)],
        [("a", 3)],
        [("b", 4)],
    ],
    2: [[("b", 1)], [("a", 1)], [("a", 2), ("a", 2)], [("control", 2)], [("a", 3)], [("b", 4)]],
}


@pytest.mark.parametrize("window", list(BUNDLED))
def test_slices_queued_back_to_back_share_a_message_per_peer_in_order(window: int) -> None:
    """The first send blocks; meanwhile slices for peers a and b queue. Each later message
    holds at most ``bundle_limit`` of one peer's slices, a take at most ``window`` items,
    in priority order, and an item that may not share a message (the control item)
    travels alone."""
    release, messages = threading.Event(), []

    def send(items: list[tuple[str, int]], records) -> None:
        if not messages:
            release.wait(5)
        messages.append(items)

    sender = PrioritySender(
        send,
        name="test-bundle",
        window=window,
        bundle=lambda item: None if item[0] == "control" else item[0],
        bundle_limit=2,
    )
    sender.put(("a", 0), priority=0)
    time.sleep(0.05)  # on the wire (blocked) before the rest queue
    queued = [("a", 3), ("b", 1), ("a", 1), ("a", 2), ("a", 2), ("control", 2), ("b", 4)]
    for peer, priority in queued:
        sender.put((peer, priority), priority=priority)
    release.set()
    sender.close(timeout_s=5)
    assert messages == [[("a", 0)], *BUNDLED[window]]
    assert [r.priority for r in sender.log] == [0, 1, 1, 2, 2, 2, 3, 4]


class _HeldOutbox:
    """An outbox whose first post waits for ``release`` (``held`` is set once it waits):
    what is queued meanwhile queues behind it."""

    local_peer = None

    def __init__(self) -> None:
        self.held, self.release, self.posts = threading.Event(), threading.Event(), []

    def post(self, peer: int, header: Header, tensors: list[torch.Tensor]):
        if not self.posts:
            self.held.set()
            self.release.wait(5)
        self.posts.append((peer, header, [t.clone() for t in tensors]))
        return 0, lambda: None


def test_a_server_applies_bundled_slices_like_single_ones_and_bundles_its_answers() -> None:
    """Two workers push slices 0–2 of one step, worker 0 as one bundle and worker 1 one by
    one. Every slice is applied once with the mean gradient; the answers, queued while a
    state reply is on the wire, go out as one bundle per worker, in priority order."""
    sizes, optim = (2, 3, 1), OptimConfig(lr=0.5, momentum=0.0)
    states = {
        i: ShardState(torch.zeros(n), lambda ps: Updater(ps, optim, lr=0.5))
        for i, n in enumerate(sizes)
    }
    outbox = _HeldOutbox()
    server = P3Server(
        states, outbox, ServerMetrics(), num_workers=2, fifo=False, timeout_s=5,
        slices_per_message=8,
    )  # fmt: skip
    server.on_state(Message(Header(Kind.STATE, worker=0)))
    assert outbox.held.wait(5)
    grads = [torch.arange(6.0), torch.arange(6.0) * 3]  # slices end to end, per worker
    pieces = [Header(Kind.PUSH, step=0, index=i, priority=2 - i) for i in range(3)]
    header, tensors = bundle_message(Kind.PUSH, pieces, list(grads[0].split(sizes)), worker=0)
    server.on_push(Message(header, tensors))
    for piece, grad in zip(pieces, grads[1].split(sizes), strict=True):
        server.on_push(Message(dataclasses.replace(piece, worker=1, length=grad.numel()), [grad]))
    outbox.release.set()
    server.close()
    expected = -0.5 * (grads[0] + grads[1]) / 2
    assert torch.equal(torch.cat([states[i].values for i in range(3)]), expected)
    kinds = [(peer, h.kind, h.count) for peer, h, _ in outbox.posts]
    assert kinds == [(0, Kind.STATE_REPLY, 1), (0, Kind.REPLY, 3), (1, Kind.REPLY, 3)]
    for _, bundled, (manifest, values) in outbox.posts[1:]:
        assert unbundle(bundled, [manifest]) == [(2, 0), (1, 1), (0, 2)]  # priority order
        assert torch.equal(values, torch.cat([states[i].values for i in (2, 1, 0)]))


def test_a_worker_writes_a_bundled_reply_into_its_parameters() -> None:
    """A bundle's values, its slices end to end, land in each slice's place; the lengths
    must add up."""
    strategy = _bare_strategy()
    pieces = [Piece("b", 1, 4), Piece("w", 0, 2), Piece("w", 4, 6)]
    strategy._write_slices(pieces, torch.arange(1.0, 8.0))
    assert strategy.params["b"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert strategy.params["w"].tolist() == [[4.0, 5.0, 0.0], [0.0, 6.0, 7.0]]
    with pytest.raises(ValueError, match="a bundle of 6 values cannot hold"):
        strategy._write_slices(pieces, torch.ones(6))


def _bare_strategy() -> PriorityPropagation:
    """A p3 strategy with only its parameters and its write state."""
    strategy = PriorityPropagation.__new__(PriorityPropagation)
    strategy.params = {"w": nn.Parameter(torch.zeros(2, 3)), "b": nn.Parameter(torch.zeros(4))}
    strategy._writes, strategy._in_backward, strategy._held = threading.Lock(), False, []
    return strategy


def test_values_back_during_backward_are_written_when_it_ends() -> None:
    """Backward may still read a parameter it saved in forward (through .detach(), say):
    a slice that comes back meanwhile waits until step(), after backward."""
    strategy = _bare_strategy()
    strategy._in_backward = True  # a gradient hook of this step has run
    saved = strategy.params["b"].detach()  # what backward saved
    strategy._write_slices([Piece("b", 0, 4)], torch.ones(4))
    assert saved.tolist() == [0.0, 0.0, 0.0, 0.0]
    strategy._write_held()  # step(): backward is over
    assert saved.tolist() == [1.0, 1.0, 1.0, 1.0] and not strategy._in_backward
    strategy._write_slices([Piece("b", 0, 4)], torch.full((4,), 2.0))  # after: at once
    assert saved.tolist() == [2.0, 2.0, 2.0, 2.0]
