"""``hybrid``: Parallax (Kim et al., EuroSys'19): sparse variables through partitioned
parameter servers, dense variables through allreduce.

- Classification: a variable is *sparse* when its gradient arrives as a sparse tensor; in
  PyTorch that is the weight of an ``nn.Embedding``/``nn.EmbeddingBag`` with
  ``sparse=True`` (``lstm-lm``'s embedding and sampled-softmax weight and bias). It is read
  from the module types, so it is known before the first backward (the dense hooks need it)
  and identical on every rank; worker 0's classification is broadcast and checked.
  ``--sparse-pattern``/``--dense-pattern`` (glob, or ``re:REGEX``) override it by name.
- Dense path: :class:`~gradsync.comm.fusion.FusedAllreduce` over the dense variables, then
  each worker's own optimizer (Horovod's path, as ``allreduce``).
- Sparse path (:mod:`gradsync.comm.sparse`): row partitions on servers (dedicated ranks, or
  colocated in the workers); after backward, before the dense path finishes (its last
  buckets are still in flight, the servers apply meanwhile), workers sum their coalesced
  rows per node (local aggregation), the node's first worker pushes them; servers average
  (``--no-average-sparse``: sum), apply SGD to those rows, and answer pulls.
- Pulls: one round trip per step. Before the forward, the rows every table will read are
  predicted from the forward's integer inputs (:mod:`gradsync.comm.prefetch`: learned, in
  a step where a lookup read rows not predicted, from which inputs fed which lookups, e.g.
  ``lstm-lm``'s token ids feed the embedding, its targets and sampled candidates the
  softmax tables) and pulled in one
  request per server. Each lookup then checks that its rows were pulled and pulls only
  those that were not (the first steps, indices made inside the forward), so a wrong
  prediction costs a round trip, never a stale row.
- The partition count P is chosen at the first step from the rows worker 0's first batch
  touched (:func:`~gradsync.comm.sparse.choose_num_partitions`), unless ``--partitions``.

Sparse optimizer rule: torch's ``SGD`` on a sparse gradient (what ``single`` runs) keeps a
sparse momentum buffer over every row ever touched and moves all of them each step; the
servers do exactly that, lazily (:mod:`gradsync.comm.lazy`: a row is caught up in closed
form when next pulled or saved), so ``hybrid`` matches ``single`` and a step costs what
its rows cost. Adam refuses sparse gradients in
torch, and weight decay densifies them, so both are refused for sparse variables.
"""

from __future__ import annotations

import fnmatch
import functools
import re
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradsync.checkpoint import OPTIM, PARAM, model_state
from gradsync.comm.counters import CommStats
from gradsync.comm.groups import NodeGroup, node_local_group
from gradsync.comm.objects import broadcast_json, broadcast_tensors
from gradsync.comm.prefetch import RowPredictor, forward_indices, missing_rows
from gradsync.comm.server import ColocatedServer, ServerMetrics, endpoints
from gradsync.comm.sparse import (
    RowPartition,
    SparseClient,
    SparseServer,
    SparseShard,
    SparseVariable,
    choose_num_partitions,
    coalesce_rows,
    cut_rows,
    gather_rows_on_node,
    install_rows,
    lag_tensors,
    measure_apply_cost,
    partition_rows,
    sparse_reader,
    split_rows,
)
from gradsync.comm.wire import Inbox, Lanes
from gradsync.config import TrainConfig
from gradsync.errors import UserError
from gradsync.options import InvalidOption, option
from gradsync.probe import lookup_tables, tied_names
from gradsync.strategies.allreduce import FusionOptions
from gradsync.strategies.base import (
    Context,
    ServerOptions,
    ServerStrategy,
    Strategy,
    broadcast_parameters,
    check_one_dtype,
)
from gradsync.trace import COMPUTE, Phase


