"""Experiment files' ``[published_gain]``: parsing, and the report's measured-vs-paper table."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradsync.bench.analysis import Row
from gradsync.bench.experiment import Cell, PublishedGain, load_experiment
from gradsync.bench.report import gain_section, measured_gains
from gradsync.errors import UserError

BASE = """
name = "gain"
models = ["mnist-cnn"]
preset = "tiny"
strategies = ["ps", "p3"]
"""


def experiment_file(tmp_path: Path, table: str) -> Path:
    path = tmp_path / "gain.toml"
    path.write_text(BASE + "\n[published_gain]\n" + table)
    return path


def row(strategy: str, median: float, link: str, spread: float = 0.0) -> Row:
    cell = Cell(
        model="mnist-cnn", strategy=strategy, workers=2, options=(("servers", 1),), bandwidth=link
    )
    return Row(
        cell=cell,
        median=median,
        low=median - spread,
        high=median + spread,
        repeats=2,
        bytes_per_step=0.0,
        exposed_comm_ms=0.0,
        loss=[],
    )


def test_published_gain_is_read_with_its_numbers(tmp_path: Path) -> None:
    path = experiment_file(
        tmp_path, 'strategy = "p3"\nbaseline = "ps"\nsource = "paper"\nmnist-cnn = 0.5\n'
    )
    assert load_experiment(path).published_gain == PublishedGain(
        strategy="p3", baseline="ps", source="paper", gains={"mnist-cnn": 0.5}
    )


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('strategy = "p3"\nbaseline = "ps"\n', "needs strategy, baseline and source"),
        ('strategy = "p3"\nbaseline = "ddp"\nsource = "x"\n', "compares 'ddp'"),
        ('strategy = "p3"\nbaseline = "ps"\nsource = "x"\nvgg19 = 0.6\n', "for 'vgg19'"),
        ('strategy = "p3"\nbaseline = "ps"\nsource = "x"\nmnist-cnn = "a lot"\n', "finite number"),
        ('strategy = "p3"\nbaseline = "ps"\nsource = "x"\nmnist-cnn = nan\n', "finite number"),
    ],
)
def test_bad_published_gain_is_a_user_error(tmp_path: Path, table: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        load_experiment(experiment_file(tmp_path, table))


def test_gain_section_pairs_each_link_and_sets_the_paper_beside_it() -> None:
    published = PublishedGain(strategy="p3", baseline="ps", source="the paper", gains={})
    rows = [
        row("ps", 10.0, "1gbit"),
        row("p3", 15.0, "1gbit"),
        row("ps", 20.0, "10gbit", spread=2.0),
        row("p3", 21.0, "10gbit", spread=2.0),
        row("p3", 9.0, "100mbit"),  # no ps at this link: no pair
    ]
    pairs = measured_gains(published, rows)
    assert [(base.median, mine.median) for base, mine in pairs] == [(10.0, 15.0), (20.0, 21.0)]
    text = "\n".join(gain_section(published, rows))
    assert "| mnist-cnn | 1gbit | 2 | 10.0 (10.0–10.0) | 15.0 (15.0–15.0) | +50% | - |" in text
    assert "+5% (ranges overlap)" in text
    with_paper = PublishedGain(strategy="p3", baseline="ps", source="x", gains={"mnist-cnn": 0.66})
    assert "| +50% | +66% |" in "\n".join(gain_section(with_paper, rows))


def test_a_gain_for_a_model_not_run_says_how_to_go_on(tmp_path: Path) -> None:
    """Shrinking p3-artifact's models was refused with no way forward (seed probe, F10)."""
    path = tmp_path / "x.toml"
    path.write_text(
        'name = "x"\nmodels = ["mnist-cnn"]\nstrategies = ["ps", "p3"]\n'
        '[published_gain]\nstrategy = "p3"\nbaseline = "ps"\nsource = "P3"\nvgg19 = 0.66\n'
    )
    with pytest.raises(UserError, match=r"add 'vgg19' to models, or drop its line"):
        load_experiment(path)
