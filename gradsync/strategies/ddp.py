"""``ddp``: PyTorch DistributedDataParallel as torch ships it (its reducer, buckets and default
allreduce hook, wrapped only to count bytes): the native baseline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from gradsync.comm.counters import tensor_bytes
from gradsync.comm.ready import guard_accumulations
from gradsync.config import TrainConfig
from gradsync.data.base import shard_bounds
from gradsync.errors import UserError
from gradsync.options import StrategyOptions, option
from gradsync.probe import (
    ProbeUnavailable,
    UnknownGradients,
    params_without_gradient,
    read_whole_elsewhere,
    sparse_lookup_weights,
)
from gradsync.strategies.base import Context, Strategy


@dataclass(frozen=True, kw_only=True)
class DDPOptions(StrategyOptions):
    """torch's own DDP knobs, passed through unchanged."""

    find_unused_parameters: bool = option(
        False,
        help="torch DDP's flag of that name; left off, it is turned on anyway when a "
        "parameter gets no gradient on some worker in the first step",
    )
    bucket_cap_mb: float = option(
        25.0,
        help="DDP's gradient bucket size in MB (its first bucket is 1 MB)",
        metavar="MB",
        above=0,
    )


class NativeDDP(Strategy):
    """DDP with its default buckets (25 MB) and comm hook; nothing replaced.

    ``find_unused_parameters`` is turned on when the step-0 probe finds a parameter without a
    gradient on some worker, when the probe cannot run (a model that cannot be deep-copied),
    or with ``--find-unused-parameters`` (the probe is then skipped); DDP then leaves a
    parameter unused on every worker with ``grad = None`` and averages one used on some
    workers with zeros from the others, as ``single`` computes it.

    Bytes: a communication hook counts each bucket DDP hands it and then runs torch's
    default ``allreduce_hook`` on it, so the reduction is DDP's own. Dense buckets are
    counted as a ring allreduce of their size; a sparse gradient (its own bucket) as Gloo's
    sparse allreduce, an allgather of its coalesced indices and values — bytes proportional
    to the rows touched. Buffers broadcast from rank 0 before each forward are counted too.
    """

    name = "ddp"
    summary = "torch DistributedDataParallel, its own reducer and hook (native baseline)"
    probes_gradients = True
    times_exposed_comm = False  # its reducer waits inside backward, out of gradsync's sight
    Options = DDPOptions

    @classmethod
    def check_config(cls, config: TrainConfig) -> None:
        """Refuse, before launch, a sparse-gradient parameter that torch's DDP reducer cannot
        reduce: one tied to a layer other than a sparse lookup (its gradient is dense: "Expected
        variable to have sparse gradient"), or one some worker leaves without a gradient in
        step 0 ("Expected sparse gradient to be defined")."""
        if config.workers == 1:
            return
        from gradsync.models import workload_of

        workload = workload_of(config)
        sparse = sparse_lookup_weights(workload.model)
        if not sparse:
            return
        if tied := sorted(read_whole_elsewhere(workload.model)):
            raise UserError(
                f"ddp: {', '.join(tied)} is an nn.Embedding(sparse=True) weight tied to a layer "
                "other than a sparse lookup (one that reads it whole, or a lookup with "
                "sparse=False), so its gradient is dense and torch's DDP expects a sparse one; "
                "use --strategy allreduce or hybrid, or build the embedding with sparse=False"
            )
        global_batch = config.global_batch or workload.global_batch
        missing: set[str] = set()
        for worker in range(config.workers):
            start, stop = shard_bounds(global_batch, config.workers, worker)
            try:
                missing |= params_without_gradient(
                    workload,
                    workload.model,
                    global_batch=global_batch,
                    start=start,
                    stop=stop,
                    device=torch.device("cpu"),
                )
            except ProbeUnavailable:
                # Not knowable here (no copy of the model, or BatchNorm as the ranks do not
                # run it): the ranks probe again, and setup refuses such a table then.
                return
        if stranded := sorted(missing & sparse):
            raise _stranded_sparse(stranded)

    def setup(self, model: nn.Module, context: Context) -> nn.Module:
        self.context, self.model = context, model
        missing = context.missing_gradients
        # check_config's refusal again, for a model it could not probe before launch
        stranded = sorted(sparse_lookup_weights(model) & (missing or set()))
        if context.num_workers > 1 and stranded and not isinstance(missing, UnknownGradients):
            raise _stranded_sparse(stranded)
        device_ids = [context.device.index] if context.device.type == "cuda" else None
        find_unused = self._find_unused(context)
        wrapped = DistributedDataParallel(
            model,
            device_ids=device_ids,
            process_group=context.worker_group,
            find_unused_parameters=find_unused,
            bucket_cap_mb=context.config.strategy_options.bucket_cap_mb,
        )
        wrapped.register_comm_hook(context.worker_group, self._counting_allreduce)
        # torch's reducer takes a gradient accumulated twice in one backward (reentrant
        # checkpointing around a parameter used outside the segment) without a word, and
        # its parameters come out wrong: refuse it as gradsync's own strategies do.
        self._ready = guard_accumulations("ddp", model.named_parameters())
        self.updater = context.make_updater(model.parameters())
        self._buffer_bytes = sum(tensor_bytes(b) for b in model.buffers())
        return wrapped if find_unused else _UnusedParameterHint(wrapped)

    @staticmethod
    def _find_unused(context: Context) -> bool:
        if context.config.strategy_options.find_unused_parameters:
            return True  # the runtime skipped the probe
        if isinstance(context.missing_gradients, UnknownGradients):
            if context.rank == 0:
                print(
                    "[rank 0] ddp: find_unused_parameters=True (the step-0 probe could not run: "
                    f"{context.missing_gradients.reason}; --find-unused-parameters skips it)",
                    flush=True,
                )
            return True
        missing = sorted(context.missing_gradients or ())
        if missing and context.rank == 0:
            shown = ", ".join(missing[:5]) + (" …" if len(missing) > 5 else "")
            print(
                f"[rank 0] ddp: find_unused_parameters=True ({len(missing)} parameter(s) got "
                f"no gradient on some worker in step 0: {shown})",
                flush=True,
            )
        return bool(missing)

    def _counting_allreduce(self, group, bucket):  # type: ignore[no-untyped-def]
        """Count the bucket's bytes, then reduce it exactly as DDP's default hook does.

        (Unannotated: DDP compares the annotations with dist.GradBucket and
        Future[Tensor], and ``from __future__ import annotations`` makes them strings.)
        """
        assert self.context is not None
        gradient, workers = bucket.buffer(), self.context.num_workers
        if gradient.is_sparse:
            gradient = gradient.coalesce()  # what Gloo sends; coalescing twice is free
            self.counters.add_sparse_allreduce(gradient, workers)
        else:
            self.counters.add_allreduce(tensor_bytes(gradient), workers)
        return default_hooks.allreduce_hook(group, _Bucket(gradient))

    def step(self) -> None:
        assert self.updater is not None and self.context is not None
        # DDP has already averaged the gradients during backward.
        self._ready.reset()
        self._count_buffer_broadcast()
        self.updater.update()

    def _count_buffer_broadcast(self) -> None:
        """DDP broadcasts rank 0's buffers (e.g. BatchNorm statistics) before every forward."""
        workers = self.context.num_workers if self.context else 1
        if self._buffer_bytes and workers > 1:
            if self.context.worker_index == 0:
                self.counters.bytes_sent += (workers - 1) * self._buffer_bytes
            else:
                self.counters.bytes_recv += self._buffer_bytes


def _stranded_sparse(names: list[str]) -> UserError:
    return UserError(
        f"ddp: torch's DDP cannot reduce a sparse gradient that some worker does not have, "
        f"and {', '.join(names)} get none on some worker in step 0; use --strategy allreduce "
        "or hybrid, or build the embedding with sparse=False"
    )


class _Bucket:
    """The one thing ``allreduce_hook`` reads from a bucket: its (possibly coalesced) buffer."""

    def __init__(self, gradient: torch.Tensor) -> None:
        self._gradient = gradient

    def buffer(self) -> torch.Tensor:
        return self._gradient


class _UnusedParameterHint(nn.Module):
    """DDP without ``find_unused_parameters``: its error on a parameter that got no gradient
    after step 0 (a data-dependent branch) becomes one line naming gradsync's flag."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        super().__init__()
        self.ddp = ddp

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.ddp(*args, **kwargs)
        except RuntimeError as error:
            if "find_unused_parameters" not in str(error):
                raise
            raise UserError(
                "ddp: a parameter got no gradient on some worker after step 0 (step 0 used "
                "them all, so gradsync left find_unused_parameters off); rerun with "
                "--find-unused-parameters"
            ) from None
