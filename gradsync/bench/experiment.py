"""Experiment files (TOML): which matrix of jobs to run, validated key by key.

Example file::

    name = "horovod-synthetic"
    models = ["vgg16", "resnet56"]
    strategies = ["allreduce", "ddp", "ps"]
    workers = [1, 2, 4]
    steps = 30
    repeats = 3

    [sweep]                                   # any strategy option, one column each
    allreduce.fusion_threshold_mb = [1, 4, 25, 64]

Every key is listed in :data:`KEYS` with what it holds; a cell of the matrix is one job.
Strategy options are the fields of each strategy's ``Options`` (``gradsync train --help``
lists them): ``[options.STRATEGY]`` fixes them, ``[sweep.STRATEGY]`` lists values to sweep.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradsync.config import LR_SCALINGS, OPTIMIZERS
from gradsync.errors import UserError
from gradsync.models import check_model
from gradsync.netem import parse_shaped_rate
from gradsync.options import StrategyOptions, field_names, options_from_mapping
from gradsync.strategies import STRATEGIES, UNAVAILABLE, options_class
from gradsync.toml_keys import TomlKeys, read_toml

# Bounds (issue 12): a typo such as repeats = 1000000000 is refused before any allocation.
MAX_REPEATS = 1_000
MAX_STEPS = 1_000_000
MAX_WORKERS = 1_024
MAX_CELLS = 10_000
RENAMED = {"warmup_steps": "measure_warmup"}
# Settings bench holds equal in every cell (see gradsync.bench.equal): not keys of a file.
FIXED = {"deterministic": "dropout", "dropout": "dropout", "batchnorm": "BatchNorm mode"}
EXAMPLE = "experiments/horovod-synthetic.toml"
# The keys that hold lists, with an example of each (strings or whole numbers ≥ 1).
LIST_KEYS: dict[str, list[Any]] = {
    "models": ["transformer"],
    "strategies": ["ddp", "allreduce"],
    "lr_scaling": ["none", "linear"],
    "bandwidths": ["1gbit", "100mbit"],
    "workers": [1, 2, 4],
    "servers": [1, 2],
    "global_batch": [32, 64],
    "batch_per_worker": [16, 32],
    "threads": [1, 2],
    "interop_threads": [1],
}
KEYS: dict[str, str] = {
    "name": "experiment name (string)",
    "description": "what the experiment asks (string)",
    "models": "registered models or FILE.py:FN (list of strings)",
    "preset": "tiny | default | paper",
    "model_options": "per model: table of KEY = VALUE strings",
    "data": "path of real data (string)",
    "strategies": "registered strategies (list)",
    "workers": "worker counts (list of positive integers)",
    "servers": "server counts, swept for every strategy that takes servers (list)",
    "options": "per strategy: fixed options, e.g. [options.p3] slice_size = 20000",
    "sweep": "per strategy: option values to sweep, e.g. [sweep.p3] slice_size = [10000, 40000]",
    "global_batch": "global batch sizes (list of positive integers)",
    "batch_per_worker": "per-worker batch sizes; global batch = this × workers (list)",
    "threads": "intra-op threads per rank (list of positive integers)",
    "interop_threads": "inter-op threads per rank (list of positive integers)",
    "bandwidths": 'emulated link rates, e.g. "1gbit" (list; needs root for namespaces)',
    "hosts": "emulated hosts when bandwidths are set (positive integer, default 2)",
    "lr_scaling": "learning-rate scaling rules: none | linear | sqrt (list)",
    "optimizer": "sgd | adam",
    "lr": "learning rate (number)",
    "lr_warmup_steps": "linear learning-rate warm-up steps (integer)",
    "lr_base_batch": (
        "the global batch lr was tuned for, that the lr_scaling rules scale from (positive "
        "integer; default: the preset's batch)"
    ),
    "steps": f"steps per job (positive integer, at most {MAX_STEPS:,})",
    "epochs": (
        "passes over the real training set per job, instead of steps: each cell's steps "
        "follow from its global batch (number above 0)"
    ),
    "measure_warmup": "steps left out of throughput (integer; default 10%, at least 5)",
    "repeats": f"repeats of every cell (positive integer, at most {MAX_REPEATS})",
    "seed": "seed (integer)",
    "verify": "compare every cell with a single-process reference (true/false)",
    "published_gain": (
        "a paper's throughput gain of one strategy over another, to set beside the measured "
        "one: table with strategy, baseline, source and MODEL = gain (0.25 = +25%)"
    ),
}


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One job of the matrix."""

    model: str
    strategy: str
    workers: int
    options: tuple[tuple[str, Any], ...] = ()  # the strategy's options that are set
    global_batch: int | None = None
    threads: int | None = None
    interop_threads: int | None = None
    bandwidth: str | None = None
    lr_scaling: str = "none"
    repeat: int = 0
    role: str = "measure"  # measure | reference | reference-rerun

    @property
    def id(self) -> str:
        """A stable, filesystem-safe name: the resume key and the run folder."""
        parts = [
            self.role,
            self.model.replace("/", "_").replace(":", "_"),
            self.strategy,
            f"w{self.workers}",
        ]
        parts += [f"{key}{value}" for key, value in self.options]
        for label, value in (
            ("b", self.global_batch),
            ("t", self.threads),
            ("i", self.interop_threads),
            ("bw", self.bandwidth),
        ):
            if value is not None:
                parts.append(f"{label}{value}")
        if self.lr_scaling != "none":
            parts.append(self.lr_scaling)
        parts.append(f"r{self.repeat}")
        return "-".join(parts)

    def option(self, name: str) -> Any:
        """The value of strategy option ``name`` in this cell, or None when not set."""
        return dict(self.options).get(name)

    def group(self) -> tuple[Any, ...]:
        """Cells that differ only by repeat belong together."""
        return (
            self.model,
            self.strategy,
            self.workers,
            self.options,
            self.global_batch,
            self.threads,
            self.interop_threads,
            self.bandwidth,
            self.lr_scaling,
            self.role,
        )


