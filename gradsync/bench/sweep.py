"""Run an experiment's cells one job each; record every cell as one JSON line; resume.

A results folder holds ``experiment.toml`` (a copy), ``results.jsonl`` (one line per
finished cell: its parameters, status, raw per-step timings, statistics, environment) and
``cells/<cell id>/`` (each job's own run folder). Cells already recorded as ``ok`` are
skipped when the sweep is started again, but only if their settings are unchanged: every
record carries the cell's job settings and a fingerprint (a hash of every setting that
affects the result), and a cell whose settings changed since (steps, preset, lr, seed,
model options, …) runs again, the sweep saying which setting changed. A failing cell is
recorded with its error and the sweep goes on; a line cut short (a sweep killed while
writing) is skipped with a warning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from gradsync.bench.equal import check_equal_workloads
from gradsync.bench.experiment import Cell, Experiment
from gradsync.config import LaunchConfig, OptimConfig, TrainConfig
from gradsync.devices import on_one_device
from gradsync.errors import JobFailed, UserError
from gradsync.files import end_line_cut_short, read_cell_records
from gradsync.jobs import check_largest_job_fills_hosts, run_job, validate
from gradsync.metrics import METRICS_DIR, read_records
from gradsync.models import shared_workloads
from gradsync.rundir import claim_resumable_dir, record_failure

RESULTS_FILE = "results.jsonl"
CELLS_DIR = "cells"


def cell_config(
    experiment: Experiment, cell: Cell, out: Path, *, timeline: bool = False
) -> TrainConfig:
    """The job of one cell. Dropout is off so every cell can be compared with ``single``.

    With ``timeline`` the job also writes ``cells/<id>/trace.json`` (see gradsync.trace).
    """
    run_dir = out / CELLS_DIR / cell.id
    launch = LaunchConfig(threads=cell.threads, interop_threads=cell.interop_threads)
    if cell.bandwidth is not None:
        launch = dataclasses.replace(launch, hosts=experiment.hosts, bandwidth=cell.bandwidth)
    config = TrainConfig(
        model=cell.model,
        preset=experiment.preset,
        model_options=experiment.model_options.get(cell.model, {}),
        strategy=cell.strategy,
        strategy_options=dict(cell.options),
        workers=cell.workers,
        steps=experiment.steps,
        global_batch=cell.global_batch,
        seed=experiment.seed,
        data=experiment.data,
        out=str(run_dir),
        timeline=str(run_dir / "trace.json") if timeline else None,
        deterministic=True,
        measure_warmup=experiment.measure_warmup,
        optim=OptimConfig(
            name=experiment.optimizer,
            lr=experiment.lr,  # type: ignore[arg-type]
            lr_warmup_steps=experiment.lr_warmup_steps,
            lr_scaling=cell.lr_scaling,
            # the base of a rule; a cell without one ("none") has nothing to scale from
            lr_base_batch=experiment.lr_base_batch if cell.lr_scaling != "none" else None,
        ),  # type: ignore[arg-type]
        launch=launch,
    )
    if experiment.epochs is not None:  # the same passes over the data in every cell
        from gradsync.models import steps_for_epochs

        config = dataclasses.replace(config, steps=steps_for_epochs(config, experiment.epochs))
    return config


def cell_settings(config: TrainConfig) -> dict[str, Any]:
    """The job settings that affect a cell's result: its config without the paths of its
    outputs (a timeline is recorded or not, wherever it goes).

    Example:
        >>> settings = cell_settings(TrainConfig(model="mnist-cnn", steps=3, out="a"))
        >>> settings["steps"], "out" in settings
        (3, False)
    """
    settings = json.loads(config.to_json())
    settings.pop("out")
    settings["timeline"] = settings["timeline"] is not None
    return settings


def fingerprint(settings: dict[str, Any]) -> str:
    """A short hash of ``settings`` (canonical JSON): a cell's identity beyond its name.

    Example:
        >>> fingerprint({"steps": 3}) == fingerprint({"steps": 3}) != fingerprint({"steps": 4})
        True
    """
    canonical = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def changed_settings(
    recorded: dict[str, Any], current: dict[str, Any], prefix: str = ""
) -> list[str]:
    """``key old → new`` for every setting that differs (nested sections as ``optim.lr``).

    Example:
        >>> changed_settings({"steps": 3, "optim": {"lr": 0.1}}, {"steps": 6, "optim": {"lr": 0.1}})
        ['steps 3 → 6']
    """
    changes = []
    for key in sorted(set(recorded) | set(current)):
        old, new = recorded.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changes += changed_settings(old, new, f"{prefix}{key}.")
        elif old != new:
            changes.append(f"{prefix}{key} {old} → {new}")
    return changes


# What an ``ok`` record must hold to be read as a measurement (see sweep.run_cell).
MEASURED = ("throughput", "step_times_s", "loss", "bytes_sent_per_step", "exposed_comm_s_per_step")


def record_problem(record: dict[str, Any]) -> str | None:
    """Why ``record`` is no measurement, or None: its error when it failed, the fields it
    lacks when it says ``ok`` (a hand-edited or foreign record).

    Example:
        >>> record_problem({"status": "ok", "throughput": {"median": 1.0}})[:38]
        'recorded as ok without step_times_s, l'
        >>> record_problem({"status": "failed", "error": "rank 1 crashed"})
        'rank 1 crashed'
    """
    status = record.get("status")
    if status == "failed":
        return str(record.get("error") or "failed, no error recorded")
    if status != "ok":
        return f"status {status!r} is neither ok nor failed; run gradsync bench again to measure it"
    missing = [key for key in MEASURED if key not in record]
    throughput = record.get("throughput", {})
    missing += [
        f"throughput.{key}"
        for key in ("median", "low", "high")
        if not isinstance(throughput, dict) or key not in throughput
    ]
    if not missing:
        return None
    return (
        f"recorded as ok without {', '.join(dict.fromkeys(missing))}; run gradsync bench "
        "again to measure it"
    )


def load_records(out: Path) -> list[dict[str, Any]]:
    """Every complete record in ``out``'s results, in the order they were written.

    A line that is not a JSON record (cut short when a sweep was killed) is skipped with a
    warning on stderr; the cell it belonged to counts as not run.
    """
    return read_cell_records(out / RESULTS_FILE, missing="not run")


def load_results(out: Path) -> list[dict[str, Any]]:
    """Every recorded cell, whatever its settings (the last record wins when a cell was
    retried); see :func:`experiment_results` for the records of the current settings."""
    return list({record["id"]: record for record in load_records(out)}.values())


# Settings a record carries that the bench command or the machine decides, not the
# experiment file: the device the launcher resolved, whether a timeline was recorded.
NOT_OF_THE_EXPERIMENT = (("launch", "device"), ("timeline",))


def experiment_fingerprint(settings: dict[str, Any]) -> str:
    """The fingerprint of the settings an experiment file decides: ``settings`` without
    the device and the timeline switch, which ``gradsync report`` cannot know.

    Example:
        >>> a = {"steps": 3, "timeline": True, "launch": {"device": "cpu", "threads": 1}}
        >>> b = {"steps": 3, "timeline": False, "launch": {"device": "cuda", "threads": 1}}
        >>> experiment_fingerprint(a) == experiment_fingerprint(b)
        True
    """
    kept = json.loads(json.dumps(settings))  # a deep copy
    for *sections, key in NOT_OF_THE_EXPERIMENT:
        section = kept
        for name in sections:
            section = section.get(name, {})
        section.pop(key, None)
    return fingerprint(kept)


def _by_cell(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each cell's records, in the order they were written."""
    by_cell: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_cell.setdefault(record["id"], []).append(record)
    return by_cell


