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
   them one at a time, most urgent first, so a late slice of an early layer overtakes the
   queued slices of later layers.

Pull is merged into push: a server answers each slice, once every worker's contribution is
in and applied, with the updated slice, which a receiver thread per server writes straight
into the parameter. A layer is ready when all its slices are back, and its forward
pre-hook waits for that layer only: the next forward starts while the later layers'
slices are still in flight.

Why it is safe to write a parameter from a receiver thread: its slices are sent only after
its gradient is fully accumulated (no backward node reads it any more in this step), and
the next read is its layer's next forward, which waits until every slice has arrived.

Transport: two process groups, one per direction (worker → server on ``push``, server →
worker on ``pull``); on each, exactly one thread sends to a given peer and one receives
from it, so messages between a pair arrive in order. A message is a float64 header
``[kind, worker, step, slice, priority, length, lr]`` followed by ``length`` payload
values. Every wait is bounded by ``--timeout``; a peer that dies breaks its connection,
the thread that sees it records the error and the training thread raises it at its next
wait.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import Tensor, nn

from gradsync.checkpoint import BUFFER, PARAM
from gradsync.comm.counters import CommStats
from gradsync.comm.layer_order import LayerOrder, Layers
from gradsync.comm.priority import PrioritySender, SendRecord
from gradsync.comm.pushpull import TransportError
from gradsync.comm.server import ShardState, assemble_variable
from gradsync.comm.slicing import Slice, slice_variables
from gradsync.config import TrainConfig
from gradsync.errors import UserError
from gradsync.metrics import MetricsWriter, ServerRecord
from gradsync.optim import Updater
from gradsync.options import StrategyOptions, option
from gradsync.strategies.base import Context, Strategy
from gradsync.trace import COMPUTE, Phase

DEFAULT_SLICE_SIZE = 40_000


@dataclass(frozen=True, kw_only=True)
class P3Options(StrategyOptions):
    """P3's servers, slice size and send order; ``priority`` off sends in arrival order
    (FIFO), ``slicing`` off sends whole variables."""

    servers: int | None = option(
        None, help="dedicated server ranks after the workers (default 1)", at_least=1
    )
    slice_size: int = option(
        DEFAULT_SLICE_SIZE,
        help="values per parameter slice (MXNet P3's default)",
        metavar="N",
        at_least=1,
    )
    priority: bool = option(True, help="send slices in layer order (off: FIFO)")
    slicing: bool = option(True, help="cut variables into slices (off: whole variables)")

    def num_servers(self) -> int:
        return 1 if self.servers is None else self.servers


HEADER = 7  # kind, worker, step, slice, priority, length, lr
PUSH, STATE, DONE, NO_GRADIENT = 0, 1, 2, 3  # worker → server
SLICE, STATE_REPLY, FIN = 0, 1, 2  # server → worker
TAG_PUSH, TAG_PULL = 111, 112
LAST = 2**40  # priority of control messages: after every slice
SEND_WINDOW = 4  # slices in flight per sender: keeps the link busy; preemption waits ≤ this


def _header(
    kind: int, worker: int, step: int, index: int, priority: int, length: int, lr: float = 0.0
) -> Tensor:
    return torch.tensor([kind, worker, step, index, priority, length, lr], dtype=torch.float64)


def _decode(header: Tensor) -> tuple[int, int, int, int, int, int, float]:
    values = header.tolist()
    return (*(int(v) for v in values[:6]), float(values[6]))  # type: ignore[return-value]


def _wait_all(works: list[Any], _keep_alive: Any) -> None:
    """Wait for isends (bounded by the group's timeout); their tensors live until then."""
    for work in works:
        work.wait()


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _average(contributions: dict[int, Tensor | None], workers: int) -> Tensor | None:
    """The workers' mean gradient, in fixed worker order (bit-identical reruns); a worker
    without a gradient adds zeros; None when no worker had one.

    Example:
        >>> _average({0: torch.ones(2), 1: None}, 2).tolist()
        [0.5, 0.5]
    """
    present = [contributions[w] for w in range(workers) if contributions[w] is not None]
    if not present:
        return None
    total = present[0].clone()
    for grad in present[1:]:
        total += grad
    return total / workers


