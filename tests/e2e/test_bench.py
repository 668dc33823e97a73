"""`gradsync bench` and `gradsync report`: sweep, resume, statistics, plots, bad files."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import pytest

from gradsync.bench import sweep
from gradsync.bench.experiment import load_experiment
from gradsync.bench.report import write_report
from tests.e2e.conftest import FAULTY, REPO, gradsync

TINY = REPO / "experiments" / "tiny.toml"


@pytest.mark.slow
def test_tiny_experiment_end_to_end(workdir: Path) -> None:
    result = gradsync("bench", str(TINY), "--out", "results", cwd=workdir)
    assert result.returncode == 0, result.stdout + result.stderr
    out = workdir / "results"
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    measured = [r for r in records if r["role"] == "measure"]
    assert {(r["strategy"], r["workers"]) for r in measured} == {
        ("ddp", 1),
        ("ddp", 2),
        ("allreduce", 1),
        ("allreduce", 2),
    }
    for record in records:
        assert record["status"] == "ok"
        assert len(record["step_times_s"]) == 8
        assert record["throughput"]["warmup_steps"] == 2
        assert {"torch", "cpu", "cores", "threads_per_rank", "link_rate"} <= set(
            record["environment"]
        )
        assert record["environment"]["allocator"].startswith(("glibc", "left to", "system"))
    report = (out / "report.md").read_text()
    assert "| strategy | workers |" in report and "efficiency" in report
    assert "Allocator: " in report and "not recorded" not in report
    assert "is fastest with" in report and "matches single within tolerance" in report
    plots = [
        line.split("(")[1].rstrip(")") for line in report.splitlines() if line.startswith("![")
    ]
    assert len(plots) == 3  # one link, so no speedup-vs-bandwidth plot
    assert not any("bandwidth" in plot for plot in plots)
    for plot in plots:
        image = matplotlib.image.imread(out / plot)
        assert image.shape[0] > 100 and image.std() > 0.01  # a real picture, not blank


@pytest.mark.slow
def test_interrupted_sweep_resumes_without_redoing_cells(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    experiment_file = workdir / "two.toml"
    experiment_file.write_text(
        'name = "two"\nmodels = ["mnist-cnn"]\npreset = "tiny"\n'
        # Two one-rank cells: this test is about resuming, not about multi-rank jobs.
        'strategies = ["single", "allreduce"]\nworkers = [1]\nthreads = [1]\nsteps = 3\n'
    )
    experiment = load_experiment(experiment_file)
    real_run_cell = sweep.run_cell
    calls: list[str] = []

    def interrupted_after_one(experiment, cell, config, **options):
        if calls:
            raise KeyboardInterrupt
        calls.append(cell.id)
        return real_run_cell(experiment, cell, config, **options)

    monkeypatch.setattr(sweep, "run_cell", interrupted_after_one)
    with pytest.raises(KeyboardInterrupt):
        sweep.run_sweep(experiment, workdir / "out", show_progress=False)
    assert len(sweep.load_results(workdir / "out")) == 1

    resumed: list[str] = []

    def counting(experiment, cell, config, **options):
        resumed.append(cell.id)
        return real_run_cell(experiment, cell, config, **options)

    monkeypatch.setattr(sweep, "run_cell", counting)
    records = sweep.run_sweep(experiment, workdir / "out", show_progress=False)
    assert calls[0] not in resumed and len(resumed) == 1
    assert len(records) == 2 and all(r["status"] == "ok" for r in records)
    assert write_report(workdir / "out").exists()
    # The experiment without allreduce, into the same folder: its cell stays in the
    # records file, out of the sweep's results and its report (probe 29b: both listed).
    experiment_file.write_text(experiment_file.read_text().replace(', "allreduce"', ""))
    records = sweep.run_sweep(load_experiment(experiment_file), workdir / "out")
    assert [r["strategy"] for r in records] == ["single"] and len(resumed) == 1
    assert "| allreduce |" not in write_report(workdir / "out").read_text()


@pytest.mark.slow
def test_a_failing_cell_is_recorded_and_the_sweep_goes_on(workdir: Path) -> None:
    """Cells whose ranks fail (a model that passes the launcher's check, then raises in
    training) are recorded as failed; the sweep goes on and the report lists them. Bad
    data, by contrast, is refused before the first cell (test_bad_experiment_file_...)."""
    experiment_file = workdir / "fail.toml"
    experiment_file.write_text(
        f'name = "fail"\nmodels = ["{FAULTY}"]\npreset = "tiny"\n'
        'strategies = ["ddp", "allreduce"]\nworkers = [2]\nglobal_batch = [8]\nsteps = 2\n'
        f'[model_options."{FAULTY}"]\nraise_in_ranks = "1"\n'
    )
    result = gradsync("bench", str(experiment_file), "--out", "out", cwd=workdir)
    assert result.returncode == 0, result.stderr
    records = [
        json.loads(line) for line in (workdir / "out" / "results.jsonl").read_text().splitlines()
    ]
    assert len(records) == 2 and all(r["status"] == "failed" for r in records)
    assert "exited with code 1" in records[0]["error"]  # the failing rank, named
    kept = (Path(workdir, records[0]["out"]) / "failure.txt").read_text()  # and its whole error
    assert "its last stderr lines" in kept
    assert "## Failed cells" in (workdir / "out" / "report.md").read_text()


BAD_FILES = {
    "unknown key": (
        'models = ["mnist-cnn"]\nworkerz = [2]\n',
        "unknown key 'workerz'",
        "allowed:",
    ),
    "unknown strategy": (
        'models = ["mnist-cnn"]\nstrategies = ["gossip"]\n',
        "unknown strategy 'gossip'",
        "allowed:",
    ),
    "workers not positive": (
        'models = ["mnist-cnn"]\nworkers = [2, 0]\n',
        "workers = [2, 0] is not a non-empty list of whole numbers of at least 1",
        "write e.g. workers = [1, 2, 4]",
    ),
    "workers not integers": (
        'models = ["mnist-cnn"]\nworkers = ["two"]\n',
        'workers = ["two"] is not a non-empty list of whole numbers',
        "write e.g.",
    ),
    "empty file": ("", "names no models"),
    "old warm-up key": ('models = ["mnist-cnn"]\nwarmup_steps = 3\n', "is now 'measure_warmup'"),
    "lr true": ('models = ["mnist-cnn"]\nlr = true\n', "lr = true is not a finite number above 0"),
    "option of the wrong type": (
        'models = ["mnist-cnn"]\n[sweep]\np3.slice_size = [1.5]\n',
        "p3.slice_size must be an integer",
    ),
    "unknown option": ('models = ["mnist-cnn"]\n[options.ps]\nslices = 3\n', "unknown option"),
    "empty list": ("models = []\n", "models = [] is not a non-empty list of strings"),
    "steps a string": ('models = ["mnist-cnn"]\nsteps = "3"\n', 'steps = "3" is not a whole'),
    "seed negative": ('models = ["mnist-cnn"]\nseed = -1\n', "seed = -1 is not a whole number"),
    "verify a string": ('models = ["mnist-cnn"]\nverify = "yes"\n', "is not true or false"),
    "a folder": (None, "experiment bad.toml is a folder"),
    "a value twice": ('models = ["mnist-cnn"]\nworkers = [2, 2]\n', "workers lists 2 twice"),
    "a swept value twice": (  # probe 30b: 4 and 4.0 ran as two cells in one folder
        'models = ["mnist-cnn"]\nstrategies = ["allreduce"]\n'
        "[sweep.allreduce]\nfusion_threshold_mb = [4, 8, 4.0]\n",
        "sweep.allreduce.fusion_threshold_mb lists 4.0 twice",
    ),
    "a sweep of a strategy not run": (  # probe 30b: silently ignored
        'models = ["mnist-cnn"]\nstrategies = ["ddp"]\n[sweep.ps]\nservers = [1, 2]\n',
        "[sweep.ps] is for 'ps', which is not in strategies (ddp)",
    ),
    "warm-up leaves no steps": (  # named as the file's keys, not as train's flags
        'models = ["mnist-cnn"]\nsteps = 4\nmeasure_warmup = 4\n',
        "measure_warmup = 4 leaves none of steps = 4 to measure",
    ),
    "batch not divisible": (
        'models = ["mnist-cnn"]\nworkers = [1, 2]\nglobal_batch = [4, 3]\n',
        "bad.toml: global_batch 3 does not divide by workers 2",
        "e.g. 4",
    ),
    "options of a strategy not run": (
        'models = ["mnist-cnn"]\nstrategies = ["ddp"]\n[options.p3]\nslice_size = 100\n',
        "[options.p3] is for 'p3', which is not in strategies (ddp)",
    ),
    "no cells": ('models = ["mnist-cnn"]\nstrategies = ["single"]\n', "the matrix has no cells"),
    "empty data": ('models = ["mnist-cnn"]\ndata = ""\n', "names no path"),
    "not a rate": (  # named as the file's key, not as train's --bandwidth
        'models = ["mnist-cnn"]\nbandwidths = ["1gbit", "fast"]\n',
        "bad.toml: bandwidths entry 'fast' is not a rate",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_experiment_file_is_one_line_exit_2(case: str, workdir: Path) -> None:
    text, *expected = BAD_FILES[case]
    if text is None:
        (workdir / "bad.toml").mkdir()
    else:
        (workdir / "bad.toml").write_text(text)
    result = gradsync("bench", "bad.toml", cwd=workdir, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and all(part in lines[0] for part in expected), lines
