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

Pushes overlap backward, as TF's per-variable sends do: a server's variables are laid out
in the order backward produces their gradients (last layer first) and grouped into chunks
of ``--push-chunk-mb``; a ``post_accumulate_grad`` hook pushes a chunk the moment its last
gradient is complete, and each chunk's answer comes back as soon as its server has applied
it. Chunks leave in a fixed order (a chunk waits for the ones before it on its server), so
every worker's pushes arrive in the same order; a chunk whose variable got no gradient in
this backward leaves after backward with its flag down. ``--no-overlap`` pushes one message
per server after backward.

Sparse gradients (``lstm-lm sparse=true``) are densified before the push; the sparse path
is the ``hybrid`` strategy's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradsync.checkpoint import load_model_state
from gradsync.comm.placement import POLICIES, Placement, Variable, plan_placement
from gradsync.comm.pushpull import Chunk, Client, DenseServer, chunk_reader, plan_chunks
from gradsync.comm.ready import ReadyOnce
from gradsync.comm.server import (
    ColocatedServer,
    Piece,
    ServerMetrics,
    ShardState,
    adopt_initial,
    assemble_checkpoint,
    endpoints,
    lay_out,
    share_initial,
    split_variable,
)
from gradsync.comm.wire import Lanes
from gradsync.config import TrainConfig
from gradsync.errors import UserError
from gradsync.optim import Updater
from gradsync.options import option
from gradsync.strategies.base import (
    Context,
    ServerOptions,
    ServerStrategy,
    check_one_dtype,
    trainable_parameters,
)
from gradsync.trace import COMPUTE, Phase


@dataclass(frozen=True, kw_only=True)
class PSOptions(ServerOptions):
    """Where the servers run, how variables are placed, and when updates apply.

    Synchronous by default; ``async_updates`` applies each push on arrival and
    ``staleness`` k bounds it (Stale Synchronous Parallel, Ho et al. 2013) and implies it.
    """

    async_updates: bool = option(
        False,
        help="apply each push on arrival (TF 1.x asynchronous training)",
        flag="--async",
        changes_results=True,
    )
    staleness: int | None = option(
        None,
        help="asynchronous, but no worker more than K steps ahead of the slowest (SSP)",
        metavar="K",
        at_least=1,
        none_means="no bound (synchronous unless --async)",
        changes_results=True,
    )
    placement: str = option(
        "greedy", help="greedy (size-balanced) or round-robin", choices=tuple(POLICIES)
    )
    partition_threshold_mb: float = option(
        4.0, help="variables larger than this are split across servers", metavar="MB", above=0
    )
    overlap: bool = option(
        True, help="push each chunk of gradients as soon as backward has produced it"
    )
    push_chunk_mb: float = option(
        4.0,
        help="gradients per push message, per server (0: one per variable or partition of "
        "one; --no-overlap: one per server)",
        metavar="MB",
        at_least=0,
    )

    @property
    def asynchronous(self) -> bool:
        return self.async_updates or self.staleness is not None