@dataclass(frozen=True, kw_only=True)
class PublishedGain:
    """A paper's gain of ``strategy`` over ``baseline`` per model (0.25 = 25% more samples/s).

    Models the paper reports without a quotable figure may be left out of ``gains``.
    """

    strategy: str
    baseline: str
    source: str
    gains: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Experiment:
    """A parsed, validated experiment file."""

    name: str
    path: str
    description: str = ""
    models: list[str] = field(default_factory=lambda: ["transformer"])
    preset: str = "default"
    model_options: dict[str, dict[str, str]] = field(default_factory=dict)
    data: str | None = None
    strategies: list[str] = field(default_factory=lambda: ["ddp", "allreduce"])
    workers: list[int] = field(default_factory=lambda: [2])
    servers: list[int] | None = None
    options: dict[str, dict[str, list[Any]]] = field(default_factory=dict)
    global_batch: list[int | None] = field(default_factory=lambda: [None])
    batch_per_worker: list[int] | None = None
    threads: list[int | None] = field(default_factory=lambda: [None])
    interop_threads: list[int | None] = field(default_factory=lambda: [None])
    bandwidths: list[str | None] = field(default_factory=lambda: [None])
    hosts: int = 2
    lr_scaling: list[str] = field(default_factory=lambda: ["none"])
    optimizer: str = "sgd"
    lr: float | None = None
    lr_warmup_steps: int = 0
    lr_base_batch: int | None = None
    steps: int = 30
    epochs: float | None = None
    measure_warmup: int | None = None
    repeats: int = 1
    seed: int = 0
    verify: bool = False
    published_gain: PublishedGain | None = None

    @property
    def length(self) -> str:
        """How long every job trains, in the experiment's own terms ("30 steps", "2 epochs")."""
        return f"{self.steps} steps" if self.epochs is None else f"{self.epochs:g} epochs"

    def cells(self) -> list[Cell]:
        """The matrix, reference cells first (so correctness is known as early as possible)."""
        measured: list[Cell] = []
        for (
            repeat,
            model,
            strategy,
            workers,
            batch,
            threads,
            interop,
            bandwidth,
            scaling,
        ) in itertools.product(
            range(self.repeats),
            self.models,
            self.strategies,
            self.workers,
            self.batch_per_worker or self.global_batch,
            self.threads,
            self.interop_threads,
            self.bandwidths,
            self.lr_scaling,
        ):
            if strategy == "single" and workers != 1:
                continue
            if self.batch_per_worker:
                batch = batch * workers  # type: ignore[operator]
            for options in self.option_values(strategy):
                measured.append(
                    Cell(
                        model=model,
                        strategy=strategy,
                        workers=workers,
                        options=options,
                        global_batch=batch,
                        threads=threads,
                        interop_threads=interop,
                        bandwidth=bandwidth,
                        lr_scaling=scaling,
                        repeat=repeat,
                    )
                )
        references: list[Cell] = []
        if self.verify:
            keys = dict.fromkeys((c.model, c.global_batch, c.lr_scaling) for c in measured)
            for model, batch, scaling in keys:
                common = dict(
                    model=model,
                    strategy="single",
                    workers=1,
                    global_batch=batch,
                    lr_scaling=scaling,
                )
                references.append(Cell(**common, role="reference"))
                references.append(Cell(**common, threads=1, role="reference-rerun"))
        return references + measured

    def option_values(self, strategy: str) -> list[tuple[tuple[str, Any], ...]]:
        """Every combination of ``strategy``'s fixed and swept options (one empty one if none)."""
        values = dict(self.options.get(strategy, {}))
        if self.servers is not None and "servers" in field_names(options_class(strategy)):
            values.setdefault("servers", self.servers)
        names = sorted(values)
        combos = itertools.product(*(values[name] for name in names))
        return [tuple(zip(names, combo, strict=True)) for combo in combos]

    def swept_options(self) -> list[str]:
        """Option names that take more than one value in some strategy (report columns)."""
        names = {
            name for values in self.options.values() for name, v in values.items() if len(v) > 1
        }
        if self.servers is not None and len(self.servers) > 1:
            names.add("servers")
        return sorted(names)


