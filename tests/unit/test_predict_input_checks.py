"""Session 30's probe of ``gradsync predict``: flags against experiment keys, the exposed
column, servers and colocate, the recommendation, and input checks (one line, exit 2)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gradsync.cli import main
from gradsync.commbench import CommbenchConfig
from gradsync.errors import UserError
from gradsync.predict.network import Cluster, Network
from gradsync.predict.simulate import StrategyChoice, predict_step
from gradsync.strategies.allreduce import AllreduceOptions
from gradsync.strategies.ps import PSOptions
from tests.unit.test_predict import ALLREDUCE, profile_of, variable
from tests.unit.test_predict_bad_inputs import experiment_file, refused


@pytest.fixture
def profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    profile_of([variable("w", 1000, 0.5)]).save(path)
    return path


# Two workers on one 1 Gbit/s network, no knob search: quick.
FAST_2 = ["--workers", "2", "--bandwidth", "1gbit", "--no-recommend"]


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


# -- 5. exposed communication leaves out the worker's optimizer and copies ----------------


@pytest.mark.parametrize(
    "choice",
    [
        StrategyChoice("allreduce", AllreduceOptions(fusion_threshold_mb=64)),
        StrategyChoice("ps", PSOptions(colocate=True)),  # its one server in its process
    ],
)
def test_one_worker_exposes_no_communication_however_long_its_optimizer(
    choice: StrategyChoice,
) -> None:
    """With 1 worker the step is compute + copies + optimizer: "exposed" was step - compute,
    so it showed the optimizer's 6% as communication."""
    costs = {"optimizer_s_per_byte": 1e-7, "copy_s_per_byte": 1e-8}
    profile = dataclasses.replace(profile_of([variable("a", 250_000, 2.0)]), **costs)
    step = predict_step(profile, Cluster(workers=1, network=Network(bandwidth=1e6)), choice)
    assert step.step_s > profile.compute_s
    assert step.exposed_comm_s == pytest.approx(0.0)


def test_exposed_communication_is_the_wait_beyond_compute_and_optimizer() -> None:
    profile = dataclasses.replace(
        profile_of([variable("a", 250_000, 2.0)]), optimizer_s_per_byte=1e-7
    )
    network = Network(bandwidth=1e6)
    step = predict_step(profile, Cluster(workers=2, network=network), ALLREDUCE)
    ring = 2 * (2 - 1) / 2 * (250_000 + 1) * 4 / 1e6
    assert step.step_s == pytest.approx(3.0 + ring + 0.1)
    assert step.exposed_comm_s == pytest.approx(ring)


# -- 6. --servers and --colocate beside a spec's own options ------------------------------


@pytest.fixture
def four_variables(tmp_path: Path) -> Path:
    """A profile with enough slices and partitions for 3 servers."""
    path = tmp_path / "four.json"
    profile_of([variable(f"w{i}", 100_000, 0.5) for i in range(4)]).save(path)
    return path


