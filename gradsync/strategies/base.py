"""The strategy protocol: how gradients become the next step's parameters.

A strategy is one file and one registry line. On a worker rank the trainer and the
runtime call, in order::

    module = strategy.setup(model, context)     # hooks, wrappers, initial broadcast
    strategy.restore_state(tensors, steps_done) # --resume only: a checkpoint's state
    held = strategy.overwritten_by_servers()    # parameters the servers overwrite every step
    strategy.stats()                            # the counters before the first step
    for each step:
        ... forward(module), loss.backward() ...
        strategy.step()                         # finish communication, update parameters
        strategy.stats(); strategy.lr_of(step)  # the step's metrics
        strategy.checkpoint_tensors()           # every --checkpoint-every steps
    strategy.checkpoint_tensors()               # the final checkpoint
    strategy.finish()                           # release servers, threads, peers

Dedicated server ranks (strategies that have them) call only ``strategy.serve(context)``,
instead of all of the above.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from gradsync.checkpoint import load_model_state, model_state
from gradsync.comm.counters import CommStats
from gradsync.comm.server import ColocatedServer, ServerPolicy, serve
from gradsync.comm.wire import Inbox
from gradsync.config import TrainConfig
from gradsync.errors import UserError
from gradsync.optim import Updater, warmup_factor
from gradsync.options import InvalidOption, StrategyOptions, option
from gradsync.trace import NullTimeline, Timeline


@dataclass(frozen=True, kw_only=True)
class Context:
    """What a strategy needs to know about the job, built by the runtime.

    ``worker_group`` is the process group of the worker ranks (None = the default group).
    ``timeline`` records phases for ``--timeline`` (a no-op when recording is off).
    ``role`` is "worker" or "server" (a dedicated server rank: no model, no data); ``lr``
    is the peak learning rate after batch-size scaling (0.0 on server ranks, which learn
    it from worker 0). ``missing_gradients``, for strategies that set ``probes_gradients``:
    the trainable parameters that got no gradient on some worker in step 0.
    ``steps_done``: where a resumed run goes on (its checkpoint's step; 0 otherwise).
    """

    config: TrainConfig
    rank: int
    world_size: int
    worker_index: int
    num_workers: int
    device: torch.device
    worker_group: Any
    make_updater: Callable[[Iterable[nn.Parameter]], Updater]
    timeline: Timeline = field(default_factory=NullTimeline)
    role: str = "worker"
    lr: float = 0.0
    missing_gradients: frozenset[str] | None = None
    steps_done: int = 0


class Strategy(ABC):
    """Base class of every synchronization strategy.

    ``synchronous`` strategies must reproduce ``single``'s parameters; ``verify`` holds them
    to the tolerance. ``expected_difference`` explains, in one line, why a strategy may
    legitimately differ (it is shown next to the verdict).
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    synchronous: ClassVar[bool] = True
    probes_gradients: ClassVar[bool] = False  # fill Context.missing_gradients before setup
    # whether CommStats.exposed_comm_s is timed (ddp's waits are inside torch's reducer)
    times_exposed_comm: ClassVar[bool] = True
    Options: ClassVar[type[StrategyOptions]] = StrategyOptions  # this strategy's options

    def __init__(self) -> None:
        self.counters = CommStats()
        self.model: nn.Module | None = None
        self.updater: Updater | None = None
        self.context: Context | None = None

    @abstractmethod
    def setup(self, model: nn.Module, context: Context) -> nn.Module:
        """Prepare ``model`` and return the module to run forward on."""

    @abstractmethod
    def step(self) -> None:
        """After backward: complete communication and update the parameters."""

    def serve(self, context: Context) -> None:
        """Server ranks only: serve workers until they finish."""
        raise NotImplementedError(f"strategy '{self.name}' has no server ranks")

    def finish(self) -> None:  # noqa: B027 - optional hook
        """After the last step and the final checkpoint: release servers, threads, peers."""

    def lr_of(self, step: int) -> float:
        """The learning rate the update of ``step`` uses (for the metrics): the peak rate
        after batch-size scaling, through the warm-up schedule every optimizer of the job
        follows (workers' and servers' alike, whatever order the updates arrive in)."""
        if self.context is None:
            return 0.0
        return self.context.lr * warmup_factor(step, self.context.config.optim.lr_warmup_steps)

    @classmethod  # noqa: B027 - optional hook
    def check_config(cls, config: TrainConfig) -> None:
        """Raise UserError, before any process starts, if ``config`` cannot run."""

    @classmethod
    def is_synchronous(cls, config: TrainConfig) -> bool:
        """Whether this configuration must reproduce ``single`` (``verify`` holds it to that)."""
        return cls.synchronous

    def stats(self) -> CommStats:
        """Cumulative bytes and exposed communication time of this rank."""
        return self.counters.copy()

    def expected_difference(self, config: TrainConfig) -> str | None:
        """Why this configuration may differ from ``single`` beyond reduction order, or None."""
        return None

    @classmethod
    def num_server_ranks(cls, config: TrainConfig) -> int:
        """Extra ranks besides the workers that this strategy needs."""
        return 0

    @classmethod
    def held_by_servers(cls, config: TrainConfig) -> set[str]:
        """The parameters whose values servers hold: each worker's copy is overwritten with
        the servers' every step, so a change a worker makes to it in place never lasts."""
        return set()

    @classmethod
    def read_by_lookup_only(cls, config: TrainConfig) -> set[str]:
        """The lookup tables whose rows a worker has up to date only where its lookups read
        them: the forward must read them in no other way."""
        return set()

    def overwritten_by_servers(self) -> set[str]:
        """After :meth:`setup`: this worker's parameters that the servers' values overwrite
        every step (:meth:`held_by_servers`, from the model set up rather than one built
        anew). The strategy writes them in :meth:`step`, or during forward through
        ``.data``, so between the end of :meth:`step` and backward their version counters
        move only when the model itself changes them."""
        return set()

    def checkpoint_state(self) -> tuple[nn.Module, torch.optim.Optimizer] | None:
        """The model and optimizer holding the authoritative state on this rank, or None.

        Data-parallel strategies hold identical replicas, so only worker 0 answers.
        """
        if self.model is None or self.updater is None or self.context is None:
            return None
        if self.context.worker_index != 0:
            return None
        return self.model, self.updater.optimizer

    def checkpoint_tensors(self) -> dict[str, torch.Tensor] | None:
        """``param/``, ``buffer/`` and ``optim/`` tensors to save from this rank, or None."""
        state = self.checkpoint_state()
        return None if state is None else model_state(*state)

    def restore_state(self, tensors: dict[str, torch.Tensor], steps_done: int) -> None:
        """``--resume``, on every worker after :meth:`setup` and before the first step: go
        on from a checkpoint's state (keys of :meth:`checkpoint_tensors`) after
        ``steps_done`` steps. This default puts it into this worker's model and updater,
        where data-parallel strategies keep it; a strategy that saves state from elsewhere
        must override both.

        Example:
            >>> # strategy.restore_state(load_checkpoint("runs/a").tensors, 10)
        """
        assert self.model is not None
        optimizer = self.updater.optimizer if self.updater is not None else None
        load_model_state(self.model, optimizer, tensors)
        if self.updater is not None:
            self.updater.resume_at(steps_done)  # the learning rate of step steps_done

    @classmethod
    def resumable(cls) -> bool:
        """Whether :meth:`restore_state` puts back what :meth:`checkpoint_tensors` saves:
        the default restores worker-local state, which the default checkpoint saves.

        Example:
            >>> from gradsync.strategies import strategy_class
            >>> strategy_class("ps").resumable()
            True
        """
        overridden = cls.restore_state is not Strategy.restore_state
        return overridden or cls.checkpoint_tensors is Strategy.checkpoint_tensors


@dataclass(frozen=True, kw_only=True)
class ServerOptions(StrategyOptions):
    """Where a server strategy's servers run: ``servers`` dedicated ranks after the workers
    (None: 1), or ``colocate``: every worker also serves one shard, in a thread."""

    servers: int | None = option(
        None,
        help="dedicated server ranks after the workers",
        metavar="S",
        at_least=1,
        none_means="1",
    )
    colocate: bool = option(False, help="every worker also serves a shard (no extra ranks)")

    def num_servers(self, workers: int) -> int:
        """Server shards in the job: one per worker when colocated."""
        return workers if self.colocate else (1 if self.servers is None else self.servers)

    def extra_ranks(self, workers: int) -> int:
        """Ranks the servers add after the workers: none when colocated."""
        return 0 if self.colocate else self.num_servers(workers)

    def server_ranks(self, workers: int) -> list[int]:
        """Server s → its global rank: s when colocated (worker s serves it), after the
        ``workers`` worker ranks otherwise.

        Example:
            >>> ServerOptions(servers=2).server_ranks(3)
            [3, 4]
            >>> ServerOptions(colocate=True).server_ranks(3)
            [0, 1, 2]
        """
        return [s if self.colocate else workers + s for s in range(self.num_servers(workers))]

    def check(self, workers: int) -> None:
        if self.colocate and self.servers is not None:
            raise InvalidOption(
                "{servers} with {colocate}: colocated servers run inside the workers, not on "
                "extra ranks; drop one of them",
                type(self),
            )


class ServerStrategy(Strategy):
    """A strategy with server ranks (``ps``, ``hybrid``, ``p3``) on the toolkit of
    :mod:`gradsync.comm.server`: it says how server s is built (:meth:`_server`); this class
    runs it on a dedicated rank or in a thread of a worker (colocated)."""

    server_ranks: list[int]  # server s → its global rank (the worker's own when colocated)
    _step: int  # on a worker: steps done, the number of its next push

    @classmethod
    def num_server_ranks(cls, config: TrainConfig) -> int:
        """The dedicated server ranks after the workers (none when colocated)."""
        return config.strategy_options.extra_ranks(config.workers)

    @classmethod
    def held_by_servers(cls, config: TrainConfig) -> set[str]:
        """Every trainable parameter (``hybrid`` keeps only its sparse tables there)."""
        return set(trainable_parameters(config))

    def overwritten_by_servers(self) -> set[str]:
        assert self.model is not None
        return {name for name, p in self.model.named_parameters() if p.requires_grad}

    def restore_state(self, tensors: dict[str, torch.Tensor], steps_done: int) -> None:
        """Every worker takes the checkpoint's values (its first forward reads them) and
        numbers its next push ``steps_done`` (servers apply the learning rate of the step
        they are sent); worker 0 installs the servers' part on every server, and no worker
        goes on before every server has acknowledged it."""
        assert self.model is not None and self.context is not None
        load_model_state(self.model, None, tensors)
        self._step = steps_done
        if self.context.worker_index == 0:
            self.load_checkpoint_tensors(tensors, steps_done)
        dist.barrier(group=self.context.worker_group)  # no push or pull before the LOADs

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor], steps_done: int) -> None:
        """Worker 0, after setup and before the first step: install a checkpoint's values
        and optimizer state (keys of :meth:`checkpoint_tensors`) on every server, which go
        on after ``steps_done`` steps; returns once every server has acknowledged."""
        raise NotImplementedError

    def _server(
        self, server: int, initial: dict[str, torch.Tensor], local_worker: int | None
    ) -> tuple[Inbox, ServerPolicy]:
        """Server ``server``'s inbox and policy, from the shared initial values;
        ``local_worker`` shares its process (colocated)."""
        raise NotImplementedError

    def _run_dedicated(self, context: Context, initial: dict[str, torch.Tensor]) -> None:
        """This rank is a server: answer the workers until every one of them is done."""
        inbox, policy = self._server(self.server_ranks.index(context.rank), initial, None)
        initial.clear()  # the policy holds its own copy of its part
        serve(inbox, policy, num_workers=context.num_workers)

    def _start_colocated(
        self, context: Context, initial: dict[str, torch.Tensor]
    ) -> tuple[Inbox, ColocatedServer]:
        """Start this worker's server in a thread; returns its inbox (for this worker's
        messages) and the thread."""
        server = self.server_ranks.index(context.rank)
        inbox, policy = self._server(server, initial, context.worker_index)
        thread = ColocatedServer(
            lambda: serve(inbox, policy, num_workers=context.num_workers),
            name=f"{self.name} server {server}",
        )
        return inbox, thread


