"""``ps``: parameter servers, the architecture of classic distributed TensorFlow.

Servers own the variables (partitioned and placed by :mod:`gradsync.comm.placement`) and
the optimizer state (:mod:`gradsync.comm.server`); workers hold a model copy and no
optimizer. Every step a worker pushes each server the gradients of the partitions it owns
and pulls their fresh values before the next forward (:mod:`gradsync.comm.pushpull`).

- Dedicated servers (``--servers S``): ranks W..W+S-1 after the W workers.
- Colocated servers (``--colocate``): worker k also serves shard k, in a thread.
- Synchronous (default): servers average all workers' gradients, apply once: ``single``'s
  parameters up to reduction order. ``--async``: each push applied on arrival.
  ``--staleness k``: asynchronous, but no worker more than k steps ahead of the slowest.

Sparse gradients (``lstm-lm sparse=true``) are densified before the push; the sparse path
is the ``hybrid`` strategy's.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradsync.checkpoint import BUFFER, PARAM
from gradsync.comm.placement import POLICIES, Placement, Variable, plan_placement
from gradsync.comm.pushpull import HEADER, Client, Inbox, Outbox
from gradsync.comm.server import ServerRound, ShardState, assemble_variable, serve
from gradsync.config import TrainConfig
from gradsync.errors import UserError
from gradsync.metrics import MetricsWriter, ServerRecord
from gradsync.optim import Updater
from gradsync.options import InvalidOption, StrategyOptions, option
from gradsync.strategies.base import Context, Strategy
from gradsync.trace import COMPUTE, Phase


@dataclass(frozen=True, kw_only=True)
class PSOptions(StrategyOptions):
    """Where the servers run and when their updates apply.

    Synchronous by default; ``async_updates`` applies each push on arrival and
    ``staleness`` k bounds it (Stale Synchronous Parallel, Ho et al. 2013) and implies it.
    """

    servers: int | None = option(
        None, help="dedicated server ranks after the workers (default 1)", at_least=1
    )
    colocate: bool = option(False, help="every worker also serves a shard (no extra ranks)")
    async_updates: bool = option(
        False, help="apply each push on arrival (TF 1.x asynchronous training)", flag="--async"
    )
    staleness: int | None = option(
        None,
        help="asynchronous, but no worker more than K steps ahead of the slowest (SSP)",
        metavar="K",
        at_least=1,
    )
    placement: str = option(
        "greedy", help="greedy (size-balanced) or round-robin", choices=tuple(POLICIES)
    )
    partition_threshold_mb: float = option(
        4.0, help="variables larger than this are split across servers", metavar="MB", above=0
    )

    @property
    def asynchronous(self) -> bool:
        return self.async_updates or self.staleness is not None

    def num_servers(self, workers: int) -> int:
        """Server shards in the job: one per worker when colocated."""
        return workers if self.colocate else (1 if self.servers is None else self.servers)

    def check(self, workers: int) -> None:
        if self.colocate and self.servers is not None:
            raise InvalidOption(
                "{servers} with {colocate}: colocated servers run inside the workers, not on "
                "extra ranks; drop one of them",
                PSOptions,
            )


@dataclass(frozen=True)
class _Slot:
    """Where a partition's elements sit in a parameter and in its server's flat buffer."""

    name: str
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


class ParameterServer(Strategy):
    """Workers push gradients to sharded servers and pull parameters back."""

    name = "ps"
    summary = "parameter servers (TF 1.x): push gradients, pull parameters; sync/async/SSP"
    Options = PSOptions

    # -- configuration -------------------------------------------------------------------

    @classmethod
    def num_server_ranks(cls, config: TrainConfig) -> int:
        return (
            0
            if config.strategy_options.colocate
            else config.strategy_options.num_servers(config.workers)
        )

    @classmethod
    def check_config(cls, config: TrainConfig) -> None:
        """Fail before launch when the model has fewer variables than servers."""
        from gradsync.models import workload_of

        workload = workload_of(config)
        _plan(
            config,
            [_variable(n, p) for n, p in workload.model.named_parameters() if p.requires_grad],
        )

    @classmethod
    def is_synchronous(cls, config: TrainConfig) -> bool:
        return not config.strategy_options.asynchronous

    def expected_difference(self, config: TrainConfig) -> str | None:
        if config.strategy_options.staleness is not None:
            return f"asynchronous updates (staleness ≤ {config.strategy_options.staleness} steps)"
        if config.strategy_options.async_updates:
            return "asynchronous updates (each push applied on arrival)"
        return None

    # -- both roles ----------------------------------------------------------------------

    def _connect(self, context: Context, model: nn.Module | None) -> dict[str, Any]:
        """Collective on every rank: the transport group, then worker 0's variables."""
        config, workers = context.config, context.num_workers
        self.context = context
        self.group = dist.new_group(list(range(context.world_size)))
        self.num_servers = config.strategy_options.num_servers(workers)
        # Server s lives on rank s when colocated, after the workers otherwise.
        self.server_ranks = [
            s if config.strategy_options.colocate else workers + s for s in range(self.num_servers)
        ]
        spec: list[Any] = [None]
        if context.rank == 0:
            assert model is not None
            params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            spec = [
                {
                    "variables": [astuple(_variable(n, p)) for n, p in params],
                    "initial": {n: p.detach().cpu() for n, p in params},
                    "lr": context.lr,
                }
            ]
        # Initial parameters: worker 0's, on every worker and server (Horovod's broadcast).
        dist.broadcast_object_list(spec, src=0)
        self.placement: Placement = _plan(config, [Variable(*v) for v in spec[0]["variables"]])
        if context.rank == 0:
            where = (
                "colocated on the workers"
                if config.strategy_options.colocate
                else "dedicated ranks"
            )
            print(
                f"[rank 0] ps placement ({config.strategy_options.placement}, "
                f"{self.num_servers} servers, "
                f"{where}):\n{self.placement.describe()}",
                flush=True,
            )
        self.slots = [_slots(self.placement.on_server(s)) for s in range(self.num_servers)]
        return spec[0]

    def _make_server(self, server: int, spec: dict[str, Any], local_worker: int | None):
        config, workers = self.context.config, self.context.num_workers
        initial = torch.cat(
            [spec["initial"][s.name].reshape(-1)[s.start : s.stop] for s in self.slots[server]]
        )
        state = ShardState(
            initial,
            lambda ps: Updater(ps, config.optim, lr=spec["lr"]),
            sizes=[slot.numel for slot in self.slots[server]],
        )
        remote = {w: w for w in range(workers) if w != local_worker}
        timeout = config.launch.timeout_s
        inbox = Inbox(
            size=push_size(self.slots[server]),
            remote=remote,
            local_worker=local_worker,
            group=self.group,
            timeout_s=timeout,
        )
        outbox = Outbox(remote=remote, local_worker=local_worker, group=self.group)
        return state, inbox, outbox

    def _serve_shard(self, server: int, state: ShardState, inbox: Inbox, outbox: Outbox) -> None:
        context = self.context
        assert context is not None
        writer = MetricsWriter(Path(context.config.out), context.rank, prefix="server")
        last = time.perf_counter()

        def on_round(done: ServerRound) -> None:
            nonlocal last
            now = time.perf_counter()
            writer.write(
                ServerRecord(
                    step=done.step,
                    rank=context.rank,
                    server=server,
                    bytes_recv=done.bytes_recv,
                    bytes_sent=done.bytes_sent,
                    busy_s=done.busy_s,
                    step_time_s=now - last,
                )
            )
            last = now

        try:
            serve(
                inbox,
                outbox,
                state,
                num_workers=context.num_workers,
                synchronous=self.is_synchronous(context.config),
                staleness=context.config.strategy_options.staleness,
                on_round=on_round,
                timeline=context.timeline,
                track=f"server {server}",
            )
        finally:
            writer.close()

    # -- dedicated server rank -----------------------------------------------------------

    def serve(self, context: Context) -> None:
        spec = self._connect(context, None)
        server = self.server_ranks.index(context.rank)
        self._serve_shard(server, *self._make_server(server, spec, local_worker=None))

    # -- worker --------------------------------------------------------------------------

    def setup(self, model: nn.Module, context: Context) -> nn.Module:
        self.model = model
        spec = self._connect(context, model)
        self.params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in spec["initial"].items():
                param = self.params[name]
                if not param.is_contiguous():
                    param.data = param.data.contiguous()  # pulls write flat views
                param.copy_(value)
        local = None
        self._server_thread: threading.Thread | None = None
        if context.config.strategy_options.colocate:
            server = context.rank
            state, inbox, outbox = self._make_server(
                server, spec, local_worker=context.worker_index
            )
            local = (inbox, outbox)
            self._server_thread = threading.Thread(
                target=self._serve_or_die,
                args=(server, state, inbox, outbox),
                name="ps-server",
                daemon=True,
            )
            self._server_thread.start()
        self.client = Client(
            worker=context.worker_index,
            sizes=[state_size(slots) for slots in self.slots],
            push_sizes=[push_size(slots) for slots in self.slots],
            servers=[None if local and r == context.rank else r for r in self.server_ranks],
            group=self.group,
            timeout_s=context.config.launch.timeout_s,
            local=local,
            alive=lambda: self._server_thread is not None and self._server_thread.is_alive(),
            timeline=context.timeline,
        )
        self._step = 0
        self._lr = 0.0
        return model

    def _serve_or_die(self, server: int, *args: Any) -> None:
        try:
            self._serve_shard(server, *args)
        except BaseException:
            # A colocated server that fails must end the job now: its peers wait on it.
            print(f"colocated parameter server {server} failed:", file=sys.stderr)
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)

    def step(self) -> None:
        started = time.perf_counter()
        grads: dict[str, Tensor] = {}
        for server, slots in enumerate(self.slots):
            payload = self.client.push_buffers[server][HEADER:]
            flags = payload[state_size(slots) :]  # one had-a-gradient flag per slot
            for index, slot in enumerate(slots):
                if slot.name not in grads:
                    grads[slot.name] = _dense_grad(self.params[slot.name])
                payload[slot.offset : slot.offset + slot.numel].copy_(
                    grads[slot.name][slot.start : slot.stop]
                )
                flags[index] = self.params[slot.name].grad is not None
        # Sync point: every server has answered with the values for the next forward.
        with self.context.timeline.span(COMPUTE, Phase.COMM_WAIT, tensor="push/pull"):
            sent, received = self.client.push_pull(self._step)
        with torch.no_grad():
            for server, slots in enumerate(self.slots):
                values = self.client.pull_buffers[server][HEADER:]
                for slot in slots:
                    flat = self.params[slot.name].view(-1)
                    flat[slot.start : slot.stop].copy_(
                        values[slot.offset : slot.offset + slot.numel]
                    )
        for param in self.params.values():
            param.grad = None
        self._lr = float(self.client.pull_buffers[0][1])
        self._step += 1
        self.counters.bytes_sent += sent
        self.counters.bytes_recv += received
        self.counters.exposed_comm_s += time.perf_counter() - started

    def current_lr(self) -> float:
        return self._lr

    def checkpoint_tensors(self) -> dict[str, Tensor] | None:
        """Worker 0 assembles the servers' authoritative state; buffers are its own."""
        if self.context is None or self.context.worker_index != 0 or self.model is None:
            return None
        states = self.client.request_state()
        pieces: dict[str, list[tuple[_Slot, dict[str, Tensor]]]] = {}
        for server, slots in enumerate(self.slots):
            for slot in slots:
                pieces.setdefault(slot.name, []).append((slot, states[server]))
        tensors: dict[str, Tensor] = {}
        for name, param in self.model.named_parameters():
            if name not in pieces:  # frozen: never placed, the worker's copy is the truth
                tensors[PARAM + name] = param.detach().clone()
                continue
            parts = sorted(pieces[name], key=lambda piece: piece[0].start)
            where = [(slot.offset, slot.numel, state) for slot, state in parts]
            tensors.update(assemble_variable(where, param.shape, name))
        for name, buffer in self.model.named_buffers():
            tensors[BUFFER + name] = buffer.detach().clone()
        return {k: v.cpu().contiguous() for k, v in tensors.items()}

    def finish(self) -> None:
        self.client.done()
        if self._server_thread is not None:
            self._server_thread.join(timeout=self.context.config.launch.timeout_s)
            if self._server_thread.is_alive():
                raise RuntimeError("the colocated parameter server did not finish in time")


