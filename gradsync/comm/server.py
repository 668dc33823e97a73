"""The server side every strategy with server ranks shares (``ps``, ``hybrid``, ``p3``).

- :func:`serve`: the loop skeleton. It reads an :class:`~gradsync.comm.wire.Inbox` until
  every worker said DONE and hands each message to a :class:`ServerPolicy`, which decides
  what a shard is, when a round is complete and what to answer.
- :class:`Gather` and :func:`sum_in_order`: the round — contributions collected per key
  until every expected worker is in, then added in fixed worker order (the same sum on
  every run: bit-identical reruns).
- :class:`ShardState`: values (flat) and the optimizer over them, with state dump and load.
- :class:`ServerMetrics`: one ``ServerRecord`` line per step per server.
- :class:`ColocatedServer`: a server in a thread of a worker process, ending the job if it
  fails (its peers would otherwise wait on it).
- :func:`assemble_checkpoint` / :func:`split_variable`: server states ↔ checkpoint tensors,
  so a server can be dumped into a checkpoint and loaded back from one (resume).

Example:
    >>> gather = Gather([0, 1])
    >>> gather.add("slice 3", 1, torch.ones(2)) is None
    True
    >>> sum_in_order(gather.add("slice 3", 0, torch.ones(2)), scale=0.5).tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradsync.checkpoint import BUFFER, OPTIM, PARAM
from gradsync.comm.objects import broadcast_json, broadcast_tensors
from gradsync.comm.pieces import Piece
from gradsync.comm.wire import (
    TAG_REPLY,
    Header,
    Inbox,
    Kind,
    Lanes,
    Message,
    Outbox,
    ReadBody,
    decode_state,
)
from gradsync.metrics import MetricsWriter, ServerRecord
from gradsync.optim import Updater

# -- the round: contributions in fixed worker order ---------------------------------------


class Gather:
    """Contributions per key (a step, a slice) until every expected worker has given one.

    :meth:`add` returns them, in the order of ``workers``, once the last one is in.
    """

    def __init__(self, workers: Sequence[int]) -> None:
        self.workers = list(workers)
        self.pending: dict[Hashable, dict[int, Any]] = {}

    def add(self, key: Hashable, worker: int, item: Any) -> list[Any] | None:
        contributions = self.pending.setdefault(key, {})
        if worker in contributions:
            raise RuntimeError(f"worker {worker} contributed to {key} twice")
        contributions[worker] = item
        if len(contributions) < len(self.workers):
            return None
        del self.pending[key]
        return [contributions[w] for w in self.workers]


def sum_in_order(items: Sequence[Tensor | None], *, scale: float = 1.0) -> Tensor | None:
    """The sum of the tensors in the order given (None: no contribution), times ``scale``;
    None when no item had one. A fixed order makes the sum bit-identical across runs.

    The inputs are never written. One new tensor holds the result: the first two are added
    into it, the rest added in place, then it is scaled in place — the same operations, in
    the same order, as summing into a copy of the first (the same bits), one copy fewer.

    Example:
        >>> sum_in_order([torch.ones(2), None, torch.ones(2)], scale=0.25).tolist()
        [0.5, 0.5]
    """
    present = [t for t in items if t is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0].clone() if scale == 1.0 else torch.mul(present[0], scale)
    total = torch.add(present[0], present[1])
    for tensor in present[2:]:
        total.add_(tensor)
    if scale != 1.0:
        total.mul_(scale)
    return total


# -- the state of a shard -----------------------------------------------------------------


SCALAR = "@scalar"


class ShardState:
    """One server's values (flat) and the optimizer that updates them.

    ``sizes`` cuts the flat values into slots (pieces of separate variables); each slot is
    its own optimizer parameter, a view of the flat tensor, so a slot whose gradient is
    missing on every worker is skipped exactly as ``single`` skips a parameter whose
    ``.grad`` is None (no momentum, no weight decay, no Adam step). Element-wise
    optimizers (SGD with momentum, Adam) give the same result on a flat concatenation as
    on the separate tensors.

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

    @property
    def lr(self) -> float:
        return self.updater.lr

    def apply(self, grad: Tensor, step: int, present: Sequence[bool] | None = None) -> None:
        """One optimizer step with ``grad`` (flat) and the learning rate of ``step``;
        slots whose ``present`` flag is False had no gradient and are left alone.

        The slots' gradients go straight to :meth:`Updater.update_params_at` (torch's
        functional SGD/Adam over the slot views): the same bits as setting each slot's
        ``.grad`` and calling ``optimizer.step()``, without its per-call cost."""
        self.apply_run(0, grad, step, [True] * self.num_slots if present is None else present)

    def apply_run(self, first: int, grad: Tensor, step: int, present: Sequence[bool]) -> None:
        """:meth:`apply` for the consecutive slots ``first … first + len(present) − 1``
        only (``grad``: theirs, flat); every other slot is skipped. Its cost is that of
        the run, whatever the shard's size.

        Example:
            >>> from gradsync.config import OptimConfig
            >>> make = lambda ps: Updater(ps, OptimConfig(lr=0.5), lr=0.5)
            >>> state = ShardState(torch.zeros(3), make, sizes=[1, 2])
            >>> state.apply_run(1, torch.ones(2), step=0, present=[True])
            >>> state.values.tolist()
            [0.0, -0.5, -0.5]
        """
        stop = first + len(present)
        sizes = self.sizes[first:stop]
        if grad.numel() != sum(sizes) or grad.dim() != 1 or grad.dtype != self.values.dtype:
            raise ValueError(
                f"a gradient of {tuple(grad.shape)} {grad.dtype} for slots {first}–{stop - 1} "
                f"of {sum(sizes)} {self.values.dtype} values"
            )
        pieces = (grad,) if len(sizes) == 1 else grad.split(sizes)
        chosen = [
            (slot, piece)
            for slot, piece, here in zip(self.slots[first:stop], pieces, present, strict=True)
            if here
        ]
        params, grads = [slot for slot, _ in chosen], [piece for _, piece in chosen]
        self.updater.update_params_at(step, params, grads)
        self.num_updates += 1

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

    def load_state_tensors(self, tensors: dict[str, Tensor]) -> None:
        """The inverse of :meth:`state_tensors`: install values and optimizer state."""
        with torch.no_grad():
            self.values.copy_(tensors["values"].reshape(-1))
        state = self.updater.optimizer.state
        for name, flat in tensors.items():
            if not name.startswith("optim/"):
                continue
            key = name[len("optim/") :]
            scalar = key.endswith(SCALAR)
            key = key.removesuffix(SCALAR)
            for slot, piece in zip(self.slots, flat.split(self.sizes), strict=True):
                if scalar:  # an empty slot kept no copy: it counts afresh, on no element
                    state[slot][key] = torch.tensor(float(piece[0]) if piece.numel() else 0.0)
                else:
                    state[slot][key] = piece.clone().view_as(slot)


