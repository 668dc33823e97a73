"""Issue 12 without processes: run folders, heartbeats and blame, bench identity, bounds,
checkpoint metadata, resume checks, a loss that is not finite."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from unittest import mock

import pytest
import torch

from gradsync import checkpoint
from gradsync.bench import sweep
from gradsync.bench.experiment import Experiment, check_bounds
from gradsync.checkpoint import load_checkpoint, save_checkpoint, sidecar_path
from gradsync.config import OptimConfig, TrainConfig
from gradsync.errors import UserError
from gradsync.heartbeat import LastBeat
from gradsync.jobs import inputs_of, validate
from gradsync.launch import RankProcess, _blame_order, _failure, _silent_rank, _terminate
from gradsync.resume import check_resume, checkpoint_step, meta_differences, resumable
from gradsync.rundir import claim_output_file, claim_run_dir
from gradsync.runtime import CHECKPOINT_FILE
from gradsync.signals import HANDLED, Stopped, signals_deferred, stop_on_signals
from gradsync.strategies import STRATEGIES
from gradsync.strategies.single import SingleProcess
from gradsync.trainer import LossNotFinite, check_loss

# ---------------------------------------------------------------- run folders


def test_a_used_run_folder_is_refused_and_overwrite_clears_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    (run / "metrics" / "rank1.jsonl").write_text("{}\n")
    with pytest.raises(UserError, match="--overwrite"):
        claim_run_dir(run, overwrite=False)
    claim_run_dir(run, overwrite=True)
    assert run.is_dir() and not any(run.iterdir())


def test_another_nodes_launch_files_do_not_make_the_folder_used(tmp_path: Path) -> None:
    """Node 1 may be writing its launch files (through temporaries) while node 0 claims."""
    run = tmp_path / "run"
    run.mkdir()
    for name in (
        "ranks-node1.json",
        ".ranks-node1.json.k2j4.tmp",
        ".launch-node1.json",
        "..launch-node1.json.x9q1.tmp",
        ".gradsync-probe.abc",
    ):
        (run / name).write_text("{}")
    claim_run_dir(run, overwrite=False)
    (run / ".summary.json.q1w2.tmp").write_text("{}")
    with pytest.raises(UserError, match="already holds a run"):
        claim_run_dir(run, overwrite=False)


def test_overwrite_never_clears_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    (tmp_path / "thesis.tex").write_text("years of work")
    with pytest.raises(UserError, match="no gradsync run"):
        claim_run_dir(tmp_path, overwrite=True)
    assert (tmp_path / "thesis.tex").exists()


def test_overwrite_clears_an_older_predict_experiment_folder(tmp_path: Path) -> None:
    (tmp_path / "vgg16").mkdir()
    (tmp_path / "vgg16" / "predictions.json").write_text("{}")
    claim_run_dir(tmp_path, overwrite=True)
    assert not any(tmp_path.iterdir())


def test_overwrite_clears_a_demo_folder_whose_cells_are_runs(tmp_path: Path) -> None:
    """A demo (or a verify stopped before its verdict) holds its cells' runs one level
    down and its own results.json/.md: gradsync's output, so --overwrite clears it."""
    (tmp_path / "results.json").write_text("{}")
    (tmp_path / "results.md").write_text("# demo")
    (tmp_path / "single-w1" / "metrics").mkdir(parents=True)
    (tmp_path / "single-w1" / "config.json").write_text("{}")
    claim_run_dir(tmp_path, overwrite=True)
    assert not any(tmp_path.iterdir())
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "config.json").write_text("{}")  # a config alone is not a run
    with pytest.raises(UserError, match="no gradsync run"):
        claim_run_dir(tmp_path, overwrite=True)


def test_overwrite_never_deletes_an_input_of_the_run(tmp_path: Path) -> None:
    """A model file, data or an experiment inside --out would be lost with the old run:
    --overwrite refuses and touches nothing."""
    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (run / "nets").mkdir()
    (run / "nets" / "mine.py").write_text("def build(): ...")
    config = TrainConfig(model=f"{run}/nets/mine.py:build", out=str(run))
    with pytest.raises(UserError, match=r"this run reads .*mine\.py, which lies inside it"):
        claim_run_dir(run, overwrite=True, inputs=inputs_of(config))
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "metrics", "nets"]
    with pytest.raises(UserError, match="also holds nets, which gradsync did not write"):
        claim_run_dir(run, overwrite=True, inputs=[tmp_path / "elsewhere.py", "no/such/file"])
    shutil.rmtree(run / "nets")
    claim_run_dir(run, overwrite=True, inputs=[tmp_path / "elsewhere.py", "no/such/file"])
    assert not any(run.iterdir())


