"""Open MPI's mpirun starts the ranks; each run matches single."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradsync.launch import free_port
from tests.cluster.conftest import (
    TOLERANCE,
    TRAIN,
    distance_to_single,
    gradsync_argv,
    report_distance,
    run,
)

pytestmark = pytest.mark.slow

# As the README runs them: root needs --allow-run-as-root; more ranks than cores,
# --oversubscribe.
MPIRUN = ["mpirun", "--allow-run-as-root"]


@pytest.mark.parametrize(
    ("options", "strategy"),
    [(["-np", "2"], "ddp"), (["--oversubscribe", "-np", "4"], "hybrid")],
    ids=["ddp-np2", "hybrid-np4"],
)
def test_mpirun_matches_single(
    packages: None,
    single: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    options: list[str],
    strategy: str,
) -> None:
    port = str(free_port())
    argv = [*MPIRUN, *options, *gradsync_argv(*TRAIN, "--strategy", strategy)]
    result = run([*argv, "--master-port", port, "--out", "run"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["launcher"] == "mpirun" and summary["workers"] == int(options[-1])
    distance = distance_to_single(single, tmp_path / "run")
    report_distance(
        request.config,
        " ".join(["mpirun", *options, "gradsync train --strategy", strategy]),
        distance,
    )
    assert distance <= TOLERANCE