# -- checkpoint assembly and splitting ------------------------------------------------------


def lay_out(ranges: Sequence[tuple[str, int, int]]) -> list[Piece]:
    """Consecutive pieces of one server's flat state, in the order given.

    Example:
        >>> [p.offset for p in lay_out([("w", 0, 4), ("b", 0, 2)])]
        [0, 4]
    """
    pieces, offset = [], 0
    for name, start, stop in ranges:
        pieces.append(Piece(name, start, stop, offset=offset))
        offset += stop - start
    return pieces


def assemble_variable(
    parts: Sequence[tuple[Piece, dict[str, Tensor]]], shape: torch.Size, name: str
) -> dict[str, Tensor]:
    """One variable's checkpoint tensors from its pieces (in element order) and the states
    of the servers holding them (keys of :meth:`ShardState.state_tensors`). A variable of
    no elements has no scalar state (Adam's ``step``), which acts on nothing anyway.

    Example:
        >>> state = {"values": torch.arange(4.0), "optim/step@scalar": torch.full((4,), 3.0)}
        >>> parts = [(Piece("w", 0, 2), state), (Piece("w", 2, 4, offset=2), state)]
        >>> sorted(assemble_variable(parts, torch.Size([2, 2]), "w"))
        ['optim/w/step', 'param/w']
    """
    tensors: dict[str, Tensor] = {}
    for key in parts[0][1]:
        flat = torch.cat([state[key][p.offset : p.offset + p.numel] for p, state in parts])
        if key == "values":
            tensors[PARAM + name] = flat.view(shape)
        elif key.endswith(SCALAR):
            if flat.numel():  # repeated over the elements: an empty variable has no copy
                tensors[OPTIM + name + key[len("optim") : -len(SCALAR)]] = flat[0].clone()
        else:
            tensors[OPTIM + name + key[len("optim") :]] = flat.view(shape)
    return tensors


