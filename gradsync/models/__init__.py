"""Model registry: one file per published model, one line here per model.

Example:
    >>> from gradsync.models import build_workload
    >>> workload = build_workload("mnist-cnn", preset="tiny")
    >>> workload.global_batch
    8
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from gradsync.errors import UserError
from gradsync.models import (
    inception_v3,
    lstm_lm,
    mnist_cnn,
    resnet,
    resnet50,
    sockeye,
    transformer,
    vgg,
    vgg19,
)
from gradsync.models.base import BuildRequest, ModelSpec, Workload, check_preset, parse_options
from gradsync.models.user import DEFAULT_USER_GLOBAL_BATCH, build_user_workload, is_user_model

if TYPE_CHECKING:
    from gradsync.config import TrainConfig

DEFAULT_MODEL = "transformer"

REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        transformer.SPEC,
        lstm_lm.SPEC,
        resnet.SPEC,
        vgg.SPEC,
        mnist_cnn.SPEC,
        resnet50.SPEC,
        inception_v3.SPEC,
        vgg19.SPEC,
        sockeye.SPEC,
    )
}


def model_spec(name: str) -> ModelSpec:
    """The registered spec called ``name``, or a UserError listing the choices."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise UserError(
            f"unknown model '{name}'; choose one of: {', '.join(REGISTRY)}, "
            "or a user model as path/to/file.py:build or package.module:build"
        ) from None


def check_model(
    name: str, preset: str = "default", options: Mapping[str, str] | None = None
) -> None:
    """Fail early (UserError) on an unknown model, preset or model option."""
    request = BuildRequest(preset=preset, options=dict(options or {}))
    if is_user_model(name):
        build_user_workload(name, request, load_only=True)
    else:
        spec = model_spec(name)
        check_preset(preset, name)
        parse_options(spec.options, request.options, name)


def default_global_batch(name: str, preset: str) -> int | None:
    """The global batch a run of ``name`` at ``preset`` takes when ``--global-batch`` is left
    out, known without building the model; None for an unknown model or preset.

    Example:
        >>> default_global_batch("mnist-cnn", "tiny"), default_global_batch("nope", "tiny")
        (8, None)
    """
    if is_user_model(name):
        return DEFAULT_USER_GLOBAL_BATCH
    config = REGISTRY[name].presets.get(preset) if name in REGISTRY else None
    return None if config is None else config.global_batch


def resolved_options(name: str, options: Mapping[str, str]) -> dict[str, Any]:
    """A registered model's ``--model-option`` values as it reads them: parsed, defaults
    filled. A user model's options, which gradsync cannot parse, as written.

    Example:
        >>> resolved_options("lstm-lm", {"sparse": "yes"})["sparse"]
        True
    """
    if is_user_model(name) or name not in REGISTRY:
        return dict(options)
    try:
        parsed = parse_options(REGISTRY[name].options, options, name)
    except UserError:
        return dict(options)
    return {} if parsed is None else dataclasses.asdict(parsed)


def same_options(name: str, first: Mapping[str, str], second: Mapping[str, str]) -> bool:
    """Whether two ``--model-option`` sets build the same model: a value written another
    way (``sparse=yes``) or equal to its default counts as the same.

    Example:
        >>> same_options("lstm-lm", {"sparse": "yes"}, {"sparse": "true"})
        True
        >>> same_options("lstm-lm", {"sparse": "false"}, {})
        True
        >>> same_options("lstm-lm", {"sparse": "true"}, {})
        False
    """
    return resolved_options(name, first) == resolved_options(name, second)


def build_workload(
    name: str,
    *,
    preset: str = "default",
    seed: int = 0,
    data: str | None = None,
    dropout: bool = True,
    options: Mapping[str, str] | None = None,
) -> Workload:
    """Build model, dataset and loss for ``name`` (registered or ``file.py:fn``/``pkg.mod:fn``)."""
    request = BuildRequest(
        preset=preset, seed=seed, data=data, dropout=dropout, options=dict(options or {})
    )
    if is_user_model(name):
        workload = build_user_workload(name, request)
    else:
        check_preset(preset, name)
        workload = model_spec(name).build(request)
    if (data is not None or is_user_model(name)) and workload.num_train_samples is None:
        # a real training set read by index (CIFAR-10, PTB, an image folder, a user's
        # dataset): its size gives the iterations per epoch
        size = getattr(workload.dataset, "num_samples", None)
        workload = dataclasses.replace(workload, num_train_samples=size)
    return workload


