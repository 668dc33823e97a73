"""Strategy registry: one file per synchronization architecture, one line here each.

A strategy from outside the package registers itself with :func:`register`; list its module
in ``GRADSYNC_STRATEGIES`` (comma-separated module names) so that every rank imports it.
``horovod`` (real Horovod) is registered only where ``horovod.torch`` imports;
:data:`UNAVAILABLE` says why it is not elsewhere.

Example:
    >>> sorted(STRATEGIES)
    ['allreduce', 'ddp', 'hybrid', 'p3', 'ps', 'single']
    >>> options_class("p3")().slice_size
    40000
"""

from __future__ import annotations

import importlib
import inspect
import os
import re

from gradsync.config import TrainConfig
from gradsync.errors import UserError
from gradsync.options import StrategyOptions
from gradsync.strategies import horovod
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
UNAVAILABLE: dict[str, str] = {}  # a built-in strategy that cannot run here → why
if (_no_horovod := horovod.unavailable()) is None:
    STRATEGIES[horovod.RealHorovod.name] = horovod.RealHorovod
else:
    UNAVAILABLE[horovod.RealHorovod.name] = _no_horovod
PLUGINS_VARIABLE = "GRADSYNC_STRATEGIES"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")  # what --strategy and verify's specs parse


def register(cls: type[Strategy]) -> type[Strategy]:
    """Add a strategy class to the registry (usable as a class decorator). A UserError
    refuses a class that cannot run (:func:`check_strategy_class`) and a name that another
    class already has: the launcher would run the plugin, the ranks the built-in.

    Example:
        >>> register(STRATEGIES["ddp"]) is STRATEGIES["ddp"]  # the same class: harmless
        True
        >>> class Shadow(STRATEGIES["ddp"]):  # inherits the name "ddp"
        ...     pass
        >>> register(Shadow)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: strategy name 'ddp' is taken by gradsync.strategies.ddp...
    """
    check_strategy_class(cls)
    taken = STRATEGIES.get(cls.name)
    if taken is not None and _qualified(taken) != _qualified(cls):  # a reload is the same
        raise UserError(
            f"strategy name '{cls.name}' is taken by {_qualified(taken)}; {_qualified(cls)} "
            f'cannot register it too: give {cls.__name__} a name of its own (name = "...")'
        )
    STRATEGIES[cls.name] = cls
    return cls


def check_strategy_class(cls: object) -> None:
    """UserError unless ``cls`` is a :class:`Strategy` subclass with a name and no abstract
    method left undefined: checked when it registers, before any rank starts.

    Example:
        >>> check_strategy_class(STRATEGIES["p3"])
        >>> check_strategy_class(dict)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: dict is not a subclass of ...Strategy; derive it from ...
    """
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise UserError(
            f"{_qualified(cls)} is not a subclass of gradsync.strategies.base.Strategy; derive "
            f"it from Strategy (README: Adding a strategy), then register it"
        )
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise UserError(
            f"strategy class {_qualified(cls)} has name {name!r}; set name to what --strategy "
            'takes: letters, digits, "_" or "-" (e.g. name = "chunked")'
        )
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise UserError(
            f"strategy class {_qualified(cls)} does not define {missing}, so it cannot be "
            f"created; define {missing} (the protocol: gradsync/strategies/base.py)"
        )


def _qualified(cls: object) -> str:
    """``module.Class`` for a class (``builtins`` left out), ``repr`` for anything else."""
    if not isinstance(cls, type):
        return repr(cls)
    module = "" if cls.__module__ == "builtins" else f"{cls.__module__}."
    return module + cls.__qualname__


def load_plugins() -> None:
    """Import the modules named in ``GRADSYNC_STRATEGIES``; each registers its strategies.
    A module that does not import is a one-line UserError naming it.

    Example:
        >>> # GRADSYNC_STRATEGIES=my_strategies gradsync train --strategy chunked ...
    """
    for module in filter(None, os.environ.get(PLUGINS_VARIABLE, "").split(",")):
        try:
            importlib.import_module(module.strip())
        except UserError:  # register refused one of its classes
            raise
        except ImportError as error:
            raise UserError(
                f"{PLUGINS_VARIABLE} names module '{module}', which does not import ({error}); "
                "fix the name or PYTHONPATH"
            ) from None
        except Exception as error:  # the plugin's own code: one line, not its traceback
            raise UserError(
                f"{PLUGINS_VARIABLE} module '{module}' raised {type(error).__name__} while "
                f"importing: {error}; fix the module (python -c 'import {module.strip()}' "
                "shows the traceback)"
            ) from None


def strategy_class(name: str) -> type[Strategy]:
    """The registered strategy called ``name``, or a UserError listing the choices."""
    if name not in STRATEGIES:
        load_plugins()
    if name not in STRATEGIES and name in UNAVAILABLE:
        raise UserError(UNAVAILABLE[name])
    if name not in STRATEGIES:
        raise UserError(f"unknown strategy '{name}'; choose one of: {', '.join(STRATEGIES)}")
    check_strategy_class(STRATEGIES[name])  # one put in STRATEGIES without register
    return STRATEGIES[name]


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


def options_by_strategy() -> dict[str, type[StrategyOptions]]:
    """Every registered strategy's options class, by name: what the flags are built from.

    Example:
        >>> options_by_strategy()["p3"].__name__
        'P3Options'
    """
    return {name: cls.Options for name, cls in STRATEGIES.items()}


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
    "check_strategy_class",
    "options_by_strategy",
    "options_class",
    "register",
    "strategy_class",
    "world_size_of",
]