def assemble_checkpoint(
    model: nn.Module, pieces: Sequence[Sequence[Piece]], states: Sequence[dict[str, Tensor]]
) -> dict[str, Tensor]:
    """Checkpoint tensors from every server's state (``pieces[s]``: server s's layout).

    A parameter on no server (frozen) and the buffers are the worker's own copies.
    """
    parts: dict[str, list[tuple[Piece, dict[str, Tensor]]]] = {}
    for server_pieces, state in zip(pieces, states, strict=True):
        for piece in server_pieces:
            parts.setdefault(piece.name, []).append((piece, state))
    tensors: dict[str, Tensor] = {}
    for name, param in model.named_parameters():
        if name not in parts:
            tensors[PARAM + name] = param.detach().clone()
            continue
        ordered = sorted(parts[name], key=lambda part: part[0].start)
        tensors.update(assemble_variable(ordered, param.shape, name))
    for name, buffer in model.named_buffers():
        tensors[BUFFER + name] = buffer.detach().clone()
    return {k: v.cpu().contiguous() for k, v in tensors.items()}


def split_variable(tensors: dict[str, Tensor], pieces: Sequence[Piece]) -> dict[str, Tensor]:
    """One server's state (keys of :meth:`ShardState.state_tensors`) cut from checkpoint
    ``tensors``: the inverse of :func:`assemble_checkpoint` for that server.

    Example:
        >>> ckpt = {"param/w": torch.arange(4.0), "optim/w/momentum_buffer": torch.ones(4)}
        >>> split_variable(ckpt, [Piece("w", 2, 4)])["values"].tolist()
        [2.0, 3.0]
    """
    keys = sorted(
        {
            k[len(OPTIM) + len(p.name) + 1 :]
            for p in pieces
            for k in tensors
            if k.startswith(f"{OPTIM}{p.name}/")
        }
    )
    state = {
        "values": torch.cat([tensors[PARAM + p.name].reshape(-1)[p.start : p.stop] for p in pieces])
    }
    for key in keys:
        flat = []
        scalar = False
        for p in pieces:
            value = tensors.get(f"{OPTIM}{p.name}/{key}")
            if value is None:
                flat.append(torch.zeros(p.numel, dtype=state["values"].dtype))
            elif value.dim() == 0:
                scalar = True
                flat.append(value.to(state["values"].dtype).expand(p.numel))
            else:
                flat.append(value.reshape(-1)[p.start : p.stop])
        state[f"optim/{key}{SCALAR if scalar else ''}"] = torch.cat(flat)
    return state


# -- the initial values ---------------------------------------------------------------------


