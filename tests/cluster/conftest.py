"""Real launchers: a Slurm cluster of our own, Open MPI's mpirun, torchrun across hosts.

Every run trains ``mnist-cnn`` (tiny) for a few float64 steps and is compared with a
``single`` run of the same steps, tensor by tensor (:func:`gradsync.compare.diff_checkpoints`,
as ``gradsync compare`` does); float64 rounds at ~1e-12, so the tolerance is 1e-9.

The Debian packages are installed when missing (:func:`tests.cluster.slurm.ensure_packages`);
where that cannot be done the tests are skipped and the reason is printed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gradsync.checkpoint import load_checkpoint
from gradsync.compare import diff_checkpoints, worst
from tests.cluster.slurm import SlurmCluster, ensure_packages

TOLERANCE = 1e-9  # float64: reduction order moves parameters by ~1e-12 at most
MODEL = ["--model", "mnist-cnn", "--preset", "tiny", "--steps", "3"]
TRAIN = ["train", *MODEL, "--deterministic", "--dtype", "float64"]
RUN_TIMEOUT_S = 300


def gradsync_argv(*args: str) -> list[str]:
    """``python -m gradsync ARGS`` with this interpreter (the one the tests run in)."""
    return [sys.executable, "-m", "gradsync", *args]


def run(
    argv: list[str], *, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a launcher command, captured; the test fails if it outlives the timeout."""
    return subprocess.run(
        argv,
        cwd=cwd,
        env={**(env or os.environ), "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )


def _say(config: pytest.Config, line: str) -> None:
    """A line on the terminal now, whatever the verbosity or capturing."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        print(line)
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(line)


def report_distance(config: pytest.Config, what: str, max_abs: float) -> None:
    """Print one launch's distance to single (the suite's record of what ran for real)."""
    _say(config, f"[cluster] {what}: max |Δ| vs single {max_abs:.1e} (tolerance {TOLERANCE:g})")


@pytest.fixture(scope="session")
def packages(request: pytest.FixtureRequest) -> None:
    """slurm-wlm, munge and openmpi-bin are installed (apt, once), or the test is skipped."""
    reason = ensure_packages()
    if reason is not None:
        _say(request.config, f"[cluster] skipping the real-launcher tests: {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm(packages: None) -> Iterator[SlurmCluster]:
    """A running one-node Slurm cluster, torn down after the module's tests."""
    with SlurmCluster.start() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint of ``single`` on :data:`TRAIN`: the reference of every launch."""
    folder = tmp_path_factory.mktemp("single")
    result = run(gradsync_argv(*TRAIN, "--strategy", "single", "--out", "run"), cwd=folder)
    assert result.returncode == 0, result.stdout + result.stderr
    return folder / "run" / "checkpoint.safetensors"


def distance_to_single(single: Path, run_dir: Path) -> float:
    """Largest |Δ| over every tensor (parameters, buffers, optimizer state) vs ``single``."""
    diffs = diff_checkpoints(load_checkpoint(single), load_checkpoint(run_dir))
    return worst(diffs).max_abs
