"""Bad input to ``profile``, ``predict`` and ``timeline summarize``: one line, exit 2, before
any work, and nothing already written lost, mixed or half-written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradsync.cli import main
from gradsync.predict.profile import Profile
from tests.unit.test_predict import profile_of, variable

FAST = ["--workers", "1,2", "--bandwidth", "1gbit", "--strategies", "allreduce", "--no-recommend"]


def refused(argv: list[str], capsys: pytest.CaptureFixture[str], *words: str) -> str:
    """Run ``gradsync argv``: exit 2 and one ``gradsync: error:`` line holding ``words``."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("gradsync: error: "), err
    for word in words:
        assert word in err, err
    return err


@pytest.fixture
def profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    profile_of([variable("w", 1000, 0.5)]).save(path)
    return path


@pytest.fixture
def no_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    def measure(*_args: object) -> None:
        raise AssertionError("measured before the bad input was refused")

    monkeypatch.setattr("gradsync.predict.profile.measure_profile", measure)


# -- 1. profile --out ----------------------------------------------------------------------


def test_profile_out_is_claimed_before_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_measuring: None
) -> None:
    other = tmp_path / "config.json"
    other.write_text('{"another": "run"}')
    profile = ["profile", "--model", "mnist-cnn", "--preset", "tiny", "--out"]
    refused([*profile, str(other)], capsys, "already exists", "--overwrite")
    assert other.read_text() == '{"another": "run"}'
    refused([*profile, str(tmp_path)], capsys, "is a folder")
    refused([*profile, str(other / "p.json")], capsys, "a folder on its path is a file")