def share_initial(model: nn.Module | None, lr: float) -> tuple[dict[str, Tensor], float]:
    """Collective on every rank: rank 0's trainable parameters (name → tensor, in model
    order) and peak learning rate, as Horovod's initial broadcast (no pickle: JSON and
    tensors). Other ranks pass ``model`` None or their own copy; only rank 0's is read."""
    mine = dist.get_rank() == 0
    params = None
    if mine:
        assert model is not None
        params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    lr = broadcast_json(lr if mine else None)
    return broadcast_tensors(params), float(lr)


def adopt_initial(params: dict[str, nn.Parameter], initial: dict[str, Tensor]) -> None:
    """Copy the shared initial values into this worker's parameters, made contiguous
    (replies are written into flat views of them)."""
    with torch.no_grad():
        for name, value in initial.items():
            param = params[name]
            if not param.is_contiguous():
                param.data = param.data.contiguous()
            param.copy_(value)


# -- metrics ------------------------------------------------------------------------------


@dataclass
class Tally:
    """What a server did for one step so far."""

    pushes: int = 0
    replies: int = 0
    bytes_recv: int = 0
    bytes_sent: int = 0
    busy_s: float = 0.0


@dataclass
class ServerMetrics:
    """Per-step tallies of one server, written as one ``ServerRecord`` per finished step.

    ``write`` receives each record (a :class:`~gradsync.metrics.MetricsWriter`'s ``write``,
    or a list's ``append`` in tests); ``step_time_s`` and ``cpu_s`` are the wall and process
    CPU time since the last record.
    """

    rank: int = 0
    server: int = 0
    write: Callable[[ServerRecord], None] = lambda record: None
    tallies: dict[int, Tally] = field(default_factory=dict)
    last: float = field(default_factory=time.perf_counter)
    last_cpu: float = field(default_factory=time.process_time)
    close: Callable[[], None] = lambda: None

    @classmethod
    def to_file(
        cls, out: str | Path, *, rank: int, server: int, steps_done: int = 0
    ) -> ServerMetrics:
        """Records in ``<out>/metrics/server<rank>.jsonl`` (a resumed run keeps those of
        the ``steps_done`` steps before it); :attr:`close` closes the file."""
        writer = MetricsWriter(Path(out), rank, prefix="server", keep_before=steps_done)
        return cls(rank=rank, server=server, write=writer.write, close=writer.close)

    def tally(self, step: int) -> Tally:
        return self.tallies.setdefault(max(step, 0), Tally())

    @contextlib.contextmanager
    def busy(self, step: int) -> Iterator[None]:
        """Count the time spent inside as the server's busy time for ``step``."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.tally(step).busy_s += time.perf_counter() - started

    def finish(self, step: int) -> None:
        """``step`` is complete on this server: write its record."""
        tally = self.tallies.pop(step, Tally())
        now, cpu = time.perf_counter(), time.process_time()
        self.write(
            ServerRecord(
                step=step,
                rank=self.rank,
                server=self.server,
                bytes_recv=tally.bytes_recv,
                bytes_sent=tally.bytes_sent,
                busy_s=tally.busy_s,
                step_time_s=now - self.last,
                cpu_s=cpu - self.last_cpu,
            )
        )
        self.last, self.last_cpu = now, cpu


# -- the loop -----------------------------------------------------------------------------


class ServerPolicy:
    """What a strategy's server does with each kind of message (override what applies).

    ``outbox`` answers workers; ``metrics`` tallies per step. :meth:`on_push` and
    :meth:`state_tensors` are the strategy's; the rest have the common behaviour.
    """

    outbox: Outbox
    metrics: ServerMetrics

    def on_push(self, message: Message) -> None:
        raise NotImplementedError

    def on_pull(self, message: Message) -> None:
        raise RuntimeError(f"worker {message.worker} sent a pull, which this server never answers")

    def on_state(self, message: Message) -> None:
        """A checkpoint request: answer with the state now."""
        self.outbox.send_state(message.worker, self.state_tensors())

    def on_load(self, message: Message) -> None:
        """A resume: install the checkpoint's state, go on after ``message.step`` steps,
        then acknowledge (the worker waits for it before anyone pushes or pulls)."""
        self.load_state_tensors(decode_state(message.tensors[0]))
        self.resume_at(message.step)
        self.outbox.send(message.worker, Header(Kind.LOADED, step=message.step))

    def on_done(self, worker: int) -> None:
        """``worker`` has finished (its last push was answered)."""

    def state_tensors(self) -> dict[str, Tensor]:
        raise NotImplementedError

    def load_state_tensors(self, tensors: dict[str, Tensor]) -> None:
        raise NotImplementedError

    def resume_at(self, steps_done: int) -> None:
        """After a LOAD: the next push is of step ``steps_done`` (policies that count
        steps set their counters here)."""

    def close(self) -> None:
        """After the last worker's DONE: every answer has left."""
        self.outbox.flush()


