"""TOML files read key by key: `bench` experiments, `predict --experiment` and `--validate`.

:func:`read_toml` reads one; :class:`TomlKeys` hands out its values, each with the one type
its key takes. A value of another type (``workers = "2"`` where a whole number is meant) is a
one-line UserError naming the file, the key, what it takes and an example, before anything
runs; never a traceback from deep inside.

Example:
    >>> keys = TomlKeys({"steps": 10, "recommend": True}, Path("plan.toml"))
    >>> keys.count("steps"), keys.flag("recommend"), keys.count("hosts", default=2)
    (10, True, 2)
    >>> TomlKeys({"steps": "10"}, Path("plan.toml")).count("steps")
    Traceback (most recent call last):
    ...
    gradsync.errors.UserError: plan.toml: steps = "10" is not a whole number of at least 1; ...
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradsync.errors import UserError

_REQUIRED: Any = object()  # the default of a key the file must have
Check = Callable[[Any], bool]


def read_toml(
    path: Path,
    flag: str,
    keys: AbstractSet[str],
    *,
    example: str,
    also: AbstractSet[str] = frozenset(),
) -> dict[str, Any]:
    """The TOML file behind ``flag``, with only ``keys`` (and ``also``, keys the caller
    refuses with a message of its own); any problem is a UserError."""
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder; pass a TOML file such as {example}")
    if not path.is_file():
        raise UserError(f"{flag} {path} does not exist; pass a TOML file such as {example}")
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise UserError(
            f"{path} is not valid TOML ({error}); pass a file such as {example}"
        ) from None
    if unknown := sorted(set(raw) - keys - also):
        raise UserError(f"{path}: unknown key '{unknown[0]}'; allowed: {', '.join(sorted(keys))}")
    return raw


@dataclass(frozen=True)
class TomlKeys:
    """The keys of one TOML table of ``path`` (``table`` names a nested one in messages,
    e.g. ``[[model]] 2``), each read as its one type. An absent key gives the ``default``
    passed (an error where there is none)."""

    raw: Mapping[str, Any]
    path: Path
    table: str = ""

    def __contains__(self, key: str) -> bool:
        return key in self.raw

    def text(self, key: str, default: Any = _REQUIRED, *, example: str = '"..."') -> str:
        """A string."""
        return self._get(key, default, _is(str), "a string", f"{key} = {example}")

    def flag(self, key: str, default: Any = _REQUIRED) -> bool:
        """``true`` or ``false``."""
        return self._get(key, default, _is(bool), "true or false (no quotes)", f"{key} = true")

    def count(self, key: str, default: Any = _REQUIRED) -> int:
        """A whole number of at least 1."""
        return self._get(key, default, _is_count, "a whole number of at least 1", f"{key} = 2")

    def whole(self, key: str, default: Any = _REQUIRED) -> int:
        """A whole number of at least 0."""
        return self._get(key, default, _is_whole, "a whole number of at least 0", f"{key} = 0")

    def positive(self, key: str, default: Any = _REQUIRED, *, example: str = "0.1") -> float:
        """A finite number above 0, as a float."""
        expected = "a finite number above 0"
        return float(self._get(key, default, _is_positive, expected, f"{key} = {example}"))

    def texts(
        self, key: str, default: Any = _REQUIRED, *, example: str, empty: bool = True
    ) -> tuple[str, ...]:
        """A list of strings (``empty`` False: at least one)."""
        expected = "a list of strings" if empty else "a non-empty list of strings"
        value = self._get(key, default, _list_of(str, empty), expected, f"{key} = {example}")
        return tuple(value) if isinstance(value, list) else value

    def counts(self, key: str, default: Any = _REQUIRED, *, example: str) -> tuple[int, ...]:
        """A non-empty list of whole numbers of at least 1."""
        value = self._get(
            key,
            default,
            _list_of(int, empty=False),
            "a non-empty list of whole numbers of at least 1",
            f"{key} = {example}",
        )
        return tuple(value) if isinstance(value, list) else value

    def comma_list(self, key: str, item: type, *, example: str) -> str:
        """A list of ``item`` values, or the comma-separated string its flag takes; given as
        that string (which the flag's own parser then reads)."""
        kind = "whole numbers" if item is int else "strings"
        fits = _list_of(item)
        value = self._get(
            key,
            _REQUIRED,
            lambda v: isinstance(v, str) or fits(v),
            f"a list of {kind} (or one comma-separated string)",
            f"{key} = {example}",
        )
        return value if isinstance(value, str) else ",".join(map(str, value))

    def text_table(self, key: str, *, example: str, numbers: bool = False) -> dict[str, str]:
        """A table of strings (``numbers``: numbers and booleans too, as strings)."""
        kinds = (str, int, float) if numbers else (str,)
        value = self._get(
            key,
            {},
            lambda v: isinstance(v, dict) and all(isinstance(x, kinds) for x in v.values()),
            "a table of strings",
            f"{key} = {example}",
        )
        return {
            name: str(v).lower() if isinstance(v, bool) else str(v) for name, v in value.items()
        }

    def tables(self, key: str, *, example: str) -> list[TomlKeys]:
        """An array of tables (``[[key]]`` sections), each as its own :class:`TomlKeys`."""
        value = self._get(key, [], _list_of(dict), f"[[{key}]] tables", example)
        return [TomlKeys(entry, self.path, f"[[{key}]] {i + 1}") for i, entry in enumerate(value)]

    def _get(self, key: str, default: Any, fits: Check, expected: str, example: str) -> Any:
        """``key``'s value where ``fits(value)``; ``default`` where absent; else a one-line
        UserError saying what the key takes (``expected``), with ``example``."""
        where = f"{self.path}: {self.table + ' ' if self.table else ''}{key}"
        if key not in self.raw:
            if default is _REQUIRED:
                raise UserError(f"{where} is missing; add e.g. {example}")
            return default
        value = self.raw[key]
        if not fits(value):
            shown = json.dumps(value, default=str)  # as TOML writes it: true, "8", [1, "2"]
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise UserError(f"{where} = {shown} is not {expected}; write e.g. {example}")
        return value


def _is(kind: type) -> Check:
    return lambda value: isinstance(value, kind)


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_count(value: Any) -> bool:
    return _is_whole(value) and value >= 1


def _is_positive(value: Any) -> bool:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and 0 < value < math.inf


def _list_of(item: type, empty: bool = True) -> Check:
    """Whether a value is a list of ``item`` values (a bool is no whole number here), and
    not empty unless ``empty``."""
    fits = _is_count if item is int else _is(item)
    return lambda value: (
        isinstance(value, list) and (empty or bool(value)) and all(fits(v) for v in value)
    )


__all__ = ["TomlKeys", "read_toml"]