@dataclass(frozen=True, kw_only=True)
class HybridOptions(ServerOptions, FusionOptions):
    """Parallax's switches: where the sparse servers run, how rows are split and summed,
    which variables count as sparse; the dense path takes allreduce's options.

    Patterns are globs, or ``re:REGEX``; a dense pattern wins over a sparse one.
    """

    partitions: int | None = option(
        None,
        help="row partitions per sparse variable (default: a cost model's choice)",
        metavar="P",
        at_least=1,
    )
    average_sparse: bool = option(
        True,
        help="average the workers' sparse gradients (off: sum them, as Parallax can)",
        changes_results=True,
    )
    local_aggregation: bool = option(True, help="sum sparse gradients inside a node first")
    sparse_patterns: tuple[str, ...] = option(
        (),
        help="treat matching variables as sparse (repeatable)",
        flag="--sparse-pattern",
        metavar="GLOB",
        changes_results=True,
    )
    dense_patterns: tuple[str, ...] = option(
        (),
        help="treat matching variables as dense (repeatable)",
        flag="--dense-pattern",
        metavar="GLOB",
        changes_results=True,
    )

    def check(self, workers: int) -> None:
        super().check(workers)
        for pattern in (*self.sparse_patterns, *self.dense_patterns):
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern[3:])
                except re.error as error:
                    raise InvalidOption(f"bad regular expression {pattern!r}: {error}") from None


