"""Typed, keyword-only run configuration, validated up front with the numbers in the message."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gradsync.errors import UserError

Optimizer = Literal["sgd", "adam"]
LrScaling = Literal["none", "linear", "sqrt"]
OPTIMIZERS = ("sgd", "adam")
LR_SCALINGS = ("none", "linear", "sqrt")
DTYPES = ("float32", "float64")
BATCHNORM_MODES = ("global", "local")
DEFAULT_LR = {"sgd": 0.05, "adam": 1e-3}


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """Optimizer and learning-rate schedule.

    ``lr_scaling`` applies a rule to ``lr`` given ``global_batch / lr_base_batch``: ``linear``
    is Goyal et al. 2017 (lr × k), ``sqrt`` is Krizhevsky 2014 (lr × √k). ``warmup_steps``
    ramps the rate linearly from lr/warmup to lr (Goyal et al.'s gradual warm-up).
    """

    name: Optimizer = "sgd"
    lr: float | None = None
    momentum: float = 0.9
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_scaling: LrScaling = "none"
    lr_base_batch: int | None = None

    def base_lr(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.name]


@dataclass(frozen=True, kw_only=True)
class AllreduceConfig:
    """Horovod-style allreduce: fusion threshold (MB), fp16 gradient compression, and
    ``sparse_as_dense`` (Horovod's flag: densify sparse gradients into the fusion buffers
    instead of allgathering their rows)."""

    fusion_threshold_mb: float = 64.0
    first_bucket_mb: float | None = None  # caps the first bucket only (DDP: 1 MB)
    fp16_compression: bool = False
    sparse_as_dense: bool = False

    @property
    def first_bucket_bytes(self) -> int | None:
        return None if self.first_bucket_mb is None else int(self.first_bucket_mb * 2**20)


@dataclass(frozen=True, kw_only=True)
class DDPConfig:
    """PyTorch DDP (strategy ``ddp``): ``find_unused_parameters`` forces DDP's search for
    parameters without a gradient (torch's flag of that name). Without it, gradsync turns the
    flag on by itself when a parameter gets no gradient on some worker in the first step."""

    find_unused_parameters: bool = False


PLACEMENTS = ("greedy", "round-robin")


@dataclass(frozen=True, kw_only=True)
class PSConfig:
    """Parameter servers (strategy ``ps``).

    ``servers`` dedicated server ranks (None: 1, or none with ``colocate``, where every
    worker also serves a shard). ``async_updates`` applies each push on arrival;
    ``staleness`` k bounds it (Stale Synchronous Parallel, Ho et al. 2013) and implies it.
    Variables above ``partition_threshold_mb`` are split across servers.
    """

    servers: int | None = None
    colocate: bool = False
    async_updates: bool = False
    staleness: int | None = None
    placement: str = "greedy"
    partition_threshold_mb: float = 4.0

    @property
    def asynchronous(self) -> bool:
        return self.async_updates or self.staleness is not None

    def num_servers(self, workers: int) -> int:
        """Server shards in the job: one per worker when colocated."""
        return workers if self.colocate else (1 if self.servers is None else self.servers)

    def check(self, workers: int) -> None:
        """UserError on an impossible parameter-server topology."""
        if self.colocate and self.servers is not None:
            raise UserError(
                f"--servers {self.servers} with --colocate: colocated servers run inside the "
                f"workers (--workers {workers}), not on extra ranks; drop --servers or --colocate"
            )
        if self.servers is not None and self.servers < 1:
            raise UserError(
                f"--servers {self.servers} leaves no parameter server; use --servers 1 or "
                "more, or --colocate to serve from the workers"
            )
        if self.staleness is not None and self.staleness < 1:
            raise UserError(
                f"--staleness {self.staleness} is lock-step, which is the synchronous mode "
                "(the default): omit --staleness, or use 1 or more"
            )
        if self.placement not in PLACEMENTS:
            raise UserError(
                f"unknown --placement '{self.placement}'; choose one of: {', '.join(PLACEMENTS)}"
            )
        if not self.partition_threshold_mb > 0:
            raise UserError(
                f"--partition-threshold-mb must be > 0, got {self.partition_threshold_mb}"
            )


@dataclass(frozen=True, kw_only=True)
class HybridConfig:
    """Parallax's hybrid (strategy ``hybrid``): sparse variables through parameter servers.

    ``servers`` dedicated server ranks (None: 1, or one per worker with ``colocate``);
    ``partitions`` row partitions per sparse variable (None: chosen by the cost model in
    :mod:`gradsync.comm.sparse`); ``average_sparse`` averages the workers' sparse gradients
    (off: sums them, as Parallax's switch does); ``local_aggregation`` sums sparse gradients
    inside a node before pushing. ``sparse_patterns`` / ``dense_patterns`` override the
    automatic classification by variable name (glob, or ``re:REGEX``).
    """

    servers: int | None = None
    colocate: bool = False
    partitions: int | None = None
    average_sparse: bool = True
    local_aggregation: bool = True
    sparse_patterns: tuple[str, ...] = ()
    dense_patterns: tuple[str, ...] = ()

    def __post_init__(self) -> None:  # JSON gives lists; keep tuples (frozen, comparable)
        object.__setattr__(self, "sparse_patterns", tuple(self.sparse_patterns))
        object.__setattr__(self, "dense_patterns", tuple(self.dense_patterns))

    def num_servers(self, workers: int) -> int:
        """Sparse server shards in the job: one per worker when colocated."""
        return workers if self.colocate else (1 if self.servers is None else self.servers)

    def check(self, workers: int) -> None:
        """UserError on an impossible hybrid topology."""
        if self.colocate and self.servers is not None:
            raise UserError(
                f"--servers {self.servers} with --colocate: colocated servers run inside the "
                f"workers (--workers {workers}), not on extra ranks; drop --servers or --colocate"
            )
        if self.servers is not None and self.servers < 1:
            raise UserError(
                f"--servers {self.servers} leaves no server for the sparse variables; use "
                "--servers 1 or more, or --colocate"
            )
        if self.partitions is not None and self.partitions < 1:
            raise UserError(f"--partitions must be a positive integer, got {self.partitions}")
        for pattern in (*self.sparse_patterns, *self.dense_patterns):
            if pattern.startswith("re:"):
                import re

                try:
                    re.compile(pattern[3:])
                except re.error as error:
                    raise UserError(f"bad regular expression {pattern!r}: {error}") from None


DEFAULT_SLICE_SIZE = 40_000


@dataclass(frozen=True, kw_only=True)
class P3Config:
    """Priority-based Parameter Propagation (strategy ``p3``, Jayarajan et al. SysML'19).

    ``servers`` dedicated server ranks (None: 1). Every variable is cut into slices of at
    most ``slice_size`` values (MXNet P3's default 40,000), spread round-robin over the
    servers; ``slicing=False`` sends whole variables. ``priority=False`` sends in arrival
    order (FIFO) instead of layer order, input side first.
    """

    servers: int | None = None
    slice_size: int = DEFAULT_SLICE_SIZE
    priority: bool = True
    slicing: bool = True

    def num_servers(self) -> int:
        return 1 if self.servers is None else self.servers

    def check(self) -> None:
        """UserError on an impossible P3 configuration."""
        if self.servers is not None and self.servers < 1:
            raise UserError(
                f"--servers {self.servers} leaves no parameter server; use --servers 1 or more"
            )
        if self.slice_size < 1:
            raise UserError(
                f"--slice-size must be a positive number of values, got {self.slice_size} "
                f"(default {DEFAULT_SLICE_SIZE})"
            )


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """Where the ranks run: local processes, or one node of a multi-node job.

    ``hosts`` > 0 runs the local ranks on that many emulated hosts (network namespaces,
    see :mod:`gradsync.netem`), ``ranks_per_host`` per host, each host's link shaped to
    ``bandwidth`` (tc notation, e.g. ``1gbit``) when given.
    """

    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    timeout_s: float = 300.0
    threads: int | None = None
    interop_threads: int | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    hosts: int = 0
    ranks_per_host: int | None = None
    bandwidth: str | None = None

    def __post_init__(self) -> None:
        from gradsync.netem import MAX_HOSTS, parse_rate

        if not 0 <= self.hosts <= MAX_HOSTS:
            raise UserError(f"--hosts must be in 1..{MAX_HOSTS}, got {self.hosts}")
        if self.ranks_per_host is not None and (self.ranks_per_host < 1 or not self.hosts):
            raise UserError(
                f"--ranks-per-host {self.ranks_per_host} needs --hosts H and a positive count"
            )
        if self.bandwidth is not None:
            if not self.hosts:
                raise UserError(
                    f"--bandwidth {self.bandwidth} shapes the links of emulated hosts; "
                    "add --hosts H (e.g. --hosts 2)"
                )
            parse_rate(self.bandwidth)
        if self.hosts and self.num_nodes > 1:
            raise UserError(
                f"--hosts emulates hosts on one machine and cannot combine with --nnodes "
                f"{self.num_nodes}; drop one of them"
            )


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training job.

    Example:
        >>> cfg = TrainConfig(model="mnist-cnn", preset="tiny", strategy="ddp", workers=2, steps=3)
        >>> TrainConfig.from_json(cfg.to_json()) == cfg
        True
    """

    model: str = "transformer"
    preset: str = "default"
    model_options: dict[str, str] = field(default_factory=dict)
    strategy: str = "allreduce"
    workers: int = 1
    steps: int = 50
    global_batch: int | None = None
    seed: int = 0
    data: str | None = None
    out: str = "runs/latest"
    deterministic: bool = False
    dtype: str = "float32"
    batchnorm: str = "global"  # "local": each worker normalizes its own shard
    measure_warmup: int | None = None
    checkpoint_every: int = 0
    log_every: int | None = None
    timeline: str | None = None
    timeline_steps: str | None = None
    optim: OptimConfig = field(default_factory=OptimConfig)
    allreduce: AllreduceConfig = field(default_factory=AllreduceConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    ps: PSConfig = field(default_factory=PSConfig)
    p3: P3Config = field(default_factory=P3Config)
    hybrid: HybridConfig = field(default_factory=HybridConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def __post_init__(self) -> None:
        if self.timeline_steps is not None:
            from gradsync.trace import parse_window

            try:
                parse_window(self.timeline_steps)
            except ValueError as error:
                raise UserError(str(error)) from None
        _check_positive("--workers", self.workers)
        _check_positive("--steps", self.steps)
        if self.global_batch is not None:
            _check_positive("--global-batch", self.global_batch)
            if self.global_batch % self.workers:
                raise UserError(
                    f"--global-batch {self.global_batch} does not divide by --workers "
                    f"{self.workers}; use a multiple of {self.workers} "
                    f"(e.g. {self.workers * max(1, self.global_batch // self.workers)})"
                )
        if self.batchnorm not in BATCHNORM_MODES:
            raise UserError(
                f"unknown --batchnorm '{self.batchnorm}'; choose global (statistics over the "
                "global batch, as single) or local (each worker's shard, as DDP and Horovod)"
            )
        if self.dtype not in DTYPES:
            raise UserError(
                f"unknown --dtype '{self.dtype}'; choose one of: {', '.join(DTYPES)} "
                "(float64 makes rounding ~1e-12, for exact comparisons)"
            )
        if self.optim.name not in OPTIMIZERS:
            raise UserError(f"unknown optimizer '{self.optim.name}'; choose one of: sgd, adam")
        if self.optim.lr_scaling not in LR_SCALINGS:
            raise UserError(
                f"unknown --lr-scaling '{self.optim.lr_scaling}'; choose one of: "
                f"{', '.join(LR_SCALINGS)}"
            )
        if self.optim.lr is not None and not self.optim.lr > 0:
            raise UserError(f"--lr must be > 0, got {self.optim.lr}")
        if self.measure_warmup is not None and self.measure_warmup < 0:
            raise UserError(f"--measure-warmup must be >= 0, got {self.measure_warmup}")
        if self.checkpoint_every < 0:
            raise UserError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if self.optim.lr_base_batch is not None and self.optim.lr_base_batch < 1:
            raise UserError(
                f"--lr-base-batch must be a positive integer, got {self.optim.lr_base_batch}"
            )
        if not 0 <= self.optim.momentum < 1:
            raise UserError(f"--momentum must be in [0, 1), got {self.optim.momentum}")
        if self.optim.warmup_steps < 0:
            raise UserError(f"--warmup-steps must be >= 0, got {self.optim.warmup_steps}")
        if self.allreduce.fusion_threshold_mb < 0:
            raise UserError(
                f"--fusion-threshold-mb must be >= 0, got {self.allreduce.fusion_threshold_mb}"
            )
        first = self.allreduce.first_bucket_mb
        if first is not None and first <= 0:
            raise UserError(f"--first-bucket-mb must be > 0, got {first} (e.g. 1, as DDP)")
        if self.strategy == "ps":
            self.ps.check(self.workers)
        if self.strategy == "p3":
            self.p3.check()
        if self.strategy == "hybrid":
            self.hybrid.check(self.workers)
        launch = self.launch
        _check_positive("--nnodes", launch.num_nodes)
        if not 0 <= launch.node_rank < launch.num_nodes:
            raise UserError(
                f"--node-rank {launch.node_rank} is outside 0..{launch.num_nodes - 1} "
                f"for --nnodes {launch.num_nodes}"
            )
        if self.workers % launch.num_nodes:
            raise UserError(
                f"--workers {self.workers} does not divide over --nnodes "
                f"{launch.num_nodes}; use a multiple of {launch.num_nodes}"
            )
        if launch.threads is not None:
            _check_positive("--threads", launch.threads)
        if launch.interop_threads is not None:
            _check_positive("--interop-threads", launch.interop_threads)
        if launch.master_port is not None and not 0 < launch.master_port < 65536:
            raise UserError(f"--master-port {launch.master_port} is not a TCP port (1..65535)")
        if not launch.timeout_s > 0:
            raise UserError(f"--timeout must be > 0 seconds, got {launch.timeout_s}")
        if self.data is not None and ":" not in self.data and not Path(self.data).exists():
            raise UserError(
                f"--data {self.data} does not exist; pass the path of the data "
                "file or directory for this model (or sklearn:digits for mnist-cnn)"
            )

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        raw = json.loads(text)
        return cls(
            **{
                k: v
                for k, v in raw.items()
                if k not in ("optim", "allreduce", "ddp", "ps", "p3", "hybrid", "launch")
            },
            optim=OptimConfig(**raw["optim"]),
            allreduce=AllreduceConfig(**raw["allreduce"]),
            ddp=DDPConfig(**raw.get("ddp", {})),
            ps=PSConfig(**raw.get("ps", {})),
            p3=P3Config(**raw.get("p3", {})),
            hybrid=HybridConfig(**raw.get("hybrid", {})),
            launch=LaunchConfig(**raw["launch"]),
        )


def _check_positive(flag: str, value: int) -> None:
    if value < 1:
        raise UserError(f"{flag} must be a positive integer, got {value}")
