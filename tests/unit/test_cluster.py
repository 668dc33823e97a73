"""gradsync sbatch's job script, srun steps of a sweep, and a batch script without srun."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradsync import cli, cluster
from gradsync.bench.experiment import load_experiment
from gradsync.errors import UserError
from gradsync.topology import check_slurm_step, detect_environment

SCALING = """
name = "scaling"
models = ["mnist-cnn"]
preset = "tiny"
strategies = ["allreduce", "ps"]
workers = [1, 2, 4, 8]
servers = [1]
threads = [2, 4]
steps = 10
"""


@pytest.fixture
def scaling(tmp_path: Path) -> Path:
    path = tmp_path / "scaling.toml"
    path.write_text(SCALING)
    return path


def test_job_shape_covers_the_largest_cell(scaling: Path) -> None:
    experiment = load_experiment(scaling)
    # ps at 8 workers has 9 ranks: 3 nodes at 4 ranks per node.
    shape = cluster.job_shape(experiment, tasks_per_node=4)
    assert (shape.nodes, shape.tasks_per_node, shape.cpus_per_task) == (3, 4, 4)
    # 16 cells × (30 s + 10 × 0.2 s) = 512 s, doubled, is above the 10-minute floor.
    assert shape.time_limit_s == 1024
    one_per_node = cluster.job_shape(experiment, tasks_per_node=1, cpus_per_task=8)
    assert (one_per_node.nodes, one_per_node.tasks_per_node, one_per_node.cpus_per_task) == (
        9,
        1,
        8,
    )


def test_sbatch_writes_the_script(scaling: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    options = ["--tasks-per-node", "4", "--time", "2:00:00", "--sbatch-option=--partition=cpu"]
    code = cli.main(["sbatch", str(scaling), *options])
    assert code == 0
    script = (tmp_path / "results" / "scaling" / "job.sbatch").read_text()
    assert "\n#SBATCH --nodes=3\n#SBATCH --ntasks-per-node=4\n#SBATCH --cpus-per-task=4\n" in script
    assert "\n#SBATCH --time=02:00:00\n" in script and "\n#SBATCH --partition=cpu\n" in script
    last = script.splitlines()[-1]
    assert last.endswith(
        f"-m gradsync bench {scaling} --out {tmp_path}/results/scaling --launcher srun"
    )
    assert "submit with: sbatch results/scaling/job.sbatch" in capsys.readouterr().out


def test_sbatch_quotes_a_working_folder_with_a_blank(
    scaling: Path, tmp_path: Path, monkeypatch
) -> None:
    folder = tmp_path / "my runs"
    folder.mkdir()
    monkeypatch.chdir(folder)
    assert cli.main(["sbatch", str(scaling), "--tasks-per-node", "4"]) == 0
    script = (folder / "results" / "scaling" / "job.sbatch").read_text()
    assert f'\n#SBATCH --chdir="{folder}"\n' in script  # sbatch splits at unquoted blanks


def test_print_sbatch_writes_nothing(scaling: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["sbatch", str(scaling), "--print-sbatch"]) == 0
    assert capsys.readouterr().out.startswith("#!/bin/bash\n")
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--time", "soon"], "--time 'soon' is not a time limit"),
        (["--tasks-per-node", "0"], "argument --tasks-per-node: 0 is not a positive integer"),
        # session 24's probe: written verbatim as "#SBATCH partition=cpu", or ignored
        (["--sbatch-option=partition=cpu"], "'partition=cpu' is not an sbatch option"),
        (["--sbatch-option="], "'' is not an sbatch option"),
        (["--print-sbatch", "--submit"], "pick one"),
    ],
)
def test_bad_sbatch_options_are_one_line(scaling: Path, capsys, argv, message) -> None:
    with pytest.raises(SystemExit) as exited:
        code = cli.main(["sbatch", str(scaling), *argv])
        raise SystemExit(code)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_bandwidth_experiments_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "bw.toml"
    path.write_text('models = ["mnist-cnn"]\npreset = "tiny"\nbandwidths = ["1gbit"]\n')
    with pytest.raises(UserError, match="emulate hosts on one machine"):
        cluster.job_shape(load_experiment(path), tasks_per_node=1)


def test_srun_steps_fit_the_allocation() -> None:
    env = {"SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_NUM_NODES": "3"}
    assert cluster.srun_argv(1, cpus_per_task=2, env=env)[1:4] == [
        "--nodes=1",
        "--ntasks=1",
        "--ntasks-per-node=1",
    ]
    assert cluster.srun_argv(9, cpus_per_task=2, env=env)[1:3] == ["--nodes=3", "--ntasks=9"]
    with pytest.raises(UserError, match="needs 13 ranks, 4 node"):
        cluster.srun_argv(13, cpus_per_task=2, env=env)


def test_srun_launcher_outside_an_allocation_is_refused(monkeypatch, scaling, capsys) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    code = cli.main(["bench", str(scaling), "--launcher", "srun", "--out", "x"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "--launcher srun runs inside a Slurm allocation" in err


BATCH_SCRIPT = {
    "SLURM_JOB_ID": "41",
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "0",
}


def test_a_batch_script_without_srun_is_refused() -> None:
    assert detect_environment(BATCH_SCRIPT) is None  # not a step: no rank layout
    with pytest.raises(UserError) as caught:
        check_slurm_step(BATCH_SCRIPT)
    assert str(caught.value).startswith("this is Slurm job 41 (4 tasks) but not a job step")
    check_slurm_step({**BATCH_SCRIPT, "SLURM_NTASKS": "1"})  # one task: training alone is right
    check_slurm_step({**BATCH_SCRIPT, "SLURM_STEP_ID": "0"})  # inside srun
    check_slurm_step({})  # no Slurm at all


def test_train_in_a_batch_script_is_one_line(monkeypatch, capsys) -> None:
    for key, value in BATCH_SCRIPT.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    assert cli.main(["train", "--model", "mnist-cnn", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "start the ranks with srun" in err


def test_slurm_nodes_with_unequal_tasks_know_their_node() -> None:
    step = {
        "SLURM_PROCID": "4",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_STEP_NUM_TASKS": "5",
        "SLURM_STEP_TASKS_PER_NODE": "3,2",
        "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_JOB_ID": "7",
    }
    env = detect_environment(step)
    assert env is not None
    assert (env.local_world_size, env.node_rank) == (2, 1)  # not 4 // 2 = 2