def load_experiment(path: str | Path) -> Experiment:
    """Read and validate an experiment file; every problem is a one-line UserError."""
    path = Path(path)
    # Keys refused below with a message of their own pass read_toml's check of unknown keys.
    raw = read_toml(
        path, "experiment", set(KEYS), example=EXAMPLE, also={*RENAMED, *FIXED, "model"}
    )
    where = f"experiment {path}"
    for key in raw:
        if key in RENAMED:
            raise UserError(f"{where}: key '{key}' is now '{RENAMED[key]}'; rename it")
        if key in FIXED:
            raise UserError(
                f"{where}: key '{key}' cannot be set: every bench cell runs with dropout off "
                "and BatchNorm over the global batch, so cells compare like with like and with "
                f"single; to measure another {FIXED[key]}, run gradsync train with "
                "--batchnorm local or without --deterministic for each strategy"
            )
    if "model" in raw:
        raise UserError(f"{where}: unknown key 'model'; use models = [\"...\"]")
    if "models" not in raw:
        raise UserError(
            f'{where}: names no models; add e.g. models = ["transformer"] '
            "(strategies default to ddp and allreduce)"
        )
    if raw.get("data") == "":
        raise UserError(f'{where}: data = "" names no path; give the data\'s path or leave it out')
    if "data" in raw and not isinstance(raw["data"], str):
        raise UserError(
            f"{where}: data must be one path (a string), got {raw['data']!r}: every cell "
            "trains on the same data so their throughputs compare; run one experiment per "
            "data set"
        )
    keys = TomlKeys(raw, path)
    values: dict[str, Any] = {"name": keys.text("name", path.stem), "path": str(path)}
    for key, example in LIST_KEYS.items():
        if key not in keys:
            continue
        if isinstance(example[0], str):
            values[key] = list(keys.texts(key, example=json.dumps(example), empty=False))
        else:
            values[key] = list(keys.counts(key, example=json.dumps(example)))
        if twice := sorted({v for v in values[key] if values[key].count(v) > 1}, key=str):
            raise UserError(
                f"{where}: {key} lists {twice[0]!r} twice; its cells would share one folder "
                "and one result; list each value once (use repeats to run a cell again)"
            )
    for rate in values.get("bandwidths", ()):
        parse_shaped_rate(rate, f"{where}: bandwidths entry")  # refused here, not by a cell's job
    for key in ("steps", "repeats", "hosts", "lr_base_batch"):
        if key in keys:
            values[key] = keys.count(key)
    for key in ("measure_warmup", "lr_warmup_steps", "seed"):
        if key in keys:
            values[key] = keys.whole(key)
    for key in ("description", "preset", "data", "optimizer"):
        if key in keys:
            values[key] = keys.text(key)
    if "lr" in keys:
        values["lr"] = keys.positive("lr")
    if "epochs" in keys:
        if "steps" in keys:
            raise UserError(f"{where}: steps and epochs both set the length of every job; keep one")
        values["epochs"] = keys.positive("epochs", example="2")
    if "verify" in keys:
        values["verify"] = keys.flag("verify")
    if "model_options" in raw:
        values["model_options"] = _model_options(raw["model_options"], where)
    if "published_gain" in raw:
        values["published_gain"] = _published_gain(raw["published_gain"], where)
    values["options"] = _strategy_options(raw.get("options", {}), raw.get("sweep", {}), where)
    if "batch_per_worker" in values and "global_batch" in values:
        raise UserError(f"{where}: give global_batch or batch_per_worker, not both")
    experiment = Experiment(**values)
    _check_names(experiment, where)
    _check_option_tables(raw, experiment.strategies, where)
    check_bounds(experiment, where)  # by arithmetic, before the matrix is built
    if not experiment.cells():
        raise UserError(
            f"{where}: the matrix has no cells: single runs only with 1 worker, and workers = "
            f"{experiment.workers}; add 1 to workers or another strategy to strategies"
        )
    check_steps_and_batches(experiment, where)
    return experiment