def test_a_spec_servers_wins_over_the_servers_flag(
    four_variables: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--servers 2 beside ps:servers=4 modelled ps:servers=2 (the flag was appended)."""
    argv = [
        "predict",
        "--profile",
        str(four_variables),
        "--servers",
        "2",
        "--strategies",
        "ps:servers=3,p3",
    ]
    assert main([*argv, *FAST_2, "--out", str(tmp_path / "out")]) == 0
    assert settings_of(tmp_path / "out")["strategies"] == ["ps:servers=3", "p3:servers=2"]


def test_colocate_applies_to_p3_too(
    four_variables: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--colocate was left out of p3's spec, though p3:colocate is modelled."""
    argv = ["predict", "--profile", str(four_variables), "--colocate", "--strategies", "p3,ps"]
    out = tmp_path / "out"
    assert main([*argv, *FAST_2, "--out", str(out)]) == 0
    assert settings_of(out)["strategies"] == ["p3:colocate", "ps:colocate"]


@pytest.mark.parametrize(
    ("strategies", "words"),
    [
        ("ps:servers=2:servers=1", "'ps:servers=2:servers=1' sets servers twice"),
        ("allreduce,allreduce", "lists allreduce more than once"),
    ],
)
def test_an_option_or_strategy_given_twice_is_refused(
    strategies: str,
    words: str,
    profile_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["predict", "--profile", str(profile_file), "--strategies", strategies, *FAST_2]
    refused([*argv, "--out", str(tmp_path / "out")], capsys, words)
    assert not (tmp_path / "out").exists()


# -- 7. the recommendation searches the listed strategies, as listed ----------------------


def recommendations_of(argv: list[str], out: Path) -> list[dict[str, object]]:
    assert main(["predict", *argv, "--bandwidth", "8mbit", "--out", str(out)]) == 0
    return json.loads((out / "predictions.json").read_text())["recommendations"]


def test_the_recommendation_stays_among_the_listed_strategies(
    four_variables: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--strategies ps recommended allreduce, a row not in the table, against allreduce."""
    argv = ["--profile", str(four_variables), "--strategies", "ps", "--workers", "2,4"]
    (found,) = recommendations_of(argv, tmp_path / "out")
    assert str(found["best"]).split(":")[0] == "ps"
    assert found["default"] == "ps"
    assert "over ps (" in capsys.readouterr().out


def test_the_recommendation_keeps_the_options_listed(
    four_variables: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The listed allreduce:fusion_threshold_mb=0 was compared as plain allreduce."""
    spec = "allreduce:fusion_threshold_mb=0"
    argv = ["--profile", str(four_variables), "--strategies", spec, "--workers", "4"]
    (found,) = recommendations_of(argv, tmp_path / "out")
    assert found["default"] == "allreduce:fusion_threshold_mb=0.0"


def test_the_knob_gain_is_over_the_fastest_listed_setting_of_the_strategy(
    four_variables: Path, tmp_path: Path
) -> None:
    """With ps:servers=1 and ps:servers=4 listed, the gain of the best ps setting was
    quoted over servers=1 (the first listed), not over the faster servers=4."""
    specs = "ps:servers=1,ps:servers=4"
    argv = ["--profile", str(four_variables), "--strategies", specs, "--workers", "4"]
    (found,) = recommendations_of(argv, tmp_path / "out")
    points = json.loads((tmp_path / "out" / "predictions.json").read_text())["points"]
    listed = {row["strategy"]: row["throughput"] for row in points}
    assert listed["ps:servers=4"] > listed["ps:servers=1"]  # the case this test is about
    best = float(str(found["best_throughput"]))
    expected = best / listed["ps:servers=4"] - 1
    assert found["gain_over_strategy_default"] == pytest.approx(expected)


# -- 8/11. a damaged commbench.json for --calibrate is one line naming the file -------------


def ring_rows(*sizes_and_times: tuple[object, object], **extra: object) -> list[dict[str, object]]:
    return [
        {"op": "allreduce", "bytes": size, "time_s": seconds, **extra}
        for size, seconds in sizes_and_times
    ]


GOOD_ROWS = ring_rows((4096, 1e-3), (2**20, 2e-2), (2**22, 8e-2))


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        ({"results": ring_rows((4096, 1e-3), (4096, 2e-3))}, "at two or more distinct sizes"),
        ({"results": ring_rows((4096, 1e-3), (2**20, float("nan")))}, "time_s at 1048576 bytes"),
        ({"results": ring_rows((4096, 1e-3), (2**20, -1.0))}, "not a finite number > 0"),
        ({"results": [{"op": "allreduce", "time_s": 1.0}, *GOOD_ROWS]}, "results[0] needs"),
        ({"results": ring_rows((4096, 1e-3), (2**20, 2e-2), cpu_s=None)}, "cpu_s at 4096"),
        ({"results": "allreduce"}, "no list of results"),
        ({"results": GOOD_ROWS, "bandwidth": "fast"}, "bandwidth 'fast' is not a rate"),
        ({"results": GOOD_ROWS, "world_size": "2"}, "world_size is '2'"),
    ],
)
def test_a_damaged_calibration_is_one_line_naming_the_file(
    payload: dict[str, object],
    words: str,
    profile_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One size passed (slope 0); NaN and negative times were taken; a missing bytes key, a
    null cpu_s or a string of results was a traceback; a bad bandwidth was the flag's."""
    path = tmp_path / "commbench.json"
    path.write_text(json.dumps({"world_size": 2, **payload}))
    argv = ["predict", "--profile", str(profile_file), "--calibrate", str(path), *FAST_2]
    refused([*argv, "--out", str(tmp_path / "out")], capsys, f"--calibrate {path}: ", words)
    assert not (tmp_path / "out").exists()


def test_a_sound_calibration_is_taken(
    profile_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "commbench.json"
    path.write_text(json.dumps({"world_size": 2, "bandwidth": "1gbit", "results": GOOD_ROWS}))
    argv = ["predict", "--profile", str(profile_file), "--calibrate", str(path), *FAST_2]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0


@pytest.mark.parametrize(
    ("options", "words"),
    [({"sizes": (4096, 4096)}, "--sizes lists 4096 more"), ({"busy_ms": (1.0, 1.0)}, "--busy-ms")],
)
def test_commbench_refuses_a_size_or_busy_time_given_twice(
    options: dict[str, tuple[float, ...]], words: str
) -> None:
    """--sizes 4K,4K measured one size twice: a calibration from it has no slope."""
    with pytest.raises(UserError, match=words):
        CommbenchConfig(workers=2, **options)  # type: ignore[arg-type]


# -- 9. an experiment writes nothing until every model is predicted ------------------------


def test_an_experiment_writes_nothing_when_a_later_model_cannot_be_modelled(
    profile_file: Path,
    four_variables: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Model a was written, b's folder left empty (a rerun refused), and the error did
    not name b."""
    profiles = f'profiles = {{ a = "{four_variables}", b = "{profile_file}" }}'
    path = experiment_file(tmp_path, profile_file, profiles, 'strategies = ["ps:servers=2"]')
    refused(["predict", "--experiment", str(path)], capsys, f"{path}: profiles.b: ")
    assert not (tmp_path / "exp").exists()


def test_a_profile_that_cannot_be_modelled_leaves_no_out(
    profile_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["predict", "--profile", str(profile_file), "--strategies", "ps:servers=2", *FAST_2]
    refused([*argv, "--out", str(tmp_path / "out")], capsys, "no configuration can be modelled")
    assert not (tmp_path / "out").exists()


# -- 10, 18. profile fields that disagree with each other: one line, no --out -------------


def two_variables() -> dict[str, Any]:
    """A sound profile as JSON: two variables in one layer."""
    profile = profile_of([variable("w", 1000, 0.5), variable("b", 10, 1.0)])
    return json.loads(profile.to_json())


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda p: p["variables"][0].update(element_size=3), "element_size = 3"),
        (lambda p: p["variables"][1].update(grad_ready_s=2.5), "grad_ready_s = 2.5"),
        (lambda p: p["layers"][0].update(forward_start_s=1.5), "forward_start_s = 1.5"),
        (lambda p: p["variables"][1].update(name="w"), 'variables[1].name = "w"'),
        (
            lambda p: p["variables"][0].update(sparse=True, num_rows=10, rows_touched=11.0),
            "rows_touched = 11.0 is not at most num_rows (10)",
        ),
        (lambda p: p.update(dtype="float12"), 'dtype = "float12"'),
        (lambda p: p.update(device="tpu"), 'device = "tpu"'),
        (lambda p: p.update(batchnorm="sync"), 'batchnorm = "sync"'),
    ],
)
def test_a_profile_whose_fields_disagree_is_one_line(
    change: Callable[[dict[str, Any]], None],
    words: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """element_size 3 was a KeyError in the simulator that left an empty --out."""
    raw = two_variables()
    change(raw)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(raw))
    argv = ["predict", "--profile", str(path), "--strategies", "allreduce", *FAST_2]
    refused([*argv, "--out", str(tmp_path / "out")], capsys, str(path), words)
    assert not (tmp_path / "out").exists()


# -- 18. a latency needs its unit, as a bandwidth does -------------------------------------


@pytest.mark.parametrize(("flag", "value"), [("--latency", "25"), ("--queue", "50")])
def test_a_duration_without_a_unit_is_refused(
    flag: str, value: str, profile_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--latency 25 meant 25 seconds where --bandwidth 100 is refused for lacking a unit."""
    argv = ["predict", "--profile", str(profile_file), flag, value, *FAST_2]
    refused([*argv, "--out", str(tmp_path / "out")], capsys, f"{flag} '{value}' has no unit")


def test_a_zero_latency_needs_no_unit(
    profile_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["predict", "--profile", str(profile_file), "--latency", "0", *FAST_2]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0


# -- 13. a validation resumes past a line cut short ----------------------------------------


def test_a_validation_log_cut_short_is_skipped_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A killed validation's half-written last line was a JSONDecodeError on resume."""
    from gradsync.predict.validate import _append_cell, _read_cells

    log = tmp_path / "cells.jsonl"
    log.write_text(json.dumps({"id": "a", "status": "ok"}) + '\n{"id": "b", "sta')
    assert [cell["id"] for cell in _read_cells(log)] == ["a"]
    assert "line 2 is not a complete record" in capsys.readouterr().err
    _append_cell(log, {"id": "b", "status": "ok"})  # the rerun measures b again
    assert [cell["id"] for cell in _read_cells(log)] == ["a", "b"]


# -- 15. a validation plan that would measure nothing, or a host without a rank ------------


@pytest.mark.parametrize(
    ("lines", "words"),
    [
        ("strategies = []", "strategies is empty"),
        ('bandwidths = ["1gbit", "1gbit"]', "bandwidths lists 1gbit more than once"),
        ("workers = 1", "workers = 1 measures no communication"),
        ("hosts = 5", "they fill only 2 of hosts = 5"),
        ('strategies = ["hybrid:colocate"]\nhosts = 3', "fill only 2 of hosts = 3"),
        ('strategies = ["ddp", "ddp"]', "strategies lists ddp more than once"),
    ],
)
def test_a_validation_plan_that_measures_nothing_is_one_line(
    lines: str, words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each was accepted: [] ran nothing (exit 0), 5 hosts for 2 workers, 1 worker."""
    keys = {"strategies": '["ddp"]', "bandwidths": '["1gbit"]', "workers": "2"}
    keys.update(line.split(" = ", 1) for line in lines.splitlines())  # type: ignore[misc]
    text = "".join(f"{key} = {value}\n" for key, value in keys.items())
    plan = tmp_path / "plan.toml"
    plan.write_text(text + '[[model]]\nname = "mnist-cnn"\n')
    argv = ["predict", "--validate", str(plan), "--out", str(tmp_path / "v")]
    refused(argv, capsys, str(plan), words)
    assert not (tmp_path / "v").exists()


@pytest.mark.parametrize(
    ("models", "words"),
    [
        ('[[model]]\nname = "mnist-cnn"\nbandwidths = []\n', "mnist-cnn: bandwidths is empty"),
        ('[[model]]\nname = "mnist-cnn"\n' * 2, "lists mnist-cnn (default) more than once"),
    ],
)
def test_a_validation_model_measured_nowhere_or_twice_is_one_line(
    models: str, words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text('strategies = ["ddp"]\nbandwidths = ["1gbit"]\n' + models)
    argv = ["predict", "--validate", str(plan), "--out", str(tmp_path / "v")]
    refused(argv, capsys, str(plan), words)
