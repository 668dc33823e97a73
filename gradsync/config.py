"""Typed, keyword-only run configuration, validated up front with the numbers in the message."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gradsync.errors import UserError
from gradsync.options import StrategyOptions, options_from_mapping

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
    is Goyal et al. 2017 (lr × k), ``sqrt`` is Krizhevsky 2014 (lr × √k). ``lr_warmup_steps``
    ramps the rate linearly from lr/warmup to lr (Goyal et al.'s gradual warm-up).
    """

    name: Optimizer = "sgd"
    lr: float | None = None
    momentum: float = 0.9
    weight_decay: float = 0.0
    lr_warmup_steps: int = 0
    lr_scaling: LrScaling = "none"
    lr_base_batch: int | None = None

    def base_lr(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.name]

    def check(self) -> None:
        """UserError on an optimizer setting that cannot train."""
        if self.name not in OPTIMIZERS:
            raise UserError(f"unknown optimizer '{self.name}'; choose one of: sgd, adam")
        if self.lr_scaling not in LR_SCALINGS:
            raise UserError(
                f"unknown --lr-scaling '{self.lr_scaling}'; choose one of: {', '.join(LR_SCALINGS)}"
            )
        if self.lr is not None and not 0 < self.lr < math.inf:
            raise UserError(f"--lr must be a finite number > 0, got {self.lr} (e.g. --lr 0.05)")
        if not 0 <= self.momentum < 1:
            raise UserError(
                f"--momentum must be in [0, 1), got {self.momentum} (e.g. --momentum 0.9)"
            )
        if not 0 <= self.weight_decay < math.inf:
            raise UserError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}")
        if self.lr_warmup_steps < 0:
            raise UserError(f"--lr-warmup-steps must be >= 0, got {self.lr_warmup_steps}")
        if self.lr_base_batch is not None and self.lr_base_batch < 1:
            raise UserError(f"--lr-base-batch must be a positive integer, got {self.lr_base_batch}")
        if self.lr_base_batch is not None and self.lr_scaling == "none":
            raise UserError(
                "--lr-base-batch sets the batch --lr-scaling scales from, and --lr-scaling is "
                "none; add --lr-scaling linear or sqrt, or drop --lr-base-batch"
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
    # reliability: a silent rank is named after this long; relaunches on a death
    hang_timeout_s: float = 60.0
    max_restarts: int = 0

    def __post_init__(self) -> None:
        from gradsync.netem import check_host_count, parse_shaped_rate

        if not 0 < self.hang_timeout_s < float("inf"):
            raise UserError(
                f"--hang-timeout must be a positive number of seconds, got {self.hang_timeout_s}"
            )
        if self.max_restarts < 0:
            raise UserError(f"--max-restarts must be >= 0, got {self.max_restarts}")

        if self.hosts:  # 0: no emulated hosts
            check_host_count(self.hosts)
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
            parse_shaped_rate(self.bandwidth)
        if self.hosts and self.num_nodes > 1:
            raise UserError(
                f"--hosts emulates hosts on one machine and cannot combine with --nnodes "
                f"{self.num_nodes}; drop one of them"
            )

    def check(self, workers: int) -> None:
        """UserError on a launch setting that cannot start ``workers`` workers."""
        _check_positive("--nnodes", self.num_nodes)
        if not 0 <= self.node_rank < self.num_nodes:
            raise UserError(
                f"--node-rank {self.node_rank} is outside 0..{self.num_nodes - 1} "
                f"for --nnodes {self.num_nodes}"
            )
        if workers % self.num_nodes:
            raise UserError(
                f"--workers {workers} does not divide over --nnodes {self.num_nodes}; "
                f"use a multiple of {self.num_nodes}"
            )
        if self.threads is not None:
            _check_positive("--threads", self.threads)
        if self.interop_threads is not None:
            _check_positive("--interop-threads", self.interop_threads)
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise UserError(f"--master-port {self.master_port} is not a TCP port (1..65535)")
        if not 0 < self.timeout_s < math.inf:
            raise UserError(
                f"--timeout must be a finite number of seconds > 0, got {self.timeout_s}"
            )


# The TrainConfig fields every rank of one job shares as they are (see shared_settings).
SHARED_FIELDS = (
    "model",
    "preset",
    "strategy",
    "workers",
    "steps",
    "global_batch",
    "seed",
    "deterministic",
    "dtype",
    "batchnorm",
    "checkpoint_every",
    "timeline_steps",
    "resume",
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
    resume: bool = False  # continue from the checkpoint in ``out``
    optim: OptimConfig = field(default_factory=OptimConfig)
    strategy_options: Any = None  # the strategy's Options (None: its defaults; a dict: read)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def __post_init__(self) -> None:
        self._check_job()
        self.optim.check()
        self.launch.check(self.workers)
        object.__setattr__(self, "strategy_options", self._read_strategy_options())
        self.strategy_options.check(self.workers)

    def _check_job(self) -> None:
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
        if self.measure_warmup is not None and self.measure_warmup < 0:
            raise UserError(f"--measure-warmup must be >= 0, got {self.measure_warmup}")
        if self.measure_warmup is not None and self.measure_warmup >= self.steps:
            raise UserError(
                f"--measure-warmup {self.measure_warmup} leaves none of --steps {self.steps} "
                "to measure; use fewer warm-up steps or more steps"
            )
        if self.checkpoint_every < 0:
            raise UserError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if self.data is not None and ":" not in self.data and not Path(self.data).exists():
            raise UserError(
                f"--data {self.data} does not exist; pass the path of the data "
                "file or directory for this model (or sklearn:digits for mnist-cnn)"
            )

    def _read_strategy_options(self) -> StrategyOptions:
        from gradsync.strategies import options_class

        cls = options_class(self.strategy)
        given = self.strategy_options
        if given is None:
            return cls()
        if isinstance(given, dict):
            return options_from_mapping(cls, given)
        if type(given) is not cls:
            raise UserError(
                f"options {type(given).__name__} given to strategy '{self.strategy}', which "
                f"takes {cls.__name__}"
            )
        return given

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    def with_strategy(self, strategy: str, **changes: Any) -> TrainConfig:
        """A copy running ``strategy`` with its default options unless given."""
        return self.replace(strategy=strategy, strategy_options=None, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def shared_settings(self) -> dict[str, Any]:
        """What every rank of one job must be started with, by flag, as the run reads it
        (``--lr`` left out is the optimizer's default, ``sparse=yes`` is ``sparse=true``):
        everything but where each node reads and writes (``--data``, ``--out``, the trace's
        path), how it launches and logs (threads, timeouts, ``--log-every``) and what only
        rank 0 measures (``--measure-warmup``).

        Example:
            >>> a = TrainConfig(seed=3, out="a", optim=OptimConfig(lr=0.05))
            >>> b = TrainConfig(seed=3, out="b", data=None)
            >>> a.shared_settings() == b.shared_settings(), a.shared_settings()["--seed"]
            (True, 3)
        """
        from gradsync.models import default_global_batch, resolved_options
        from gradsync.options import flag_of

        settings: dict[str, Any] = {
            f"--{name.replace('_', '-')}": getattr(self, name) for name in SHARED_FIELDS
        }
        settings["--timeline"] = self.timeline is not None
        if self.global_batch is None:  # the preset's, written or not
            settings["--global-batch"] = default_global_batch(self.model, self.preset)
        optim = self.optim
        settings.update(
            {
                "--optimizer": optim.name,
                "--lr": optim.base_lr(),
                "--momentum": optim.momentum,
                "--weight-decay": optim.weight_decay,
                "--lr-warmup-steps": optim.lr_warmup_steps,
                "--lr-scaling": optim.lr_scaling,
                "--lr-base-batch": optim.lr_base_batch,
            }
        )
        for key, value in resolved_options(self.model, self.model_options).items():
            settings[f"--model-option {key}"] = value
        for item in dataclasses.fields(self.strategy_options):
            settings[flag_of(item)] = getattr(self.strategy_options, item.name)
        if settings.get("--servers", 0) is None and not settings.get("--colocate"):
            settings["--servers"] = 1  # the default, written or not
        return json.loads(json.dumps(settings))  # as the other ranks read it

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        raw = json.loads(text)
        return cls(
            **{k: v for k, v in raw.items() if k not in ("optim", "launch")},
            optim=OptimConfig(**raw["optim"]),
            launch=LaunchConfig(**raw["launch"]),
        )


def _check_positive(flag: str, value: int) -> None:
    if value < 1:
        raise UserError(f"{flag} must be a positive integer, got {value}")