def test_profile_overwrite_replaces_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    measured = profile_of([variable("w", 10, 0.5)])
    monkeypatch.setattr("gradsync.predict.profile.measure_profile", lambda _request: measured)
    out = tmp_path / "p.json"
    profile_of([variable("old", 1, 0.1)]).save(out)  # an earlier profile
    assert main(["profile", "--model", "mnist-cnn", "--out", str(out), "--overwrite"]) == 0
    assert Profile.load(out) == measured
    out.write_text("a user's notes")  # not a profile: kept
    assert main(["profile", "--model", "mnist-cnn", "--out", str(out), "--overwrite"]) == 2
    assert out.read_text() == "a user's notes"


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--warmup", "-1"], "--warmup must be >= 0"),  # medians of the last step alone
        (["--workers", "3"], "8, does not divide by --workers 3"),  # a shard no run computes
    ],
)
def test_profile_settings_train_would_refuse_are_refused(
    flags: list[str], words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.json"
    refused(["profile", "--model", "mnist-cnn", "--preset", "tiny", *flags, "--out", str(out)],
            capsys, words)  # fmt: skip
    assert not out.exists()


# -- 2. predict --out ----------------------------------------------------------------------


def test_predict_out_is_one_run(
    profile_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pred"
    predict = ["predict", "--profile", str(profile_file), *FAST, "--out"]
    assert main([*predict, str(out)]) == 0
    before = (out / "predictions.json").read_text()
    refused([*predict, str(out)], capsys, "already holds a run", "--overwrite")
    assert (out / "predictions.json").read_text() == before
    assert main([*predict, str(out), "--overwrite"]) == 0  # its own output: replaced
    train_run = tmp_path / "train"
    train_run.mkdir()
    (train_run / "config.json").write_text("{}")
    refused([*predict, str(train_run)], capsys, "already holds a run")
    unrelated = tmp_path / "notes"
    unrelated.mkdir()
    (unrelated / "todo.txt").write_text("keep me")
    refused([*predict, str(unrelated), "--overwrite"], capsys, "refuses to clear")
    assert [p.name for p in train_run.iterdir()] == ["config.json"]
    assert [p.name for p in unrelated.iterdir()] == ["todo.txt"]
    refused([*predict, str(profile_file)], capsys, "is a file")


# -- 3. damaged profiles -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"forward_s": "fast"}, "forward_s"),
        ({"forward_s": None}, "forward_s"),
        ({"backward_s": float("nan")}, "backward_s"),
        ({"layers": []}, "layers"),
        ({"batch": 0}, "batch"),
        ({"variables": [{"name": "w"}]}, "numel"),
    ],
)
def test_a_damaged_profile_names_its_field(
    change: dict, words: str, profile_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = json.loads(profile_file.read_text())
    profile_file.write_text(json.dumps({**raw, **change}))
    refused(["predict", "--profile", str(profile_file)], capsys, str(profile_file), words)


def test_a_variable_outside_the_layers_is_refused(
    profile_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = json.loads(profile_file.read_text())
    raw["variables"][0]["layer"] = 3
    profile_file.write_text(json.dumps(raw))
    refused(["predict", "--profile", str(profile_file)], capsys, "variables[0].layer")


@pytest.mark.parametrize(
    ("content", "words"),
    [("[1, 2]", "not a gradsync profile"), (b"\x00\xff\xfe", "not a gradsync profile")],
)
def test_a_profile_that_is_no_object_is_one_line(
    content: str | bytes, words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    err = refused(["predict", "--profile", str(path)], capsys, words)
    assert "pop expected" not in err


@pytest.mark.parametrize("value", ["inf", "infms", "nan"])
def test_a_latency_no_step_can_wait_is_one_line(
    value: str, profile_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An infinite latency made the simulator wait forever; it is refused before --out."""
    out = tmp_path / "pred"
    argv = ["predict", "--profile", str(profile_file), *FAST, "--out", str(out)]
    refused([*argv, "--latency", value], capsys, "--latency")
    refused([*argv, "--queue", value], capsys, "--queue")
    assert not out.exists()


def test_a_profile_folder_is_not_called_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(["predict", "--profile", str(tmp_path)], capsys, "is a folder")
    assert "does not exist" not in err


# -- 4, 5. speed-up and intra-host rate ----------------------------------------------------


@pytest.mark.parametrize("speedup", ["inf", "nan", "0", "-2"])
def test_compute_speedup_is_a_finite_positive_number(
    speedup: str, profile_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["predict", "--profile", str(profile_file), "--compute-speedup", speedup]
    refused([*argv, "--out", str(out)], capsys, "--compute-speedup", "finite")
    assert not out.exists()


def test_intra_bandwidth_is_named_as_itself(
    profile_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["predict", "--profile", str(profile_file), "--intra-bandwidth", "0"]
    err = refused(argv, capsys, "--intra-bandwidth '0'")
    assert "--bandwidth '0'" not in err


# -- 6. predict --experiment ---------------------------------------------------------------


def experiment_file(tmp_path: Path, profile: Path, *lines: str) -> Path:
    """An experiment predicting ``profile`` quickly into tmp_path/exp, with ``lines`` added
    (each replaces the key it sets)."""
    keys = {
        "profiles": f'{{ hand = "{profile}" }}',
        "out": f'"{tmp_path / "exp"}"',
        "workers": "[1, 2]",
        "bandwidth": '["1gbit"]',
        "strategies": '["allreduce"]',
    }
    keys.update(line.split(" = ", 1) for line in lines)  # type: ignore[arg-type]
    path = tmp_path / "experiment.toml"
    path.write_text("".join(f"{key} = {value}\n" for key, value in keys.items()))
    return path


@pytest.mark.parametrize(
    "line",
    [
        "workers = 2",
        "bandwidth = 1",
        "strategies = 5",
        "latency = 5",
        'compute_speedup = "fast"',
        "compute_speedup = inf",
        'batch = "8"',
        'ranks_per_host = "2"',
        "ranks_per_host = 0",
        'colocate = "no"',
        "profiles = { m = 5 }",
    ],
)
def test_an_experiment_key_of_the_wrong_type_is_one_line(
    line: str,
    profile_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_measuring: None,
) -> None:
    path = experiment_file(tmp_path, profile_file, line)
    refused(["predict", "--experiment", str(path)], capsys, str(path), line.split(" = ")[0])
    assert not (tmp_path / "exp").exists()


@pytest.mark.parametrize("where", ["folder", "under a file"])
def test_an_experiment_profile_path_must_be_writable_as_a_file(
    where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_measuring: None
) -> None:
    (tmp_path / "a-file").write_text("x")
    profile = tmp_path if where == "folder" else tmp_path / "a-file" / "p.json"
    path = experiment_file(tmp_path, profile, f'profiles = {{ mnist-cnn = "{profile}" }}')
    refused(["predict", "--experiment", str(path)], capsys, "profiles.mnist-cnn")
    if where == "folder":  # refused before its out was claimed: no empty folder left
        assert not (tmp_path / "exp").exists()


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ('profiles = { vgg16 = "PROFILE" }', "measured with model hand-made, not vgg16"),
        ('preset = "default"', "measured with preset none, not default"),
        ("batch = 64", "measured with batch 10, not 64"),
    ],
)
def test_an_experiment_profile_of_another_model_preset_or_batch_is_refused(
    line: str, words: str, profile_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mnist-cnn profile under the key vgg16 was predicted and filed as vgg16 (session
    24's probe); a profile under a key that names no zoo model (here: hand) is the user's."""
    path = experiment_file(tmp_path, profile_file, line.replace("PROFILE", str(profile_file)))
    refused(["predict", "--experiment", str(path)], capsys, words)
    assert not (tmp_path / "exp").exists()


def test_a_flag_given_beside_an_experiment_wins_over_its_key(
    profile_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--workers on the command line is what runs, not the file's workers (it was dropped)."""
    path = experiment_file(tmp_path, profile_file, "workers = [4]")
    assert main(["predict", "--experiment", str(path), "--workers", "2"]) == 0
    predictions = json.loads((tmp_path / "exp" / "hand" / "predictions.json").read_text())
    assert {point["workers"] for point in predictions["points"]} == {2}


def test_an_experiment_claims_its_out_once(
    profile_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = experiment_file(tmp_path, profile_file)
    assert main(["predict", "--experiment", str(path)]) == 0
    out = tmp_path / "exp"
    assert (out / "hand" / "predictions.json").is_file()
    before = (out / "hand" / "predictions.json").read_text()
    refused(["predict", "--experiment", str(path)], capsys, "already holds a run")
    assert (out / "hand" / "predictions.json").read_text() == before
    assert main(["predict", "--experiment", str(path), "--overwrite"]) == 0


# -- 7. predict --validate -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("model = 5", "model = 5"),
        ("strategies = 5", "strategies = 5 is not a list of strings"),
        ('bandwidths = "1gbit"', "bandwidths"),
        ("recommend = 1", "recommend"),
    ],
)
def test_a_validation_key_of_the_wrong_type_is_one_line(
    line: str, words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = {"strategies": '["ddp"]', "bandwidths": '["1gbit"]'}
    keys.update([line.split(" = ", 1)])  # type: ignore[list-item]
    text = "".join(f"{key} = {value}\n" for key, value in keys.items())
    plan = tmp_path / "plan.toml"
    plan.write_text(text + ("" if line.startswith("model") else '[[model]]\nname = "vgg16"\n'))
    err = refused(["predict", "--validate", str(plan), "--out", str(tmp_path / "v")], capsys)
    assert words in err and str(plan) in err and "object is not" not in err


def test_a_validation_refuses_a_foreign_folder_and_resumes_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gradsync.predict.validate import claim_validation_dir

    plan = tmp_path / "plan.toml"
    plan.write_text('strategies = ["ddp"]\nbandwidths = ["1gbit"]\n[[model]]\nname = "vgg16"\n')
    train_run = tmp_path / "train"
    train_run.mkdir()
    (train_run / "config.json").write_text("{}")
    refused(["predict", "--validate", str(plan), "--out", str(train_run)], capsys, "holds a run")
    assert [p.name for p in train_run.iterdir()] == ["config.json"]
    earlier = tmp_path / "validation"
    claim_validation_dir(earlier, plan, overwrite=False)  # a new folder: the plan is copied in
    assert (earlier / "plan.toml").read_bytes() == plan.read_bytes()
    (earlier / "cells.jsonl").write_text('{"id": "a"}\n')
    claim_validation_dir(earlier, plan, overwrite=False)  # the same plan goes on
    assert (earlier / "cells.jsonl").read_text() == '{"id": "a"}\n'
    claim_validation_dir(earlier, earlier / "plan.toml", overwrite=False)  # from its own copy
    claim_validation_dir(earlier, plan, overwrite=True)  # starts afresh
    assert [p.name for p in earlier.iterdir()] == ["plan.toml"]


def test_a_validation_refuses_another_plans_cells_and_an_unrecorded_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Cells measured under another plan (other steps, hosts, models) would mix into this
    plan's summary: refused in one line, nothing touched."""
    first, second = tmp_path / "first.toml", tmp_path / "second.toml"
    first.write_text('strategies = ["ddp"]\nbandwidths = ["1gbit"]\n[[model]]\nname = "vgg16"\n')
    second.write_text(first.read_text().replace("1gbit", "100mbit"))
    out = tmp_path / "v"
    out.mkdir()
    (out / "cells.jsonl").write_text('{"id": "a"}\n')
    args = ["predict", "--validate", str(second), "--out", str(out)]
    refused(args, capsys, "does not record its plan")  # written before plans were kept
    (out / "plan.toml").write_bytes(first.read_bytes())
    refused(args, capsys, "holds the cells of another validation plan")
    assert sorted(p.name for p in out.iterdir()) == ["cells.jsonl", "plan.toml"]
    assert (out / "plan.toml").read_bytes() == first.read_bytes()
    assert (out / "cells.jsonl").read_text() == '{"id": "a"}\n'


# -- 8. timeline summarize -----------------------------------------------------------------


def test_timeline_summarize_refuses_a_predicted_trace_in_one_line(
    profile_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pred"
    assert main(["predict", "--profile", str(profile_file), *FAST, "--out", str(out)]) == 0
    capsys.readouterr()
    refused(["timeline", "summarize", str(out / "trace.json")], capsys, "predicted")
    assert not (out / "trace.summary.json").exists()


def test_timeline_summarize_refuses_a_binary_file_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00\xa8\xff\xfe")
    refused(["timeline", "summarize", str(weights)], capsys, "not a gradsync Chrome-trace")


def _trace(path: Path, steps: list[int]) -> Path:
    """A minimal gradsync trace: one rank's STEP spans."""
    events: list[dict[str, object]] = []
    for i, step in enumerate(steps):
        track = {"name": "STEP", "pid": 0, "tid": 0}
        begin = {**track, "ph": "B", "ts": 10 * i, "args": {"step": step}}
        events += [begin, {**track, "ph": "E", "ts": 10 * i + 5}]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_timeline_summarize_writes_nothing_when_it_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trace without steps, or a folder where a summary goes, refuses every trace given
    before any summary is written; an earlier summary is left as it was."""
    good, empty = _trace(tmp_path / "good.json", [1, 2]), _trace(tmp_path / "empty.json", [])
    (tmp_path / "empty.summary.json").write_text('{"mine": "precious"}')
    refused(["timeline", "summarize", str(good), str(empty)], capsys, "records no steps")
    assert not (tmp_path / "good.summary.json").exists()
    assert (tmp_path / "empty.summary.json").read_text() == '{"mine": "precious"}'
    (tmp_path / "good.summary.json").mkdir()
    refused(["timeline", "summarize", str(good)], capsys, "is a folder")
