"""Session 30's probe of ``gradsync predict``: flags against experiment keys, the exposed
column, servers and colocate, the recommendation, and input checks (one line, exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradsync.cli import main
from tests.unit.test_predict import profile_of, variable
from tests.unit.test_predict_bad_inputs import experiment_file, refused  # noqa: F401


@pytest.fixture
def profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    profile_of([variable("w", 1000, 0.5)]).save(path)
    return path


def settings_of(out: Path) -> dict[str, object]:
    return json.loads((out / "predictions.json").read_text())["settings"]


# -- 4. a flag typed with its default value still wins over the experiment's key ----------


def test_a_flag_at_its_default_value_wins_over_the_experiment_key(
    profile_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--latency 25us (the default) lost to the file's latency = "1s": "given" was decided
    by comparing with the default."""
    path = experiment_file(tmp_path, profile_file, 'latency = "1s"')
    assert main(["predict", "--experiment", str(path), "--latency", "25us", "--no-recommend"]) == 0
    assert settings_of(tmp_path / "exp" / "hand")["latency_s"] == pytest.approx(25e-6)


def test_an_experiment_key_fills_a_flag_left_out(
    profile_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = experiment_file(tmp_path, profile_file, 'latency = "1ms"')
    assert main(["predict", "--experiment", str(path), "--no-recommend"]) == 0
    assert settings_of(tmp_path / "exp" / "hand")["latency_s"] == pytest.approx(1e-3)