@pytest.mark.parametrize(
    "user_files",
    [
        {"thesis.tex": "", "oldrun/config.json": "{}", "oldrun/metrics/rank0.jsonl": ""},
        {"config.json": "{}", "train.py": ""},
        {"metrics/": None, "analysis.py": ""},
    ],
)
def test_overwrite_clears_only_a_folder_of_gradsyncs_own_outputs(
    tmp_path: Path, user_files: dict[str, str | None]
) -> None:
    """--overwrite deleted a user's thesis.tex beside an old run, train.py beside a
    config.json, analysis.py beside a metrics folder (probe 29b). It refuses, touching
    nothing."""
    for name, text in user_files.items():
        path = tmp_path / name
        if text is None:
            path.mkdir(parents=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with pytest.raises(UserError, match="which gradsync did not write; move it out first"):
        claim_run_dir(tmp_path, overwrite=True)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_overwrite_removes_a_link_in_a_run_not_what_it_points_to(tmp_path: Path) -> None:
    """A link to a folder made rmtree fail halfway, the old run half deleted (probe 29b)."""
    run, kept = tmp_path / "run", tmp_path / "kept"
    (run / "metrics").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (run / ".config.json.ab12cd.tmp").write_text("")  # an interrupted atomic write
    kept.mkdir()
    (kept / "data.bin").write_text("x")
    (run / "timeline").symlink_to(kept)  # a name of gradsync's, a user's link
    claim_run_dir(run, overwrite=True)
    assert not any(run.iterdir()) and (kept / "data.bin").is_file()


def test_a_batch_the_workers_cannot_share_is_refused_before_the_folder(tmp_path: Path) -> None:
    """The tiny preset's global batch (8) on 3 workers: one line at validation, so the
    folder that --overwrite would clear is still whole."""
    config = TrainConfig(model="mnist-cnn", preset="tiny", workers=3, out=str(tmp_path))
    with pytest.raises(UserError, match=r"global batch .* 8, does not divide by --workers 3"):
        validate(config)
    validate(config.replace(global_batch=6))


def test_out_that_is_a_file_or_unwritable_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        claim_run_dir(tmp_path / "file", overwrite=False)
    with pytest.raises(UserError, match="cannot be created or written"):
        claim_run_dir(tmp_path / "file" / "below", overwrite=False)


# ---------------------------------------------------------------- heartbeats and blame


class _FakePopen:
    """Just enough of Popen for the launcher's bookkeeping."""

    def __init__(self, pid: int, returncode: int | None = None) -> None:
        self.pid, self.returncode = pid, returncode


def _rank(rank: int, *, step: int, phase: str, at: float, code: int | None = None) -> RankProcess:
    process = RankProcess(rank, _FakePopen(10**7 + rank, code))  # type: ignore[arg-type]
    process.last_beat = LastBeat(at=at, step=step, phase=phase)
    return process


def test_the_silent_rank_doing_its_own_work_is_blamed_not_the_waiter() -> None:
    now = 1000.0
    waiter = _rank(0, step=12, phase="sync", at=now - 31)
    hung = _rank(1, step=12, phase="backward", at=now - 30.5)
    assert _silent_rank([waiter, hung], 30.0, now) is hung
    assert _silent_rank([waiter, hung], 60.0, now) is None  # not silent long enough


def test_hang_limit_grows_with_slow_steps_and_starting_ranks_are_left_alone() -> None:
    now = 1000.0
    slow = _rank(0, step=3, phase="forward", at=now - 40)
    slow.last_beat.slowest_step_s = 10.0  # 5 steps of 10 s = 50 s > 30 s
    assert _silent_rank([slow], 30.0, now) is None
    starting = _rank(1, step=-1, phase="rendezvous", at=now - 100)
    assert _silent_rank([starting], 30.0, now) is None
    building = _rank(2, step=-1, phase="build", at=now - 100)  # first step: 5 × the limit
    assert _silent_rank([building], 30.0, now) is None
    assert _silent_rank([building], 30.0, now + 60) is building


def test_a_lost_connection_is_a_victim_and_the_earliest_failure_is_the_cause() -> None:
    victim = _rank(0, step=5, phase="sync", at=0.0, code=1)
    victim.tail = deque(["RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1234"])
    victim.exited_at = 10.0
    cause = _rank(1, step=5, phase="forward", at=0.0, code=-9)
    cause.exited_at = 10.05
    later = _rank(2, step=5, phase="forward", at=0.0, code=1)
    later.exited_at = 11.0
    assert min([victim, later, cause], key=_blame_order) is cause
    failure = _failure(cause, victims=[victim, later])
    assert "rank 1" in str(failure) and "SIGKILL" in failure.cause  # type: ignore[attr-defined]
    assert "rank(s) 0 then lost their connection" in str(failure)


def test_last_beat_measures_steps_and_describes_itself() -> None:
    beat = LastBeat(at=0.0)
    for at, line in [(1.0, "0 forward"), (1.5, "0 sync"), (4.0, "1 forward"), (4.2, "1 backward")]:
        beat.update(line, at)
    assert beat.slowest_step_s == 3.0 and beat.describe() == "backward of step 1"
    beat.update("garbage", 5.0)
    assert beat.at == 4.2


def test_heartbeats_reach_a_pipe_without_blocking(tmp_path: Path) -> None:
    script = (
        "from gradsync.heartbeat import beat\n"
        "for step in range(3):\n"
        "    beat('forward', step); beat('sync', step)\n"
        "beat('sync', 2)\n"  # thinned: same step and phase within 0.5 s
    )
    read, write = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        env={**os.environ, "GRADSYNC_HEARTBEAT_FD": str(write)},
        pass_fds=(write,),
    )
    os.close(write)
    with open(read, "rb") as beats:
        lines = beats.read().decode().splitlines()
    assert child.wait(timeout=60) == 0
    assert lines == ["0 forward", "0 sync", "1 forward", "1 sync", "2 forward", "2 sync"]


