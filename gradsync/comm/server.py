"""A parameter server: the authoritative values of its partitions, their optimizer, its loop.

:class:`ShardState` holds one server's partitions as one flat tensor with the optimizer
(and its state) over it; workers hold no optimizer state. :func:`serve` answers pushes
until every worker has said it is done, under one of two update rules:

- synchronous (:class:`SyncRounds`): wait for every worker's push of step t, add them in
  worker order, divide by the number of workers (the global-batch gradient, as ``single``
  computes it), apply once, answer everyone with the same values;
- stale-synchronous (:class:`BoundedStaleness`, Ho et al. 2013): apply each push on
  arrival (scaled by 1/workers, so one round of pushes moves as far as one synchronous
  step), answer at once unless that lets the pusher run more than ``staleness`` steps
  ahead of the slowest worker; ``staleness=None`` is plain asynchronous training (TF 1.x
  between-graph replication), which never holds an answer back.

Element-wise optimizers (SGD with momentum, Adam) give the same result on a flat
concatenation as on the separate tensors, so the server optimizes one flat tensor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from gradsync.checkpoint import OPTIM, PARAM
from gradsync.comm.pushpull import DONE, HEADER, PUSH, STATE, Inbox, Message, Outbox
from gradsync.optim import Updater
from gradsync.trace import NullTimeline, Phase


class ShardState:
    """One server's partitions (flat) and the optimizer that updates them.

    ``sizes`` cuts the flat values into slots (the partitions of separate variables); each
    slot is its own optimizer parameter, a view of the flat tensor, so a slot whose
    gradient is missing on every worker is skipped exactly as ``single`` skips a parameter
    whose ``.grad`` is None (no momentum, no weight decay, no Adam step).

    Example:
        >>> from gradsync.config import OptimConfig
        >>> make = lambda ps: Updater(ps, OptimConfig(lr=0.5), lr=0.5)
        >>> state = ShardState(torch.zeros(3), make, sizes=[1, 2])
        >>> state.apply(torch.ones(3), step=0, present=[True, False]); state.values.tolist()
        [-0.5, 0.0, 0.0]
    """

    def __init__(
        self,
        initial: Tensor,
        make_updater: Callable[[list[nn.Parameter]], Updater],
        sizes: Sequence[int] | None = None,
    ):
        self.values = initial.detach().clone().reshape(-1)
        self.sizes = list(sizes) if sizes is not None else [self.values.numel()]
        self.slots = [nn.Parameter(view) for view in self.values.split(self.sizes)]
        self.updater = make_updater(self.slots)
        self.num_updates = 0

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    def apply(self, grad: Tensor, step: int, present: Sequence[bool] | None = None) -> None:
        """One optimizer step with ``grad`` (flat) and the learning rate of ``step``;
        slots whose ``present`` flag is False had no gradient and are left alone."""
        present = present if present is not None else [True] * self.num_slots
        for slot, piece, here in zip(self.slots, grad.split(self.sizes), present, strict=True):
            slot.grad = piece if here else None
        self.updater.update_at(step)
        self.num_updates += 1

    def apply_push(self, payload: Tensor, step: int) -> None:
        """Apply a push payload laid out as gradients then one had-a-gradient flag per slot."""
        grad, flags = payload[: self.values.numel()], payload[self.values.numel() :]
        self.apply(grad, step, present=flags.gt(0).tolist())

    @property
    def lr(self) -> float:
        return self.updater.lr

    def snapshot(self, step: int) -> Tensor:
        """A pull message: header (step applied, learning rate) and a copy of the values."""
        message = torch.empty(HEADER + self.values.numel())
        message[:HEADER] = torch.tensor([step, self.lr, 0.0])
        message[HEADER:] = self.values
        return message

    def state_tensors(self) -> dict[str, Tensor]:
        """``values`` and ``optim/<key>``, flat like the values. A slot without optimizer
        state (never updated) gives zeros; a scalar state such as Adam's ``step`` is repeated
        over its slot's elements and named ``optim/<key>@scalar``."""
        tensors = {"values": self.values.clone()}
        state = self.updater.optimizer.state
        keys = sorted(
            {k for slot in self.slots for k, v in state[slot].items() if isinstance(v, Tensor)}
        )
        for key in keys:
            pieces, scalar = [], False
            for slot in self.slots:
                value = state[slot].get(key)
                if value is None:
                    pieces.append(torch.zeros(slot.numel(), dtype=self.values.dtype))
                elif value.dim() == 0:
                    scalar = True
                    pieces.append(value.to(self.values.dtype).expand(slot.numel()))
                else:
                    pieces.append(value.detach().reshape(-1))
            tensors[f"optim/{key}{SCALAR if scalar else ''}"] = torch.cat(pieces)
        return tensors


