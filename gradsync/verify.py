"""``verify`` and ``demo``: every strategy on the same global batches, checked against ``single``.

Precision: ``verify`` runs in float64 by default (``--precision``): model, data, gradients,
messages, server and optimizer state. Rounding then stays near 1e-12 after many steps, even
on chaotic models and across CPUs, so the tolerance is an absolute ``1e-9``
(:data:`FLOAT64_TOLERANCE`) and any real bug (a skipped or doubled gradient, a stale row)
shows orders of magnitude above it. The float32 floors below remain for ``--precision
float32``.

Tolerances in float32 (max |Δ| over every parameter and buffer): synchronous strategies differ from
``single`` only by floating-point reduction order (sums of shard gradients instead of one
sum). With SGD that stays ≤ 1e-5 after 20 steps (measured ≤ 6e-7 on the tiny presets).

Adam is different: it divides each gradient by its running RMS, so a parameter whose exact
gradient is zero moves by up to ``lr`` per step on rounding noise alone. The attention key
biases of the transformer are such parameters (softmax cancels them): their gradients are
±1e-10 noise, and after 20 steps at lr 1e-3 they differ by 9.6e-4 between ``single`` and
``allreduce``. The Adam tolerance is therefore a quarter of the largest possible noise drift,
``0.25 · lr · steps`` (5e-3 for 20 steps at 1e-3), while every other parameter still agrees
to ~1e-7.

Both are floors. ``verify`` also reruns ``single`` with another intra-op thread count, which
changes nothing but the reduction order, and takes the tolerance as the larger of the floor
and 10× that drift (see :func:`reference_spread`), so long runs of larger models are held
to what floating point allows, not to a figure measured on tiny ones.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gradsync.checkpoint import Checkpoint, load_checkpoint
from gradsync.comm.batchnorm import has_batchnorm
from gradsync.compare import (
    FLOAT32_TOLERANCE,
    FLOAT64_TOLERANCE,
    TensorDiff,
    diff_checkpoints,
    worst,
)
from gradsync.config import TrainConfig
from gradsync.devices import on_one_device
from gradsync.errors import JobFailed, UserError
from gradsync.files import atomic_write_text
from gradsync.jobs import check_largest_job_fills_hosts, run_job, validate
from gradsync.metrics import load_summary
from gradsync.models import shared_workloads, workload_of
from gradsync.options import InvalidOption, field_names, flag_named, parse_texts
from gradsync.rundir import record_failure
from gradsync.runtime import CHECKPOINT_FILE
from gradsync.stats import Throughput
from gradsync.strategies import options_by_strategy, options_class, strategy_class
from gradsync.tables import markdown_table, print_table
from gradsync.topology import default_threads

SGD_TOLERANCE = FLOAT32_TOLERANCE
NOISE_FACTOR = 10
ADAM_NOISE_FRACTION = 0.25


def tolerance_for(config: TrainConfig) -> float:
    """Max |Δparam| allowed for a synchronous strategy against single (see module docstring).

    Example:
        >>> from gradsync.config import OptimConfig
        >>> tolerance_for(TrainConfig(steps=20, optim=OptimConfig(name="adam", lr=1e-3)))
        0.005
        >>> tolerance_for(TrainConfig(dtype="float64"))
        1e-09
    """
    if config.dtype == "float64":
        return FLOAT64_TOLERANCE
    if config.optim.name == "adam":
        return round(ADAM_NOISE_FRACTION * config.optim.base_lr() * config.steps, 12)
    return SGD_TOLERANCE


REFERENCE = "single"


@dataclass(frozen=True)
class Outcome:
    """One strategy × workers cell, compared with the reference."""

    strategy: str
    workers: int
    max_abs: float
    max_rel: float
    tolerance: float
    verdict: str
    reason: str
    throughput: dict[str, Any]
    bytes_sent_per_step: float
    final_loss: float
    out: str

    @property
    def failed(self) -> bool:
        return self.verdict in ("FAIL", CRASHED)


CRASHED = "crashed"


def run_matrix(
    base: TrainConfig,
    strategies: Sequence[str],
    workers: Sequence[int],
    out: Path,
    *,
    given: Mapping[str, Any] | None = None,
    log: bool = True,
) -> list[Outcome]:
    """Run ``single`` once and each strategy at each worker count; compare parameters.

    A cell whose job fails becomes a ``crashed`` row with its one-line reason; the others
    still run (if ``single`` itself fails there is nothing to compare with, and it is the
    only row). ``given``: strategy options from the command line, for the strategies that
    take them.

    Example:
        >>> # run_matrix(TrainConfig(model="mnist-cnn", preset="tiny", steps=20),
        >>> #            ["ddp", "allreduce"], [2, 4], Path("runs/verify"))
    """
    cells = _cells(strategies, workers)
    configs = _cell_configs(base, cells, out, given)
    labels = {config.out: spec for config, (spec, _) in zip(configs, cells, strict=True)}
    with shared_workloads():  # the model built once for every cell's checks
        for config in configs:
            validate(config)  # every cell is checked before the first one runs
    if log:
        print("running single twice (default threads, then other threads) ...", flush=True)
    try:
        run_job(configs[0])
        reference = load_checkpoint(Path(configs[0].out) / CHECKPOINT_FILE)
        spread = reference_spread(configs[0], reference, out)
    except (JobFailed, UserError) as error:
        return [_crashed(REFERENCE, configs[0], error, tolerance_for(base))]
    check_reproducible(base, spread)
    tolerance = max(tolerance_for(base), NOISE_FACTOR * spread)
    if log:
        print(
            f"tolerance {tolerance:.1e}: the larger of the {base.dtype} floor "
            f"{tolerance_for(base):.0e} and {NOISE_FACTOR}× single's drift with other "
            f"threads ({spread:.1e})",
            flush=True,
        )
    outcomes: list[Outcome] = []
    for config in configs:
        label = labels[config.out]
        if log and config is not configs[0]:
            print(f"running {label} with {config.workers} worker(s) ...", flush=True)
        try:
            outcomes.append(
                _run_cell(config, label, reference, tolerance, first=config is configs[0])
            )
        except (JobFailed, UserError) as error:
            outcomes.append(_crashed(label, config, error, tolerance))
            if log:
                print(f"  {label} × {config.workers} crashed: {outcomes[-1].reason}", flush=True)
    return outcomes


def _run_cell(
    config: TrainConfig, label: str, reference: Checkpoint, tolerance: float, *, first: bool
) -> Outcome:
    summary = load_summary(Path(config.out)) if first else run_job(config)
    if not (Path(config.out) / CHECKPOINT_FILE).is_file():  # the job ran, but saved nothing
        raise UserError(
            f"strategy '{config.strategy}' saved no state, so its run wrote no checkpoint to "
            "compare; set self.model and self.updater in setup, or override checkpoint_tensors"
        )
    checkpoint = load_checkpoint(Path(config.out) / CHECKPOINT_FILE)
    diffs = diff_checkpoints(reference, checkpoint, include_optimizer=False)
    diff = worst(diffs)
    verdict, reason = verdict_for(config, diff.max_abs, tolerance)
    if verdict == "FAIL":
        reason = which_tensors_fail(diffs, tolerance)
    return Outcome(
        strategy=label,
        workers=config.workers,
        max_abs=diff.max_abs,
        max_rel=diff.max_rel,
        tolerance=tolerance,
        verdict=verdict,
        reason=reason,
        throughput=summary["throughput"],
        bytes_sent_per_step=summary["bytes_sent_per_step"],
        final_loss=summary["final_loss"],
        out=config.out,
    )


def _crashed(label: str, config: TrainConfig, error: Exception, tolerance: float) -> Outcome:
    nan = float("nan")
    return Outcome(
        strategy=label,
        workers=config.workers,
        max_abs=nan,
        max_rel=nan,
        tolerance=tolerance,
        verdict=CRASHED,
        reason=record_failure(Path(config.out), error),
        throughput={},
        bytes_sent_per_step=nan,
        final_loss=nan,
        out=config.out,
    )


def diagnosis(outcomes: Sequence[Outcome]) -> str | None:
    """A hint when every synchronous strategy misses ``single`` by about the same amount.

    Independent strategies that are all wrong by the same distance point at what they
    share: the model or its loss (e.g. a loss that is a sum rather than a mean over
    samples, or a layer other than BatchNorm that mixes samples), not the synchronization.
    No hint when any strategy matches (then the model is fine) or only one was run.

    Example:
        >>> row = lambda s, d, v="FAIL": Outcome(s, 2, d, 0.0, 1e-9, v, "", {}, 0.0, 0.0, "")
        >>> diagnosis([row("ddp", 1.0e-3), row("ps", 1.2e-3)])[:70]
        'every synchronous strategy differs from single by about the same amoun'
        >>> diagnosis([row("ddp", 1.0e-3), row("ps", 1e-12, "match")]) is None
        True
        >>> diagnosis([row("ddp", 1.0e-3), row("ps", 1.0)]) is None
        True
        >>> buffers = lambda s: Outcome(s, 2, 1e-3, 0.0, 1e-9, "FAIL", BUFFERS_ONLY, {}, 0, 0, "")
        >>> diagnosis([buffers("ddp"), buffers("ps")]) is None  # no model or loss to blame
        True
    """
    compared = [o for o in outcomes if o.verdict in ("match", "FAIL")]
    failing = [o.max_abs for o in compared if o.verdict == "FAIL"]
    strategies = {o.strategy.split(":")[0] for o in compared}
    if not failing or len(failing) < len(compared) or len(strategies) < 2:
        return None
    if all(o.reason.startswith(BUFFERS_ONLY) for o in compared):  # each row says so
        return None
    if max(failing) > 3 * min(failing):
        return None
    return (
        f"every synchronous strategy differs from single by about the same amount "
        f"({min(failing):.1e}–{max(failing):.1e}): the likely cause is the model or its loss "
        "(a loss that is not a mean over the samples, or a layer that mixes samples other "
        "than BatchNorm), not the strategies"
    )


def check_reproducible(base: TrainConfig, spread: float) -> None:
    """UserError when ``single`` drifted from its own rerun by more than float64 rounding
    can: in float64 a thread count moves parameters by ~1e-12, so a larger drift means the
    run is not reproducible (an unseeded draw in the model or its data), and no tolerance
    could tell a strategy's bug from it.

    Example:
        >>> check_reproducible(TrainConfig(dtype="float64"), 3e-15)
        >>> check_reproducible(TrainConfig(dtype="float64"), 0.57)
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: single differs from its own rerun by 5.7e-01, ...
    """
    if base.dtype != "float64" or spread <= FLOAT64_TOLERANCE:
        return
    raise UserError(
        f"single differs from its own rerun by {spread:.1e}, where float64 rounding moves "
        f"parameters by less than {FLOAT64_TOLERANCE:.0e}: the run is not reproducible, so no "
        "strategy can be checked against it; seed every random draw of the model and its data "
        "from the build request's seed"
    )


def reference_spread(reference_config: TrainConfig, reference: Checkpoint, out: Path) -> float:
    """How far ``single`` drifts from itself when only the floating-point reduction order
    changes: the same run with another intra-op thread count (1 instead of several, or 2).

    On small models and few steps this is ~1e-7; on larger models over more steps, ReLU
    units near zero flip and the drift grows (the default transformer: ~6e-5 after 30 SGD
    steps). A strategy that only reorders reductions cannot be held closer than this.
    """
    threads = reference_config.launch.threads or default_threads(1)
    other = 1 if threads > 1 else 2
    rerun = reference_config.replace(
        out=str(out / "single-rerun"),
        launch=dataclasses.replace(reference_config.launch, threads=other),
    )
    run_job(rerun)
    checkpoint = load_checkpoint(Path(rerun.out) / CHECKPOINT_FILE)
    return worst(diff_checkpoints(reference, checkpoint, include_optimizer=False)).max_abs


def cell_config(
    base: TrainConfig,
    spec: str,
    workers: int,
    out: Path,
    given: Mapping[str, Any] | None = None,
) -> TrainConfig:
    """The config of one verify cell. ``spec`` is a strategy name, optionally with options
    after colons (``ps:servers=2``, ``ps:colocate``, ``ps:async:staleness=2``); ``given``
    holds options from the command line, applied to the strategies that take them, except
    where the spec's own options make one meaningless (``--slice-size`` beside
    ``p3:slicing=false``): the spec's win.

    Example:
        >>> config = cell_config(TrainConfig(), "ps:servers=2:colocate=false", 4, Path("v"))
        >>> config.strategy_options.servers
        2
        >>> whole = cell_config(TrainConfig(), "p3:slicing=false", 2, Path("v"), {"slice_size": 9})
        >>> whole.strategy_options.slice_size == options_class("p3")().slice_size
        True
    """
    name, *variant = spec.split(":")
    cls = options_class(name)
    given_here = {key: value for key, value in (given or {}).items() if key in field_names(cls)}
    try:
        cls(**given_here).check(workers)  # the command line's options must agree by themselves
        own = parse_texts(cls, _spec_options(variant, field_names(cls)))
        options = cls(**own)
    except UserError as error:
        raise UserError(f"'{spec}': {error}") from None
    for key, value in given_here.items():
        if key in own:
            continue
        with_given = dataclasses.replace(options, **{key: value})
        try:
            with_given.check(workers)
        except InvalidOption:
            continue  # meaningless beside the spec's own options, which win
        options = with_given
    label = spec.replace(":", "-").replace("=", "")
    cell_out = str(out / f"{label}-w{workers}")
    return base.replace(strategy=name, strategy_options=options, workers=workers, out=cell_out)


def _spec_options(parts: Sequence[str], names: Sequence[str]) -> dict[str, str]:
    """``key=value`` texts of a spec's parts; a part that is neither ``key=value`` nor an
    option's name continues the value before it, which held a colon (``re:emb``).

    Example:
        >>> _spec_options(["dense_pattern=re", "emb", "colocate"], ["dense_pattern", "colocate"])
        {'dense_pattern': 're:emb', 'colocate': ''}
    """
    texts: dict[str, str] = {}
    last = None
    for part in parts:
        key, equals, value = part.partition("=")
        if not equals and key not in names and last is not None:
            texts[last] += f":{part}"
            continue
        texts[key], last = value, key if equals else None
    return texts


def _cells(strategies: Sequence[str], workers: Sequence[int]) -> list[tuple[str, int]]:
    """(strategy spec, workers) of every job: ``single`` first, once."""
    return [(REFERENCE, 1)] + [(s, w) for w in workers for s in strategies if s != REFERENCE]


def _cell_configs(
    base: TrainConfig, cells: Sequence[tuple[str, int]], out: Path, given: Mapping[str, Any] | None
) -> list[TrainConfig]:
    """The jobs of ``cells``, all on one device (the CPU when any cannot have the GPUs)."""
    return on_one_device([cell_config(base, spec, w, out, given) for spec, w in cells])


def check_cells(
    base: TrainConfig,
    strategies: Sequence[str],
    workers: Sequence[int],
    given: Mapping[str, Any],
    out: Path,
) -> None:
    """UserError, before any job, for a bad strategy spec, a device the jobs cannot have,
    ``--hosts`` that not even the largest job fills, or a command-line option that none of
    ``strategies`` takes."""
    if all(spec.split(":")[0] == REFERENCE for spec in strategies):
        raise UserError(
            f"--strategies {','.join(strategies)} names only the reference ({REFERENCE}), so "
            "nothing would be compared with it; name the strategies to verify, e.g. "
            "--strategies ddp,allreduce"
        )
    check_largest_job_fills_hosts(_cell_configs(base, _cells(strategies, workers), out, given))
    taken = {key for spec in strategies for key in field_names(options_class(spec.split(":")[0]))}
    if unused := sorted(set(given) - taken):
        names = ", ".join(flag_named(options_by_strategy(), key) for key in unused)
        raise UserError(
            f"{names}: no strategy in this run takes it ({', '.join(strategies)}); drop it or "
            "add a strategy that does"
        )


def verdict_for(config: TrainConfig, max_abs: float, tolerance: float) -> tuple[str, str]:
    """The verdict of one cell and its reason.

    Example:
        >>> verdict_for(TrainConfig(strategy="ddp", workers=2), 5e-10, 1e-9)
        ('match', 'reduction order only')
    """
    if config.strategy == REFERENCE:
        return "reference", "the whole global batch in one process"
    strategy = strategy_class(config.strategy)
    if not strategy.is_synchronous(config):
        # Not held to the tolerance: asynchronous training is a different computation.
        expected = expected_difference(config)
        return (
            "differs: asynchronous updates",
            f"{expected or 'asynchronous updates'}; distance to single {max_abs:.2e}",
        )
    if max_abs <= tolerance:
        return "match", "reduction order only"
    expected = expected_difference(config)
    if expected is not None or not strategy.synchronous:
        return "differs (expected)", expected or "asynchronous updates"
    return "FAIL", "a synchronous strategy must match single"


BUFFERS_ONLY = "parameters match; buffers differ"


def which_tensors_fail(diffs: list[TensorDiff], tolerance: float) -> str:
    """A failing cell's reason, naming the tensors beyond ``tolerance`` (worst first); when
    only buffers differ, says so: parameters that match beside buffers that do not are
    statistics a layer keeps per worker (gradsync saves worker 0's), not wrong training.

    Example:
        >>> diffs = [TensorDiff("param/w", 0.0, 0.0), TensorDiff("buffer/ema", 0.1, 1.0)]
        >>> print(which_tensors_fail(diffs, 1e-9))  # doctest: +ELLIPSIS
        parameters match; buffers differ (each worker keeps its own; ...): buffer/ema
    """
    beyond = sorted((d for d in diffs if not d.within(tolerance)), key=lambda d: -d.max_abs)
    names = ", ".join(d.name for d in beyond[:3]) + (", …" if len(beyond) > 3 else "")
    if all(d.name.startswith("buffer/") for d in beyond):
        kept = "each worker keeps its own; worker 0's are saved"
        return f"{BUFFERS_ONLY} ({kept}): {names}"
    return f"a synchronous strategy must match single; beyond: {names}"


def expected_difference(config: TrainConfig) -> str | None:
    """Why a cell is expected to differ from single: its strategy's reason, per-worker
    BatchNorm, or a lookup table that scales its gradient by each shard's row counts.

    Example:
        >>> expected_difference(TrainConfig(strategy="ddp", workers=2, preset="tiny")) is None
        True
    """
    reason = strategy_class(config.strategy)().expected_difference(config)
    return reason or batchnorm_difference(config) or frequency_scaling_difference(config)


def frequency_scaling_difference(config: TrainConfig) -> str | None:
    """Why a model with ``nn.Embedding(scale_grad_by_freq=True)`` differs from single on
    several workers: each worker divides its gradient by the row counts of its own shard,
    as DDP and Horovod do, not of the global batch. None on one worker or without one.

    Example:
        >>> frequency_scaling_difference(TrainConfig(strategy="ddp", workers=2, preset="tiny"))
    """
    if config.workers < 2:
        return None
    from gradsync.probe import lookup_tables

    tables = lookup_tables(workload_of(config).model)
    scaled = [name for name, table in tables.items() if table.scale_grad_by_freq]
    if not scaled:
        return None
    return (
        f"lookup table {scaled[0]} has scale_grad_by_freq: each worker scales by the row "
        "counts of its own shard, not of the global batch"
    )


def batchnorm_difference(config: TrainConfig) -> str | None:
    """Why ``--batchnorm local`` differs from single (None when it cannot: one worker, or
    a model without BatchNorm, which must still match).

    Example:
        >>> local = TrainConfig(strategy="ddp", workers=2, batchnorm="local", preset="tiny")
        >>> batchnorm_difference(dataclasses.replace(local, model="resnet56"))
        'per-worker BatchNorm statistics (--batchnorm local)'
        >>> batchnorm_difference(dataclasses.replace(local, model="transformer")) is None
        True
    """
    if config.batchnorm != "local" or config.workers < 2:
        return None
    if not has_batchnorm(workload_of(config).model):  # one build a cell, under local only
        return None
    return "per-worker BatchNorm statistics (--batchnorm local)"


def deterministic_notice(config: TrainConfig) -> str:
    return (
        f"verify: dropout is disabled so every strategy sees the same computation; "
        f"{config.steps} steps, seed {config.seed}, optimizer {config.optim.name}, "
        f"{config.dtype}"
    )


def report_verify(outcomes: list[Outcome], out: Path) -> None:
    """Print the verdict table and write verify.json / verify.md under ``out``."""
    headers = [
        "strategy",
        "workers",
        "max abs diff",
        "max rel diff",
        "tolerance",
        "verdict",
        "reason",
    ]
    rows = [
        [
            o.strategy,
            str(o.workers),
            f"{o.max_abs:.2e}",
            f"{o.max_rel:.2e}",
            f"{o.tolerance:.0e}",
            o.verdict,
            o.reason,
        ]
        for o in outcomes
    ]
    print_table("gradsync verify: parameters against single", headers, rows)
    markdown = markdown_table(headers, rows)
    if hint := diagnosis(outcomes):
        print(f"diagnosis: {hint}")
        markdown += f"\n\nDiagnosis: {hint}"
    _write_results(out, "verify", outcomes, markdown)


def report_demo(outcomes: list[Outcome], out: Path, title: str) -> None:
    """Print the side-by-side table (throughput and correctness) and write the results folder."""
    measured = [o for o in outcomes if o.verdict != CRASHED] or outcomes
    baseline = next((o for o in measured if o.strategy == "ddp"), measured[0])
    headers = [
        "strategy",
        "workers",
        "samples/s median (min–max)",
        "vs ddp",
        "bytes sent/step",
        "max |Δparam| vs single",
        "verdict",
    ]
    rows = []
    for o in outcomes:
        if o.verdict == CRASHED or baseline.verdict == CRASHED:
            reason = f"{o.verdict}: {o.reason}"
            rows.append([o.strategy, str(o.workers), "—", "—", "—", "—", reason])
            continue
        rate = Throughput(**o.throughput)
        ratio = o.throughput["median"] / baseline.throughput["median"]
        rows.append(
            [
                o.strategy,
                str(o.workers),
                str(rate),
                f"{ratio:.2f}×",
                _bytes(o.bytes_sent_per_step),
                f"{o.max_abs:.2e}",
                o.verdict,
            ]
        )
    note = (
        f"Correctness: max |Δparam| against single after the same global batches; tolerance "
        f"{outcomes[0].tolerance:.1e} (see gradsync/verify.py). Throughput: samples/s after "
        f"warm-up, median over windows (min–max); ratios are to ddp in this run."
    )
    print_table(title, headers, rows)
    print(note)
    markdown = f"# {title}\n\n" + markdown_table(headers, rows) + f"\n\n{note}"
    _write_results(out, "results", outcomes, markdown)


def _write_results(out: Path, stem: str, outcomes: list[Outcome], markdown: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "outcomes": [_json_safe(asdict(o)) for o in outcomes],
    }
    atomic_write_text(out / f"{stem}.json", json.dumps(payload, indent=2) + "\n")
    atomic_write_text(out / f"{stem}.md", markdown + "\n")
    print(f"results written to {out}/{stem}.json and {out}/{stem}.md")


def _json_safe(row: dict[str, Any]) -> dict[str, Any]:
    """NaN (a crashed cell's figures) as null: JSON has no NaN."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}


def _bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1024 or unit == "GB":
            return f"{count:,.1f} {unit}"
        count /= 1024
    return ""