def check_steps_and_batches(experiment: Experiment, where: str) -> None:
    """UserError, naming the file's keys, for what every cell's job would refuse naming
    ``train``'s flags: warm-up steps that leave none to measure, a global batch that does
    not divide by a cell's workers.

    Example:
        >>> check_steps_and_batches(Experiment(name="x", path="x.toml", steps=4,
        ...                                    measure_warmup=4), "x.toml")
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: x.toml: measure_warmup = 4 leaves none of steps = 4 to ...
    """
    warmup, steps = experiment.measure_warmup, experiment.steps
    if warmup is not None and warmup >= steps and experiment.epochs is None:
        raise UserError(
            f"{where}: measure_warmup = {warmup} leaves none of steps = {steps} to measure; "
            "lower measure_warmup or raise steps"
        )
    for cell in experiment.cells():
        batch = cell.global_batch
        if batch is not None and batch % cell.workers:
            lcm = math.lcm(*experiment.workers)
            raise UserError(
                f"{where}: global_batch {batch} does not divide by workers {cell.workers} "
                f"(each worker takes an equal share); list multiples of every worker count, "
                f"e.g. {lcm * math.ceil(batch / lcm)}, or use batch_per_worker"
            )


def check_bounds(experiment: Experiment, where: str) -> None:
    """UserError when repeats, steps, workers or the number of cells exceed their limits.

    The cell count is computed by arithmetic, so the check itself allocates nothing.

    Example:
        >>> check_bounds(Experiment(name="x", path="x.toml", repeats=10**9), "x.toml")
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: x.toml: repeats = 1000000000 exceeds the limit of 1000 ...
    """
    for key, value, limit in (
        ("repeats", experiment.repeats, MAX_REPEATS),
        ("steps", experiment.steps, MAX_STEPS),
        ("workers", max(experiment.workers), MAX_WORKERS),
    ):
        if value > limit:
            raise UserError(
                f"{where}: {key} = {value} exceeds the limit of {limit} (every value is one "
                f"job or step run for real); lower {key}"
            )
    batches = experiment.batch_per_worker or experiment.global_batch
    cells = experiment.repeats * math.prod(
        len(axis)
        for axis in (
            experiment.models,
            experiment.strategies,
            experiment.workers,
            batches,
            experiment.threads,
            experiment.interop_threads,
            experiment.bandwidths,
            experiment.lr_scaling,
            experiment.servers or [None],
            *(values for options in experiment.options.values() for values in options.values()),
        )
    )
    if cells > MAX_CELLS:
        raise UserError(
            f"{where}: the matrix has up to {cells:,} cells (repeats {experiment.repeats} × the "
            f"lists' lengths), more than the limit of {MAX_CELLS:,}; shorten the lists or repeats"
        )