SCALAR = "@scalar"


def assemble_variable(
    parts: Sequence[tuple[int, int, dict[str, Tensor]]], shape: torch.Size, name: str
) -> dict[str, Tensor]:
    """One variable's checkpoint tensors from its pieces on the servers.

    ``parts`` are (offset, numel, server state) in the variable's element order; the keys are
    those of :meth:`ShardState.state_tensors`.

    Example:
        >>> state = {"values": torch.arange(4.0), "optim/step@scalar": torch.full((4,), 3.0)}
        >>> sorted(assemble_variable([(0, 2, state), (2, 2, state)], torch.Size([2, 2]), "w"))
        ['optim/w/step', 'param/w']
    """
    tensors: dict[str, Tensor] = {}
    for key in parts[0][2]:
        flat = torch.cat([state[key][offset : offset + numel] for offset, numel, state in parts])
        if key == "values":
            tensors[PARAM + name] = flat.view(shape)
        elif key.endswith(SCALAR):
            tensors[OPTIM + name + key[len("optim") : -len(SCALAR)]] = flat[0].clone()
        else:
            tensors[OPTIM + name + key[len("optim") :]] = flat.view(shape)
    return tensors


@dataclass(frozen=True, kw_only=True)
class ServerRound:
    """What one server did for one step: bytes in (pushes) and out (pulls), busy time."""

    step: int
    bytes_recv: int
    bytes_sent: int
    busy_s: float


@dataclass
class _Tally:
    pushes: int = 0
    replies: int = 0
    bytes_recv: int = 0
    bytes_sent: int = 0
    busy_s: float = 0.0


@dataclass
class RoundLog:
    """Per-step counters; a step is reported once all workers pushed it and got answers."""

    num_workers: int
    on_round: Callable[[ServerRound], None]
    tallies: dict[int, _Tally] = field(default_factory=dict)

    def tally(self, step: int) -> _Tally:
        return self.tallies.setdefault(step, _Tally())

    def report_complete(self) -> None:
        for step in sorted(self.tallies):
            t = self.tallies[step]
            if t.pushes < self.num_workers or t.replies < self.num_workers:
                return
            del self.tallies[step]
            self.on_round(
                ServerRound(
                    step=step, bytes_recv=t.bytes_recv, bytes_sent=t.bytes_sent, busy_s=t.busy_s
                )
            )


