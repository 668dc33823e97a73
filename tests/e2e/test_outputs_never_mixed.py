"""Outputs never land on what is already there (DESIGN.md §5): a trace, a commbench or a
bench results folder is refused in one line, exit 2, before anything runs, and what was
there is left as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import gradsync

TINY = ("--model", "mnist-cnn", "--preset", "tiny", "--steps", "2")
EXPERIMENT = """\
name = "{name}"
models = ["mnist-cnn"]
preset = "tiny"
strategies = ["allreduce"]
workers = [2]
steps = 3
"""


def _refused(result, says: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradsync: error: "), result.stderr
    assert says in lines[0], lines[0]


@pytest.mark.parametrize("target", ["notes.txt", "a-folder", "notes.txt/trace.json"])
def test_a_timeline_never_replaces_a_file_or_a_folder(target: str, workdir: Path) -> None:
    (workdir / "notes.txt").write_text("mine\n")
    (workdir / "a-folder").mkdir()
    result = gradsync("train", *TINY, "--timeline", target, "--out", "run", cwd=workdir)
    _refused(result, "--timeline")
    assert (workdir / "notes.txt").read_text() == "mine\n"
    assert not (workdir / "run").exists()  # refused before the run's folder


def test_commbench_refuses_a_used_folder(workdir: Path) -> None:
    used = workdir / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine\n")
    result = gradsync("commbench", "--sizes", "8K", "--iters", "1", "--out", "used", cwd=workdir)
    _refused(result, "already holds")
    assert sorted(p.name for p in used.iterdir()) == ["notes.txt"]


def test_bench_refuses_another_experiments_results(workdir: Path) -> None:
    first, second = workdir / "first.toml", workdir / "second.toml"
    first.write_text(EXPERIMENT.format(name="first"))
    second.write_text(EXPERIMENT.format(name="second"))
    results = workdir / "results"
    results.mkdir()
    (results / "experiment.toml").write_text(first.read_text())
    (results / "results.jsonl").write_text('{"id": "cell", "experiment": "first"}\n')
    result = gradsync("bench", str(second), "--out", "results", cwd=workdir)
    _refused(result, "holds the results of another experiment")
    assert (results / "experiment.toml").read_text() == first.read_text()


BAD_INPUTS = {
    "commbench port": (["commbench", "--master-port", "99999"], "--master-port 99999"),
    "commbench timeout": (["commbench", "--timeout", "nan"], "--timeout"),
    "verify no strategy": (["verify", *TINY, "--strategies", ""], "strateg"),
    "warm-up past the steps": (["train", *TINY, "--measure-warmup", "2"], "--measure-warmup 2"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_values_are_one_line_before_anything_runs(case: str, workdir: Path) -> None:
    args, says = BAD_INPUTS[case]
    _refused(gradsync(*args, "--out", "out", cwd=workdir, timeout=60), says)
    assert not (workdir / "out").exists()


def test_compare_refuses_a_tolerance_that_is_not_a_number(workdir: Path) -> None:
    _refused(gradsync("compare", "a", "b", "--tolerance", "nan", cwd=workdir), "--tolerance")


@pytest.mark.parametrize(
    ("name", "options", "says"),
    [
        ("../escaped", [], "not a plain folder name"),
        ("fine", ["--time", "00:00:00"], "zero"),
        ("fine", ["--sbatch-option", "--partition=cpu\necho owned"], "line break"),
    ],
)
def test_sbatch_refuses_what_would_misplace_or_break_its_script(
    name: str, options: list[str], says: str, workdir: Path
) -> None:
    experiment = workdir / "e.toml"
    experiment.write_text(EXPERIMENT.format(name=name))
    _refused(gradsync("sbatch", str(experiment), *options, cwd=workdir, timeout=60), says)
    assert not (workdir / "results").exists() and not (workdir / "escaped").exists()
