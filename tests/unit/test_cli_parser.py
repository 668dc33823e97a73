"""The ``gradsync`` command line: parsing, one-line errors with exit code 2, compare."""

from __future__ import annotations

import pytest
import torch

import gradsync
from gradsync.checkpoint import save_checkpoint
from gradsync.cli import EXIT_USER_ERROR, build_parser, main
from gradsync.options import given_options

LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GRADSYNC_LAUNCHER",
    "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
)


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in LAUNCHER_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("gradsync: error: ")
    assert "Traceback" not in captured.err and "usage:" not in captured.err
    assert captured.out == ""
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "mentions"),
    [
        (["train", "--bogus"], "--bogus"),
        (["frobnicate"], "frobnicate"),
        ([], "command"),
        (["train", "--workers", "0"], "0 is not a positive integer"),
        (["train", "--workers", "two"], "'two' is not an integer"),
        (["train", "--steps", "-1"], "-1 is not a positive integer"),
        (["predict", "--bandwidth", "-1gbit"], "write --bandwidth=-1gbit"),
        (["train", "--lr", "fast"], "fast"),
        (["train", "--device", "gpu"], "gpu"),
        (["train", "--model-option", "novalue"], "'novalue' is not KEY=VALUE"),
        (["train", "--model-option", "=x"], "'=x' is not KEY=VALUE"),
        (["verify", "--workers", "2,0"], "0 is not a positive integer"),
        (["verify", "--workers", "2,x"], "'x' is not an integer"),
        (["demo", "--workers", "2,4"], "'2,4' is not an integer"),
        (["compare"], "checkpoints"),
        (["train", "--global-batch"], "--global-batch"),
        (["train", "--fusion-threshold-mb", "nan"], "--fusion-threshold-mb must be a finite"),
        (["train", "--slice-size", "0"], "--slice-size must be >= 1, got 0"),
        (["train", "--placement", "random"], "choose one of: greedy, round-robin"),
        (["train", "--warmup-steps", "3"], "--warmup-steps"),
        # an empty --out silently meant a timestamped folder (session 23's probe)
        (["train", "--out", ""], "--out: '' names no path"),
        (["bench", "x.toml", "--out", " "], "--out: ' ' names no path"),
        (["predict", "--out", ""], "--out: '' names no path"),
        # said only "not a positive integer" while profile takes a warm-up of 0 (probe 30b)
        (["commbench", "--warmup", "0"], "commbench always runs at least 1"),
        (["commbench", "--warmup", "x"], "'x' is not an integer"),
        (["train", "--epochs", "1", "--steps", "3"], "--steps: not allowed with argument"),
        (["verify", "--epochs", "0"], "0 is not a finite number above 0"),
        (["train", "--epochs", "inf"], "inf is not a finite number above 0"),
    ],
)
def test_bad_command_lines_exit_2_with_one_line(capsys, argv, mentions):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == EXIT_USER_ERROR == 2
    line = _one_line_error(capsys)
    assert mentions in line
    assert "--help" in line  # says how to find out more


def test_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"gradsync {gradsync.__version__}"


@pytest.mark.parametrize(
    ("text", "workers"), [("2,4", [2, 4]), ("4", [4]), ("2, 4,8", [2, 4, 8]), ("2,,4,", [2, 4])]
)
def test_verify_workers_list(text, workers):
    assert build_parser().parse_args(["verify", "--workers", text]).workers == workers


def test_defaults_per_command():
    parser = build_parser()
    train = parser.parse_args(["train"])
    verify = parser.parse_args(["verify"])
    demo = parser.parse_args(["demo"])
    assert (train.steps, verify.steps, demo.steps) == (50, 20, 30)
    assert (train.workers, verify.workers, demo.workers) == (None, [2], 2)
    assert train.model == "transformer" and train.strategy == "allreduce"
    assert train.model_option == [] and given_options(train) == {}
    assert (train.nnodes, train.node_rank, train.master_port) == (1, 0, None)
    assert verify.strategies is None
    compare = parser.parse_args(["compare", "a", "b"])
    assert (compare.checkpoints, compare.tolerance) == (["a", "b"], None)