class SyncRounds:
    """Aggregate every worker's push of a step, apply once, answer all."""

    timeline: NullTimeline = NullTimeline()
    track: str = "server"

    def __init__(self, state: ShardState, outbox: Outbox, log: RoundLog) -> None:
        self.state, self.outbox, self.log = state, outbox, log
        self.pending: dict[int, Tensor] = {}

    def on_push(self, message: Message) -> None:
        if message.worker in self.pending:
            raise RuntimeError(f"worker {message.worker} pushed step {message.step} twice")
        self.pending[message.worker] = message.payload
        if len(self.pending) < self.log.num_workers:
            return
        started = time.perf_counter()
        step, nbytes = message.step, message.payload.numel() * message.payload.element_size()
        with self.timeline.span(
            self.track,
            Phase.SERVER_AGGREGATE,
            step=step,
            tensor=self.track,
            bytes=nbytes * self.log.num_workers,
        ):
            # Fixed worker order: the sum is the same on every run (bit-identical reruns).
            total = self.pending[0].clone()
            for worker in range(1, self.log.num_workers):
                total += self.pending[worker]
            total /= self.log.num_workers
        with self.timeline.span(
            self.track, Phase.SERVER_APPLY, step=step, tensor=self.track, bytes=nbytes
        ):
            self.state.apply_push(total, message.step)
        reply = self.state.snapshot(message.step)
        tally = self.log.tally(message.step)
        for worker in range(self.log.num_workers):
            tally.bytes_sent += self.outbox.send(worker, reply)
            tally.replies += 1
        tally.busy_s += time.perf_counter() - started
        self.pending.clear()


class BoundedStaleness:
    """Apply each push on arrival; hold an answer back only to keep the staleness bound."""

    timeline: NullTimeline = NullTimeline()
    track: str = "server"

    def __init__(
        self, state: ShardState, outbox: Outbox, log: RoundLog, staleness: int | None
    ) -> None:
        self.state, self.outbox, self.log = state, outbox, log
        self.staleness = staleness
        self.clocks = [0] * log.num_workers  # steps each worker has completed here
        self.waiting: list[tuple[int, int]] = []  # (worker, step) whose answer is held

    def on_push(self, message: Message) -> None:
        started = time.perf_counter()
        with self.timeline.span(
            self.track,
            Phase.SERVER_APPLY,
            step=message.step,
            tensor=self.track,
            worker=message.worker,
        ):
            self.state.apply_push(message.payload / self.log.num_workers, message.step)
        self.clocks[message.worker] = message.step + 1
        self.waiting.append((message.worker, message.step))
        self.log.tally(message.step).busy_s += time.perf_counter() - started
        self._release()

    def _release(self) -> None:
        slowest = min(self.clocks)
        held = []
        for worker, step in self.waiting:
            # SSP: the pusher's next step (step + 1) may lead the slowest by ≤ staleness.
            if self.staleness is not None and step + 1 - slowest > self.staleness:
                held.append((worker, step))
                continue
            tally = self.log.tally(step)
            tally.bytes_sent += self.outbox.send(worker, self.state.snapshot(step))
            tally.replies += 1
        self.waiting = held


def serve(
    inbox: Inbox,
    outbox: Outbox,
    state: ShardState,
    *,
    num_workers: int,
    synchronous: bool,
    staleness: int | None = None,
    on_round: Callable[[ServerRound], None] = lambda _: None,
    timeline: NullTimeline | None = None,
    track: str = "server",
) -> None:
    """Answer pushes and state requests until all ``num_workers`` workers are done.

    ``timeline`` records SERVER_AGGREGATE and SERVER_APPLY on ``track``.
    """
    log = RoundLog(num_workers, on_round)
    rule = (
        SyncRounds(state, outbox, log)
        if synchronous
        else BoundedStaleness(state, outbox, log, staleness)
    )
    rule.timeline, rule.track = timeline or NullTimeline(), track
    done: set[int] = set()
    while len(done) < num_workers:
        message = inbox.get()
        if message.kind == DONE:
            done.add(message.worker)
        elif message.kind == STATE:
            outbox.send_state(message.worker, state.state_tensors())
        elif message.kind == PUSH:
            tally = log.tally(message.step)
            tally.pushes += 1
            tally.bytes_recv += message.wire_bytes
            rule.on_push(message)
            log.report_complete()
        else:
            raise RuntimeError(f"unknown message kind {message.kind} from worker {message.worker}")
    outbox.flush()


__all__ = [
    "BoundedStaleness",
    "ServerRound",
    "ShardState",
    "SyncRounds",
    "assemble_variable",
    "serve",
]