def test_stopped_carries_the_shell_exit_code() -> None:
    assert Stopped(signal.SIGTERM).exit_code == 143 and Stopped(signal.SIGHUP).exit_code == 129


def test_a_sigterm_during_a_checkpoint_lands_after_the_sidecar(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.safetensors"
    previous = {s: signal.getsignal(s) for s in HANDLED}
    stop_on_signals()
    real_write = checkpoint.atomic_write_text

    def signalled_write(target: Path, text: str) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # between the rename and the sidecar
        real_write(target, text)

    try:
        with (
            mock.patch.object(checkpoint, "atomic_write_text", signalled_write),
            pytest.raises(Stopped),
        ):
            save_checkpoint(path, {"param/w": torch.ones(2)}, {"step": 4})
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    assert json.loads(sidecar_path(path).read_text())["step"] == 4
    assert load_checkpoint(path).meta["step"] == 4


def test_a_failed_deferred_block_keeps_its_error_and_leaves_no_signal_pending() -> None:
    previous = {s: signal.getsignal(s) for s in HANDLED}
    stop_on_signals()
    try:
        with pytest.raises(OSError, match="disk full"), signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            raise OSError("disk full")
        with signals_deferred():
            pass  # the dropped SIGTERM of the failed block does not stop this one
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


_SIGNALS_PARENT_ON_SIGTERM = """
import os, signal, sys, time
def stop(*_):
    os.kill(os.getppid(), signal.SIGTERM)  # an impatient second SIGTERM reaches the launcher
    time.sleep(0.5)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(60)
"""


def test_a_sigterm_while_ranks_are_stopped_waits_until_they_are_gone() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _SIGNALS_PARENT_ON_SIGTERM], stdout=subprocess.PIPE
    )
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    previous = {s: signal.getsignal(s) for s in HANDLED}
    stop_on_signals()
    try:
        with pytest.raises(Stopped):
            _terminate([RankProcess(0, child)])
        assert child.poll() == 0  # stopped and reaped before the signal was raised
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        child.kill()
        child.wait()