class PriorityPropagation(Strategy):
    """Sliced parameter server; slices sent in layer order; forward waits per layer."""

    name = "p3"
    summary = "P3 (SysML'19): sliced parameter server, priority-ordered slices, per-layer waits"
    Options = P3Options

    # -- configuration -------------------------------------------------------------------

    @classmethod
    def num_server_ranks(cls, config: TrainConfig) -> int:
        return config.strategy_options.num_servers()

    @classmethod
    def check_config(cls, config: TrainConfig) -> None:
        """Fail before launch when the model has fewer slices than servers."""
        from gradsync.models import workload_of

        workload = workload_of(config)
        variables = [
            (n, p.numel()) for n, p in workload.model.named_parameters() if p.requires_grad
        ]
        try:
            _slices(config, variables)
        except UserError as error:
            raise UserError(f"model '{config.model}' ({config.preset}): {error}") from None

    # -- both roles ----------------------------------------------------------------------

    def _connect(self, context: Context, model: nn.Module | None) -> dict[str, Any]:
        """Collective on every rank: one group per direction, then worker 0's variables."""
        config, workers = context.config, context.num_workers
        self.context = context
        self.timeout_s = config.launch.timeout_s
        everyone = list(range(context.world_size))
        timeout = timedelta(seconds=self.timeout_s)
        self.push_group = dist.new_group(everyone, timeout=timeout)
        self.pull_group = dist.new_group(everyone, timeout=timeout)
        self.num_servers = config.strategy_options.num_servers()
        self.server_ranks = [workers + s for s in range(self.num_servers)]
        spec: list[Any] = [None]
        if context.rank == 0:
            assert model is not None
            params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            spec = [
                {
                    "variables": [(n, p.numel()) for n, p in params],
                    "initial": {n: p.detach().cpu() for n, p in params},
                    "lr": context.lr,
                }
            ]
        # Initial parameters: worker 0's, on every worker and server (Horovod's broadcast).
        dist.broadcast_object_list(spec, src=0)
        self.slices = _slices(config, spec[0]["variables"])
        if context.rank == 0:
            p3 = config.strategy_options
            print(
                f"[rank 0] p3: {len(self.slices)} slices of ≤ "
                f"{p3.slice_size if p3.slicing else 'unbounded'} values over "
                f"{self.num_servers} server(s), round-robin; "
                f"order: {'layer priority' if p3.priority else 'FIFO'}",
                flush=True,
            )
        return spec[0]

    # -- server rank ---------------------------------------------------------------------

    def serve(self, context: Context) -> None:
        spec = self._connect(context, None)
        config, workers = context.config, context.num_workers
        self.server = context.rank - workers
        self.timeline = context.timeline
        self.track = f"server {self.server}"
        mine = [s for s in self.slices if s.server == self.server]
        lr = spec["lr"]
        self.states = {
            s.index: ShardState(
                spec["initial"][s.name].reshape(-1)[s.start : s.stop],
                lambda ps: Updater(ps, config.optim, lr=lr),
            )
            for s in mine
        }
        del spec
        inbox: queue.Queue[Any] = queue.Queue()
        receivers = [
            threading.Thread(
                target=self._receive_pushes, args=(w, inbox), daemon=True, name=f"p3-recv-{w}"
            )
            for w in range(workers)
        ]
        for thread in receivers:
            thread.start()
        self.replies = PrioritySender(
            self._send_reply,
            name="p3-reply",
            fifo=not config.strategy_options.priority,
            window=SEND_WINDOW,
        )
        writer = MetricsWriter(Path(config.out), context.rank, prefix="server")
        try:
            self._serve_loop(inbox, writer, workers, len(mine))
            self.replies.close(timeout_s=self.timeout_s)
        finally:
            writer.close()
        for thread in receivers:
            thread.join(timeout=self.timeout_s)

    def _receive_pushes(self, worker: int, inbox: queue.Queue[Any]) -> None:
        try:
            while True:
                header = torch.empty(HEADER, dtype=torch.float64)
                dist.recv(header, src=worker, group=self.push_group, tag=TAG_PUSH)
                kind, _, step, index, priority, length, _ = _decode(header)
                payload = None
                if kind == PUSH:  # NO_GRADIENT: a slice of a parameter without a gradient
                    payload = torch.empty(length)
                    dist.recv(payload, src=worker, group=self.push_group, tag=TAG_PUSH)
                inbox.put((kind, worker, step, index, priority, payload))
                if kind == DONE:
                    return
        except BaseException as error:  # the server loop re-raises it, naming the worker
            inbox.put(TransportError(f"receiving from worker {worker} failed: {error}"))

    def _serve_loop(
        self, inbox: queue.Queue[Any], writer: MetricsWriter, workers: int, num_slices: int
    ) -> None:
        pending: dict[int, dict[int, Tensor]] = {}
        applied: dict[int, int] = {}  # step → slices applied
        tally: dict[int, list[float]] = {}  # step → [bytes in, bytes out, busy seconds]
        done: set[int] = set()
        last = time.perf_counter()
        while len(done) < workers:
            try:
                item = inbox.get(timeout=self.timeout_s)
            except queue.Empty:
                raise TransportError(
                    f"no message reached this server in {self.timeout_s:g} s"
                ) from None
            if isinstance(item, BaseException):
                raise item
            kind, worker, step, index, priority, payload = item
            if self.replies.error is not None:
                raise TransportError(f"sending replies failed: {self.replies.error}")
            if kind == DONE:
                done.add(worker)
                self.replies.put((worker, _header(FIN, worker, -1, -1, 0, 0), None), LAST)
                continue
            if kind == STATE:
                data = self._state_bytes()
                header = _header(STATE_REPLY, worker, -1, -1, 0, data.numel())
                self.replies.put((worker, header, data), LAST)
                continue
            counts = tally.setdefault(step, [0.0, 0.0, 0.0])
            counts[0] += (0 if payload is None else _nbytes(payload)) + HEADER * 8
            contributions = pending.setdefault(index, {})
            if worker in contributions:
                raise RuntimeError(f"worker {worker} pushed slice {index} of step {step} twice")
            contributions[worker] = payload
            if len(contributions) < workers:
                continue
            started = time.perf_counter()
            del pending[index]
            state = self.states[index]
            args = dict(step=step, slice=index, priority=priority, bytes=_nbytes(state.values))
            with self.timeline.span(self.track, Phase.SERVER_AGGREGATE, **args):
                total = _average(contributions, workers)
            with self.timeline.span(self.track, Phase.SERVER_APPLY, **args):
                # No gradient on any worker: skipped, as single's optimizer skips it.
                state.apply(
                    state.values if total is None else total, step, present=[total is not None]
                )
            values = state.values.detach().clone()
            for w in range(workers):
                header = _header(SLICE, w, step, index, priority, values.numel(), state.lr)
                self._reply(w, header, values, priority)
                counts[1] += _nbytes(values) + HEADER * 8
            counts[2] += time.perf_counter() - started
            applied[step] = applied.get(step, 0) + 1
            if applied[step] == num_slices:  # this server has finished the step
                now = time.perf_counter()
                bytes_in, bytes_out, busy = tally.pop(step)
                writer.write(
                    ServerRecord(
                        step=step,
                        rank=self.context.rank,
                        server=self.server,
                        bytes_recv=int(bytes_in),
                        bytes_sent=int(bytes_out),
                        busy_s=busy,
                        step_time_s=now - last,
                    )
                )
                last = now
                del applied[step]

    def _reply(self, worker: int, header: Tensor, values: Tensor, priority: int) -> None:
        """Queue an updated slice for ``worker`` (tests override it to slow a layer down)."""
        self.replies.put((worker, header, values), priority)

    def _send_reply(self, item: tuple[int, Tensor, Tensor | None], record: SendRecord):
        worker, header, payload = item
        works = [dist.isend(header, dst=worker, group=self.pull_group, tag=TAG_PULL)]
        if payload is not None:
            works.append(dist.isend(payload, dst=worker, group=self.pull_group, tag=TAG_PULL))
        return lambda: _wait_all(works, item)

    def _state_bytes(self) -> Tensor:
        tensors = {}
        for index, state in self.states.items():
            for key, value in state.state_tensors().items():
                tensors[f"{index}/{key}"] = value
        return torch.frombuffer(bytearray(save_tensors(tensors)), dtype=torch.uint8)

    # -- worker --------------------------------------------------------------------------

    def setup(self, model: nn.Module, context: Context) -> nn.Module:
        self.model = model
        spec = self._connect(context, model)
        self.worker = context.worker_index
        self.timeline = context.timeline
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        with torch.no_grad():
            for name, value in spec["initial"].items():
                param = self.params[name]
                if not param.is_contiguous():
                    param.data = param.data.contiguous()  # receivers write flat views
                param.copy_(value)
        del spec
        self.slices_of: dict[str, list[Slice]] = {}
        for s in self.slices:
            self.slices_of.setdefault(s.name, []).append(s)
        self.layers: Layers | None = None
        self._order = LayerOrder(model)  # records the first forward's module order
        for name, param in self.params.items():
            param.register_post_accumulate_grad_hook(
                lambda p, name=name: self._on_gradient(name, p)
            )
        self._step = 0
        self._pushed: set[str] = set()
        self._lr = context.lr
        self._cond = threading.Condition()
        self._remaining: list[int] = []  # per layer: slices not yet back
        self._errors: list[BaseException] = []
        self.ready_log: list[tuple[int, int, float]] = []  # (step, layer, time ready)
        self._bytes_sent = 0
        self._bytes_recv = [0] * self.num_servers
        self._exposed_s = 0.0
        self._states: list[queue.Queue[Tensor]] = [queue.Queue() for _ in self.server_ranks]
        self.sender = PrioritySender(
            self._send_slice,
            name="p3-send",
            fifo=not context.config.strategy_options.priority,
            window=SEND_WINDOW,
        )
        self._receivers = [
            threading.Thread(
                target=self._receive_replies, args=(s, rank), daemon=True, name=f"p3-pull-{s}"
            )
            for s, rank in enumerate(self.server_ranks)
        ]
        for thread in self._receivers:
            thread.start()
        return model

    def _finish_layer_order(self) -> Layers:
        """After the first forward: number the layers, install the per-layer waits."""
        layers = self._order.finish()
        self.layer_of = layers.layer_of
        self._remaining = [0] * layers.num_layers
        self._layer_names = layers.names
        for layer, module in enumerate(layers.modules):
            module.register_forward_pre_hook(lambda _m, _a, layer=layer: self._wait_for(layer))
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
        self._pushed.add(name)
        for s in slices:
            self.sender.put((s, self._step, layer, flat_grad), layer)

    def _send_slice(self, item: Any, record: SendRecord):
        if item[0] == "control":
            _, kind, server = item
            header = _header(kind, self.worker, -1, -1, 0, 0)
            dist.send(header, dst=self.server_ranks[server], group=self.push_group, tag=TAG_PUSH)
            return
        s, step, layer, flat_grad = item
        dst = self.server_ranks[s.server]
        if flat_grad is None:  # no gradient: a header alone, the server expects every slice
            header = _header(NO_GRADIENT, self.worker, step, s.index, layer, 0)
            dist.send(header, dst=dst, group=self.push_group, tag=TAG_PUSH)
            self._bytes_sent += HEADER * 8
            return None
        payload = flat_grad[s.start : s.stop]
        header = _header(PUSH, self.worker, step, s.index, layer, s.numel)
        track = f"p3 push {record.seq % SEND_WINDOW}"  # one track per slice in flight
        self.timeline.begin(
            track,
            Phase.PUSH,
            step=step,
            tensor=f"{s.name}[{s.start}:{s.stop}]",
            slice=s.index,
            layer=layer,
            layer_name=self._layer_names[layer],
            priority=layer,
            bytes=_nbytes(payload),
            queued=record.num_waiting,
            next_priority=record.next_priority,
            server=s.server,
        )
        works = [
            dist.isend(header, dst=dst, group=self.push_group, tag=TAG_PUSH),
            dist.isend(payload, dst=dst, group=self.push_group, tag=TAG_PUSH),
        ]

        def finish() -> None:
            _wait_all(works, (header, payload))
            self.timeline.end(track, Phase.PUSH, step=step)
            self._bytes_sent += _nbytes(payload) + HEADER * 8

        return finish

    def _receive_replies(self, server: int, rank: int) -> None:
        track = f"p3 pull from server {server}"
        try:
            while True:
                header = torch.empty(HEADER, dtype=torch.float64)
                dist.recv(header, src=rank, group=self.pull_group, tag=TAG_PULL)
                kind, _, step, index, priority, length, lr = _decode(header)
                self._bytes_recv[server] += HEADER * 8
                if kind == FIN:
                    return
                if kind == STATE_REPLY:
                    data = torch.empty(length, dtype=torch.uint8)
                    dist.recv(data, src=rank, group=self.pull_group, tag=TAG_PULL)
                    self._states[server].put(data)
                    continue
                s = self.slices[index]
                target = self.params[s.name].data.view(-1)[s.start : s.stop]
                with self.timeline.span(
                    track,
                    Phase.PULL,
                    step=step,
                    slice=index,
                    tensor=f"{s.name}[{s.start}:{s.stop}]",
                    layer=priority,
                    priority=priority,
                    bytes=_nbytes(target),
                ):
                    # Straight into the parameter: nothing reads it until its layer is ready.
                    dist.recv(target, src=rank, group=self.pull_group, tag=TAG_PULL)
                self._bytes_recv[server] += _nbytes(target)
                layer = self.layer_of[s.name]
                with self._cond:
                    self._lr = lr
                    self._remaining[layer] -= 1
                    if self._remaining[layer] == 0:
                        self.ready_log.append((step, layer, time.perf_counter()))
                        del self.ready_log[:-10_000]
                        self._cond.notify_all()
        except BaseException as error:
            with self._cond:
                self._errors.append(
                    TransportError(f"receiving from server {server} (rank {rank}) failed: {error}")
                )
                self._cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self._errors:
            raise self._errors[0]
        if self.sender.error is not None:
            raise TransportError(f"sending to the servers failed: {self.sender.error}")

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
        for name in self.params:
            if name not in self._pushed:  # unused this step: the servers still expect it
                self._enqueue(name, None)
        self._pushed.clear()
        self._step += 1
        if self._step == self.context.config.steps:
            self._wait_for(None)

    def stats(self) -> CommStats:
        stats = self.counters.copy()
        stats.bytes_sent = self._bytes_sent
        stats.bytes_recv = sum(self._bytes_recv)
        stats.exposed_comm_s = self._exposed_s
        return stats

    def current_lr(self) -> float:
        return self._lr

    def checkpoint_tensors(self) -> dict[str, Tensor] | None:
        """Worker 0 assembles the servers' authoritative state; buffers are its own."""
        if self.context is None or self.context.worker_index != 0 or self.model is None:
            return None
        self._wait_for(None)  # every slice of the last step is applied on its server
        for server in range(self.num_servers):
            self.sender.put(("control", STATE, server), LAST)
        states: dict[int, dict[str, Tensor]] = {}
        for server in range(self.num_servers):
            data = self._get_state(server)
            for key, value in load_tensors(data.numpy().tobytes()).items():
                index, _, rest = key.partition("/")
                states.setdefault(int(index), {})[rest] = value
        tensors: dict[str, Tensor] = {}
        for name, param in self.model.named_parameters():
            if name not in self.slices_of:  # frozen: never sliced, the worker's copy is the truth
                tensors[PARAM + name] = param.detach().clone()
                continue
            parts = [(0, s.numel, states[s.index]) for s in self.slices_of[name]]  # start order
            tensors.update(assemble_variable(parts, param.shape, name))
        for name, buffer in self.model.named_buffers():
            tensors[BUFFER + name] = buffer.detach().clone()
        return {k: v.cpu().contiguous() for k, v in tensors.items()}

    def _get_state(self, server: int) -> Tensor:
        deadline = time.perf_counter() + self.timeout_s
        while True:
            try:
                return self._states[server].get(timeout=0.5)
            except queue.Empty:
                self._raise_if_failed()
                if time.perf_counter() > deadline:
                    raise TransportError(
                        f"server {server} sent no checkpoint state in {self.timeout_s:g} s"
                    ) from None

    def finish(self) -> None:
        """Tell every server this worker is done; wait for their last message."""
        for server in range(self.num_servers):
            self.sender.put(("control", DONE, server), LAST)
        self.sender.close(timeout_s=self.timeout_s)
        for thread in self._receivers:
            thread.join(timeout=self.timeout_s)
        self._raise_if_failed()
        if any(thread.is_alive() for thread in self._receivers):
            raise TransportError(f"a server did not acknowledge the end in {self.timeout_s:g} s")


def _slices(config: TrainConfig, variables: list[tuple[str, int]]) -> list[Slice]:
    p3 = config.strategy_options
    return slice_variables(
        variables,
        slice_size=p3.slice_size if p3.slicing else None,
        num_servers=p3.num_servers(),
    )


__all__ = ["PriorityPropagation"]
