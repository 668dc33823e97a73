"""srun and sbatch on a real Slurm cluster (ours, on this machine), each matched to single."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.cluster.conftest import (
    TOLERANCE,
    TRAIN,
    distance_to_single,
    gradsync_argv,
    report_distance,
    run,
)
from tests.cluster.slurm import SlurmCluster

pytestmark = pytest.mark.slow
README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.parametrize(
    ("srun", "strategy"),
    [
        (["-N", "1", "-n", "2"], ["--strategy", "allreduce"]),
        (["-n", "3"], ["--strategy", "ps", "--servers", "1", "--workers", "2"]),
    ],
    ids=["allreduce", "ps"],
)
def test_srun_matches_single(
    slurm: SlurmCluster,
    single: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    srun: list[str],
    strategy: list[str],
) -> None:
    argv = ["srun", *srun, *gradsync_argv(*TRAIN, *strategy, "--out", "run")]
    result = run(argv, cwd=tmp_path, env=slurm.env())
    assert result.returncode == 0, result.stdout + result.stderr + slurm.logs()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["launcher"] == "slurm" and summary["workers"] == 2
    distance = distance_to_single(single, tmp_path / "run")
    launch = " ".join(["srun", *srun, "gradsync train", *strategy])
    report_distance(request.config, launch, distance)
    assert distance <= TOLERANCE


def readme_sbatch_script() -> str:
    """The job script the README shows under "Running on a cluster"."""
    match = re.search(r"```bash\n(#!/bin/bash\n#SBATCH.*?)```", README.read_text(), re.S)
    assert match is not None, "README has no sbatch script (```bash, #!/bin/bash, #SBATCH …)"
    return match.group(1)


def test_readme_sbatch_script_runs_and_matches_single(
    slurm: SlurmCluster, single: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    script = readme_sbatch_script()
    # The README's script as a user would run it, with this test's model and interpreter.
    script = script.replace("gradsync train", " ".join(gradsync_argv(*TRAIN)))
    (tmp_path / "job.sbatch").write_text(script)
    code = slurm.sbatch("job.sbatch", cwd=tmp_path)
    logs = "".join(p.read_text() for p in tmp_path.glob("*.out"))
    assert code == 0, logs + slurm.logs()
    (run_dir,) = [p.parent for p in tmp_path.rglob("checkpoint.safetensors")]
    distance = distance_to_single(single, run_dir)
    report_distance(request.config, "sbatch (README script)", distance)
    assert distance <= TOLERANCE


TINY_EXPERIMENT = """
name = "cluster-tiny"
models = ["mnist-cnn"]
preset = "tiny"
strategies = ["allreduce"]
workers = [2]
steps = 4
measure_warmup = 1
"""


def test_gradsync_sbatch_script_runs_and_report_reads_it(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    work = tmp_path / "my runs"  # sbatch splits #SBATCH lines at unquoted blanks
    work.mkdir()
    (work / "exp.toml").write_text(TINY_EXPERIMENT)
    written = run(
        gradsync_argv("sbatch", "exp.toml", "--out", "results", "--tasks-per-node", "2"),
        cwd=work,
    )
    assert written.returncode == 0, written.stderr
    script = (work / "results" / "job.sbatch").read_text()
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=2\n" in script
    code = slurm.sbatch("results/job.sbatch", cwd=work)
    logs = "".join(p.read_text() for p in work.glob("slurm-*.out"))
    assert code == 0, logs + slurm.logs()
    records = [json.loads(line) for line in (work / "results" / "results.jsonl").open()]
    assert {r["status"] for r in records} == {"ok"}, records
    # Every cell ran as its own srun step: its ranks saw Slurm's environment.
    for record in records:
        summary = json.loads((Path(record["out"]) / "summary.json").read_text())
        assert summary["launcher"] == "slurm"
    report = run(gradsync_argv("report", "results"), cwd=work)
    assert report.returncode == 0, report.stderr
    text = (work / "results" / "report.md").read_text()
    assert "| allreduce | 2 |" in text


def test_train_in_a_batch_script_without_srun_is_one_line(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    command = " ".join(gradsync_argv(*TRAIN, "--strategy", "allreduce"))
    code = slurm.sbatch("-n", "2", "-o", "job.out", "--wrap", command, cwd=tmp_path)
    output = (tmp_path / "job.out").read_text()
    assert code == 2, output
    (line,) = output.splitlines()
    assert line.startswith("gradsync: error: this is Slurm job ") and "srun" in line


def test_cluster_is_gone_after_teardown(packages: None) -> None:
    with SlurmCluster.start(cpus=2) as cluster:
        pids = [p.pid for p in cluster.processes]
        assert cluster.run("sinfo", "-h", "-o", "%T").stdout.strip() == "idle"
    assert not cluster.folder.exists()
    assert [pid for pid in pids if Path(f"/proc/{pid}").exists()] == []


class _FailsWhenStarted(SlurmCluster):
    started: list[_FailsWhenStarted] = []  # noqa: RUF012 - read by the test

    def _wait_idle(self) -> None:
        self.pids = [p.pid for p in self.processes]
        _FailsWhenStarted.started.append(self)
        raise RuntimeError("failing on purpose")


def test_cluster_is_torn_down_when_starting_fails(packages: None) -> None:
    with pytest.raises(RuntimeError, match="on purpose"), _FailsWhenStarted.start(cpus=2):
        pass
    (cluster,) = _FailsWhenStarted.started
    assert len(cluster.pids) == 3 and cluster.processes == []
    assert [pid for pid in cluster.pids if Path(f"/proc/{pid}").exists()] == []
    assert not cluster.folder.exists()