def test_the_step_of_a_checkpoint_is_read_from_its_header_alone(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / CHECKPOINT_FILE, {"param/w": torch.ones(2)}, {"step": 9})
    with mock.patch.object(checkpoint, "load_file", side_effect=AssertionError("read tensors")):
        assert checkpoint_step(tmp_path) == 9


def test_a_rank_exits_with_its_code_and_output_but_without_the_interpreter_teardown() -> None:
    # The teardown is where a Gloo thread releasing its last tensor aborts a rank.
    script = (
        "import atexit, sys\n"
        "from gradsync import rendezvous\n"
        "atexit.register(lambda: print('teardown ran'))\n"
        "rendezvous._joined = True  # as join_process_group leaves it\n"
        "print('results written', end='')\n"
        "sys.exit(rendezvous.finish_process(3))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (3, "results written")


# ---------------------------------------------------------------- bench identity and bounds


def test_a_changed_setting_changes_the_fingerprint_and_is_named() -> None:
    before = sweep.cell_settings(TrainConfig(model="mnist-cnn", steps=6, out="a"))
    after = sweep.cell_settings(TrainConfig(model="mnist-cnn", steps=12, out="b"))
    same = sweep.cell_settings(TrainConfig(model="mnist-cnn", steps=6, out="c"))
    assert sweep.fingerprint(before) == sweep.fingerprint(same) != sweep.fingerprint(after)
    assert sweep.changed_settings(before, after) == ["steps 6 → 12"]


def test_a_truncated_results_line_is_skipped_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gradsync.files import end_line_cut_short

    good = json.dumps({"id": "a", "status": "ok"})
    (tmp_path / sweep.RESULTS_FILE).write_text(good + "\n" + '{"id": "b", "sta')
    assert [r["id"] for r in sweep.load_results(tmp_path)] == ["a"]
    assert "line 2 is not a complete record" in capsys.readouterr().err
    end_line_cut_short(tmp_path / sweep.RESULTS_FILE)
    assert (tmp_path / sweep.RESULTS_FILE).read_text().endswith("\n")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"repeats": 10**9}, "repeats = 1000000000 exceeds the limit of 1000"),
        ({"steps": 10**7}, "steps = 10000000 exceeds"),
        ({"workers": [2, 4096]}, "workers = 4096 exceeds"),
        ({"repeats": 1000, "workers": list(range(1, 21))}, "more than the limit of 10,000"),
    ],
)
def test_experiment_bounds_are_checked_by_arithmetic(changes: dict, message: str) -> None:
    started = time.perf_counter()
    with pytest.raises(UserError, match=message):
        check_bounds(Experiment(name="x", path="x.toml", **changes), "x.toml")
    assert time.perf_counter() - started < 1.0  # nothing was allocated per cell


# ---------------------------------------------------------------- checkpoints and resume


def test_a_stale_sidecar_is_ignored_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "checkpoint.safetensors"
    save_checkpoint(path, {"param/w": torch.ones(2)}, {"model": "m", "step": 7})
    sidecar_path(path).write_text(json.dumps({"model": "m", "step": 6}))
    assert load_checkpoint(path).meta["step"] == 7
    assert "stale" in capsys.readouterr().err


class _SavesItsOwnState(SingleProcess):
    """A plugin whose checkpoint comes from elsewhere, with no restore_state to match."""

    name = "saves-own"

    def checkpoint_tensors(self) -> dict[str, torch.Tensor] | None:
        return {}