def test_model_options_are_key_value_pairs_in_order():
    args = build_parser().parse_args(
        [
            "train",
            "--model-option",
            "sparse=true",
            "--model-option",
            "expr=a=b",
            "--model-option",
            "empty=",
            "--model-option",
            "sparse=false",
        ]
    )
    assert args.model_option == [
        ("sparse", "true"),
        ("expr", "a=b"),
        ("empty", ""),
        ("sparse", "false"),
    ]
    assert dict(args.model_option) == {"sparse": "false", "expr": "a=b", "empty": ""}


def test_all_train_flags_parse():
    args = build_parser().parse_args(
        [
            "train",
            "--strategy",
            "ddp",
            "--workers",
            "4",
            "--model",
            "mnist-cnn",
            "--preset",
            "tiny",
            "--steps",
            "3",
            "--global-batch",
            "16",
            "--seed",
            "5",
            "--optimizer",
            "adam",
            "--lr",
            "0.01",
            "--momentum",
            "0.8",
            "--weight-decay",
            "1e-4",
            "--lr-warmup-steps",
            "2",
            "--lr-scaling",
            "linear",
            "--lr-base-batch",
            "8",
            "--fusion-threshold-mb",
            "0",
            "--fp16-compression",
            "--threads",
            "2",
            "--device",
            "cpu",
            "--timeout",
            "9",
            "--measure-warmup",
            "1",
            "--out",
            "o",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "h",
            "--master-port",
            "4000",
            "--checkpoint-every",
            "2",
            "--log-every",
            "1",
            "--deterministic",
        ]
    )
    assert (args.strategy, args.workers, args.global_batch, args.lr, args.lr_base_batch) == (
        "ddp",
        4,
        16,
        0.01,
        8,
    )
    assert args.deterministic and args.lr_warmup_steps == 2
    assert given_options(args) == {"fusion_threshold_mb": 0.0, "fp16_compression": True}
    assert (args.timeout, args.master_port) == (9.0, 4000)


def test_config_errors_exit_2_with_one_line(capsys, no_launcher, tmp_path):
    code = main(
        [
            "train",
            "--workers",
            "3",
            "--global-batch",
            "8",
            "--steps",
            "1",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    assert code == EXIT_USER_ERROR
    line = _one_line_error(capsys)
    assert "--global-batch 8" in line and "--workers 3" in line
    assert not (tmp_path / "run").exists()


def test_compare_needs_two_checkpoints(capsys):
    assert main(["compare", "only-one.safetensors"]) == EXIT_USER_ERROR
    assert "at least two checkpoints" in _one_line_error(capsys)


def test_compare_missing_checkpoint(capsys, tmp_path):
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == EXIT_USER_ERROR
    assert "no checkpoint at" in _one_line_error(capsys)


def test_compare_exit_codes(capsys, tmp_path):
    meta = {"model": "m", "preset": "tiny"}
    save_checkpoint(tmp_path / "a.safetensors", {"param/w": torch.ones(3)}, meta)
    save_checkpoint(tmp_path / "b.safetensors", {"param/w": torch.ones(3)}, meta)
    save_checkpoint(tmp_path / "c.safetensors", {"param/w": torch.tensor([1.0, 1.0, 1.5])}, meta)
    paths = [str(tmp_path / f"{n}.safetensors") for n in "abc"]
    assert main(["compare", paths[0], paths[1]]) == 0
    assert "all tensors within tolerance" in capsys.readouterr().out
    assert main(["compare", *paths]) == 1
    out = capsys.readouterr().out
    assert "BEYOND" in out and "1 tensor(s) beyond tolerance" in out
    assert main(["compare", paths[0], paths[2], "--tolerance", "0.5"]) == 0
    # float64 checkpoints are judged at float64's tolerance: 1e-7 apart is a difference
    near = torch.ones(3, dtype=torch.float64)
    save_checkpoint(tmp_path / "d.safetensors", {"param/w": near}, meta)
    save_checkpoint(tmp_path / "e.safetensors", {"param/w": near + 1e-7}, meta)
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "d.safetensors"), str(tmp_path / "e.safetensors")]) == 1
    assert "max abs ≤ 1e-09" in capsys.readouterr().out


