"""What a model is to gradsync: a ``Workload`` (module, dataset, loss) built from a preset.

Model files import nothing distributed; distribution is applied afterwards by a strategy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor, nn

from gradsync.data.base import Dataset
from gradsync.errors import UserError

PRESETS = ("tiny", "default", "paper")


class LossFn(Protocol):
    """``loss(output, targets)`` -> scalar mean over the samples of the shard."""

    def __call__(self, output: Any, targets: Tensor, /) -> Tensor: ...


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A model with its data and loss, ready to train.

    ``global_batch`` is the preset's default global batch size. ``loss`` must be a mean over
    samples so that averaging equal shards' gradients equals the global-batch gradient.
    A classifier may carry ``validation`` (``num_validation`` held-out samples, read as one
    global batch of step 0) for validation accuracy; ``num_train_samples`` is the size of a
    real training set (for iterations per epoch), None for synthetic data.
    """

    model: nn.Module
    dataset: Dataset
    loss: LossFn
    global_batch: int
    description: str = ""
    validation: Dataset | None = None
    num_validation: int = 0
    num_train_samples: int | None = None


@dataclass(frozen=True, kw_only=True)
class BuildRequest:
    """Everything a model's build function may use."""

    preset: str = "default"
    seed: int = 0
    data: str | None = None
    dropout: bool = True
    options: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One registry entry: ``name`` → ``build(request) -> Workload``.

    ``options`` is a dataclass type for ``--model-option KEY=VALUE`` (or None);
    ``presets`` maps each preset's name to its configuration, which has a ``global_batch``.
    """

    name: str
    summary: str
    build: Callable[[BuildRequest], Workload]
    options: type | None = None
    presets: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def parse_options(options_type: type | None, raw: Mapping[str, str], model: str) -> Any:
    """Turn ``{"sparse": "true"}`` into an ``options_type`` instance, with clear errors.

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Opts:
        ...     sparse: bool = False
        ...     sampled: int = 0
        >>> parse_options(Opts, {"sparse": "yes", "sampled": "64"}, "m")
        Opts(sparse=True, sampled=64)
    """
    if options_type is None:
        if raw:
            raise UserError(f"model '{model}' takes no --model-option (got {', '.join(raw)})")
        return None
    fields = {f.name: f for f in dataclasses.fields(options_type)}
    values: dict[str, Any] = {}
    for key, text in raw.items():
        name = key.replace("-", "_")
        if name not in fields:
            raise UserError(
                f"unknown --model-option '{key}' for model '{model}'; "
                f"allowed: {', '.join(sorted(fields))}"
            )
        values[name] = _convert(text, fields[name].type, key)
    return options_type(**values)


def _convert(text: str, annotation: Any, key: str) -> Any:
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    try:
        if kind == "bool":
            lowered = text.lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(text)
            return lowered in ("1", "true", "yes", "on")
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
    except ValueError:
        raise UserError(f"--model-option {key}={text!r} is not a valid {kind}") from None
    return text


def check_preset(preset: str, model: str) -> None:
    if preset not in PRESETS:
        raise UserError(
            f"unknown preset '{preset}' for model '{model}'; choose one of: {', '.join(PRESETS)}"
        )