def test_resume_names_a_setting_that_differs_and_refuses_a_strategy_it_cannot_restore(
    tmp_path: Path,
) -> None:
    meta = {"model": "mnist-cnn", "preset": "tiny", "seed": 0, "workers": 2, "dtype": "float64"}
    config = TrainConfig(model="mnist-cnn", preset="tiny", workers=2, seed=1, dtype="float64")
    assert meta_differences(meta, config) == ["seed 0, not 1"]
    # The batch and rate as the run resolved them: the preset's batch (8) when the flag is
    # left out, the rate after scaling; every optimizer setting that changes the result.
    ran = {**meta, "seed": 1, "global_batch": 16, "lr": 0.05, "momentum": 0.9, "data": None}
    assert meta_differences(ran, config) == ["global_batch 16, not 8"]
    assert meta_differences(ran, config.replace(global_batch=16)) == []
    changed = config.replace(global_batch=16, optim=OptimConfig(lr=0.1, momentum=0.5))
    assert meta_differences(ran, changed) == ["lr 0.05, not 0.1", "momentum 0.9, not 0.5"]
    # A model option is compared as the model reads it: its default, or written another
    # way, is no change; a different value is.
    lstm = {"model": "lstm-lm", "preset": "tiny", "model_options": {"sparse": "false"}}
    plain = TrainConfig(model="lstm-lm", preset="tiny")
    assert meta_differences(lstm, plain) == []
    assert meta_differences(lstm, plain.replace(model_options={"sparse": "no"})) == []
    assert meta_differences(lstm, plain.replace(model_options={"sparse": "true"})) == [
        "model_options {'sparse': 'false'}, not {'sparse': 'true'}"
    ]
    assert all(resumable(name) for name in ("single", "ddp", "allreduce", "ps", "hybrid", "p3"))
    with mock.patch.dict(STRATEGIES, {"saves-own": _SavesItsOwnState}):
        assert not resumable("saves-own")
        with pytest.raises(UserError, match="no restore_state") as refused:
            check_resume(TrainConfig(strategy="saves-own"), tmp_path)
    assert len(str(refused.value).splitlines()) == 1
    (tmp_path / "predictions.json").write_text("{}")  # another command's folder
    with pytest.raises(UserError, match="not a training run's folder"):
        check_resume(TrainConfig(strategy="ps", workers=2), tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="wrote no checkpoint"):
        check_resume(TrainConfig(strategy="ps", workers=2), tmp_path)


# One option per strategy that changes what is computed, and its flag.
_OPTION_CHANGES = {
    "allreduce": ({"fp16_compression": True}, "--fp16-compression"),
    "ps": ({"async_updates": True}, "--async"),
    "hybrid": ({"average_sparse": False}, "--average-sparse"),
}


@pytest.mark.parametrize("strategy", ["single", "ddp", "p3", *_OPTION_CHANGES])
def test_resume_compares_strategy_options_as_the_checkpoint_kept_them(strategy: str) -> None:
    """Before session 24 a resume with other strategy options (fp16 compression,
    asynchronous updates, averaged sparse rows...) mixed two runs' results without a word.
    The options go through JSON as in the checkpoint's sidecar (hybrid's tuples come back
    as lists) and still compare equal; a server count or slice size may change."""
    from gradsync.models import workload_of
    from gradsync.optim import effective_lr
    from gradsync.resume import run_settings

    config = TrainConfig(model="lstm-lm", preset="tiny", strategy=strategy, workers=2)
    batch = workload_of(config).global_batch
    settings = run_settings(config, batch, effective_lr(config.optim, batch, batch))
    kept = json.loads(json.dumps(settings))
    assert meta_differences(kept, config) == []
    if strategy in _OPTION_CHANGES:
        change, flag = _OPTION_CHANGES[strategy]
        ((name, value),) = change.items()
        other = config.replace(strategy_options=change)
        assert meta_differences(kept, other) == [
            f"{flag} {kept['strategy_options'][name]}, not {value}"
        ]
    layout = {"p3": {"slice_size": 1000, "servers": 2}, "ddp": {"bucket_cap_mb": 1.0}}
    if strategy in layout:
        assert meta_differences(kept, config.replace(strategy_options=layout[strategy])) == []


def test_a_loss_that_is_not_finite_names_the_step() -> None:
    check_loss(torch.tensor(2.5), 3, 0)
    with pytest.raises(LossNotFinite, match="loss is inf at step 9 on rank 1"):
        check_loss(torch.tensor(float("inf")), 9, 1)


# ---------------------------------------------------------------- bad input before launch

