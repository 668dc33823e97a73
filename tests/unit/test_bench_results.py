"""`gradsync bench`/`report` on records written by hand: which records a report reads."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from gradsync.bench import sweep
from gradsync.bench.experiment import Experiment, load_experiment
from gradsync.bench.report import write_report
from gradsync.devices import on_one_device

MIX = (
    'name = "mix"\nmodels = ["mnist-cnn"]\npreset = "tiny"\nstrategies = ["allreduce", "ddp"]\n'
    "workers = [2]\nthreads = [1]\nmeasure_warmup = 1\n"
)


def _experiment(folder: Path, steps: int) -> Experiment:
    path = folder / "experiment.toml"
    path.write_text(MIX + f"steps = {steps}\n")
    return load_experiment(path)


def _record(experiment: Experiment, strategy: str, samples_per_s: float) -> dict[str, Any]:
    """An ``ok`` record of ``strategy``'s cell as :func:`sweep.run_cell` writes it."""
    (cell,) = [c for c in experiment.cells() if c.strategy == strategy]
    config = sweep.cell_config(experiment, cell, Path(experiment.path).parent)
    settings = sweep.cell_settings(config)
    settings["launch"]["device"] = "cpu"  # resolved by the launcher at bench time
    throughput = {"median": samples_per_s, "low": samples_per_s, "high": samples_per_s}
    return {
        "id": cell.id,
        **json.loads(json.dumps(dataclasses.asdict(cell))),  # as read back
        "experiment": experiment.name,
        "out": config.out,
        "settings": settings,
        "fingerprint": sweep.fingerprint(settings),
        "status": "ok",
        "step_times_s": [0.1] * experiment.steps,
        "throughput": {**throughput, "warmup_steps": 1},
        "loss": [1.0] * experiment.steps,
        "bytes_sent_per_step": 1000.0,
        "exposed_comm_s_per_step": 0.0,
        "environment": {"cores": 2, "threads_per_rank": 1},
    }


def _write(folder: Path, records: list[dict[str, Any]]) -> None:
    lines = "".join(json.dumps(record) + "\n" for record in records)
    (folder / sweep.RESULTS_FILE).write_text(lines)


def test_a_report_leaves_out_records_of_earlier_settings(tmp_path: Path) -> None:
    """Probe 30b: steps 4 → 12, the rerun stopped after allreduce; the report compared
    allreduce at 12 steps with ddp at 4 under a "12 steps, held equal" line."""
    before = _experiment(tmp_path, steps=4)
    old = [_record(before, "allreduce", 100.0), _record(before, "ddp", 200.0)]
    now = _experiment(tmp_path, steps=12)
    _write(tmp_path, [*old, _record(now, "allreduce", 117.0)])
    current = sweep.experiment_results(tmp_path, now, sweep.load_records(tmp_path))
    assert [(r["strategy"], r["settings"]["steps"]) for r in current] == [("allreduce", 12)]
    assert sweep.stale_cells(tmp_path, now, sweep.load_records(tmp_path)) == [old[1]["id"]]
    report = write_report(tmp_path).read_text()
    assert "| ddp |" not in report and "| allreduce |" in report
    assert "Left out: 1 cell(s) recorded only at other settings" in report
    assert old[1]["id"] in report


def test_back_to_earlier_settings_reads_their_records_again(tmp_path: Path) -> None:
    before = _experiment(tmp_path, steps=4)
    old = [_record(before, "allreduce", 100.0), _record(before, "ddp", 200.0)]
    _write(tmp_path, [*old, _record(_experiment(tmp_path, steps=12), "allreduce", 117.0)])
    again = _experiment(tmp_path, steps=4)
    assert sweep.experiment_results(tmp_path, again, sweep.load_records(tmp_path)) == old
    assert sweep.stale_cells(tmp_path, again, sweep.load_records(tmp_path)) == []


def test_records_without_settings_are_kept(tmp_path: Path) -> None:
    """Records written before gradsync recorded settings cannot be judged: kept."""
    experiment = _experiment(tmp_path, steps=4)
    record = _record(experiment, "ddp", 200.0)
    del record["settings"], record["fingerprint"]
    _write(tmp_path, [record])
    assert sweep.experiment_results(tmp_path, experiment, [record]) == [record]


def test_an_ok_record_without_throughput_is_listed_not_a_crash(tmp_path: Path) -> None:
    """Probe 30b: a record without ``throughput`` made `gradsync report` a KeyError."""
    experiment = _experiment(tmp_path, steps=4)
    broken = _record(experiment, "ddp", 200.0)
    del broken["throughput"]
    _write(tmp_path, [_record(experiment, "allreduce", 100.0), broken])
    report = write_report(tmp_path).read_text()
    assert "| allreduce |" in report and "| ddp |" not in report
    assert f"| {broken['id']} | recorded as ok without throughput" in report


def test_bench_runs_an_ok_record_without_throughput_again(tmp_path: Path) -> None:
    experiment = _experiment(tmp_path, steps=4)
    broken = _record(experiment, "ddp", 200.0)
    del broken["throughput"]
    _write(tmp_path, [_record(experiment, "allreduce", 100.0), broken])
    cells = experiment.cells()
    configs = [sweep.cell_config(experiment, cell, tmp_path) for cell in cells]
    resolved = dict(zip([c.id for c in cells], on_one_device(configs, gpus=0), strict=True))
    todo, done = sweep._cells_to_run(cells, resolved, sweep.load_records(tmp_path))
    assert [cell.strategy for cell in todo] == ["ddp"] and done == 1


def test_a_report_warns_once_for_a_line_cut_short(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gradsync report` read results.jsonl three times (experiment_results, and
    stale_cells's own two reads), so one line cut short warned three times."""
    experiment = _experiment(tmp_path, steps=4)
    _write(tmp_path, [_record(experiment, "allreduce", 100.0)])
    with (tmp_path / sweep.RESULTS_FILE).open("a") as results:
        results.write('{"id": "cut sh')
    assert "| allreduce |" in write_report(tmp_path).read_text()
    assert capsys.readouterr().err.count("is not a complete record") == 1
