"""Strategy registry: one file per synchronization architecture, one line here each.

A strategy from outside the package registers itself with :func:`register`; list its module
in ``GRADSYNC_STRATEGIES`` (comma-separated module names) so that every rank imports it.

Example:
    >>> sorted(STRATEGIES)
    ['allreduce', 'ddp', 'hybrid', 'p3', 'ps', 'single']
    >>> options_class("p3")().slice_size
    40000
"""

from __future__ import annotations

import importlib
import os

from gradsync.config import TrainConfig
from gradsync.errors import UserError
from gradsync.options import StrategyOptions
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
PLUGINS_VARIABLE = "GRADSYNC_STRATEGIES"


def register(cls: type[Strategy]) -> type[Strategy]:
    """Add a strategy class to the registry (usable as a class decorator)."""
    STRATEGIES[cls.name] = cls
    return cls


def load_plugins() -> None:
    """Import the modules named in ``GRADSYNC_STRATEGIES``; each registers its strategies."""
    for module in filter(None, os.environ.get(PLUGINS_VARIABLE, "").split(",")):
        try:
            importlib.import_module(module.strip())
        except ImportError as error:
            raise UserError(
                f"{PLUGINS_VARIABLE} names module '{module}', which does not import ({error}); "
                "fix the name or PYTHONPATH"
            ) from None


def strategy_class(name: str) -> type[Strategy]:
    """The registered strategy called ``name``, or a UserError listing the choices."""
    if name not in STRATEGIES:
        load_plugins()
    try:
        return STRATEGIES[name]
    except KeyError:
        raise UserError(
            f"unknown strategy '{name}'; choose one of: {', '.join(STRATEGIES)}"
        ) from None


def split_specs(text: str) -> list[str]:
    """The comma-separated strategy specs in ``text`` (verify's and predict's
    ``--strategies``). After a spec that gives an option a value, a part that does not
    start with a strategy's name continues the spec: a tuple option's further values, or
    a regular expression's ``{1,2}``.

    Example:
        >>> split_specs("ddp,hybrid:dense_patterns=emb*,fc*,p3:slice_size=100")
        ['ddp', 'hybrid:dense_patterns=emb*,fc*', 'p3:slice_size=100']
        >>> split_specs("hybrid:dense_patterns=re:a{1,2},ps,nosuch")  # nosuch: refused by name
        ['hybrid:dense_patterns=re:a{1,2}', 'ps', 'nosuch']
    """
    specs: list[str] = []
    for part in (piece.strip() for piece in text.split(",")):
        if not part:
            continue
        if specs and "=" in specs[-1] and not _is_strategy(part.split(":")[0]):
            specs[-1] += "," + part
        else:
            specs.append(part)
    return specs


def _is_strategy(name: str) -> bool:
    if name not in STRATEGIES:
        load_plugins()
    return name in STRATEGIES


def options_class(name: str) -> type[StrategyOptions]:
    """The options dataclass of strategy ``name``."""
    return strategy_class(name).Options


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
    cls.check_config(config)


__all__ = [
    "STRATEGIES",
    "Context",
    "Strategy",
    "check_strategy",
    "options_class",
    "register",
    "strategy_class",
    "world_size_of",
]