def trainable_parameters(config: TrainConfig) -> dict[str, nn.Parameter]:
    """The parameters of ``config``'s model that train, by name, from a model built for
    the pre-launch checks: what the servers of ``ps`` and ``p3`` hold.

    Example:
        >>> # sorted(trainable_parameters(TrainConfig(model="mnist-cnn")))[:1]  # ['conv1.bias']
    """
    from gradsync.models import workload_of

    model = workload_of(config).model
    return {name: param for name, param in model.named_parameters() if param.requires_grad}


def lost_edit(parameter: str, strategy: str, where: str = "") -> str:
    """Why a change the model makes in place to a parameter the servers hold is refused.

    Example:
        >>> lost_edit("head.weight", "ps").startswith("the model changes parameter head.weight")
        True
    """
    return (
        f"the model changes parameter {parameter} in place during forward{where} (a clamp_ "
        f"under no_grad, say), but under {strategy} its values live on the servers, which "
        "overwrite each worker's copy every step, so the change would be lost; compute with a "
        "changed copy instead (F.linear(x, w.clamp(-c, c))), or train with allreduce or ddp"
    )


def check_one_dtype(strategy: str, params: dict[str, torch.Tensor]) -> None:
    """UserError when the parameters a server strategy's servers keep come in several
    dtypes: a server keeps its shard in one flat buffer of one dtype, so one dtype would
    be rounded into another. The message names a parameter of the rarest dtype.

    Example:
        >>> odd = torch.zeros(2, dtype=torch.bfloat16)
        >>> check_one_dtype("ps", {"a": torch.zeros(2), "b": torch.zeros(2), "c": odd})
        Traceback (most recent call last):
        gradsync.errors.UserError: ps keeps ... but parameter c is bfloat16 while other ...
    """
    by_dtype: dict[str, list[str]] = {}
    for name, param in params.items():
        by_dtype.setdefault(str(param.dtype).removeprefix("torch."), []).append(name)
    if len(by_dtype) > 1:
        rare = min(by_dtype, key=lambda dtype: len(by_dtype[dtype]))
        others = " and ".join(sorted(d for d in by_dtype if d != rare))
        raise UserError(
            f"{strategy} keeps each server's shard in one buffer of one dtype, but parameter "
            f"{by_dtype[rare][0]} is {rare} while other parameters it serves are {others}; "
            "give them one dtype, or use allreduce or ddp"
        )


def broadcast_parameters(model: nn.Module, group: Any = None) -> None:
    """Make every rank start from rank 0's parameters and buffers (Horovod's first step)."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_contiguous():
                dist.broadcast(tensor, src=0, group=group)
            else:  # NCCL refuses strided tensors ("Tensors must be contiguous")
                staged = tensor.contiguous()
                dist.broadcast(staged, src=0, group=group)
                tensor.copy_(staged)