BAD_MODELS = """
import sys
import torch
from torch import nn
from torch.utils.data import TensorDataset

def _data():
    return TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))

def wrong_types():
    return "model", _data(), 3

def vector_loss():
    return nn.Linear(4, 2), _data(), lambda out, t: nn.functional.cross_entropy(
        out, t, reduction="none")

def no_params():
    return nn.ReLU(), _data(), lambda out, t: out.sum()

def exits():
    sys.exit(3)
"""


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("wrong_types", "with an nn.Module and a callable loss, got (str, TensorDataset, int)"),
        ("vector_loss", "loss returned (32,), not a scalar tensor"),
        ("no_params", "has no trainable parameters"),
        ("exits", "called sys.exit(3) instead of returning"),
    ],
)
def test_a_broken_user_model_is_one_line_before_launch(
    function: str, message: str, tmp_path: Path
) -> None:
    from gradsync.jobs import validate

    (tmp_path / "bad.py").write_text(BAD_MODELS)
    config = TrainConfig(model=f"{tmp_path / 'bad.py'}:{function}", strategy="single")
    with pytest.raises(UserError, match=re.escape(message)):
        validate(config)


def test_a_model_file_that_exits_on_import_is_one_line(tmp_path: Path) -> None:
    from gradsync.jobs import validate

    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(UserError, match=re.escape("called sys.exit(3) while being imported")):
        validate(TrainConfig(model=f"{tmp_path / 'exits.py'}:build", strategy="single"))


def test_mnist_files_with_zero_images_are_one_line(tmp_path: Path) -> None:
    from gradsync.data.mnist import (
        IMAGES_FILE,
        IMAGES_MAGIC,
        LABELS_FILE,
        LABELS_MAGIC,
        MNISTImages,
    )

    (tmp_path / IMAGES_FILE).write_bytes(struct.pack(">4I", IMAGES_MAGIC, 0, 28, 28))
    (tmp_path / LABELS_FILE).write_bytes(struct.pack(">2I", LABELS_MAGIC, 0))
    with pytest.raises(UserError, match="hold 0 images"):
        MNISTImages(tmp_path, seed=0)


def _step_events(step: int) -> list[dict]:
    return [
        {"ph": "B", "name": "STEP", "pid": 0, "tid": 0, "ts": step * 10, "args": {"step": step}},
        {"ph": "E", "pid": 0, "tid": 0, "ts": step * 10 + 5},
    ]


@pytest.mark.parametrize(
    ("events", "step", "message"),
    [
        ([{"ph": "E", "pid": 0, "tid": 0, "ts": 1}], None, "ends a span that never began"),
        ([{"ph": "B", "name": "X", "pid": 0, "tid": 0, "ts": 1}], None, "is never ended"),
        ([{"ph": "B", "name": "STEP", "tid": 0, "ts": 1}], None, "has no finite numeric pid"),
        (_step_events(0) + _step_events(1), 7, "--step 7 is not in"),
        # session 24's probe: each was a traceback or a summary with nonsense in it
        ([{**_step_events(0)[0], "ts": math.nan}], None, "has no finite numeric ts"),
        ([_step_events(0)[0], {**_step_events(0)[1], "ts": -3}], None, "before it began"),
        ([{"ph": "B", "pid": 0, "tid": 0, "ts": 1}], None, "has no name"),
        ([{**_step_events(0)[0], "args": 5}, _step_events(0)[1]], None, "args 5, not an object"),
        ([{**_step_events(0)[0], "args": {"step": "abc"}}, _step_events(0)[1]], None, "args.step"),
        ([{"ph": "M", "name": "process_name", "pid": 0}], None, "has no name or no args"),
    ],
)
def test_a_malformed_trace_is_one_line_and_writes_nothing(
    events: list, step: int | None, message: str, tmp_path: Path
) -> None:
    from gradsync.cli import main

    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    with pytest.raises(UserError, match=re.escape(message)):
        from gradsync.trace_check import check_trace

        check_trace(trace, step)
    argv = ["timeline", "summarize", str(trace), *(["--step", str(step)] if step else [])]
    assert main(argv) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]  # no summary written


def test_a_trace_whose_other_data_is_not_an_object_is_one_line(tmp_path: Path) -> None:
    from gradsync.trace_check import check_trace

    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": _step_events(0), "otherData": [1, 2]}))
    with pytest.raises(UserError, match="otherData is not an object"):
        check_trace(trace)


