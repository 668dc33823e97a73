"""Strategy options: one frozen dataclass per strategy, the single source of every option.

A strategy names its options class (``Strategy.Options``); each field carries its default,
its help text and its bounds. Everything else is generated from the fields: the command-line
flags (:func:`add_option_flags`), experiment-file keys and sweeps (:func:`options_from_mapping`),
``verify``'s ``name:key=value`` variants (:func:`options_from_texts`) and the run's
``config.json`` (:func:`dataclasses.asdict`).

Example:
    >>> @dataclass(frozen=True, kw_only=True)
    ... class Knobs(StrategyOptions):
    ...     window: int = option(4, help="messages in flight", at_least=1)
    >>> options_from_texts(Knobs, {"window": "8"})
    Knobs(window=8)
    >>> options_from_mapping(Knobs, {"window": 0})
    Traceback (most recent call last):
    gradsync.options.InvalidOption: --window must be >= 1, got 0
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gradsync.errors import UserError

TRUE_TEXTS = ("", "1", "true", "yes", "on")
FALSE_TEXTS = ("0", "false", "no", "off")


class InvalidOption(UserError):
    """A bad option value. The message names options as ``{field}`` placeholders, rendered
    as command-line flags by default and as ``strategy.field`` keys for experiment files."""

    def __init__(self, template: str, owner: type[StrategyOptions] | None = None) -> None:
        self.template = template
        self.owner = owner
        super().__init__(template.format_map(_Names(owner, key_prefix=None)))

    def as_key(self, prefix: str) -> str:
        """The message naming experiment-file keys, e.g. ``allreduce.fusion_threshold_mb``."""
        return self.template.format_map(_Names(self.owner, key_prefix=prefix))


class _Names(dict):  # type: ignore[type-arg]
    def __init__(self, owner: type[StrategyOptions] | None, key_prefix: str | None) -> None:
        super().__init__()
        self.owner, self.key_prefix = owner, key_prefix

    def __missing__(self, name: str) -> str:
        if self.key_prefix is not None:
            return f"{self.key_prefix}.{name}"
        return flag_of(_field(self.owner, name)) if self.owner else f"--{name.replace('_', '-')}"


def option(
    default: Any,
    *,
    help: str,
    flag: str | None = None,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    at_least: float | None = None,
    above: float | None = None,
    none_means: str = "automatic",
    changes_results: bool = False,
) -> Any:
    """A dataclass field of an options class: default, help, flag name and bounds;
    ``none_means`` is what ``--help`` shows for a default of None; ``changes_results`` marks
    an option that changes what training computes (not only where or when: a server count,
    a bucket size), which a resume must match."""
    metadata = dict(
        help=help,
        flag=flag,
        metavar=metavar,
        choices=choices,
        at_least=at_least,
        above=above,
        none_means=none_means,
        changes_results=changes_results,
    )
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True, kw_only=True)
class StrategyOptions:
    """Base of every options class; a strategy without options uses it as is.

    Field values are checked against their type and bounds on construction; ``check``
    adds the constraints that need the job's worker count.
    """

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if isinstance(value, list):  # JSON and TOML give lists; keep tuples (hashable)
                object.__setattr__(self, item.name, tuple(value))
            _check_field(type(self), item, getattr(self, item.name))

    def check(self, workers: int) -> None:
        """Raise :class:`InvalidOption` if these options cannot run with ``workers``."""

    def result_changing(self) -> dict[str, Any]:
        """The fields marked ``changes_results``, by name, as JSON keeps them (lists).

        Example:
            >>> @dataclass(frozen=True, kw_only=True)
            ... class Knobs(StrategyOptions):
            ...     window: int = option(4, help="messages in flight")
            ...     exact: tuple[str, ...] = option((), help="names", changes_results=True)
            >>> Knobs().result_changing()
            {'exact': []}
        """
        fields = [item for item in dataclasses.fields(self) if item.metadata.get("changes_results")]
        values = {item.name: getattr(self, item.name) for item in fields}
        return {name: list(v) if isinstance(v, tuple) else v for name, v in values.items()}

    def changed(self) -> dict[str, Any]:
        """The fields that differ from their defaults (for labels and reports)."""
        return {
            item.name: getattr(self, item.name)
            for item in dataclasses.fields(self)
            if getattr(self, item.name) != item.default
        }


# --- reading one field -----------------------------------------------------------------


def _field(cls: type[StrategyOptions] | None, name: str) -> dataclasses.Field[Any]:
    for item in dataclasses.fields(cls) if cls else ():
        if item.name == name:
            return item
    raise KeyError(name)


def flag_of(item: dataclasses.Field[Any]) -> str:
    """The command-line flag of a field: its ``flag`` metadata or ``--field-name``."""
    return item.metadata.get("flag") or f"--{item.name.replace('_', '-')}"


def flag_named(owners: Mapping[str, type[StrategyOptions]], name: str) -> str:
    """The command-line flag of option ``name``, as the first of ``owners`` that has it
    declares it (``async_updates`` → ``--async``).

    Example:
        >>> from gradsync.strategies import options_by_strategy
        >>> flag_named(options_by_strategy(), "async_updates")
        '--async'
    """
    for cls in owners.values():
        if name in field_names(cls):
            return flag_of(_field(cls, name))
    return f"--{name.replace('_', '-')}"


def kind_of(cls: type[StrategyOptions], item: dataclasses.Field[Any]) -> tuple[type, bool]:
    """(``bool``/``int``/``float``/``str``/``tuple``, optional) of a field's annotation."""
    hint = typing.get_type_hints(cls)[item.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = type(None) in typing.get_args(hint)
    base = typing.get_origin(hint) or hint
    if optional and len(args) == 1:
        base = typing.get_origin(args[0]) or args[0]
    if base not in (bool, int, float, str, tuple):
        raise TypeError(f"option {cls.__name__}.{item.name}: unsupported type {hint}")
    return base, optional


def _check_field(cls: type[StrategyOptions], item: dataclasses.Field[Any], value: Any) -> None:
    base, optional = kind_of(cls, item)
    name = "{" + item.name + "}"
    if value is None:
        if optional:
            return
        raise InvalidOption(f"{name} needs a value", cls)
    if not _has_type(value, base):
        raise InvalidOption(f"{name} must be {_type_word(base)}, got {value!r}", cls)
    if base is float and not math.isfinite(value):
        raise InvalidOption(f"{name} must be a finite number, got {value}", cls)
    meta = item.metadata
    if meta.get("choices") and value not in meta["choices"]:
        raise InvalidOption(
            f"{name}: unknown value '{value}'; choose one of: {', '.join(meta['choices'])}", cls
        )
    if meta.get("at_least") is not None and value < meta["at_least"]:
        raise InvalidOption(f"{name} must be >= {meta['at_least']:g}, got {value}", cls)
    if meta.get("above") is not None and not value > meta["above"]:
        raise InvalidOption(f"{name} must be > {meta['above']:g}, got {value}", cls)


def _has_type(value: Any, base: type) -> bool:
    if base is bool:
        return isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if base is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if base is tuple:
        return isinstance(value, tuple | list) and all(isinstance(v, str) for v in value)
    return isinstance(value, str)


def _type_word(base: type) -> str:
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return words.get(base, "a list of strings")


# --- building options from the three sources -------------------------------------------


def field_names(cls: type[StrategyOptions]) -> list[str]:
    """The option names of ``cls``, in declaration order."""
    return [item.name for item in dataclasses.fields(cls)]


def options_from_mapping(
    cls: type[StrategyOptions], values: Mapping[str, Any], *, where: str = ""
) -> StrategyOptions:
    """Options from typed values (an experiment file, config.json): types are strict.

    ``where`` (e.g. ``"experiment x.toml: p3"``) makes messages name keys instead of flags.
    """
    names = field_names(cls)
    for key in values:
        if key not in names:
            raise UserError(
                f"{where + ': ' if where else ''}unknown option '{key}'; "
                f"{'takes: ' + ', '.join(names) if names else 'this strategy takes no options'}"
            )
    floats = {name for name in names if kind_of(cls, _field(cls, name))[0] is float}
    values = {k: float(v) if k in floats and _is_number(v) else v for k, v in values.items()}
    try:
        return cls(**values)
    except InvalidOption as error:
        if not where:
            raise
        prefix, _, strategy = where.rpartition(": ")
        raise UserError(f"{prefix}: {error.as_key(strategy)}") from None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def parse_text(cls: type[StrategyOptions], name: str, text: str) -> Any:
    """One option's value from command-line text (``verify``'s ``ps:servers=2``)."""
    item = _field(cls, name)
    base, optional = kind_of(cls, item)
    if optional and text.lower() == "none":
        return None
    if base is bool:
        if text.lower() in TRUE_TEXTS:
            return True
        if text.lower() in FALSE_TEXTS:
            return False
        raise InvalidOption(f"{{{name}}} must be true or false, got '{text}'", cls)
    if base is tuple:
        return tuple(part for part in text.split(",") if part)
    try:
        return base(text)
    except ValueError:
        raise InvalidOption(f"{{{name}}} must be {_type_word(base)}, got '{text}'", cls) from None


def parse_texts(cls: type[StrategyOptions], texts: Mapping[str, str]) -> dict[str, Any]:
    """Typed values from ``key=value`` texts; keys are field or flag names (``async``)."""
    aliases = {flag_of(item)[2:].replace("-", "_"): item.name for item in dataclasses.fields(cls)}
    values = {}
    for key, text in texts.items():
        name = aliases.get(key.replace("-", "_"), key.replace("-", "_"))
        if name not in aliases.values():
            names = ", ".join(aliases) or "none"
            raise UserError(f"unknown option '{key}'; this strategy takes: {names}")
        values[name] = parse_text(cls, name, text)
    return values


def options_from_texts(cls: type[StrategyOptions], texts: Mapping[str, str]) -> StrategyOptions:
    """Options from ``key=value`` texts (see :func:`parse_texts`)."""
    return cls(**parse_texts(cls, texts))


# --- command-line flags ------------------------------------------------------------------

FLAG_PREFIX = "option_"


def add_option_flags(
    parser: argparse.ArgumentParser, owners: Mapping[str, type[StrategyOptions]]
) -> None:
    """One flag per option name over every strategy in ``owners`` (name → options class).

    Options of the same name in several strategies (``servers``) share one flag; its help
    says which strategies take it. Every flag defaults to None, meaning "not given".
    """
    group = parser.add_argument_group("strategy options (each applies to the strategies named)")
    for name, (cls, item), users in _option_index(owners):
        base, _ = kind_of(cls, item)
        meta = item.metadata
        defaults = _defaults_text(owners, users, name)
        help_text = f"{meta['help']} [{', '.join(users)}; default {defaults}]"
        kwargs: dict[str, Any] = dict(dest=FLAG_PREFIX + name, default=None, help=help_text)
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif base is tuple:
            kwargs.update(action="append", metavar=meta.get("metavar") or "TEXT")
        else:
            kwargs.update(type=_flag_parser(cls, name), metavar=meta.get("metavar") or name.upper())
            if meta.get("choices"):
                kwargs["metavar"] = meta.get("metavar") or "|".join(meta["choices"])
        group.add_argument(flag_of(item), **kwargs)


def _option_index(
    owners: Mapping[str, type[StrategyOptions]],
) -> Iterable[tuple[str, tuple[type[StrategyOptions], dataclasses.Field[Any]], list[str]]]:
    first: dict[str, tuple[type[StrategyOptions], dataclasses.Field[Any]]] = {}
    users: dict[str, list[str]] = {}
    for strategy, cls in owners.items():
        for item in dataclasses.fields(cls):
            if item.name in first and kind_of(*first[item.name]) != kind_of(cls, item):
                raise TypeError(f"option '{item.name}' has two types across strategies")
            first.setdefault(item.name, (cls, item))
            users.setdefault(item.name, []).append(strategy)
    return [(name, first[name], users[name]) for name in first]


def _defaults_text(owners: Mapping[str, type[StrategyOptions]], users: list[str], name: str) -> str:
    """The default of option ``name``; where its strategies differ, each one's after the first's
    (``4; horovod: 128``)."""
    texts = {user: _default_text(_field(owners[user], name)) for user in users}
    first = texts[users[0]]
    others = [f"{user}: {text}" for user, text in texts.items() if text != first]
    return "; ".join([first, *others])


def _default_text(item: dataclasses.Field[Any]) -> str:
    default = item.default
    if default is None:
        return item.metadata.get("none_means", "automatic")
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, tuple):
        return "none" if not default else ",".join(default)
    return f"{default:g}" if isinstance(default, float) else str(default)


def _flag_parser(cls: type[StrategyOptions], name: str) -> Any:
    def parse(text: str) -> Any:
        try:
            value = parse_text(cls, name, text)
            _check_field(cls, _field(cls, name), value)
            return value
        except UserError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The strategy options given on the command line, by field name."""
    return {
        key[len(FLAG_PREFIX) :]: tuple(value) if isinstance(value, list) else value
        for key, value in vars(args).items()
        if key.startswith(FLAG_PREFIX) and value is not None
    }


def options_for(
    strategy: str, owners: Mapping[str, type[StrategyOptions]], given: Mapping[str, Any]
) -> StrategyOptions:
    """``strategy``'s options from command-line values; a value it does not take is an
    error naming the flag and the strategies that take it."""
    cls = owners[strategy]
    names = field_names(cls)
    for name, (_, item), users in _option_index(owners):
        if name in given and name not in names:
            raise UserError(
                f"{flag_of(item)} applies to --strategy {' or '.join(users)}, not '{strategy}'; "
                f"drop it or pick one of those strategies"
            )
    return cls(**{key: value for key, value in given.items() if key in names})