def _latest_of(
    records: list[dict[str, Any]], accept: Callable[[dict[str, Any]], bool]
) -> dict[str, Any] | None:
    """The last of ``records`` that ``accept`` takes, or None."""
    return next((record for record in reversed(records) if accept(record)), None)


def _cells_to_run(
    cells: list[Cell], configs: dict[str, TrainConfig], records: list[dict[str, Any]]
) -> tuple[list[Cell], int]:
    """The cells without an ``ok`` record (with its measurements) of the same settings
    among ``records`` (:func:`load_records`); say why each reruns."""
    by_cell = _by_cell(records)
    todo, done = [], 0
    for cell in cells:
        settings = cell_settings(configs[cell.id])
        mine, wanted = by_cell.get(cell.id, []), fingerprint(settings)
        same = _latest_of(mine, lambda r, f=wanted: r.get("fingerprint") == f)
        if same is not None and record_problem(same) is None:
            done += 1
            continue
        last = _latest_of(mine, lambda r: r.get("status") == "ok")
        if same is None and last is not None:
            changes = changed_settings(last.get("settings", {}), settings)
            reason = "; ".join(changes[:4]) if last.get("settings") else "no settings recorded"
            print(f"cell {cell.id}: runs again, its settings changed ({reason})", flush=True)
        todo.append(cell)
    return todo, done


