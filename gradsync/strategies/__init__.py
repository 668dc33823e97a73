"""Strategy registry: one file per synchronization architecture, one line here each.

Example:
    >>> sorted(STRATEGIES)
    ['allreduce', 'ddp', 'hybrid', 'p3', 'ps', 'single']
"""

from __future__ import annotations

from gradsync.config import DDPConfig, HybridConfig, P3Config, PSConfig, TrainConfig
from gradsync.errors import UserError
from gradsync.strategies.allreduce import HorovodAllreduce
from gradsync.strategies.base import Context, Strategy
from gradsync.strategies.ddp import NativeDDP
from gradsync.strategies.hybrid import Hybrid
from gradsync.strategies.p3 import PriorityPropagation
from gradsync.strategies.ps import ParameterServer
from gradsync.strategies.single import SingleProcess

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        SingleProcess,
        NativeDDP,
        HorovodAllreduce,
        ParameterServer,
        Hybrid,
        PriorityPropagation,
    )
}


def strategy_class(name: str) -> type[Strategy]:
    """The registered strategy called ``name``, or a UserError listing the choices."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise UserError(
            f"unknown strategy '{name}'; choose one of: {', '.join(STRATEGIES)}"
        ) from None


def world_size_of(config: TrainConfig) -> int:
    """Processes in the job: the workers plus any server ranks the strategy adds."""
    return config.workers + strategy_class(config.strategy).num_server_ranks(config)


def check_strategy(config: TrainConfig) -> None:
    """Fail early on a strategy that cannot run in ``config``'s topology."""
    cls = strategy_class(config.strategy)
    if config.strategy == "single" and config.workers != 1:
        raise UserError(
            f"strategy 'single' runs one process on the whole global batch, but "
            f"--workers is {config.workers}; use --workers 1 or another strategy"
        )
    if config.strategy != "ps" and config.ps != PSConfig():
        raise UserError(
            f"--servers/--colocate/--async/--staleness/--placement apply to --strategy ps, "
            f"not '{config.strategy}'; drop them or use --strategy ps"
        )
    if config.strategy != "hybrid" and config.hybrid != HybridConfig():
        raise UserError(
            f"--partitions/--no-average-sparse/--no-local-aggregation/--sparse-pattern/"
            f"--dense-pattern apply to --strategy hybrid, not '{config.strategy}'; drop them "
            "or use --strategy hybrid"
        )
    if config.strategy != "p3" and config.p3 != P3Config():
        raise UserError(
            f"--slice-size/--no-priority/--no-slicing apply to --strategy p3, not "
            f"'{config.strategy}'; drop them or use --strategy p3"
        )
    if config.strategy != "ddp" and config.ddp != DDPConfig():
        raise UserError(
            f"--find-unused-parameters applies to --strategy ddp, not '{config.strategy}' "
            "(the other strategies handle parameters without a gradient themselves); drop it"
        )
    cls.check_config(config)


__all__ = ["STRATEGIES", "Context", "Strategy", "check_strategy", "strategy_class", "world_size_of"]