def _variable(name: str, param: nn.Parameter) -> Variable:
    return Variable(name, param.numel(), param.element_size())


def _plan(config: TrainConfig, variables: list[Variable]) -> Placement:
    try:
        return plan_placement(
            variables,
            num_servers=config.strategy_options.num_servers(config.workers),
            policy=config.strategy_options.placement,
            threshold_bytes=int(config.strategy_options.partition_threshold_mb * 2**20),
        )
    except UserError as error:
        raise UserError(f"model '{config.model}' ({config.preset}): {error}") from None


def _slots(partitions: list[Any]) -> list[_Slot]:
    slots, offset = [], 0
    for p in partitions:
        slots.append(_Slot(p.name, p.start, p.stop, offset))
        offset += p.numel
    return slots


def state_size(slots: list[_Slot]) -> int:
    return sum(s.numel for s in slots)


def push_size(slots: list[_Slot]) -> int:
    """A push carries the slots' gradients, then one had-a-gradient flag per slot."""
    return state_size(slots) + len(slots)


def _dense_grad(param: nn.Parameter) -> Tensor:
    """The flat gradient; none is zeros, sparse is densified (hybrid keeps it sparse)."""
    grad = param.grad
    if grad is None:
        return torch.zeros(param.numel(), dtype=param.dtype, device=param.device)
    return (grad.to_dense() if grad.is_sparse else grad).reshape(-1)