# The workloads of the checks in progress (see shared_workloads), by what builds them.
_shared: dict[tuple[object, ...], Workload] | None = None


@contextlib.contextmanager
def shared_workloads() -> Iterator[None]:
    """Within this block :func:`workload_of` builds each distinct workload once and hands
    the same one to every check: the launcher's validation, the strategies' ``check_config``
    and a resume's settings read it, none trains it. It is dropped at the end, so no model
    outlives the checks (a launcher would otherwise hold a vgg16 through a whole sweep).

    Example:
        >>> from gradsync.config import TrainConfig
        >>> config = TrainConfig(model="mnist-cnn", preset="tiny")
        >>> with shared_workloads():
        ...     workload_of(config) is workload_of(config)
        True
        >>> workload_of(config) is workload_of(config)
        False
    """
    global _shared
    outer = _shared
    _shared = {} if outer is None else outer
    try:
        yield
    finally:
        _shared = outer


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set to ``dtype`` inside the block, as a rank of a run with
    ``--dtype`` has it while it builds the model.

    Example:
        >>> with default_dtype(torch.float64):
        ...     torch.zeros(1).dtype
        torch.float64
    """
    outer = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(outer)


def workload_of(config: TrainConfig, *, dropout: bool = False) -> Workload:
    """The workload a run's config names (model, preset, seed, data, options); dropout off
    unless asked, as the launcher's checks want it. Inside :func:`shared_workloads`, one
    build per distinct workload.

    Example:
        >>> from gradsync.config import TrainConfig
        >>> workload_of(TrainConfig(model="mnist-cnn", preset="tiny")).global_batch
        8
    """
    options = config.model_options
    key = (config.model, config.preset, config.seed, config.data, dropout, config.dtype)
    key += tuple(sorted(options.items()))
    if _shared is not None and key in _shared:
        return _shared[key]
    with default_dtype(getattr(torch, config.dtype)):  # as the ranks build it
        workload = build_workload(
            config.model,
            preset=config.preset,
            seed=config.seed,
            data=config.data,
            dropout=dropout,
            options=options,
        )
    if _shared is not None:
        _shared[key] = workload
    return workload


def steps_for_epochs(config: TrainConfig, epochs: float) -> int:
    """The steps that pass ``epochs`` times over ``config``'s training set at its global
    batch (the last step may go into the next epoch); a UserError for synthetic data,
    which has no epochs.

    Example:
        >>> from gradsync.config import TrainConfig
        >>> steps_for_epochs(TrainConfig(model="mnist-cnn", data="sklearn:digits"), 2)
        29
    """
    options = tuple(sorted(config.model_options.items()))
    samples, preset_batch = _epoch_shape(
        config.model, config.preset, config.seed, config.data, options
    )
    if samples is None:
        raise UserError(
            f"epochs need a real training set, and {config.model} trains on synthetic data "
            "(no epochs: every step draws new samples); pass --data, or give steps instead"
        )
    global_batch = config.global_batch or preset_batch
    return max(1, math.ceil(epochs * samples / global_batch))


@functools.lru_cache(maxsize=32)
def _epoch_shape(
    model: str, preset: str, seed: int, data: str | None, options: tuple[tuple[str, str], ...]
) -> tuple[int | None, int]:
    """A workload's training-set size and default global batch. Its build reads the data,
    and a sweep asks for every cell, for each report: built once, kept as two numbers."""
    from gradsync.config import TrainConfig

    config = TrainConfig(
        model=model, preset=preset, seed=seed, data=data, model_options=dict(options)
    )
    workload = workload_of(config)
    return workload.num_train_samples, workload.global_batch


__all__ = [
    "DEFAULT_MODEL",
    "REGISTRY",
    "BuildRequest",
    "ModelSpec",
    "Workload",
    "build_workload",
    "check_model",
    "default_global_batch",
    "model_spec",
    "resolved_options",
    "same_options",
    "shared_workloads",
    "steps_for_epochs",
    "workload_of",
]