def test_compare_nan_in_both_is_equal_in_one_is_beyond(capsys, tmp_path):
    meta = {"model": "m", "preset": "tiny"}
    nan = float("nan")
    for name, values in (("a", [nan, 1.0]), ("b", [nan, 1.0]), ("c", [2.0, 1.0])):
        save_checkpoint(tmp_path / f"{name}.safetensors", {"param/w": torch.tensor(values)}, meta)
    a, b, c = (str(tmp_path / f"{n}.safetensors") for n in "abc")
    assert main(["compare", a, b]) == 0
    assert "all tensors within tolerance" in capsys.readouterr().out
    assert main(["compare", a, c]) == 1
    row = next(line for line in capsys.readouterr().out.splitlines() if "param/w" in line)
    assert row.count("nan") == 2 and "BEYOND" in row and "0.000e+00" not in row


def test_compare_notes_optimizer_state_keys_in_one_run_only(capsys, tmp_path):
    meta = {"model": "m", "preset": "tiny"}
    save_checkpoint(tmp_path / "a.safetensors", {"param/w": torch.ones(2)}, meta)
    state = {"param/w": torch.ones(2), "optim/w/momentum_buffer": torch.ones(2)}
    save_checkpoint(tmp_path / "b.safetensors", state, meta)
    main(["compare", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")])
    out = capsys.readouterr().out
    assert "the runs differ in optimizer-state keys (optim/w/momentum_buffer in one only)" in out
    assert "keys differ" not in out


# ---------------------------------------------------------------- train under a launcher

OPEN_MPI_TWO_NODES = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}


@pytest.fixture
def ranks_started(no_launcher: pytest.MonkeyPatch) -> list:
    """Stand-ins for validation and the rank itself: record the RankEnv it would run as."""
    started: list = []
    no_launcher.setattr("gradsync.jobs.validate", lambda config, **_: None)
    no_launcher.setattr(
        "gradsync.runtime.run_rank", lambda config, env: started.append((config, env))
    )
    for key, value in OPEN_MPI_TWO_NODES.items():
        no_launcher.setenv(key, value)
    return started


def test_train_under_mpirun_uses_the_launchers_world(ranks_started, no_launcher, tmp_path):
    no_launcher.setenv("MASTER_ADDR", "10.0.0.9")
    no_launcher.setenv("MASTER_PORT", "30000")
    assert (
        main(
            [
                "train",
                "--model",
                "mnist-cnn",
                "--preset",
                "tiny",
                "--strategy",
                "ddp",
                "--master-port",
                "31000",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    [(config, env)] = ranks_started
    assert config.workers == 4 and config.strategy == "ddp"
    assert (env.launcher, env.rank, env.world_size, env.master_addr, env.master_port) == (
        "mpirun",
        1,
        4,
        "10.0.0.9",
        31000,
    )


def test_train_under_mpirun_with_wrong_worker_count(capsys, ranks_started, no_launcher):
    no_launcher.setenv("MASTER_ADDR", "10.0.0.9")
    assert main(["train", "--workers", "2", "--strategy", "ddp"]) == EXIT_USER_ERROR
    line = _one_line_error(capsys)
    assert "mpirun started 4 processes but --workers 2" in line
    assert ranks_started == []


def test_master_addr_flag_reaches_the_rank_under_mpirun(ranks_started, tmp_path):
    code = main(
        [
            "train",
            "--model",
            "mnist-cnn",
            "--preset",
            "tiny",
            "--strategy",
            "ddp",
            "--master-addr",
            "10.0.0.1",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    [(_, env)] = ranks_started
    assert env.master_addr == "10.0.0.1"


@pytest.mark.parametrize(
    ("argv", "mentions"),
    [
        (["train", "--strategy", "ddp", "--slice-size", "10"], "--slice-size applies to"),
        (["train", "--strategy", "allreduce", "--servers", "2"], "ps or hybrid or p3"),
        (["train", "--strategy", "bogus"], "unknown strategy 'bogus'"),
        (["train", "--weight-decay", "-1"], "--weight-decay must be a finite number >= 0"),
        (["train", "--timeout", "inf"], "--timeout must be a finite number"),
        (["train", "--lr", "inf"], "--lr must be a finite number"),
        (["verify", "--strategies", "ddp,allreduce", "--slice-size", "9"], "--slice-size"),
        (["verify", "--strategies", "ps:bogus=1"], "'ps:bogus=1': unknown option 'bogus'"),
        (["verify", "--strategies", "single"], "nothing would be compared"),
        (["train", "--workers", "100000", "--global-batch", "100000"], "lower --workers"),
        (["train", "--model", "mnist-cnn", "--preset", "tiny", "--workers", "3"], "--workers 3"),
    ],
)
def test_option_errors_exit_2_before_launch(capsys, no_launcher, tmp_path, argv, mentions):
    code = main([*argv, "--out", str(tmp_path / "run")])
    assert code == EXIT_USER_ERROR
    assert mentions in _one_line_error(capsys)
    assert not (tmp_path / "run").exists()


def test_one_flag_serves_every_strategy_that_takes_the_option():
    args = build_parser().parse_args(["train", "--servers", "2", "--no-priority"])
    assert given_options(args) == {"servers": 2, "priority": False}


def test_resume_with_overwrite_is_refused(capsys, no_launcher, tmp_path):
    """--resume keeps the run, --overwrite would clear it: one line, nothing touched."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    assert main(["train", "--resume", str(run), "--overwrite"]) == EXIT_USER_ERROR
    assert "drop one of them" in _one_line_error(capsys)
    assert [p.name for p in run.iterdir()] == ["config.json"]


def test_momentum_with_adam_is_refused_not_ignored(capsys, no_launcher, tmp_path):
    """Adam would train without it: a user comparing momenta got the same run twice."""
    argv = ["train", "--optimizer", "adam", "--momentum", "0.5", "--out", str(tmp_path / "r")]
    assert main(argv) == EXIT_USER_ERROR
    assert "--momentum 0.5 is SGD's; adam keeps its own moments" in _one_line_error(capsys)
    assert not (tmp_path / "r").exists()


def test_a_sigterm_while_the_parser_is_built_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Building the parser imports torch (seconds): a SIGTERM then said nothing, exit 143."""
    import signal

    from gradsync import cli
    from gradsync.signals import HANDLED, Stopped

    previous = {s: signal.getsignal(s) for s in HANDLED}

    def stopped() -> None:
        raise Stopped(signal.SIGTERM)

    monkeypatch.setattr(cli, "build_parser", stopped)
    try:
        assert cli.main(["train"]) == 143
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    assert capsys.readouterr().err == "gradsync: stopped by SIGTERM before anything started\n"


def test_every_flag_of_every_command_says_what_it_does() -> None:
    """`--strategy`, `--steps`, `--seed`, `--log-every`… had no help text, and DDP's
    `--bucket-cap-mb` showed the metavar OPTION_BUCKET_CAP_MB (session 31's probe)."""
    import argparse

    from gradsync.cli import build_parser

    commands = next(
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    silent = [
        f"{name} {action.option_strings[-1] if action.option_strings else action.dest}"
        for name, parser in commands.choices.items()
        for action in parser._actions
        if not action.help and not isinstance(action, argparse._HelpAction)
    ]
    assert silent == []
    assert "OPTION_" not in commands.choices["train"].format_help()


def test_epochs_become_the_steps_of_the_training_set(capsys):
    """Seed 004 asks for the same epochs at every worker count; only steps could be given."""
    from gradsync.cli import _config

    args = build_parser().parse_args(
        ["train", "--model", "mnist-cnn", "--data", "sklearn:digits", "--epochs", "2",
         "--global-batch", "64"]
    )  # fmt: skip
    assert _config(args).steps == 45  # ceil(2 × 1,438 / 64)
    synthetic = build_parser().parse_args(["train", "--model", "mnist-cnn", "--epochs", "2"])
    with pytest.raises(gradsync.errors.UserError, match="epochs need a real training set"):
        _config(synthetic)