def test_train_refuses_emulated_hosts_its_ranks_would_leave_empty() -> None:
    """`train --hosts 3 --workers 2` ran on 2 hosts without a word (session 23's probe)."""
    from gradsync.config import LaunchConfig
    from gradsync.jobs import check_every_host_used

    def job(
        workers: int, hosts: int, per_host: int | None = None, **options: object
    ) -> TrainConfig:
        launch = LaunchConfig(hosts=hosts, ranks_per_host=per_host)
        return TrainConfig(strategy="ps", workers=workers, launch=launch, strategy_options=options)

    check_every_host_used(job(2, 2))
    check_every_host_used(job(2, 3, servers=1))  # the server rank fills the third host
    with pytest.raises(UserError, match=r"--hosts 3, but the job's 3 rank\(s\) fill only 2"):
        check_every_host_used(job(2, 3, per_host=2, servers=1))
    with pytest.raises(UserError, match="pass --hosts 2, or more --workers"):
        check_every_host_used(job(1, 3, servers=1))


def test_verify_refuses_emulated_hosts_that_not_even_its_largest_job_fills(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`verify --workers 2 --hosts 3` ran every cell on 2 hosts, rc 0, where train refuses
    (session 31's probe). A smaller cell beside one that fills the hosts still runs."""
    from gradsync.cli import main
    from gradsync.verify import check_cells

    argv = ["verify", "--preset", "tiny", "--strategies", "allreduce", "--workers", "2"]
    hosts = ["--hosts", "3", "--bandwidth", "1gbit", "--out", str(tmp_path / "v")]
    assert main([*argv, *hosts]) == 2
    assert "--hosts 3, but the job's 2 rank(s) fill only 2 host(s)" in capsys.readouterr().err
    assert not (tmp_path / "v").exists()
    base = TrainConfig(preset="tiny", launch=dataclasses.replace(TrainConfig().launch, hosts=3))
    check_cells(base, ["allreduce"], [1, 6], {}, tmp_path / "w")
    bench = tmp_path / "hosts.toml"
    bench.write_text(
        'name = "h"\nmodels = ["mnist-cnn"]\npreset = "tiny"\nstrategies = ["allreduce"]\n'
        'workers = [2]\nsteps = 3\nbandwidths = ["1gbit"]\nhosts = 3\n'
    )
    assert main(["bench", str(bench), "--out", str(tmp_path / "b")]) == 2
    assert "--hosts 3, but the job's 2 rank(s)" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_overwrite_and_resume_replace_only_a_trace_or_a_profile(tmp_path: Path) -> None:
    """`--resume R --timeline notes.txt` and `--overwrite` replaced a user's file with a
    trace; `profile --out notes.txt --overwrite` with a profile (probe 29b)."""
    from gradsync.jobs import claim_timeline
    from gradsync.predict.profile import PROFILE_BEGINS
    from gradsync.trace import TRACE_BEGINS

    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for config, overwrite in ((TrainConfig(timeline=str(notes)), True),
                              (TrainConfig(timeline=str(notes), resume="r"), False)):  # fmt: skip
        with pytest.raises(UserError, match="is not gradsync's output"):
            claim_timeline(config, overwrite=overwrite)
    with pytest.raises(UserError, match="is not gradsync's output"):
        claim_output_file(notes, overwrite=True, begins=PROFILE_BEGINS)
    assert notes.read_text() == "mine"
    trace = tmp_path / "trace.json"
    trace.write_text(TRACE_BEGINS + "[]}")
    claim_timeline(TrainConfig(timeline=str(trace), resume="r"), overwrite=False)


def test_a_folder_another_job_is_writing_is_refused_until_it_ends(tmp_path: Path) -> None:
    """Two jobs started into one --out both ran, one's results silently lost; a --resume
    of a live run broke both (probe 29b)."""
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, pathlib; from gradsync.rundir import hold_run_dir; "
         f"hold_run_dir(pathlib.Path({str(tmp_path / 'run')!r})); print('held', flush=True); "
         "sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        for overwrite in (False, True):
            with pytest.raises(UserError, match="being written by another gradsync job"):
                claim_run_dir(tmp_path / "run", overwrite=overwrite)
    finally:
        holder.communicate("")  # it ends, and its lock with it
    claim_run_dir(tmp_path / "run", overwrite=False)


def test_the_oversubscription_warning_does_not_round_below_its_limit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """9 ranks on 2 cores read "4 ranks per core (more than 4)" (session 31's probe)."""
    from gradsync import launch

    monkeypatch.setattr(launch.os, "cpu_count", lambda: 2)
    launch._warn_if_oversubscribed(9)
    assert "9 ranks on 2 core(s) is 4.5 ranks per core (more than 4)" in capsys.readouterr().err


def test_a_victim_ranks_line_is_kept_but_not_echoed(capsys: pytest.CaptureFixture[str]) -> None:
    """A rank stopped by its peer's exit printed Gloo's "Connection closed by peer … GLHF!"
    before the cause's one line (session 31's probe); it stays in the rank's tail."""
    from gradsync.launch import VICTIM_PREFIX, RankProcess, _start_reader

    lines = [b"[some log line]\n", f"{VICTIM_PREFIX}Connection closed by peer\n".encode()]
    child = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.stderr.buffer.write({b''.join(lines)!r})"],
        stderr=subprocess.PIPE,
    )
    process = _start_reader(RankProcess(rank=1, popen=child), echo=True)
    child.wait()
    assert process.reader is not None
    process.reader.join(timeout=30)
    assert capsys.readouterr().err == "[rank 1] [some log line]\n"
    assert list(process.tail)[-1] == f"{VICTIM_PREFIX}Connection closed by peer"


def test_a_stopped_rank_is_named_when_a_peer_times_out_waiting_for_it() -> None:
    """--timeout below --hang-timeout: rank 0's collective timed out and rank 0 was named,
    though rank 1 was the one stopped (session 31's probe)."""
    from gradsync.errors import JobFailed
    from gradsync.launch import RankProcess, _watch

    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    failing = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1); exit(1)"])
    try:
        frozen.send_signal(signal.SIGSTOP)
        ranks = [RankProcess(rank=0, popen=failing), RankProcess(rank=1, popen=frozen)]
        with pytest.raises(JobFailed) as failed:
            _watch(ranks, hang_timeout_s=600)
        assert str(failed.value).startswith(f"rank 1 (worker, pid {frozen.pid}) is stopped")
        assert "rank 0 exited with code 1 waiting for it" in str(failed.value)
    finally:
        for process in (frozen, failing):
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
            process.wait()


