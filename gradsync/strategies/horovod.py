"""``horovod``: real Horovod (Sergeev & Del Balso 2018), the peer ``allreduce`` is measured
against, run through gradsync's harness: the same model, data, optimizer, BatchNorm mode
and measurement, with Horovod's own ``DistributedOptimizer``, fusion and Gloo controller.

Registered only where ``horovod.torch`` imports (Horovod built with PyTorch and Gloo); see
:mod:`gradsync.strategies`. Each rank starts Horovod as ``horovodrun --gloo`` would: worker 0
runs Horovod's HTTP rendezvous server, the ranks learn its port over torch.distributed,
then call ``hvd.init()`` with Horovod's environment variables for rank, size, hosts,
fusion threshold, cycle time and timeout.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradsync.comm.objects import all_gather_json, broadcast_json
from gradsync.comm.ready import guard_accumulations
from gradsync.config import TrainConfig
from gradsync.errors import UserError
from gradsync.options import StrategyOptions, option
from gradsync.probe import sparse_lookup_weights
from gradsync.strategies.allreduce import (
    FP16_ROUNDING,
    fp16_compression_option,
    fusion_threshold_option,
    sparse_as_dense_option,
)
from gradsync.strategies.base import Context, Strategy, broadcast_parameters
from gradsync.trace import COMPUTE, Phase


@dataclass(frozen=True, kw_only=True)
class HorovodOptions(StrategyOptions):
    """Horovod's own knobs, under the flags ``allreduce`` uses for the same things; the
    defaults are Horovod 0.28's (``HOROVOD_FUSION_THRESHOLD`` 128 MB, ``HOROVOD_CYCLE_TIME``
    1 ms)."""

    fusion_threshold_mb: float = fusion_threshold_option(128.0)
    cycle_time_ms: float = option(
        1.0,
        help="Horovod's cycle time: how long its background thread gathers ready tensors "
        "before fusing and launching them (HOROVOD_CYCLE_TIME)",
        metavar="MS",
        above=0,
    )
    fp16_compression: bool = fp16_compression_option()
    sparse_as_dense: bool = sparse_as_dense_option()


class RealHorovod(Strategy):
    """``hvd.DistributedOptimizer`` over the model: Horovod's hooks, fusion and allreduce.

    The step synchronizes Horovod's handles, then runs gradsync's optimizer update (its
    warm-up schedule and sparse-gradient handling) inside ``skip_synchronize()``, Horovod's
    documented pattern for work between the reduction and the update. A parameter that got
    no gradient is reduced as zeros, as Horovod does, so the optimizer then updates it
    (momentum, weight decay), where ``single`` skips it.

    Bytes are counted as Horovod sends them: a dense gradient as a ring allreduce of its
    size (half with fp16 compression), a sparse one as an allgather of its rows.
    """

    name = "horovod"
    summary = "real Horovod (horovod.torch): DistributedOptimizer, its fusion and Gloo"
    Options = HorovodOptions

    @classmethod
    def check_config(cls, config: TrainConfig) -> None:
        """Refuse, before launch, a trainable parameter that is not contiguous: Horovod
        allreduces its gradient in place and refuses it ("Tensor is required to be
        contiguous") in the first backward."""
        if config.workers == 1:
            return
        from gradsync.models import workload_of

        model = workload_of(config).model
        strided = [
            n for n, p in model.named_parameters() if p.requires_grad and not p.is_contiguous()
        ]
        if strided:
            raise UserError(
                f"horovod: parameter {strided[0]} is not contiguous (a transposed view?), and "
                "Horovod allreduces a gradient in place only when it is contiguous; build it "
                "with .contiguous(), or use --strategy allreduce, which reduces it as it is"
            )

    def setup(self, model: nn.Module, context: Context) -> nn.Module:
        self.context, self.model = context, model
        options = context.config.strategy_options
        self._server = start_horovod(context, options)
        # Horovod's own broadcast refuses a non-contiguous parameter; gradsync's does not
        broadcast_parameters(model, context.worker_group)
        hvd = horovod()
        self._named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        lookups = set() if options.sparse_as_dense else sparse_lookup_weights(model)
        self._lookups = [p for name, p in self._named if name in lookups]
        # Horovod asserts on a gradient accumulated twice ("Increase backward_passes_per_step",
        # a knob gradsync does not expose): say what happened, as allreduce does.
        self._ready = guard_accumulations("horovod", self._named)
        self.updater = context.make_updater(model.parameters())
        compression = hvd.Compression.fp16 if options.fp16_compression else hvd.Compression.none
        self.updater.wrap(
            lambda optimizer: hvd.DistributedOptimizer(
                optimizer,
                named_parameters=list(model.named_parameters()),  # frozen ones too
                compression=compression,
                sparse_as_dense=options.sparse_as_dense,
            )
        )
        return model

    def step(self) -> None:
        assert self.updater is not None and self.context is not None
        self._ready.reset()
        self._fill_unread_lookups()
        self._count_bytes()
        started = time.perf_counter()
        with self.context.timeline.span(COMPUTE, Phase.COMM_WAIT):
            self.updater.optimizer.synchronize()
        self.counters.exposed_comm_s += time.perf_counter() - started
        with self.updater.optimizer.skip_synchronize():
            self.updater.update()

    def _fill_unread_lookups(self) -> None:
        """A sparse lookup table this worker read no row of gets an empty sparse gradient.
        Horovod would fill it with dense zeros and allreduce them while the workers that read
        rows allgather theirs: the names never meet and the job hangs (Horovod's own note in
        ``_allreduce_grad_async``). An empty one joins the others' allgather."""
        for table in self._lookups:
            if table.grad is None:
                indices = torch.empty(1, 0, dtype=torch.long, device=table.device)
                rows = table.new_empty(0, *table.shape[1:])
                table.grad = torch.sparse_coo_tensor(indices, rows, table.shape)

    def _count_bytes(self) -> None:
        assert self.context is not None
        options, workers = self.context.config.strategy_options, self.context.num_workers
        for _, param in self._named:
            grad = param.grad
            if grad is None or not grad.is_sparse or options.sparse_as_dense:
                size = 2 if options.fp16_compression else param.element_size()
                self.counters.add_allreduce(param.numel() * size, workers)
            else:
                self.counters.add_sparse_allreduce(grad.coalesce(), workers)

    def finish(self) -> None:
        horovod().shutdown()
        if self._server is not None:
            self._server.stop()

    def expected_difference(self, config: TrainConfig) -> str | None:
        if config.strategy_options.fp16_compression:
            return FP16_ROUNDING
        return None


def unavailable() -> str | None:
    """Why real Horovod cannot run here (one line: what, and how to install it), or None.

    Example:
        >>> reason = unavailable()  # None where horovod.torch imports
    """
    try:
        horovod()
    except Exception as error:  # ImportError, or a build against another torch
        return (
            f"strategy 'horovod' runs real Horovod, but horovod.torch does not import here "
            f"({type(error).__name__}: {error}); install Horovod built with PyTorch and Gloo "
            "(HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 pip install --no-build-isolation "
            "horovod), or use --strategy allreduce, gradsync's own Horovod-style allreduce"
        )
    return None


def horovod() -> Any:
    """``horovod.torch``, imported when first needed: this module imports without it."""
    import horovod.torch

    return horovod.torch


def start_horovod(context: Context, options: HorovodOptions) -> Any:
    """``hvd.init()`` on every worker with the environment ``horovodrun --gloo`` gives its
    ranks; worker 0 runs Horovod's rendezvous server and returns it (None elsewhere).

    Example:
        >>> # server = start_horovod(context, HorovodOptions())  # then hvd.rank() == worker
    """
    host = f"{socket.gethostname()}-{os.environ.get('GLOO_SOCKET_IFNAME', '')}"
    slots = slot_plan(all_gather_json(host, group=context.worker_group))
    server, port = None, 0
    if context.worker_index == 0:
        from horovod.runner.common.util.hosts import SlotInfo
        from horovod.runner.http.http_server import RendezvousServer

        server = RendezvousServer()
        port = server.start()
        server.init([SlotInfo(*slot) for slot in slots])
    port = broadcast_json(port, src=0, group=context.worker_group)
    hostname, rank, local_rank, cross_rank, size, local_size, cross_size = slots[
        context.worker_index
    ]
    env = {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
        "HOROVOD_GLOO_RENDEZVOUS_PORT": port,
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_HOSTNAME": hostname,
        "HOROVOD_RANK": rank,
        "HOROVOD_SIZE": size,
        "HOROVOD_LOCAL_RANK": local_rank,
        "HOROVOD_LOCAL_SIZE": local_size,
        "HOROVOD_CROSS_RANK": cross_rank,
        "HOROVOD_CROSS_SIZE": cross_size,
        "HOROVOD_FUSION_THRESHOLD": int(options.fusion_threshold_mb * 2**20),
        "HOROVOD_CYCLE_TIME": options.cycle_time_ms,
        "HOROVOD_GLOO_TIMEOUT_SECONDS": max(1, round(context.config.launch.timeout_s)),
    }
    if "GLOO_SOCKET_IFNAME" in os.environ:
        env["HOROVOD_GLOO_IFACE"] = os.environ["GLOO_SOCKET_IFNAME"]
    os.environ.update({key: str(value) for key, value in env.items()})
    horovod().init()
    return server


def slot_plan(hosts: Sequence[str]) -> list[tuple[str, int, int, int, int, int, int]]:
    """Horovod's slot of each rank, given the host each rank runs on: (hostname, rank,
    local_rank, cross_rank, size, local_size, cross_size), as ``horovodrun`` assigns them,
    ranks keeping their order.

    Example:
        >>> slot_plan(["a", "a", "b"])[2]  # rank 2: first on host b, second host of local 0
        ('b', 2, 0, 1, 3, 1, 2)
    """
    local_ranks, order = [], list(dict.fromkeys(hosts))
    for rank, host in enumerate(hosts):
        local_ranks.append(hosts[:rank].count(host))
    slots = []
    for rank, host in enumerate(hosts):
        local_rank = local_ranks[rank]
        peers = [h for h in order if hosts.count(h) > local_rank]  # hosts with this local rank
        slots.append(
            (
                host,
                rank,
                local_rank,
                peers.index(host),
                len(hosts),
                hosts.count(host),
                len(peers),
            )
        )
    return slots