class ParameterServer(ServerStrategy):
    """Workers push gradients to sharded servers and pull parameters back."""

    name = "ps"
    summary = "parameter servers (TF 1.x): push gradients, pull parameters; sync/async/SSP"
    Options = PSOptions

    # -- configuration -------------------------------------------------------------------

    @classmethod
    def check_config(cls, config: TrainConfig) -> None:
        """Fail before launch when the model has fewer variables than servers."""
        params = trainable_parameters(config)
        check_one_dtype(cls.name, params)
        _plan(config, params)

    @classmethod
    def is_synchronous(cls, config: TrainConfig) -> bool:
        """Synchronous, or asynchronous with one worker (whose pushes arrive in order, so
        it must compute what ``single`` computes)."""
        return not config.strategy_options.asynchronous or config.workers == 1

    def expected_difference(self, config: TrainConfig) -> str | None:
        options = config.strategy_options
        if self.is_synchronous(config):
            return None
        if options.staleness is not None:
            return f"asynchronous updates (staleness ≤ {options.staleness} steps)"
        if options.async_updates:
            return "asynchronous updates (each push applied on arrival)"
        return None

    # -- both roles ----------------------------------------------------------------------

    def _connect(self, context: Context, model: nn.Module | None) -> dict[str, Tensor]:
        """Collective on every rank: the transport's lanes, then worker 0's variables."""
        config, workers = context.config, context.num_workers
        options = config.strategy_options
        self.context = context
        self.lanes = Lanes.create(context.world_size, timedelta(seconds=config.launch.timeout_s))
        self.num_servers = options.num_servers(workers)
        self.server_ranks = options.server_ranks(workers)
        initial, self.lr0 = share_initial(model, context.lr)
        self.placement: Placement = _plan(config, initial)
        if context.rank == 0:
            where = "colocated on the workers" if options.colocate else "dedicated ranks"
            print(
                f"[rank 0] ps placement ({options.placement}, {self.num_servers} servers, "
                f"{where}):\n{self.placement.describe()}",
                flush=True,
            )
        element = next(iter(initial.values())).element_size() if initial else 4
        self.pieces, self.chunks = push_layout(self.placement, list(initial), options, element)
        return initial

    def _server(self, server: int, initial: dict[str, Tensor], local_worker: int | None):
        """Server ``server``'s inbox and policy (``local_worker`` shares its process)."""
        context = self.context
        config, workers = context.config, context.num_workers
        pieces = self.pieces[server]
        state = ShardState(
            torch.cat([initial[p.name].reshape(-1)[p.start : p.stop] for p in pieces]),
            lambda ps: Updater(ps, config.optim, lr=self.lr0),
            sizes=[p.numel for p in pieces],
        )
        inbox, outbox = endpoints(
            num_workers=workers,
            local_worker=local_worker,
            lanes=self.lanes,
            timeout_s=config.launch.timeout_s,
            read_body=chunk_reader(self.chunks[server]),
            deliver_local=None if local_worker is None else self._local_replies.put,
        )
        policy = DenseServer(
            state,
            outbox,
            ServerMetrics.to_file(
                config.out, rank=context.rank, server=server, steps_done=context.steps_done
            ),
            num_workers=workers,
            synchronous=self.is_synchronous(config),
            staleness=config.strategy_options.staleness,
            chunks=self.chunks[server],
            timeline=context.timeline,
            track=f"server {server}",
        )
        return inbox, policy

    # -- dedicated server rank -----------------------------------------------------------

    def serve(self, context: Context) -> None:
        self._run_dedicated(context, self._connect(context, None))

    # -- worker --------------------------------------------------------------------------

    def setup(self, model: nn.Module, context: Context) -> nn.Module:
        self.model = model
        initial = self._connect(context, model)
        self.params = dict(model.named_parameters())
        adopt_initial(self.params, initial)
        self.client = Client(
            worker=context.worker_index,
            chunks=self.chunks,
            servers=[
                None if context.config.strategy_options.colocate and r == context.rank else r
                for r in self.server_ranks
            ],
            lanes=self.lanes,
            timeout_s=context.config.launch.timeout_s,
            alive=lambda: self._colocated is not None and self._colocated.alive(),
            timeline=context.timeline,
        )
        self._local_replies = self.client.local_replies
        self._colocated: ColocatedServer | None = None
        if context.config.strategy_options.colocate:
            self.client.local_inbox, self._colocated = self._start_colocated(context, initial)
        self._step = 0
        self._watch_gradients(context.config.strategy_options.overlap)
        return model

    def _watch_gradients(self, overlap: bool) -> None:
        """Per chunk, the variables it waits for; with ``overlap``, a hook per variable."""
        self._waits_for: list[list[set[str]]] = [
            [{p.name for p in pieces[c.first_slot : c.stop_slot]} for c in chunks]
            for pieces, chunks in zip(self.pieces, self.chunks, strict=True)
        ]
        self._ready = ReadyOnce("ps", "--no-overlap (push after backward)")
        self._chunks_of: dict[str, list[tuple[int, int]]] = {}
        for server, chunk_names in enumerate(self._waits_for):
            for index, names in enumerate(chunk_names):
                for name in names:
                    self._chunks_of.setdefault(name, []).append((server, index))
        self._new_step()
        if overlap:
            for name in self._chunks_of:
                self.params[name].register_post_accumulate_grad_hook(
                    lambda _, name=name: self._on_gradient(name)
                )

    def _new_step(self) -> None:
        self._begun = False
        self._missing = [[set(names) for names in chunks] for chunks in self._waits_for]
        self._next_push = [0] * self.num_servers
        self._grads: dict[str, Tensor] = {}
        self._ready.reset()

    def _on_gradient(self, name: str) -> None:
        """``name``'s gradient is complete: push every chunk now ready, in chunk order."""
        self._ready.mark(name)
        for server, index in self._chunks_of[name]:
            self._missing[server][index].discard(name)
            while self._next_is_complete(server):
                self._push(server)

    def _next_is_complete(self, server: int) -> bool:
        """Whether server ``server``'s next chunk exists and has all its gradients."""
        index = self._next_push[server]
        return index < len(self.chunks[server]) and not self._missing[server][index]

    def _push(self, server: int) -> None:
        """Fill and push server ``server``'s next chunk (flags: which slots had a gradient)."""
        if not self._begun:
            self.client.begin(self._step)  # lazily: checkpoint requests between steps
            self._begun = True
        index = self._next_push[server]
        self._next_push[server] += 1
        chunk: Chunk = self.chunks[server][index]
        payload = self.client.push_buffers[server][index]
        pieces = self.pieces[server][chunk.first_slot : chunk.stop_slot]
        with torch.no_grad():
            for slot, piece in enumerate(pieces):
                if piece.name not in self._grads:
                    self._grads[piece.name] = _dense_grad(self.params[piece.name])
                start = piece.offset - chunk.start
                payload[start : start + piece.numel].copy_(
                    self._grads[piece.name][piece.start : piece.stop]
                )
                payload[chunk.numel + slot] = self.params[piece.name].grad is not None
        self.client.push(server, index)

    def step(self) -> None:
        started = time.perf_counter()
        for server, chunks in enumerate(self.chunks):  # what backward did not complete
            while self._next_push[server] < len(chunks):
                self._push(server)
        # Sync point: every server has answered with the values for the next forward.
        with self.context.timeline.span(COMPUTE, Phase.COMM_WAIT, tensor="push/pull"):
            sent, received = self.client.finish()
        with torch.no_grad():
            for server, pieces in enumerate(self.pieces):
                values = self.client.pull_buffers[server]
                for piece in pieces:
                    flat = self.params[piece.name].view(-1)
                    flat[piece.start : piece.stop].copy_(
                        values[piece.offset : piece.offset + piece.numel]
                    )
        for param in self.params.values():
            param.grad = None
        self._step += 1
        self._new_step()
        self.counters.bytes_sent += sent
        self.counters.bytes_recv += received
        self.counters.exposed_comm_s += time.perf_counter() - started

    def checkpoint_tensors(self) -> dict[str, Tensor] | None:
        """Worker 0 assembles the servers' authoritative state; buffers are its own.

        Every worker calls it. With asynchronous updates the servers apply a push on
        arrival, so no worker pushes again before the state of this step is taken: a step
        applied into it would be applied twice by ``--resume`` or a restart.
        """
        if self.context is None or self.model is None:
            return None
        tensors = None
        if self.context.worker_index == 0:
            tensors = self._servers_state()
        if self.context.config.strategy_options.asynchronous:
            dist.barrier(group=self.context.worker_group)
        return tensors

    def _servers_state(self) -> dict[str, Tensor]:
        """Every server's values and optimizer state, as checkpoint tensors (worker 0)."""
        assert self.model is not None
        return assemble_checkpoint(self.model, self.pieces, self.client.request_state())

    def load_checkpoint_tensors(self, tensors: dict[str, Tensor], steps_done: int) -> None:
        states = [split_variable(tensors, pieces) for pieces in self.pieces]
        self.client.load_state(states, steps_done)

    def finish(self) -> None:
        if self.context.worker_index == 0 and self.context.config.strategy_options.asynchronous:
            # Worker 0's copy is its last pull; later pushes of the others are on the
            # servers. The validation after finish reads this worker's model.
            load_model_state(self.model, None, self._servers_state())
        self.client.done()
        if self._colocated is not None:
            self._colocated.join(self.context.config.launch.timeout_s)