def serve(inbox: Inbox, policy: ServerPolicy, *, num_workers: int) -> None:
    """Hand every message to ``policy`` until all ``num_workers`` workers are done."""
    done: set[int] = set()
    try:
        while len(done) < num_workers:
            message = inbox.get()
            kind = message.kind
            if kind in (Kind.PUSH, Kind.NO_GRADIENT):
                tally = policy.metrics.tally(message.step)
                tally.pushes += 1
                tally.bytes_recv += message.wire_bytes
                policy.on_push(message)
            elif kind == Kind.PULL:
                policy.metrics.tally(message.step).bytes_recv += message.wire_bytes
                policy.on_pull(message)
            elif kind == Kind.STATE:
                policy.on_state(message)
            elif kind == Kind.LOAD:
                policy.on_load(message)
            elif kind == Kind.DONE:
                done.add(message.worker)
                policy.on_done(message.worker)
            else:
                raise RuntimeError(f"unknown message kind {kind} from worker {message.worker}")
        policy.close()
    finally:
        policy.metrics.close()


def endpoints(
    *,
    num_workers: int,
    local_worker: int | None,
    lanes: Lanes,
    timeout_s: float,
    read_body: ReadBody,
    deliver_local: Callable[[Message], None] | None = None,
) -> tuple[Inbox, Outbox]:
    """A server's inbox (receivers from every worker but ``local_worker``) and outbox
    (replies; ``local_worker``'s to ``deliver_local``). Worker k is global rank k."""
    remote = {w: w for w in range(num_workers) if w != local_worker}
    inbox = Inbox(remote=remote.values(), lanes=lanes, timeout_s=timeout_s, read_body=read_body)
    outbox = Outbox(
        ranks=remote,
        lanes=lanes,
        tag=TAG_REPLY,
        local_peer=local_worker,
        deliver_local=deliver_local,
    )
    return inbox, outbox


class ColocatedServer:
    """A server running in a thread of a worker process.

    If it fails, the process ends at once (exit 1, traceback on stderr): every other worker
    waits on this server, so carrying on would only turn the failure into a timeout.
    """

    def __init__(self, run: Callable[[], None], *, name: str) -> None:
        self.name = name
        self._run = run
        self.thread = threading.Thread(target=self._run_or_die, name=name, daemon=True)
        self.thread.start()

    def _run_or_die(self) -> None:
        try:
            self._run()
        except BaseException:
            print(f"colocated {self.name} failed:", file=sys.stderr)
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)

    def alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout=timeout_s)
        if self.thread.is_alive():
            raise RuntimeError(f"the colocated {self.name} did not finish in {timeout_s:g} s")


__all__ = [
    "ColocatedServer",
    "Gather",
    "Piece",
    "ServerMetrics",
    "ServerPolicy",
    "ShardState",
    "Tally",
    "adopt_initial",
    "assemble_checkpoint",
    "assemble_variable",
    "endpoints",
    "lay_out",
    "serve",
    "share_initial",
    "split_variable",
    "sum_in_order",
]