# -- classification (pure) ------------------------------------------------------------------


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.search(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def classify(model: nn.Module, options: HybridOptions) -> dict[str, str]:
    """Variable name → "sparse" or "dense", in model order (trainable variables only).

    Example:
        >>> model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
        >>> classify(model, HybridOptions())
        {'0.weight': 'sparse', '1.weight': 'dense', '1.bias': 'dense'}
        >>> classify(model, HybridOptions(dense_patterns=("0.*",)))["0.weight"]
        'dense'
    """
    lookups = lookup_tables(model)
    tied = tied_names(model)
    trainable = [name for name, param in model.named_parameters() if param.requires_grad]
    _check_patterns_match(trainable, options)
    result = {}
    for name in trainable:
        # A tied lookup table is also read whole (e.g. as the output projection): pulling
        # only the rows a lookup reads would leave that reader with stale rows.
        sparse = name in lookups and lookups[name].sparse and name not in tied
        if any(_matches(name, p) for p in options.sparse_patterns):
            _check_forced_sparse(name, lookups, tied)
            sparse = True
        if any(_matches(name, p) for p in options.dense_patterns):
            sparse = False
        result[name] = "sparse" if sparse else "dense"
    return result


def _check_patterns_match(names: list[str], options: HybridOptions) -> None:
    """UserError for a pattern that matches no trainable variable (a typo would otherwise
    leave the classification silently as it was)."""
    for flag, patterns in (
        ("--sparse-pattern", options.sparse_patterns),
        ("--dense-pattern", options.dense_patterns),
    ):
        for pattern in patterns:
            if not any(_matches(name, pattern) for name in names):
                shown = ", ".join(names[:4]) + (", …" if len(names) > 4 else "")
                raise UserError(
                    f"{flag} {pattern!r} matches no trainable variable of the model ({shown}); "
                    "fix the pattern (globs match whole names, e.g. 'emb*.weight')"
                )


def _check_forced_sparse(name: str, lookups: dict[str, nn.Module], tied: set[str]) -> None:
    """UserError unless ``--sparse-pattern`` may send ``name`` through the servers: the
    weight of a lookup built with ``sparse=True`` and read by nothing else."""
    if name not in lookups:
        raise UserError(
            f"--sparse-pattern matched '{name}', which is not the weight of an "
            "nn.Embedding/EmbeddingBag: hybrid pulls the rows a lookup reads, so only "
            "lookup tables can take the sparse path; narrow the pattern"
        )
    if not lookups[name].sparse:
        raise UserError(
            f"--sparse-pattern matched '{name}', whose lookup is built with sparse=False: its "
            "gradient is a dense table, not rows; build it with sparse=True, or narrow the pattern"
        )
    if name in tied:
        raise UserError(
            f"--sparse-pattern matched '{name}', a lookup table tied to another layer that "
            "reads it whole: the servers would leave that layer stale rows; narrow the pattern"
        )


def describe_classification(model: nn.Module, kinds: dict[str, str]) -> str:
    params = dict(model.named_parameters())
    lookups, tied = lookup_tables(model), tied_names(model)
    lines = []
    for name, kind in kinds.items():
        shape = "×".join(map(str, params[name].shape))
        path = "servers (rows pushed/pulled)" if kind == "sparse" else "allreduce"
        if kind == "dense" and name in tied and getattr(lookups.get(name), "sparse", False):
            path += " (a sparse lookup table tied to another layer, read whole: dense path)"
        lines.append(f"  {name} [{shape}]: {kind} → {path}")
    return "\n".join(lines)


@functools.lru_cache(maxsize=8)
def _classify_config(text: str) -> tuple[tuple[str, str], ...]:
    from gradsync.models import workload_of

    config = TrainConfig.from_json(text)
    return tuple(classify(workload_of(config).model, config.strategy_options).items())


def _has_sparse(config: TrainConfig) -> bool:
    return any(kind == "sparse" for _, kind in _classify_config(config.to_json()))


# -- the strategy ---------------------------------------------------------------------------

# What worker 0 sends the dedicated servers instead of the spec when the workers ran no step.
NO_STEP: dict[str, Any] = {"no_step": True}


class Hybrid(ServerStrategy):
    """Sparse variables via row-partitioned servers, dense ones via fused allreduce."""

    name = "hybrid"
    summary = "Parallax: sparse variables via partitioned servers, dense via allreduce"
    Options = HybridOptions

    @classmethod
    def num_server_ranks(cls, config: TrainConfig) -> int:
        if not _has_sparse(config):
            return 0
        return super().num_server_ranks(config)

    @classmethod
    def held_by_servers(cls, config: TrainConfig) -> set[str]:
        """The sparse tables (the dense variables are allreduced among the workers)."""
        return {n for n, kind in _classify_config(config.to_json()) if kind == "sparse"}

    read_by_lookup_only = held_by_servers  # a worker pulls only the rows its lookups read

    def overwritten_by_servers(self) -> set[str]:
        return set(self.sparse_names)

    @classmethod
    def check_config(cls, config: TrainConfig) -> None:
        kinds = dict(_classify_config(config.to_json()))
        sparse = [n for n, k in kinds.items() if k == "sparse"]
        if not sparse:
            return
        from gradsync.models import workload_of

        params = dict(workload_of(config).model.named_parameters())
        check_one_dtype(cls.name, {name: params[name] for name in sparse})
        optim = config.optim
        if optim.name != "sgd":
            raise UserError(
                f"hybrid applies SGD to sparse rows; torch's Adam refuses sparse gradients "
                f"(so single cannot run {', '.join(sparse)} either); use --optimizer sgd, or "
                "--dense-pattern to allreduce them"
            )
        if optim.weight_decay:
            raise UserError(
                f"--weight-decay {optim.weight_decay} makes torch's SGD densify sparse "
                f"gradients (every row decays every step), which defeats the sparse path of "
                f"{', '.join(sparse)}; use --weight-decay 0 or --dense-pattern"
            )
        servers = config.strategy_options.num_servers(config.workers)
        partitions = config.strategy_options.partitions
        if partitions is not None and partitions * len(sparse) < servers:
            raise UserError(
                f"--partitions {partitions} × {len(sparse)} sparse variables leaves some of "
                f"the {servers} servers without rows; use --partitions "
                f"{-(-servers // len(sparse))} or more"
            )

    def expected_difference(self, config: TrainConfig) -> str | None:
        options = config.strategy_options
        if not options.average_sparse and config.workers > 1:
            return "--no-average-sparse sums the workers' sparse gradients instead of averaging"
        return options.rounding()  # the dense path's fusion buffers

    # -- both roles ------------------------------------------------------------------------

    def _join(self, context: Context, is_worker: bool) -> None:
        """Collective on every rank, in this order: the transport's lanes, node groups."""
        self.context = context
        config = context.config
        self.options = config.strategy_options
        self.num_servers = self.options.num_servers(context.num_workers)
        self.server_ranks = self.options.server_ranks(context.num_workers)
        timeout = timedelta(seconds=config.launch.timeout_s)
        self.lanes = Lanes.create(context.world_size, timeout)
        from gradsync.topology import detect_environment

        env = detect_environment()
        node = env.node_rank if env is not None else 0
        # Who is on which node; servers get a node of their own (no local aggregation).
        nodes = [torch.zeros(1, dtype=torch.long) for _ in range(context.world_size)]
        dist.all_gather(nodes, torch.tensor([node if is_worker else -1]))
        workers_by_node: dict[int, list[int]] = {}
        for rank, n in enumerate(int(t) for t in nodes):
            if n >= 0:
                workers_by_node.setdefault(n, []).append(rank)
        self.node: NodeGroup | None  # this worker's node, None without local aggregation
        if self.options.local_aggregation:
            self.node = node_local_group(node if is_worker else -1 - context.rank, timeout)
            self.pushers = sorted(ranks[0] for ranks in workers_by_node.values())
        else:
            self.node = None
            self.pushers = list(range(context.num_workers))

    def _receive_spec(self, spec: dict[str, Any] | None) -> dict[str, Tensor] | None:
        """Worker 0's classification, geometry, partition count and initial rows, everywhere;
        returns the initial rows, or None when the workers ran no step (:data:`NO_STEP`)."""
        initial = spec.pop("initial") if spec is not None else None
        spec = broadcast_json(spec)
        if spec == NO_STEP:
            return None
        self.spec_kinds: dict[str, str] = spec["kinds"]
        self.variables = [SparseVariable(*v) for v in spec["variables"]]
        self.partitions = partition_rows(
            self.variables, spec["num_partitions"], num_servers=self.num_servers
        )
        self.on_server = [
            [p for p in self.partitions if p.server == s] for s in range(self.num_servers)
        ]
        return broadcast_tensors(initial)

    def _server(
        self, server: int, initial: dict[str, Tensor], local_worker: int | None
    ) -> tuple[Inbox, SparseServer]:
        """Server ``server``'s inbox and policy (``local_worker`` shares its process)."""
        context = self.context
        workers = context.num_workers
        inbox, outbox = endpoints(
            num_workers=workers,
            local_worker=local_worker,
            lanes=self.lanes,
            timeout_s=context.config.launch.timeout_s,
            read_body=sparse_reader(self.on_server[server]),
            deliver_local=None if local_worker is None else self._local_replies.put,
        )
        shard = SparseShard(self.on_server[server], initial, momentum=context.config.optim.momentum)
        policy = SparseServer(
            shard,
            outbox,
            ServerMetrics.to_file(
                context.config.out, rank=context.rank, server=server, steps_done=context.steps_done
            ),
            pushers=self.pushers,
            scale=1.0 / workers if self.options.average_sparse else 1.0,
            timeline=context.timeline,
            track=f"sparse-server{server}",
        )
        return inbox, policy

    # -- dedicated server rank -----------------------------------------------------------

    def serve(self, context: Context) -> None:
        """Serve once the workers' first step sends the spec; return at once if they ran no
        step (a restart or resume after the last one: nothing to serve)."""
        self._join(context, is_worker=False)
        initial = self._receive_spec(None)
        if initial is not None:
            self._run_dedicated(context, initial)

    # -- worker ----------------------------------------------------------------------------

    def setup(self, model: nn.Module, context: Context) -> nn.Module:
        self.context, self.model = context, model
        config = context.config
        broadcast_parameters(model, context.worker_group)
        self.kinds = classify(model, config.strategy_options)
        self.params = dict(model.named_parameters())
        self.sparse_names = [n for n, k in self.kinds.items() if k == "sparse"]
        dense = [(n, self.params[n]) for n, k in self.kinds.items() if k == "dense"]
        if context.rank == 0:
            print(
                f"[rank 0] hybrid classification:\n{describe_classification(model, self.kinds)}",
                flush=True,
            )
            if not self.sparse_names:
                print(
                    "[rank 0] hybrid: no sparse variables, so it degenerates to allreduce "
                    "(every gradient through fused allreduce, no servers)",
                    flush=True,
                )
        self.sparse_counters = CommStats()
        options = config.strategy_options
        self.fused = options.fused_allreduce(dense, context, self.counters)
        # Sparse variables get no optimizer here: the servers own their update.
        self._placeholder = nn.Parameter(torch.zeros(1))  # keeps the lr schedule without dense
        self.updater = context.make_updater([p for _, p in dense] or [self._placeholder])
        self._step = 0
        self._connected = False
        self._finished = False  # after finish(): lookups read the own tables, untracked
        self._colocated: ColocatedServer | None = None
        self._to_load: dict[str, Tensor] | None = None
        if not self.sparse_names:
            return model
        self._join(context, is_worker=True)
        self.predictor = RowPredictor({n: self.params[n].shape[0] for n in self.sparse_names})
        self._inputs: dict[str, Tensor] = {}  # this step's integer forward inputs
        self._read: dict[str, list[Tensor]] = {}  # rows each table's lookups read this step
        self._missed = True  # a lookup read rows not predicted: learn the prediction anew
        self._fresh: dict[str, Tensor] = {}  # rows pulled for step _fresh_step
        self._fresh_step = -1
        # Before the forward: every table's predicted rows in one pull; then each lookup
        # pulls only the rows it reads that were not predicted (none, once learned).
        model.register_forward_pre_hook(self._prefetch_rows, with_kwargs=True)
        lookups = lookup_tables(model)
        for name in self.sparse_names:
            lookups[name].register_forward_pre_hook(
                lambda _module, args, kwargs, name=name: self._lookup(
                    name, args[0] if args else kwargs["input"]
                ),
                with_kwargs=True,
            )
        return model

    def _connect(self, touched: dict[str, Tensor]) -> None:
        """First step: choose P from the rows worker 0 touched, start the servers."""
        context = self.context
        spec = None
        if context.rank == 0:
            variables = [
                SparseVariable(n, self.params[n].shape[0], self.params[n][0].numel())
                for n in self.sparse_names
            ]
            choice = None
            count = self.options.partitions
            if count is None:
                widest = max(v.row_numel for v in variables)
                apply_cost = measure_apply_cost(widest, momentum=context.config.optim.momentum)
                choice = choose_num_partitions(
                    variables, touched, num_servers=self.num_servers, apply_cost=apply_cost
                )
                count = choice.num_partitions
            spec = {
                "variables": [(v.name, v.num_rows, v.row_numel, v.element_size) for v in variables],
                "num_partitions": count,
                "kinds": self.kinds,
                "initial": {n: self.params[n].detach() for n in self.sparse_names},
            }
            where = "colocated on the workers" if self.options.colocate else "dedicated ranks"
            how = "--partitions" if choice is None else f"cost model: {choice.describe()}"
            print(
                f"[rank 0] hybrid: {len(variables)} sparse variable(s) in {count} row "
                f"partition(s) each ({how}) on {self.num_servers} server(s), {where}; "
                f"pushers {self.pushers}"
                + (" (local aggregation)" if self.options.local_aggregation else ""),
                flush=True,
            )
        initial = self._receive_spec(spec)
        assert initial is not None  # worker 0 sent the spec, not NO_STEP
        if self.spec_kinds != self.kinds:
            raise RuntimeError(
                f"rank {context.rank} classified the variables differently "
                f"from rank 0: {self.kinds} vs {self.spec_kinds}"
            )
        colocate = self.options.colocate
        self.client = SparseClient(
            worker=context.worker_index,
            servers=[None if colocate and r == context.rank else r for r in self.server_ranks],
            partitions=self.on_server,
            lanes=self.lanes,
            timeout_s=context.config.launch.timeout_s,
            alive=lambda: self._colocated is not None and self._colocated.alive(),
        )
        self._local_replies = self.client.local_replies
        if colocate:
            self.client.local_inbox, self._colocated = self._start_colocated(context, initial)
        self._connected = True
        if self._to_load is not None:  # --resume: the servers take the checkpoint's rows
            if context.worker_index == 0:
                self.client.load_state(cut_rows(self._to_load, self.on_server), self._step)
            dist.barrier(group=context.worker_group)  # no pull before every LOAD is in
            self._to_load = None

    def _prefetch_rows(
        self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Forward pre-hook of the model: pull, in one round trip, the rows every table is
        predicted to read this step (:class:`~gradsync.comm.prefetch.RowPredictor`)."""
        if self._finished:
            return
        self._inputs = forward_indices(args, kwargs)
        if not self._connected:  # first step: every worker holds the same initial values
            return
        predicted = {n: r for n, r in self.predictor.predict(self._inputs).items() if len(r)}
        if predicted:
            self._pull(predicted)

    def _lookup(self, name: str, lookup: Tensor) -> None:
        """Forward pre-hook of a sparse lookup: note the rows it reads, and pull those of
        them not pulled yet this step (a wrong or missing prediction stays correct)."""
        if self._finished:  # the validation pass: the worker's own tables, nothing to note
            return
        rows = torch.unique(lookup.detach().reshape(-1)).cpu().long()  # int64 CPU indices
        self._read.setdefault(name, []).append(rows)
        if not self._connected:
            return
        fresh = self._fresh.get(name) if self._fresh_step == self._step else None
        missing = missing_rows(rows, fresh)
        if len(missing):
            self._missed = True
            self._pull({name: missing})

    def _pull(self, rows: dict[str, Tensor]) -> None:
        """Fetch the sorted unique ``rows`` of each named table, one request per server
        holding any of them (one round trip in all), and write them into the tables."""
        started = time.perf_counter()
        wanted = self._wanted_per_server(rows)
        label = ",".join(rows)
        with (
            self.context.timeline.span(COMPUTE, Phase.WAIT_FOR_PARAMS, tensor=label),
            self.context.timeline.span("sparse-pull", Phase.PULL, tensor=label),
        ):
            replies, sent, received = self.client.pull(self._step, wanted)
        for s, parts in enumerate(self.on_server):
            offset = 0
            for p, want in zip(parts, wanted[s], strict=True):
                width = len(want) * p.row_numel
                if width:
                    table = self.params[p.name].data.view(self.params[p.name].shape[0], -1)
                    values = replies[s][offset : offset + width].view(len(want), -1)
                    table.index_copy_(0, want, values.to(table.dtype))
                offset += width
        if self._fresh_step != self._step:
            self._fresh, self._fresh_step = {}, self._step
        for name, pulled in rows.items():
            before = self._fresh.get(name)
            both = pulled if before is None else torch.cat([before, pulled])
            self._fresh[name] = torch.unique(both)
        self._count(sent, received, time.perf_counter() - started)

    def _wanted_per_server(self, rows: dict[str, Tensor]) -> list[list[Tensor]]:
        """``rows`` cut per partition: ``[s][i]`` are the rows of server s's partition i."""
        pieces: dict[RowPartition, Tensor] = {}
        for name, wanted in rows.items():
            mine = [p for p in self.partitions if p.name == name]
            pieces.update(zip(mine, (i for i, _ in split_rows(wanted, None, mine)), strict=True))
        none = torch.zeros(0, dtype=torch.long)
        return [[pieces.get(p, none) for p in parts] for parts in self.on_server]

    def _count(self, sent: int, received: int, seconds: float) -> None:
        for stats in (self.sparse_counters, self.counters):
            stats.bytes_sent += sent
            stats.bytes_recv += received
            stats.exposed_comm_s += seconds

    def _local_rows(self) -> tuple[dict[str, tuple[Tensor, Tensor]], dict[str, bool]]:
        """This worker's coalesced (indices, rows) per sparse variable, and whether each
        had a gradient at all (an unused lookup table has none: single skips it)."""
        rows, present = {}, {}
        for name in self.sparse_names:
            param = self.params[name]
            if param.grad is not None and not param.grad.is_sparse:
                raise RuntimeError(
                    f"hybrid: sparse variable '{name}' received a dense gradient, so the model "
                    "reads it outside its nn.Embedding lookup (e.g. as a tied output layer); "
                    f"pulled rows would be stale there. Add --dense-pattern '{name}'"
                )
            present[name] = param.grad is not None
            indices, values = coalesce_rows(param.grad, param.shape[0])
            values = values.reshape(len(indices), param[0].numel())
            rows[name] = (indices, values.to(torch.get_default_dtype()))
            param.grad = None
        return rows, present

    def _aggregate_on_node(
        self, rows: dict[str, tuple[Tensor, Tensor]], present: dict[str, bool]
    ) -> tuple[dict[str, tuple[Tensor, Tensor]], dict[str, bool]] | None:
        """Local aggregation: the node's workers' rows, summed, on its first worker (and
        whether any of them had a gradient per variable); None on the other workers."""
        node = self.node
        if node is None or len(node.ranks) == 1:
            return rows, present
        started = time.perf_counter()
        num_rows = {n: self.params[n].shape[0] for n in self.sparse_names}
        with self.context.timeline.span("sparse-node", Phase.ALLGATHER, step=self._step):
            merged, anywhere, moved = gather_rows_on_node(rows, present, num_rows, node)
        self._count(moved, moved, time.perf_counter() - started)
        return (merged, anywhere) if self.context.rank == min(node.ranks) else None

    def step(self) -> None:
        assert self.updater is not None
        lr = self.updater.lr  # the rate this step's update uses (the schedule moves after)
        if self.sparse_names and self._connected:
            # Sparse rows first, while the last dense buckets are still being reduced: the
            # servers apply them during the dense finish and update, so the next step's
            # pull waits less.
            self._sync_sparse(lr)
            self._finish_dense()
        else:  # the first step starts the servers (collectives): the dense path is done first
            self._finish_dense()
            if self.sparse_names:
                self._sync_sparse(lr)
        self._step += 1

    def _finish_dense(self) -> None:
        assert self.updater is not None
        self.fused.finish()
        self.updater.update()

    def _sync_sparse(self, lr: float) -> None:
        """Push this step's sparse rows (starting the servers at the first step) and, where
        a lookup read rows that were not predicted (the first step, a changed model path),
        learn the next step's prefetch from the rows the lookups read."""
        rows, present = self._local_rows()
        if not self._connected:
            self._connect({n: r[0] for n, r in rows.items()})
        # The training thread waits for the node's row sum and the push: exposed.
        with self.context.timeline.span(COMPUTE, Phase.COMM_WAIT, tensor="sparse rows"):
            self._push(rows, present, lr)
        if self._missed:  # a prediction that covered every read stays: it costs nothing
            read = {n: torch.unique(torch.cat(r)) for n, r in self._read.items()}
            self.predictor.learn(read, self._inputs)
        self._read, self._missed = {}, False

    def _push(
        self, rows: dict[str, tuple[Tensor, Tensor]], present: dict[str, bool], lr: float
    ) -> None:
        on_node = self._aggregate_on_node(rows, present)
        if on_node is None:  # not the node's pusher: its rows went into the node's sum
            return
        aggregated, anywhere = on_node
        started = time.perf_counter()
        per_server: list[list[tuple[Tensor, Tensor]]] = [[] for _ in range(self.num_servers)]
        pieces: dict[RowPartition, tuple[Tensor, Tensor | None]] = {}
        for name in self.sparse_names:
            mine = [p for p in self.partitions if p.name == name]
            pieces.update(zip(mine, split_rows(*aggregated[name], mine), strict=True))
        for s, parts in enumerate(self.on_server):
            for p in parts:
                indices, values = pieces[p]
                assert values is not None
                per_server[s].append((indices, values))
        flags = [[anywhere[p.name] for p in parts] for parts in self.on_server]
        with self.context.timeline.span("sparse-push", Phase.PUSH, step=self._step):
            sent = self.client.push(self._step, lr, per_server, flags)
        self._count(sent, 0, time.perf_counter() - started)

    def stats(self) -> CommStats:
        return self.counters.copy()

    def checkpoint_tensors(self) -> dict[str, Tensor] | None:
        """Worker 0: its dense state, and the servers' authoritative sparse rows."""
        if self.context is None or self.context.worker_index != 0 or self.model is None:
            return None
        assert self.updater is not None
        tensors = model_state(self.model, self.updater.optimizer)
        if not self._connected:
            return tensors
        states = self.client.request_state(self._step)
        tables = {n: self.params[n].data for n in self.sparse_names}
        buffers = None
        if self.context.config.optim.momentum:
            buffers = {n: torch.zeros_like(t) for n, t in tables.items()}
            tensors.update({f"{OPTIM}{n}/momentum_buffer": b for n, b in buffers.items()})
            tensors.update(lag_tensors(states, self.on_server))  # for --resume, exactly
        with torch.no_grad():  # worker 0's tables get the servers' rows (evaluation reads them)
            install_rows(states, self.on_server, tables, buffers)
        for name in self.sparse_names:
            tensors[PARAM + name] = self.params[name].detach().clone()
        return {k: v.contiguous() for k, v in tensors.items()}

    def restore_state(self, tensors: dict[str, Tensor], steps_done: int) -> None:
        """Every worker restores its model, dense optimizer state and schedule (the default)
        and numbers its next push ``steps_done``; the servers start at the end of the first
        step (as in a fresh run, whose first step reads the tables every worker holds), and
        then worker 0 installs the checkpoint's rows, momentum and lazy rows on them."""
        Strategy.restore_state(self, tensors, steps_done)
        self._step = steps_done
        if self.sparse_names:
            self._to_load = tensors

    def finish(self) -> None:
        """Release the servers. Lookups after this (the validation pass) read the worker's
        own tables, which worker 0's final checkpoint filled with the servers' rows."""
        if not self._connected:
            self._release_unstarted_servers()
            return
        self.client.done()
        self._connected = False  # no pull may wait on a server that has stopped
        self._finished = True
        if self._colocated is not None:
            self._colocated.join(self.context.config.launch.timeout_s)

    def _release_unstarted_servers(self) -> None:
        """No step ran (a restart or ``--resume`` with no step left): the dedicated servers,
        which start at the end of the first step, still wait in :meth:`_receive_spec`; every
        worker takes part in sending them :data:`NO_STEP` instead (collective, once)."""
        if not self.sparse_names or self.options.colocate or self._finished:
            return  # no servers, or colocated ones, which start only with the first step
        broadcast_json(NO_STEP)
        self._finished = True


__all__ = ["Hybrid", "classify", "describe_classification"]