def _plan(config: TrainConfig, params: dict[str, Tensor]) -> Placement:
    variables = [Variable(n, p.numel(), p.element_size()) for n, p in params.items()]
    try:
        return plan_placement(
            variables,
            num_servers=config.strategy_options.num_servers(config.workers),
            policy=config.strategy_options.placement,
            threshold_bytes=int(config.strategy_options.partition_threshold_mb * 2**20),
        )
    except UserError as error:
        raise UserError(f"model '{config.model}' ({config.preset}): {error}") from None


def push_layout(
    placement: Placement, model_order: Sequence[str], options: PSOptions, element_size: int
) -> tuple[list[list[Piece]], list[list[Chunk]]]:
    """Each server's pieces, laid out in the order backward completes their gradients (last
    layer first), and the chunks its workers push them in (one per server without
    overlap). ``gradsync predict`` plans ``ps`` with it too.

    Example:
        >>> placement = plan_placement(
        ...     [Variable("a", 3, 4), Variable("b", 5, 4)], num_servers=1, policy="greedy",
        ...     threshold_bytes=1 << 20)
        >>> pieces, chunks = push_layout(placement, ["a", "b"], PSOptions(push_chunk_mb=0), 4)
        >>> [p.name for p in pieces[0]], [(c.start, c.stop) for c in chunks[0]]
        (['b', 'a'], [(0, 5), (5, 8)])
    """
    ready_order = {name: -index for index, name in enumerate(model_order)}
    chunk_values = None
    if options.overlap:
        chunk_values = int(options.push_chunk_mb * 2**20) // element_size
    pieces = [
        lay_out(
            [
                (p.name, p.start, p.stop)
                for p in sorted(
                    placement.on_server(s), key=lambda p: (ready_order[p.name], p.start)
                )
            ]
        )
        for s in range(placement.num_servers)
    ]
    return pieces, [plan_chunks([p.numel for p in run], chunk_values) for run in pieces]


def _dense_grad(param: nn.Parameter) -> Tensor:
    """The flat gradient; none is zeros, sparse is densified (hybrid keeps it sparse)."""
    grad = param.grad
    if grad is None:
        return torch.zeros(param.numel(), dtype=param.dtype, device=param.device)
    return (grad.to_dense() if grad.is_sparse else grad).reshape(-1)