def _strategy_options(fixed: Any, sweep: Any, where: str) -> dict[str, dict[str, list[Any]]]:
    """``[options.S]`` (one value each) and ``[sweep.S]`` (lists) as value lists per option,
    each value checked against strategy S's options class."""
    merged: dict[str, dict[str, list[Any]]] = {}
    for table, name, lists in ((fixed, "options", False), (sweep, "sweep", True)):
        if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
            raise UserError(
                f"{where}: {name} must be a table per strategy, e.g. [{name}.p3] slice_size = "
                + ("[10000, 40000]" if lists else "20000")
            )
        for strategy, options in table.items():
            if strategy in UNAVAILABLE:
                raise UserError(f"{where}: {name}.{strategy}: {UNAVAILABLE[strategy]}")
            if strategy not in STRATEGIES:
                raise UserError(f"{where}: {name}.{strategy}: unknown strategy '{strategy}'")
            cls = options_class(strategy)
            for key, value in options.items():
                if lists and (not isinstance(value, list) or not value):
                    raise UserError(
                        f"{where}: sweep.{strategy}.{key} must be a non-empty list, got {value!r}"
                    )
                candidates = value if lists else [value]
                _check_sweep_values(cls, strategy, key, candidates, where)
                if key in merged.get(strategy, {}):
                    raise UserError(f"{where}: {strategy}.{key} is both fixed and swept")
                merged.setdefault(strategy, {})[key] = list(candidates)
    return merged


def _check_sweep_values(
    cls: type[StrategyOptions], strategy: str, key: str, values: list[Any], where: str
) -> None:
    """UserError for a value that makes invalid options, or one listed twice (as its
    strategy reads it: ``4`` and ``4.0`` of a float option are the same value).

    Example:
        >>> cls = options_class("allreduce")
        >>> _check_sweep_values(cls, "allreduce", "fusion_threshold_mb", [4, 4.0], "x.toml")
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: x.toml: sweep.allreduce.fusion_threshold_mb lists 4.0 twice; ...
    """
    seen: list[Any] = []
    for value in values:  # each value must make valid options
        options = options_from_mapping(cls, {key: value}, where=f"{where}: {strategy}")
        parsed = getattr(options, key)
        if parsed in seen:
            raise UserError(
                f"{where}: sweep.{strategy}.{key} lists {parsed!r} twice; its cells would share "
                "one folder and one result; list each value once (use repeats to run a cell "
                "again)"
            )
        seen.append(parsed)


def _check_option_tables(raw: dict[str, Any], strategies: list[str], where: str) -> None:
    """UserError for an ``[options.S]`` or ``[sweep.S]`` table of a strategy S that is not
    in ``strategies``: no cell would read it.

    Example:
        >>> _check_option_tables({"sweep": {"ps": {"servers": [1, 2]}}}, ["ddp"], "x.toml")
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: x.toml: [sweep.ps] is for 'ps', which is not in strategies ...
    """
    for name in ("options", "sweep"):
        for strategy in raw.get(name, {}):
            if strategy not in strategies:
                raise UserError(
                    f"{where}: [{name}.{strategy}] is for '{strategy}', which is not in "
                    f"strategies ({', '.join(strategies)}); add it to strategies or remove "
                    "the table"
                )


