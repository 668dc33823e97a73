"""A strategy registered from a test module runs through train, verify and bench, and an
experiment file sweeps options of two strategies, with a column and a plot per option."""

from __future__ import annotations

import json
import os
from pathlib import Path

import matplotlib.image
import pytest

from tests.e2e.conftest import REPO, gradsync, verify_outcomes

pytestmark = pytest.mark.slow
TINY = ("--model", "mnist-cnn", "--preset", "tiny")


@pytest.fixture
def with_toy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADSYNC_STRATEGIES", "tests.plugins.toy_strategy")
    monkeypatch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def test_a_registered_plugin_trains_verifies_and_benches(with_toy: None, workdir: Path) -> None:
    help_text = gradsync("train", "--help", cwd=workdir).stdout
    assert "--chunk-values N" in help_text and "[toy; default 1000]" in help_text

    trained = gradsync(
        "train", "--strategy", "toy", "--chunk-values", "50", "--workers", "2", *TINY,
        "--steps", "3", "--out", "run", cwd=workdir,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    config = json.loads((workdir / "run" / "config.json").read_text())
    assert config["strategy_options"] == {"chunk_values": 50}

    verified = gradsync(
        "verify", "--strategies", "toy,toy:chunk_values=7", *TINY, "--steps", "4",
        "--out", "verify", cwd=workdir,
    )  # fmt: skip
    assert verified.returncode == 0, verified.stdout + verified.stderr
    verdicts = {o["strategy"]: o["verdict"] for o in verify_outcomes(workdir / "verify")}
    assert verdicts == {"single": "reference", "toy": "match", "toy:chunk_values=7": "match"}

    (workdir / "toy.toml").write_text(
        'models = ["mnist-cnn"]\npreset = "tiny"\nstrategies = ["toy"]\nworkers = [2]\n'
        "steps = 4\nmeasure_warmup = 1\n[sweep]\ntoy.chunk_values = [10, 100000]\n"
    )
    benched = gradsync("bench", "toy.toml", "--out", "bench", cwd=workdir)
    assert benched.returncode == 0, benched.stdout + benched.stderr
    records = (workdir / "bench" / "results.jsonl").read_text().splitlines()
    assert sorted(json.loads(r)["options"] for r in records) == [
        [["chunk_values", 10]],
        [["chunk_values", 100000]],
    ]


def test_an_experiment_sweeps_options_of_two_strategies(workdir: Path) -> None:
    (workdir / "sweep.toml").write_text(
        'name = "sweep"\nmodels = ["mnist-cnn"]\npreset = "tiny"\n'
        'strategies = ["allreduce", "p3"]\nworkers = [2]\nthreads = [1]\nsteps = 4\n'
        "measure_warmup = 1\n"
        "[sweep]\nallreduce.fusion_threshold_mb = [0.01, 64]\np3.slice_size = [500, 40000]\n"
    )
    result = gradsync("bench", "sweep.toml", "--out", "out", cwd=workdir)
    assert result.returncode == 0, result.stdout + result.stderr
    report = (workdir / "out" / "report.md").read_text()
    assert "fusion_threshold_mb=0.01" in report and "slice_size=500" in report
    plots = {line.split("](")[1].rstrip(")") for line in report.splitlines() if "![" in line}
    for option in ("fusion_threshold_mb", "slice_size"):
        (plot,) = [p for p in plots if p.endswith(f"-{option}.png")]
        image = matplotlib.image.imread(workdir / "out" / plot)
        assert image.shape[0] > 100 and image.std() > 0.01