def test_a_signal_while_a_rank_reports_its_error_ends_it_quietly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C, then the launcher's teardown SIGTERM inside the rank's except block: a
    traceback ("gradsync.signals.Stopped: SIGTERM") and an abort (session 31's probe)."""
    from gradsync import runtime
    from gradsync.signals import Stopped

    def interrupted_then_stopped(argv: list[str]) -> int:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise Stopped(signal.SIGTERM) from None  # as the handler raises it

    monkeypatch.setattr(runtime, "_run", interrupted_then_stopped)
    monkeypatch.setattr(runtime, "stop_on_signals", lambda: None)
    assert runtime.main(["unused"]) == 143
    assert "Traceback" not in capsys.readouterr().err


def test_an_option_no_verified_strategy_takes_is_named_by_its_flag(tmp_path: Path) -> None:
    """`verify --strategies ddp --async` named `--async-updates`, a flag nothing accepts."""
    from gradsync.verify import check_cells

    with pytest.raises(UserError, match=r"^--async: no strategy in this run takes it \(ddp\)"):
        check_cells(TrainConfig(preset="tiny"), ["ddp"], [2], {"async_updates": True}, tmp_path)


def test_ranks_that_do_not_divide_over_the_nodes_get_a_fix() -> None:
    """`--nnodes 2` with ps on 2 workers and 1 server said only '3 ranks do not divide'."""
    from gradsync.launch import launch_local

    launch = dataclasses.replace(TrainConfig().launch, num_nodes=2)
    config = TrainConfig(model="mnist-cnn", preset="tiny", strategy="ps", workers=2, launch=launch)
    with pytest.raises(UserError, match=r"3 ranks do not divide .*\(2 \+ 1\).*--colocate"):
        launch_local(config)