def _model_options(value: Any, where: str) -> dict[str, dict[str, str]]:
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise UserError(
            f"{where}: model_options must be a table per model, e.g. "
            '[model_options.lstm-lm] sparse = "true"'
        )
    return {
        model: {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in opts.items()}
        for model, opts in value.items()
    }


def _published_gain(value: Any, where: str) -> PublishedGain:
    """``[published_gain]`` with strategy, baseline, source and ``MODEL = gain`` numbers."""
    example = '[published_gain] strategy = "p3", baseline = "ps", source = "paper", resnet50 = 0.25'
    if not isinstance(value, dict):
        raise UserError(f"{where}: published_gain must be a table, e.g. {example}")
    names = {key: value.get(key) for key in ("strategy", "baseline", "source")}
    if not all(isinstance(text, str) and text for text in names.values()):
        raise UserError(
            f"{where}: published_gain needs strategy, baseline and source strings, e.g. {example}"
        )
    gains = {key: gain for key, gain in value.items() if key not in names}
    for model, gain in gains.items():
        if not isinstance(gain, int | float) or isinstance(gain, bool) or not math.isfinite(gain):
            raise UserError(
                f"{where}: published_gain.{model} must be a finite number (0.25 = +25%), "
                f"got {gain!r}"
            )
    return PublishedGain(**names, gains={model: float(gain) for model, gain in gains.items()})


def _check_names(experiment: Experiment, where: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]*", experiment.name):
        raise UserError(
            f"{where}: name {experiment.name!r} is not a plain folder name (it names "
            "results/<name>); use letters, digits, '.', '_' and '-'"
        )
    for strategy in experiment.strategies:
        if strategy in UNAVAILABLE:
            raise UserError(f"{where}: {UNAVAILABLE[strategy]}")
        if strategy not in STRATEGIES:
            raise UserError(
                f"{where}: unknown strategy '{strategy}' in strategies; allowed: "
                f"{', '.join(STRATEGIES)}"
            )
    for scaling in experiment.lr_scaling:
        if scaling not in LR_SCALINGS:
            raise UserError(
                f"{where}: unknown lr_scaling '{scaling}'; allowed: {', '.join(LR_SCALINGS)}"
            )
    if experiment.lr_base_batch is not None and set(experiment.lr_scaling) == {"none"}:
        raise UserError(
            f"{where}: lr_base_batch sets the batch the lr_scaling rules scale from, and "
            'lr_scaling is only "none"; add lr_scaling = ["linear"] (or "sqrt"), or drop '
            "lr_base_batch"
        )
    if experiment.optimizer not in OPTIMIZERS:
        raise UserError(
            f"{where}: unknown optimizer '{experiment.optimizer}'; allowed: {', '.join(OPTIMIZERS)}"
        )
    for model in experiment.models:
        try:
            check_model(model, experiment.preset, experiment.model_options.get(model))
        except UserError as error:
            raise UserError(f"{where}: {error}") from None
    published = experiment.published_gain
    if published is not None:
        for strategy in (published.strategy, published.baseline):
            if strategy not in experiment.strategies:
                raise UserError(
                    f"{where}: published_gain compares '{strategy}', which is not in strategies "
                    f"({', '.join(experiment.strategies)})"
                )
        for model in published.gains:
            if model not in experiment.models:
                raise UserError(
                    f"{where}: published_gain for '{model}', which is not in models "
                    f"({', '.join(experiment.models)}); a misspelt name would compare nothing: "
                    f"add '{model}' to models, or drop its line from [published_gain]"
                )
    for model in experiment.model_options:
        if model not in experiment.models:
            raise UserError(
                f"{where}: model_options for '{model}', which is not in models "
                f"({', '.join(experiment.models)}); add '{model}' to models, or drop its "
                "model_options"
            )
