"""Statistics over a sweep's records: repeats combined, speedup, efficiency, correctness.

* Throughput of a cell: samples/s after warm-up, median over measurement windows.
* Repeats: the median of the repeats' medians; the range is min–max over repeats (over
  windows when there is one repeat); spread = range / median, and a spread above 10% is
  flagged noisy.
* Speedup S(N) = T(N)/T(1) and scaling efficiency E(N) = T(N)/(N·T(1)), against the same
  strategy and settings at one worker.
* Correctness: each cell's final parameters against the ``single`` reference cell of the
  same model, batch and learning-rate rule, with :mod:`gradsync.verify`'s tolerance.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradsync.bench.equal import one_worker
from gradsync.bench.experiment import Cell, Experiment
from gradsync.bench.sweep import cell_config, record_problem
from gradsync.checkpoint import load_checkpoint
from gradsync.compare import diff_checkpoints, worst
from gradsync.errors import UserError
from gradsync.runtime import CHECKPOINT_FILE
from gradsync.verify import NOISE_FACTOR, tolerance_for, verdict_for

NOISY_SPREAD = 0.10


@dataclass
class Row:
    """One configuration, its repeats combined."""

    cell: Cell
    median: float
    low: float
    high: float
    repeats: int
    bytes_per_step: float
    exposed_comm_ms: float
    loss: list[float]
    accuracy: float | None = None
    iterations_per_epoch: int | None = None
    speedup: float | None = None
    efficiency: float | None = None
    max_abs: float | None = None
    tolerance: float | None = None
    verdict: str = "-"
    reason: str = ""
    outs: list[str] = field(default_factory=list)

    @property
    def spread(self) -> float:
        return (self.high - self.low) / self.median if self.median else 0.0

    @property
    def noisy(self) -> bool:
        return self.spread > NOISY_SPREAD


def _cell(record: dict[str, Any]) -> Cell:
    fields = {k: v for k, v in record.items() if k in Cell.__dataclass_fields__}
    fields["options"] = tuple(tuple(pair) for pair in fields.get("options", ()))  # JSON lists
    return Cell(**fields)


def analyse(experiment: Experiment, records: list[dict[str, Any]], out: Path) -> list[Row]:
    """Rows of the measured cells (ok ones, each with its measurements), in experiment order."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for record in records:
        if record_problem(record) is None and record["role"] == "measure":
            groups.setdefault(_cell(record).group(), []).append(record)
    rows = [_combine(group) for group in groups.values()]
    by_key = {row.cell.group(): row for row in rows}
    for row in rows:
        # Weak scaling (batch_per_worker): one worker ran its own, smaller global batch.
        one = by_key.get(one_worker(experiment, row.cell).group())
        if one is not None and one.median > 0:
            row.speedup = row.median / one.median
            row.efficiency = row.median / (row.cell.workers * one.median)
    if experiment.verify:
        _check_correctness(experiment, records, rows, out)
    return rows


def _with(cell: Cell, **changes: Any) -> Cell:
    from dataclasses import replace

    return replace(cell, **changes)


def _combine(group: list[dict[str, Any]]) -> Row:
    medians = [r["throughput"]["median"] for r in group]
    if len(group) > 1:
        low, high = min(medians), max(medians)
    else:
        low, high = group[0]["throughput"]["low"], group[0]["throughput"]["high"]
    first = min(group, key=lambda r: r["repeat"])
    return Row(
        cell=_with(_cell(first), repeat=0),
        median=statistics.median(medians),
        low=low,
        high=high,
        repeats=len(group),
        bytes_per_step=statistics.median(r["bytes_sent_per_step"] for r in group),
        exposed_comm_ms=1000 * statistics.median(r["exposed_comm_s_per_step"] for r in group),
        loss=first["loss"],
        outs=[r["out"] for r in group],
        accuracy=_median_or_none(r.get("validation_accuracy") for r in group),
        iterations_per_epoch=first.get("iterations_per_epoch"),
    )


def _median_or_none(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _check_correctness(
    experiment: Experiment, records: list[dict[str, Any]], rows: list[Row], out: Path
) -> None:
    references = {
        (r["model"], r["global_batch"], r["lr_scaling"], r["role"]): r["out"]
        for r in records
        if r.get("status") == "ok" and r["role"] != "measure"
    }
    for row in rows:
        key = (row.cell.model, row.cell.global_batch, row.cell.lr_scaling)
        reference_out = references.get((*key, "reference"))
        if reference_out is None:
            row.reason = "no single reference cell"
            continue
        try:
            reference = load_checkpoint(Path(reference_out) / CHECKPOINT_FILE)
            spread = 0.0
            if (rerun := references.get((*key, "reference-rerun"))) is not None:
                again = load_checkpoint(Path(rerun) / CHECKPOINT_FILE)
                spread = worst(diff_checkpoints(reference, again, include_optimizer=False)).max_abs
            checkpoint = load_checkpoint(Path(row.outs[0]) / CHECKPOINT_FILE)
            diff = worst(diff_checkpoints(reference, checkpoint, include_optimizer=False))
        except UserError as error:
            row.reason = str(error)
            continue
        config = cell_config(experiment, row.cell, out)
        row.tolerance = max(tolerance_for(config), NOISE_FACTOR * spread)
        row.max_abs = diff.max_abs
        row.verdict, row.reason = verdict_for(config, diff.max_abs, row.tolerance)