def run_sweep(
    experiment: Experiment,
    out: Path,
    *,
    show_progress: bool = True,
    timeline: bool = False,
    launcher: str = "local",
    overwrite: bool = False,
) -> list[dict]:
    """Run every cell not yet recorded as ok; return all records.

    ``launcher`` is ``local`` (processes on this machine) or ``srun`` (each cell one step
    of the current Slurm allocation, see :mod:`gradsync.cluster`). ``out`` is claimed
    once every cell is checked (:func:`claim_results_dir`; ``overwrite`` starts afresh).
    """
    run = _job_runner(launcher)
    cells = experiment.cells()
    configs = {cell.id: cell_config(experiment, cell, out, timeline=timeline) for cell in cells}
    if launcher == "local":  # under srun each cell's ranks agree in their rendezvous
        configs = dict(zip(configs, on_one_device(list(configs.values())), strict=True))
    with shared_workloads():  # each model built once for all its cells' checks
        for config in configs.values():
            validate(config, local=launcher == "local")  # a bad matrix fails before any job
        check_largest_job_fills_hosts(list(configs.values()))
        check_equal_workloads(experiment, configs, launcher=launcher)  # compared cells alike
    claim_results_dir(out, experiment, overwrite=overwrite)
    records = load_records(out)  # read once: a line cut short warns once
    todo, done = _cells_to_run(cells, configs, records)
    if done or len(todo) < len(cells):
        print(f"resuming {out}: {done} cell(s) already done, {len(todo)} to run")
    end_line_cut_short(out / RESULTS_FILE)
    with (
        _SweepProgress(len(cells), done, enabled=show_progress) as progress,
        open(out / RESULTS_FILE, "a") as results,
    ):
        for cell in todo:
            config = configs[cell.id]
            shutil.rmtree(config.out, ignore_errors=True)  # a half-run cell starts afresh
            metrics = Path(config.out) / METRICS_DIR / "rank0.jsonl"
            record = progress.run(
                cell, lambda c=cell, j=config: run_cell(experiment, c, j, run=run), metrics
            )
            line = json.dumps(record)
            results.write(line + "\n")
            results.flush()
            records.append(json.loads(line))  # as a later read of the file gives it
    return experiment_results(out, experiment, records)


