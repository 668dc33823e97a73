"""Equal workloads in bench: the pairs a report compares, the check before launch, and a
report that compares only like with like when an experiment sweeps threads or batch."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gradsync import cli
from gradsync.bench import equal
from gradsync.bench.analysis import Row
from gradsync.bench.equal import Swept, check_equal_workloads, compared_pairs
from gradsync.bench.experiment import Cell, Experiment, load_experiment
from gradsync.bench.report import _series, held_equal, reading
from gradsync.bench.sweep import cell_config
from gradsync.config import TrainConfig
from gradsync.errors import UserError
from gradsync.optim import effective_lr

MNIST = {"name": "x", "path": "x.toml", "models": ["mnist-cnn"], "preset": "tiny"}


def experiment(**keys: object) -> Experiment:
    return Experiment(**{**MNIST, **keys})  # type: ignore[arg-type]


def jobs(exp: Experiment) -> dict[str, TrainConfig]:
    return {cell.id: cell_config(exp, cell, Path("out")) for cell in exp.cells()}


def test_pairs_stay_within_each_swept_value() -> None:
    exp = experiment(strategies=["ddp", "allreduce"], workers=[1, 2], threads=[1, 2])
    pairs = compared_pairs(exp, exp.cells())
    kinds = [kind for kind, _, _ in pairs]
    assert kinds.count("strategies side by side") == 4  # 2 workers × 2 threads
    assert kinds.count("scaling efficiency") == 4  # 2 strategies × 2 threads
    assert all(a.threads == b.threads for _, a, b in pairs)


def test_weak_scaling_pairs_the_same_per_worker_batch() -> None:
    exp = experiment(strategies=["allreduce"], workers=[1, 4], batch_per_worker=[8], threads=[1])
    ((kind, big, one),) = compared_pairs(exp, exp.cells())
    assert (kind, big.global_batch, one.global_batch) == ("scaling efficiency", 32, 8)
    check_equal_workloads(exp, jobs(exp), cores=2)  # 8 per worker in both: accepted


def test_unset_threads_that_differ_by_rank_count_are_refused_with_the_fix() -> None:
    exp = experiment(strategies=["allreduce", "ps"], workers=[2])  # ps adds a server rank
    with pytest.raises(UserError) as caught:
        check_equal_workloads(exp, jobs(exp), cores=4)
    message = str(caught.value)
    assert message.startswith(
        "x.toml: strategies side by side would compare allreduce at 2 workers with ps"
    )
    assert "intra-op threads per rank 2 vs 1" in message
    assert "set threads = [1] in the experiment (the largest job has 3 ranks)" in message
    check_equal_workloads(exp, jobs(exp), cores=1)  # 1 thread per rank either way
    check_equal_workloads(exp, jobs(exp), launcher="srun", cores=4)  # CPUs per task: equal
    pinned = dataclasses.replace(exp, threads=[2])
    check_equal_workloads(pinned, jobs(pinned), cores=4)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"deterministic": False}, "dropout on vs off"),
        ({"batchnorm": "local"}, "BatchNorm per worker vs over the global batch"),
        ({"data": "sklearn:digits"}, "data sklearn:digits vs synthetic"),
        ({"global_batch": 16}, "global batch 16 vs 8"),
    ],
)
def test_a_compared_pair_with_another_workload_is_refused(
    change: dict[str, object], expected: str
) -> None:
    exp = experiment(strategies=["allreduce"], workers=[1, 2], global_batch=[8], threads=[1])
    configs = jobs(exp)
    two = next(cell.id for cell in exp.cells() if cell.workers == 2)
    configs[two] = configs[two].replace(**change)
    with pytest.raises(UserError, match=f"scaling efficiency .* which differ in {expected}"):
        check_equal_workloads(exp, configs, cores=2)


def test_bench_refuses_before_launch_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(equal, "machine_cores", lambda: 2)
    path = tmp_path / "unequal.toml"
    path.write_text(
        'name = "unequal"\nmodels = ["mnist-cnn"]\npreset = "tiny"\n'
        'strategies = ["ddp"]\nworkers = [1, 2]\nsteps = 3\n'
    )
    code = cli.main(["bench", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "ddp at 2 workers with ddp at 1 worker" in err and "threads = [1]" in err
    assert not (tmp_path / "out").exists()  # nothing launched, no results folder


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('batchnorm = "local"', "key 'batchnorm' cannot be set: every bench cell runs"),
        ("deterministic = false", "key 'deterministic' cannot be set"),
        ('data = ["a", "b"]', "data must be one path"),
    ],
)
def test_settings_bench_holds_equal_are_not_keys(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "fixed.toml"
    path.write_text(f'models = ["mnist-cnn"]\n{line}\n')
    with pytest.raises(UserError, match=message):
        load_experiment(path)


def row(strategy: str, median: float, **cell: object) -> Row:
    return Row(
        cell=Cell(model="mnist-cnn", strategy=strategy, workers=2, **cell),  # type: ignore[arg-type]
        median=median,
        low=median,
        high=median,
        repeats=1,
        bytes_per_step=0.0,
        exposed_comm_ms=0.0,
        loss=[],
    )


def test_the_reading_ranks_strategies_only_within_one_swept_value() -> None:
    exp = experiment(strategies=["ddp", "allreduce"], threads=[1, 2], interop_threads=[1, 2])
    swept = Swept.of(exp)
    rows = [
        row("ddp", 10.0, threads=1, interop_threads=1),
        row("allreduce", 12.0, threads=1, interop_threads=1),
        row("ddp", 30.0, threads=2, interop_threads=1),  # never set beside 1-thread rows
        row("ddp", 50.0, threads=2, interop_threads=2),  # nor beside 1 inter-op thread
        row("allreduce", 40.0, threads=2, interop_threads=2),
    ]
    assert reading(rows, swept) == (
        "At 2 workers (1 thread, 1 inter-op), `allreduce` is fastest with 12.0 samples/s, "
        "1.20× `ddp`. At 2 workers (2 threads, 2 inter-op), `ddp` is fastest with 50.0 "
        "samples/s, 1.25× `allreduce`."
    )
    series = _series(rows, swept)
    assert all(len(mine) == 1 for mine in series.values()) and len(series) == 5
    assert "ddp (2 threads, 2 inter-op)" in series


def test_held_equal_says_how_it_compares() -> None:
    swept = held_equal(experiment(workers=[1, 2], threads=[1, 2], batch_per_worker=[8]))
    assert "per-worker batch (weak scaling)" in swept
    assert "each within one value of the swept intra-op threads" in swept
    assert "refused at launch" in swept
    pinned = held_equal(experiment(workers=[1, 2], threads=[1]))
    assert "1 intra-op thread per rank" in pinned and "global batch (strong scaling)" in pinned


def test_lr_base_batch_is_where_the_rules_scale_from(tmp_path: Path) -> None:
    """A weak-scaling experiment's rules were relative to the preset's batch (100 for
    mnist-cnn): at 1 worker of 32 samples, "linear" trained at 0.32 × lr. lr_base_batch
    sets the base; a cell without a rule gets none."""
    path = tmp_path / "x.toml"
    path.write_text(
        'name = "x"\nmodels = ["mnist-cnn"]\nworkers = [1, 2]\nbatch_per_worker = [32]\n'
        'lr = 0.02\nlr_scaling = ["none", "linear"]\nlr_base_batch = 32\n'
    )
    configs = jobs(load_experiment(path))
    rates = {
        (c.workers, c.optim.lr_scaling): effective_lr(c.optim, c.global_batch or 0, 100)
        for c in configs.values()
    }
    assert rates == {(1, "none"): 0.02, (2, "none"): 0.02, (1, "linear"): 0.02, (2, "linear"): 0.04}
    path.write_text(path.read_text().replace('["none", "linear"]', '["none"]'))
    with pytest.raises(UserError, match=r'lr_base_batch sets .* lr_scaling is only "none"'):
        load_experiment(path)


def test_a_strategy_that_does_not_time_its_exposed_communication_says_so() -> None:
    """ddp's waits are inside torch's reducer: its column read 0.0 ms, as if it hid all."""
    from gradsync.bench.report import HEADERS, _cells

    column = HEADERS.index("exposed comm/step")
    assert _cells(row("ddp", 1.0))[column] == "not timed"
    assert _cells(row("allreduce", 1.0))[column] == "0.0 ms"


def test_epochs_give_every_cell_the_same_passes_over_the_data(tmp_path: Path) -> None:
    """With a fixed per-worker batch and one step count, 4 workers trained 4x the epochs of
    1 (0.44 against 1.78), so the accuracy column compared unequal training."""
    path = tmp_path / "x.toml"
    path.write_text(
        'name = "x"\nmodels = ["mnist-cnn"]\ndata = "sklearn:digits"\nworkers = [1, 2]\n'
        "batch_per_worker = [32]\nepochs = 0.1\n"
    )
    exp = load_experiment(path)
    steps = {c.workers: c.steps for c in jobs(exp).values()}
    assert steps == {1: 5, 2: 3}  # ceil(0.1 × 1,438 / 32), ceil(0.1 × 1,438 / 64)
    assert exp.length == "0.1 epochs" and "0.1 epochs. Varied" in held_equal(exp)
    path.write_text(path.read_text() + "steps = 10\n")
    with pytest.raises(UserError, match="steps and epochs both set the length"):
        load_experiment(path)


def test_no_plot_along_an_axis_the_experiment_does_not_sweep(tmp_path: Path) -> None:
    """A speedup-vs-bandwidth plot with no bandwidth swept showed one point at y = 1.0, and
    a scaling plot one worker count."""
    from gradsync.bench.report import _plots

    exp = experiment(strategies=["ddp", "allreduce"], workers=[2])
    rows = [row("ddp", 10.0), row("allreduce", 11.0)]
    assert sorted(_plots(tmp_path, "mnist-cnn", rows, [], Swept.of(exp))) == [
        "loss vs step",
        "throughput by strategy",
    ]
    rows += [row("ddp", 4.0, bandwidth="1gbit"), row("allreduce", 6.0, bandwidth="1gbit")]
    assert "speedup vs bandwidth" in _plots(tmp_path, "mnist-cnn", rows, [], Swept.of(exp))


def test_the_environment_line_gives_the_range_of_steps_when_epochs_set_them() -> None:
    from gradsync.bench.report import _environment

    throughput = {"median": 1.0, "low": 1.0, "high": 1.0, "warmup_steps": 5}
    records = [
        {"status": "ok", "step_times_s": [0.1] * n, "throughput": throughput, "loss": [],
         "bytes_sent_per_step": 0.0, "exposed_comm_s_per_step": 0.0}
        for n in (90, 23, 45)
    ]  # fmt: skip
    assert "steps per job 23–90," in _environment(records)[0]
