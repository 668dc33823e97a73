"""``p3``: Priority-based Parameter Propagation (Jayarajan et al., SysML'19).

A parameter server (the servers own the values and the optimizer, as in ``ps``) with two
changes that let communication overlap computation:

1. **Slicing** (:mod:`gradsync.comm.slicing`): every variable is cut into slices of about
   ``--slice-size`` values (default 40,000), spread round-robin over the servers.
2. **Priority propagation**: each slice carries its layer's priority — the layer's place
   in the forward pass, input side first, found by :class:`~gradsync.comm.layer_order.
   LayerOrder` on the first step. Backward produces gradients output side first; a
   ``post_accumulate_grad`` hook queues a parameter's slices the moment its gradient is
   complete, and one sender thread (:class:`~gradsync.comm.priority.PrioritySender`) sends
   them most urgent first, so a late slice of an early layer overtakes the queued slices
   of later layers.

Messages: ``--slices-per-message N`` lets up to N slices queued back to back for the same
server (and answers for the same worker) travel as one message, with N slices (at least
4) in flight per sender; a server's answers share that many times the workers it answers.
The default, 1, is MXNet's P3: a message per slice, 4 in flight. P3's messages cost
microseconds in C++; each of ours passes through Gloo and several Python threads (2.4–3.6
ms of CPU per slice across the processes on vgg16), so where the cores are the bottleneck
16 per message takes p3 from 0.68× to 0.94× ``ps`` (vgg16 on loopback, 2 cores). Behind
a 300 Mbit/s link the larger messages cost 12% instead
(docs/results/strategies-vs-ddp/session8). Sharing messages keeps the order and the slices
the server applies; an urgent slice may wait behind N slices on the wire instead of 4.

Pull is merged into push: a server answers each slice, once every worker's contribution is
in and applied, with the updated slice, which a receiver thread per server writes straight
into the parameter. A layer is ready when all its slices are back, and its forward
pre-hook waits for that layer only: the next forward starts while the later layers'
slices are still in flight.

Why it is safe to write a parameter from a receiver thread: its slices are sent only after
its gradient is fully accumulated (no backward node reads it any more in this step), and
the next read is its layer's next forward, which waits until every slice has arrived.

Servers are dedicated ranks (``--servers S``) or threads of the workers (``--colocate``:
worker k serves shard k; its own slices are handed over in the process). The server side is
the toolkit's (:mod:`gradsync.comm.server`) with :class:`~gradsync.comm.priority.P3Server`
as its policy: a round per slice, answers in priority order.

Transport: two process groups, one per direction (worker → server on ``push``, server →
worker on ``pull``); on each, exactly one thread sends to a given peer and one receives
from it, so messages between a pair arrive in order. A message is the toolkit's float64
header (:mod:`gradsync.comm.wire`: ``index`` is the slice, ``priority`` its layer)
followed by ``length`` payload values. Every wait is bounded by ``--timeout``; a peer that
dies breaks its connection, the thread that sees it records the error and the training
thread raises it at its next wait.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradsync.comm.counters import CommStats
from gradsync.comm.layer_order import LayerOrder, Layers
from gradsync.comm.priority import (
    LAST,
    SEND_WINDOW,
    P3Server,
    PrioritySender,
    SendRecord,
    bundle_message,
    read_manifest,
    send_window,
    slice_reader,
    split_bundle,
    unbundle,
)
from gradsync.comm.ready import READ_AFTER_BACKWARD, ReadyOnce
from gradsync.comm.server import (
    ColocatedServer,
    Piece,
    ServerMetrics,
    ShardState,
    adopt_initial,
    assemble_checkpoint,
    endpoints,
    share_initial,
    split_variable,
)
from gradsync.comm.slicing import slice_variables
from gradsync.comm.wire import (
    TAG_PUSH,
    TAG_REPLY,
    Header,
    Kind,
    Lanes,
    Message,
    Recv,
    ServerLinks,
    TransportError,
    decode_state,
    nbytes,
    start_receiver,
)
from gradsync.config import TrainConfig
from gradsync.errors import UserError
from gradsync.optim import Updater
from gradsync.options import InvalidOption, option
from gradsync.strategies.base import (
    Context,
    ServerOptions,
    ServerStrategy,
    check_one_dtype,
    trainable_parameters,
)
from gradsync.trace import COMPUTE, Phase

DEFAULT_SLICE_SIZE = 40_000
DEFAULT_SLICES_PER_MESSAGE = 1


@dataclass(frozen=True, kw_only=True)
class P3Options(ServerOptions):
    """P3's servers, slice size and send order; ``priority`` off sends in arrival order
    (FIFO), ``slicing`` off sends whole variables."""

    slice_size: int = option(
        DEFAULT_SLICE_SIZE,
        help="values per parameter slice (MXNet P3's default)",
        metavar="N",
        at_least=1,
    )
    priority: bool = option(True, help="send slices in layer order (off: FIFO)")
    slicing: bool = option(True, help="cut variables into slices (off: whole variables)")
    slices_per_message: int = option(
        DEFAULT_SLICES_PER_MESSAGE,
        help="slices queued back to back for one peer that share a message; as many "
        "(at least 4) may be in flight (1: a message per slice, as MXNet's P3)",
        metavar="N",
        at_least=1,
    )

    def check(self, workers: int) -> None:
        super().check(workers)
        if not self.slicing and "slice_size" in self.changed():
            raise InvalidOption(
                "{slice_size} with {slicing} off: each variable is then sent whole, so no "
                "slice size applies; drop one of them",
                type(self),
            )


class PriorityPropagation(ServerStrategy):
    """Sliced parameter server; slices sent in layer order; forward waits per layer."""

    name = "p3"
    summary = "P3 (SysML'19): sliced parameter server, priority-ordered slices, per-layer waits"
    Options = P3Options

    # -- configuration -------------------------------------------------------------------

    @classmethod
    def check_config(cls, config: TrainConfig) -> None:
        """Fail before launch when the model has fewer slices than servers."""
        trained = trainable_parameters(config)
        check_one_dtype(cls.name, trained)
        variables = [(n, p.numel()) for n, p in trained.items()]
        try:
            _slices(config, variables)
        except UserError as error:
            raise UserError(f"model '{config.model}' ({config.preset}): {error}") from None

    # -- both roles ----------------------------------------------------------------------

    def _connect(self, context: Context, model: nn.Module | None) -> dict[str, Tensor]:
        """Collective on every rank: the transport's lanes, then worker 0's variables."""
        config, workers = context.config, context.num_workers
        self.context = context
        self.timeout_s = config.launch.timeout_s
        timeout = timedelta(seconds=self.timeout_s)
        self.lanes = Lanes.create(context.world_size, timeout)
        self.num_servers = config.strategy_options.num_servers(workers)
        colocate = config.strategy_options.colocate
        self.server_ranks = config.strategy_options.server_ranks(workers)
        initial, self.lr0 = share_initial(model, context.lr)
        self.slices = _slices(config, [(n, t.numel()) for n, t in initial.items()])
        if context.rank == 0:
            p3 = config.strategy_options
            where = "colocated on the workers" if colocate else "dedicated ranks"
            print(
                f"[rank 0] p3: {len(self.slices)} slices of ≤ "
                f"{p3.slice_size if p3.slicing else 'unbounded'} values over "
                f"{self.num_servers} server(s) ({where}), round-robin; "
                f"order: {'layer priority' if p3.priority else 'FIFO'}",
                flush=True,
            )
        return initial

    # -- server ------------------------------------------------------------------------

    server_policy = P3Server  # tests substitute a subclass

    def _server(self, server: int, initial: dict[str, Tensor], local_worker: int | None):
        """Server ``server``'s inbox and policy (``local_worker`` shares its process)."""
        context = self.context
        config, workers = context.config, context.num_workers
        states = {
            s.index: ShardState(
                initial[s.name].reshape(-1)[s.start : s.stop],
                lambda ps: Updater(ps, config.optim, lr=self.lr0),
            )
            for s in self.slices
            if s.server == server
        }
        inbox, outbox = endpoints(
            num_workers=workers,
            local_worker=local_worker,
            lanes=self.lanes,
            timeout_s=self.timeout_s,
            read_body=slice_reader,
            deliver_local=None if local_worker is None else self._on_local_reply,
        )
        policy = self.server_policy(
            states,
            outbox,
            ServerMetrics.to_file(
                config.out, rank=context.rank, server=server, steps_done=context.steps_done
            ),
            num_workers=workers,
            fifo=not config.strategy_options.priority,
            timeout_s=self.timeout_s,
            slices_per_message=config.strategy_options.slices_per_message,
            timeline=context.timeline,
            track=f"server {server}",
        )
        return inbox, policy

    def serve(self, context: Context) -> None:
        self._run_dedicated(context, self._connect(context, None))

    # -- worker --------------------------------------------------------------------------

    def setup(self, model: nn.Module, context: Context) -> nn.Module:
        self.model = model
        initial = self._connect(context, model)
        self.worker = context.worker_index
        self.timeline = context.timeline
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        adopt_initial(self.params, initial)
        self.slices_of: dict[str, list[Piece]] = {}
        for s in self.slices:
            self.slices_of.setdefault(s.name, []).append(s)
        self.layers: Layers | None = None
        self._order = LayerOrder(model)  # records the first forward's module order
        for name, param in self.params.items():
            param.register_post_accumulate_grad_hook(
                lambda p, name=name: self._on_gradient(name, p)
            )
        self._step = 0
        self._ready = ReadyOnce("p3", READ_AFTER_BACKWARD)
        self._cond = threading.Condition()
        self._writes = threading.Lock()  # guards the two below
        self._in_backward = False  # from this step's first gradient to step()
        self._held: list[tuple[Piece, Tensor]] = []  # values back during backward
        self._remaining: list[int] = []  # per layer: slices not yet back
        self._errors: list[BaseException] = []
        self.ready_log: list[tuple[int, int, float]] = []  # (step, layer, time ready)
        self._bytes_sent = 0
        self._bytes_recv = [0] * self.num_servers
        self._exposed_s = 0.0
        self._control: list[queue.Queue[Message]] = [queue.Queue() for _ in self.server_ranks]
        self._local_server: int | None = None
        self._colocated: ColocatedServer | None = None
        self.links = ServerLinks(
            worker=self.worker,
            servers=[None if r == context.rank else r for r in self.server_ranks],
            lanes=self.lanes,
            timeout_s=self.timeout_s,
        )
        if context.config.strategy_options.colocate:
            self._local_server = self.server_ranks.index(context.rank)
            self.links.local_inbox, self._colocated = self._start_colocated(context, initial)
        del initial
        self.sender = PrioritySender(
            self._send_slices,
            name="p3-send",
            fifo=not context.config.strategy_options.priority,
            window=send_window(context.config.strategy_options.slices_per_message),
            bundle=self._bundle_peer,
            bundle_limit=context.config.strategy_options.slices_per_message,
        )
        self._receivers = [
            start_receiver(
                rank=rank,
                lanes=self.lanes,
                tag=TAG_REPLY,
                read_body=lambda header, recv, s=s: self._read_reply(s, header, recv),
                deliver=lambda message, s=s: self._on_reply(s, message),
                name=f"p3-pull-{s}",
            )
            for s, rank in enumerate(self.server_ranks)
            if s != self._local_server
        ]
        return model

    def _finish_layer_order(self) -> Layers:
        """After the first forward: number the layers, install the per-layer waits."""
        layers = self._order.finish()
        self.layer_of = layers.layer_of
        self._remaining = [0] * layers.num_layers
        self._layer_names = layers.names
        for layer, module in enumerate(layers.modules):
            module.register_forward_pre_hook(  # before the module's own pre-hooks read
                lambda _m, _a, layer=layer: self._wait_for(layer), prepend=True
            )
        for module, owned in layers.owners:  # a tied or skipped owner called first later on
            module.register_forward_pre_hook(
                lambda _m, _a, owned=owned: self._wait_for_layers(owned),
                prepend=True,
            )
        self.layers = layers
        if self.worker == 0:
            print(
                f"[rank 0] p3 layer order (priority 0 first, from the first forward): "
                f"{', '.join(layers.names)}",
                flush=True,
            )
        return layers

    def _on_gradient(self, name: str, param: nn.Parameter) -> None:
        """Backward hook: the gradient of ``name`` is complete — queue its slices now."""
        self._ready.mark(name)
        self._in_backward = True  # before any slice of this step can come back
        grad = param.grad
        assert grad is not None
        flat = (grad.to_dense() if grad.is_sparse else grad).reshape(-1)
        param.grad = None  # the queued slices hold the gradient; the next one starts afresh
        self._enqueue(name, flat)

    def _enqueue(self, name: str, flat_grad: Tensor | None) -> None:
        """Queue ``name``'s slices; None tells the servers it has no gradient this step."""
        if self.layers is None:
            self._finish_layer_order()
        self._raise_if_failed()
        layer = self.layer_of[name]
        slices = self.slices_of[name]
        with self._cond:
            self._remaining[layer] += len(slices)
        for s in slices:
            self.sender.put(_Queued(s, self._step, layer, flat_grad), layer)

    def _bundle_peer(self, item: _Queued | _Control) -> tuple[int, int] | None:
        """Gradient slices of one step for one server may share a message."""
        if isinstance(item, _Control) or item.grad is None:
            return None
        return (item.piece.server, item.step)

    def _send_slices(self, items: list[Any], records: list[SendRecord]):
        """A control request, a slice, or one server's slices: one message for a remote
        server, handed over one by one to this process's."""
        item, record = items[0], records[0]
        if isinstance(item, _Control):
            self.links.send(item.server, Header(item.kind, worker=self.worker), [])
            return None
        s, step, layer = item.piece, item.step, item.layer
        if item.grad is None:  # no gradient: a header alone, the server expects every slice
            header = Header(Kind.NO_GRADIENT, self.worker, step, s.index, layer)
            self._bytes_sent += self.links.send(s.server, header, [])
            return None
        if s.server == self._local_server:  # the server reads them, never writes
            for queued in items:
                self.links.send(s.server, queued.header(self.worker), [queued.values])
            return None
        header, tensors = bundle_message(
            Kind.PUSH,
            [queued.header(self.worker) for queued in items],
            [queued.values for queued in items],
            worker=self.worker,
        )
        track = f"p3 push {record.seq % SEND_WINDOW}"  # one track per message in flight
        self.timeline.begin(
            track,
            Phase.PUSH,
            step=step,
            tensor=f"{s.name}[{s.start}:{s.stop}]",
            slice=s.index,
            slices=len(items),
            layer=layer,
            layer_name=self._layer_names[layer],
            priority=layer,
            bytes=nbytes(tensors[-1]),
            queued=record.num_waiting,
            next_priority=record.next_priority,
            server=s.server,
        )
        dst, encoded = self.server_ranks[s.server], header.encode()
        pieces = [encoded, *tensors]
        group = self.lanes.to(dst)
        works = [dist.isend(t, dst=dst, group=group, tag=TAG_PUSH) for t in pieces]
        # Counted as posted, not as completed: a completion the step's record has already
        # read would count in the next step's (none in the first, two in the last).
        self._bytes_sent += sum(nbytes(t) for t in pieces)

        def finish() -> None:  # the tensors live in this closure until they have left
            for work in works:
                work.wait()
            self.timeline.end(track, Phase.PUSH, step=step)

        return finish

    def _read_reply(self, server: int, header: Header, recv: Recv) -> list[Tensor]:
        """A reply's payload goes straight into the parameter (a bundle's through one
        buffer): nothing reads it until its layer is ready."""
        if header.kind != Kind.REPLY:
            return []
        manifest = read_manifest(header, recv)
        pieces = [self.slices[index] for index, _ in unbundle(header, manifest)]
        s = pieces[0]
        with self.timeline.span(
            f"p3 pull from server {server}",
            Phase.PULL,
            step=header.step,
            slice=header.index,
            slices=len(pieces),
            tensor=f"{s.name}[{s.start}:{s.stop}]",
            layer=header.priority,
            priority=header.priority,
            bytes=header.length * self.params[s.name].element_size(),
        ):
            with self._writes:
                direct = len(pieces) == 1 and not self._in_backward
            if direct:
                recv(self._target(s))
            else:
                values = recv(torch.empty(header.length, dtype=self.params[s.name].dtype))
                self._write_slices(pieces, values)
        return manifest

    def _target(self, s: Piece) -> Tensor:
        """Where slice ``s`` lives in its parameter."""
        return self.params[s.name].data.view(-1)[s.start : s.stop]

    def _write_slices(self, pieces: list[Piece], values: Tensor) -> None:
        """Copy a bundle's values (``pieces``' end to end) into their parameters; while
        backward runs, keep them for :meth:`step` instead: backward may still read a
        parameter it saved in forward (one read through ``.detach()`` there, say), and a
        write through ``.data`` is invisible to autograd's check."""
        lengths = [s.numel for s in pieces]
        writes = list(zip(pieces, split_bundle(values, lengths), strict=True))
        with self._writes:
            if self._in_backward:
                self._held.extend(writes)
                return
        for s, piece_values in writes:
            self._target(s).copy_(piece_values)

    def _write_held(self) -> None:
        """Backward is over: write the values that came back during it."""
        with self._writes:
            self._in_backward = False
            held, self._held = self._held, []
        for s, values in held:
            self._target(s).copy_(values)

    def _on_local_reply(self, message: Message) -> None:
        """A reply of this process's server (on its reply thread): as if received."""
        if message.kind == Kind.REPLY:
            self._write_slices([self.slices[message.header.index]], message.tensors[0])
        self._on_reply(self._local_server, message)

    def _on_reply(self, server: int, message: Message | BaseException) -> None:
        if isinstance(message, BaseException):
            with self._cond:
                self._errors.append(
                    TransportError(f"receiving from server {server} failed: {message}")
                )
                self._cond.notify_all()
            return
        self._bytes_recv[server] += message.wire_bytes
        if message.kind in (Kind.STATE_REPLY, Kind.LOADED):
            self._control[server].put(message)
        if message.kind != Kind.REPLY:
            return
        header = message.header
        layers = [self.layer_of[self.slices[i].name] for i, _ in unbundle(header, message.tensors)]
        with self._cond:
            for layer in layers:
                self._remaining[layer] -= 1
                if self._remaining[layer] == 0:
                    self.ready_log.append((header.step, layer, time.perf_counter()))
                    self._cond.notify_all()
            del self.ready_log[:-10_000]

    def _raise_if_failed(self) -> None:
        if self._errors:
            raise self._errors[0]
        if self.sender.error is not None:
            raise TransportError(f"sending to the servers failed: {self.sender.error}")

    def _wait_for_layers(self, layers: tuple[int, ...]) -> None:
        for layer in layers:
            self._wait_for(layer)

    def _wait_for(self, layer: int | None) -> None:
        """Block until ``layer``'s slices (every layer's if None) are back, or raise."""

        def ready() -> bool:
            if layer is None:
                return not any(self._remaining)
            return self._remaining[layer] == 0

        with self._cond:
            if ready():
                return
        started = time.perf_counter()
        deadline = started + self.timeout_s
        name = "all" if layer is None else self._layer_names[layer]
        with (
            self.timeline.span(
                COMPUTE, Phase.WAIT_FOR_PARAMS, layer=name, priority=-1 if layer is None else layer
            ),
            self._cond,
        ):
            while not ready():
                self._raise_if_failed()
                if time.perf_counter() > deadline:
                    raise TransportError(
                        f"the parameters of layer {name} did not arrive in {self.timeout_s:g} s"
                    )
                self._cond.wait(timeout=0.5)  # short waits: a dead sender is noticed
        self._exposed_s += time.perf_counter() - started

    def step(self) -> None:
        """After backward: tell the servers which parameters had no gradient; on the last
        step, wait for every slice (the checkpoint and the caller see the final parameters)."""
        self._write_held()
        for name in self.params:
            if name not in self._ready.seen:  # unused this step: the servers still expect it
                self._enqueue(name, None)
        self._ready.reset()
        self._step += 1
        if self._step == self.context.config.steps:
            self._wait_for(None)

    def stats(self) -> CommStats:
        stats = self.counters.copy()
        stats.bytes_sent = self._bytes_sent
        stats.bytes_recv = sum(self._bytes_recv)
        stats.exposed_comm_s = self._exposed_s
        return stats

    def checkpoint_tensors(self) -> dict[str, Tensor] | None:
        """Worker 0 assembles the servers' authoritative state; buffers are its own."""
        if self.context is None or self.context.worker_index != 0 or self.model is None:
            return None
        self._wait_for(None)  # every slice of the last step is applied on its server
        for server in range(self.num_servers):
            self.sender.put(_Control(Kind.STATE, server), LAST)
        per_slice: dict[int, dict[str, Tensor]] = {}
        for server in range(self.num_servers):
            message = self._control_reply(server, Kind.STATE_REPLY)
            for key, value in decode_state(message.tensors[0]).items():
                index, _, rest = key.partition("/")
                per_slice.setdefault(int(index), {})[rest] = value
        pieces = [[_piece(s)] for s in self.slices]
        return assemble_checkpoint(self.model, pieces, [per_slice[s.index] for s in self.slices])

    def load_checkpoint_tensors(self, tensors: dict[str, Tensor], steps_done: int) -> None:
        states: list[dict[str, Tensor]] = [{} for _ in range(self.num_servers)]
        for s in self.slices:
            for key, value in split_variable(tensors, [_piece(s)]).items():
                states[s.server][f"{s.index}/{key}"] = value
        # Sent from this thread: the sender has sent nothing yet, and sends nothing before
        # the acknowledgements, which arrive on the receiver threads.
        self.links.send_load(states, steps_done)
        for server in range(self.num_servers):
            self._control_reply(server, Kind.LOADED)

    def _control_reply(self, server: int, kind: Kind) -> Message:
        """The next STATE_REPLY or LOADED of ``server`` (its receiver thread queued it)."""
        deadline = time.perf_counter() + self.timeout_s
        while True:
            try:
                message = self._control[server].get(timeout=0.5)
            except queue.Empty:
                self._raise_if_failed()
                if time.perf_counter() > deadline:
                    raise TransportError(
                        f"server {server} sent no {kind.name} in {self.timeout_s:g} s"
                    ) from None
                continue
            if message.kind != kind:
                raise TransportError(f"server {server} sent {message.kind.name}, not {kind.name}")
            return message

    def finish(self) -> None:
        """Tell every server this worker is done; wait for their last message."""
        for server in range(self.num_servers):
            self.sender.put(_Control(Kind.DONE, server), LAST)
        self.sender.close(timeout_s=self.timeout_s)
        for thread in self._receivers:
            thread.join(timeout=self.timeout_s)
        self._raise_if_failed()
        if any(thread.is_alive() for thread in self._receivers):
            raise TransportError(f"a server did not acknowledge the end in {self.timeout_s:g} s")
        if self._colocated is not None:
            self._colocated.join(self.timeout_s)


@dataclass(frozen=True)
class _Queued:
    """A slice in the send queue: ``grad`` is its variable's flat gradient (None: the
    variable had none this step)."""

    piece: Piece
    step: int
    layer: int
    grad: Tensor | None

    @property
    def values(self) -> Tensor:
        assert self.grad is not None
        return self.grad[self.piece.start : self.piece.stop]

    def header(self, worker: int) -> Header:
        s = self.piece
        return Header(Kind.PUSH, worker, self.step, s.index, self.layer, s.numel)


@dataclass(frozen=True)
class _Control:
    """A request for one server that goes after every slice (STATE, DONE)."""

    kind: Kind
    server: int


def _piece(s: Piece) -> Piece:
    """A slice as the one piece of its own server state."""
    return Piece(s.name, s.start, s.stop)


def _slices(config: TrainConfig, variables: list[tuple[str, int]]) -> list[Piece]:
    p3 = config.strategy_options
    return slice_variables(
        variables,
        slice_size=p3.slice_size if p3.slicing else None,
        num_servers=p3.num_servers(config.workers),
    )


__all__ = ["PriorityPropagation"]