def experiment_results(
    out: Path, experiment: Experiment, records: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Of ``records`` (``out``'s, :func:`load_records`), those of ``experiment``'s cells at
    its current settings, the last one of each cell. A cell an earlier version of the
    experiment had, and this one does not, or a record of other settings (``steps = 4``
    before ``steps = 12``), stays in ``results.jsonl`` but out of the report. A record
    without settings (written before gradsync recorded them) cannot be judged and is kept.

    Example:
        >>> # experiment_results(out, load_experiment(path), load_records(out))
    """
    by_cell = _by_cell(records)
    current = []
    for cell in experiment.cells():
        wanted = _experiment_fingerprint_of(experiment, cell, out)
        record = _latest_of(by_cell.get(cell.id, []), lambda r, f=wanted: _of_settings(r, f))
        if record is not None:
            current.append(record)
    return current


def stale_cells(out: Path, experiment: Experiment, records: list[dict[str, Any]]) -> list[str]:
    """The ids of ``experiment``'s cells that ``records`` (``out``'s) hold only at other
    settings than the current ones: left out of the report until ``gradsync bench`` runs
    them again.

    Example:
        >>> # stale_cells(out, load_experiment(path), load_records(out))  # ['measure-…-r0']
    """
    kept = {record["id"] for record in experiment_results(out, experiment, records)}
    recorded = {record["id"] for record in records}
    return [cell.id for cell in experiment.cells() if cell.id in recorded - kept]


def _experiment_fingerprint_of(experiment: Experiment, cell: Cell, out: Path) -> str:
    return experiment_fingerprint(cell_settings(cell_config(experiment, cell, out)))


def _of_settings(record: dict[str, Any], wanted: str) -> bool:
    """Whether ``record`` was measured at the experiment settings fingerprinted ``wanted``."""
    settings = record.get("settings")
    return settings is None or experiment_fingerprint(settings) == wanted


def claim_results_dir(out: Path, experiment: Experiment, *, overwrite: bool) -> None:
    """``out`` for ``experiment``'s results: new, or empty, or holding this experiment's
    results (a sweep goes on where it stopped; cells whose settings changed run again).
    Another experiment's results, or any other files, are refused in one line unless
    ``overwrite``. The experiment file is copied in, which marks the folder as its own.

    Example:
        >>> # claim_results_dir(Path("results/scaling"), load_experiment(path), overwrite=False)
    """
    claim_resumable_dir(
        out,
        Path(experiment.path),
        kept_as="experiment.toml",
        holds_same=lambda folder: _holds_results_of(folder, experiment),
        other=f"the results of another experiment than {experiment.name!r}",
        overwrite=overwrite,
    )


def _holds_results_of(out: Path, experiment: Experiment) -> bool:
    """Whether ``out``'s results are ``experiment``'s: its records name it, or (none yet,
    as after ``gradsync sbatch``) its copy of the experiment file is the same file."""
    names = {record.get("experiment") for record in load_results(out)} - {None}
    if names:
        return names == {experiment.name}
    return (out / "experiment.toml").read_bytes() == Path(experiment.path).read_bytes()


def _job_runner(launcher: str) -> Callable[[TrainConfig], dict[str, Any]]:
    if launcher == "srun":
        from gradsync.cluster import check_allocation, srun_job

        check_allocation()  # before the first cell, not once per cell
        return srun_job
    return run_job


def run_cell(
    experiment: Experiment,
    cell: Cell,
    config: TrainConfig,
    *,
    run: Callable[[TrainConfig], dict[str, Any]] = run_job,
) -> dict[str, Any]:
    """Run one cell's job (with ``run``); its record, ``ok`` or ``failed`` with the error."""
    settings = cell_settings(config)
    record: dict[str, Any] = {
        "id": cell.id,
        **dataclasses.asdict(cell),
        "experiment": experiment.name,
        "out": config.out,
        "settings": settings,
        "fingerprint": fingerprint(settings),
    }
    started = time.time()
    try:
        summary = run(config)
    except (JobFailed, UserError, Exception) as error:  # recorded; the sweep goes on
        return {
            **record,
            "status": "failed",
            "error": record_failure(Path(config.out), error),
            "wall_s": time.time() - started,
        }
    records = read_records(Path(config.out), range(cell.workers))
    steps = sorted({r["step"] for lines in records.values() for r in lines})
    step_times = [
        max(r["step_time_s"] for lines in records.values() for r in lines if r["step"] == s)
        for s in steps
    ]
    workers = [rank for rank in summary["ranks"] if int(rank) < cell.workers]
    exposed = [summary["ranks"][rank]["exposed_comm_s_per_step"] for rank in workers]
    return {
        **record,
        "status": "ok",
        "wall_s": time.time() - started,
        "global_batch_used": summary["global_batch"],
        "step_times_s": step_times,
        "throughput": summary["throughput"],
        "loss": summary["loss"],
        "bytes_sent_per_step": summary["bytes_sent_per_step"],
        "exposed_comm_s_per_step": sum(exposed) / len(exposed) if exposed else 0.0,
        "validation_accuracy": summary.get("validation_accuracy"),
        "iterations_per_epoch": summary.get("iterations_per_epoch"),
        "environment": {**summary["environment"], "link_rate": cell.bandwidth},
    }


class _SweepProgress:
    """Cells done, ETA and the running cell's samples/s (read from its rank-0 metrics)."""

    def __init__(self, total: int, done: int, *, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, done, enabled
        self._bar: Progress | None = None

    def __enter__(self) -> _SweepProgress:
        if self.enabled:
            self._bar = Progress(
                TextColumn("cells"),
                MofNCompleteColumn(),
                BarColumn(),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[status]}"),
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(
                "sweep", total=self.total, completed=self.done, status=""
            )
        return self

    def run(self, cell: Cell, job: Callable[[], dict[str, Any]], metrics: Path) -> dict[str, Any]:
        """Run ``job`` in a thread while showing the cell's live samples/s."""
        result: dict[str, Any] = {}
        raised: list[BaseException] = []

        def target() -> None:
            try:
                result.update(job())
            except BaseException as error:  # re-raised on the sweep's thread
                raised.append(error)

        worker = threading.Thread(target=target, daemon=True)
        worker.start()
        while worker.is_alive():
            self._show(cell, metrics)
            worker.join(timeout=0.5)
        if raised:
            raise raised[0]
        if self._bar is not None:
            self._bar.update(self._task, advance=1)
        else:
            rate = result.get("throughput", {}).get("median")
            shown = f"{rate:,.1f} samples/s" if rate else result.get("error", "")
            print(f"cell {cell.id}: {result['status']} {shown}", flush=True)
        return result

    def _show(self, cell: Cell, metrics: Path) -> None:
        if self._bar is None:
            return
        rate = ""
        try:
            last = metrics.read_text().splitlines()[-1]
            rate = f"{json.loads(last)['samples_per_s']:,.1f} samples/s"
        except (OSError, IndexError, ValueError, KeyError):
            pass
        self._bar.update(self._task, status=f"{cell.id}  {rate}")

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
