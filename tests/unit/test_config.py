"""TrainConfig: validation up front (UserError naming the numbers and the fix), JSON round trip."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gradsync.config import DEFAULT_LR, LaunchConfig, OptimConfig, TrainConfig
from gradsync.errors import UserError
from gradsync.strategies.allreduce import AllreduceOptions
from gradsync.strategies.ps import PSOptions

# (keyword arguments, substrings the message must contain: the offending values and a fix)
INVALID = {
    "workers-zero": (dict(workers=0), ["--workers", "positive integer", "got 0"]),
    "workers-negative": (dict(workers=-3), ["--workers", "got -3"]),
    "steps-zero": (dict(steps=0), ["--steps", "positive integer", "got 0"]),
    "global-batch-zero": (dict(global_batch=0), ["--global-batch", "positive integer", "got 0"]),
    "global-batch-indivisible": (
        dict(global_batch=10, workers=4),
        ["--global-batch 10", "--workers 4", "multiple of 4", "e.g. 8"],
    ),
    "global-batch-smaller-than-workers": (
        dict(global_batch=3, workers=4),
        ["--global-batch 3", "--workers 4", "multiple of 4", "e.g. 4"],
    ),
    "optimizer": (dict(optim=OptimConfig(name="rmsprop")), ["'rmsprop'", "sgd, adam"]),
    "lr-scaling": (
        dict(optim=OptimConfig(lr_scaling="cubic")),
        ["--lr-scaling 'cubic'", "none, linear, sqrt"],
    ),
    "lr-zero": (dict(optim=OptimConfig(lr=0.0)), ["--lr", "> 0", "got 0.0"]),
    "lr-negative": (dict(optim=OptimConfig(lr=-0.25)), ["--lr", "> 0", "got -0.25"]),
    "lr-nan": (dict(optim=OptimConfig(lr=float("nan"))), ["--lr", "> 0", "got nan"]),
    "lr-inf": (dict(optim=OptimConfig(lr=float("inf"))), ["--lr", "finite", "got inf"]),
    "weight-decay-negative": (
        dict(optim=OptimConfig(weight_decay=-1.0)),
        ["--weight-decay", ">= 0", "got -1.0"],
    ),
    "warmup-negative": (
        dict(optim=OptimConfig(lr_warmup_steps=-2)),
        ["--lr-warmup-steps", ">= 0", "got -2"],
    ),
    "fusion-negative": (
        dict(strategy_options={"fusion_threshold_mb": -1.5}),
        ["--fusion-threshold-mb", ">= 0", "got -1.5"],
    ),
    "fusion-nan": (
        dict(strategy_options={"fusion_threshold_mb": float("nan")}),
        ["--fusion-threshold-mb", "finite", "got nan"],
    ),
    "options-of-another-strategy": (
        dict(strategy="ddp", strategy_options=PSOptions()),
        ["PSOptions", "'ddp'", "DDPOptions"],
    ),
    "unknown-option": (dict(strategy_options={"slice_size": 4}), ["unknown option 'slice_size'"]),
    "servers-with-colocate": (
        dict(strategy="ps", workers=2, strategy_options={"servers": 2, "colocate": True}),
        ["--servers with --colocate", "drop one"],
    ),
    "nnodes-zero": (dict(launch=LaunchConfig(num_nodes=0)), ["--nnodes", "got 0"]),
    "node-rank-too-big": (
        dict(workers=4, launch=LaunchConfig(num_nodes=2, node_rank=2)),
        ["--node-rank 2", "0..1", "--nnodes 2"],
    ),
    "node-rank-negative": (
        dict(workers=4, launch=LaunchConfig(num_nodes=2, node_rank=-1)),
        ["--node-rank -1", "0..1"],
    ),
    "workers-over-nodes": (
        dict(workers=3, launch=LaunchConfig(num_nodes=2)),
        ["--workers 3", "--nnodes 2", "multiple of 2"],
    ),
    "threads-zero": (dict(launch=LaunchConfig(threads=0)), ["--threads", "got 0"]),
    "port-zero": (dict(launch=LaunchConfig(master_port=0)), ["--master-port 0", "1..65535"]),
    "port-too-big": (
        dict(launch=LaunchConfig(master_port=65536)),
        ["--master-port 65536", "1..65535"],
    ),
    "timeout-zero": (dict(launch=LaunchConfig(timeout_s=0.0)), ["--timeout", "> 0", "got 0.0"]),
    "timeout-negative": (dict(launch=LaunchConfig(timeout_s=-5.0)), ["--timeout", "got -5.0"]),
    "timeout-inf": (dict(launch=LaunchConfig(timeout_s=float("inf"))), ["--timeout", "got inf"]),
}


@pytest.mark.parametrize(("kwargs", "expected"), list(INVALID.values()), ids=list(INVALID))
def test_invalid_config_is_a_user_error_naming_the_numbers(kwargs, expected):
    with pytest.raises(UserError) as raised:
        TrainConfig(**kwargs)
    message = str(raised.value)
    for part in expected:
        assert part in message, f"{part!r} missing from {message!r}"
    assert "\n" not in message  # one line for the CLI


def test_missing_data_path_names_the_path_and_the_fix(tmp_path):
    missing = tmp_path / "nowhere" / "train.bin"
    with pytest.raises(UserError, match="does not exist; pass the path") as raised:
        TrainConfig(data=str(missing))
    assert str(missing) in str(raised.value)


def test_existing_data_path_is_accepted(tmp_path):
    (tmp_path / "data.txt").write_text("hello")
    assert TrainConfig(data=str(tmp_path / "data.txt")).data == str(tmp_path / "data.txt")


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(workers=4, global_batch=8),
        dict(workers=4, global_batch=4),
        dict(workers=6, launch=LaunchConfig(num_nodes=3, node_rank=2)),
        dict(launch=LaunchConfig(master_port=1)),
        dict(launch=LaunchConfig(master_port=65535, threads=1)),
        dict(optim=OptimConfig(name="adam", lr=1e-9, lr_warmup_steps=0, lr_scaling="sqrt")),
        dict(strategy_options=AllreduceOptions(fusion_threshold_mb=0.0)),
        dict(strategy_options={"fusion_threshold_mb": 1}),  # an integer is a number
    ],
)
def test_boundary_values_are_valid(kwargs):
    TrainConfig(**kwargs)  # must not raise


def test_defaults_are_valid_and_documented_values():
    cfg = TrainConfig()
    assert (cfg.workers, cfg.steps, cfg.global_batch, cfg.strategy) == (1, 50, None, "allreduce")
    assert cfg.strategy_options == AllreduceOptions()
    assert cfg.strategy_options.fusion_threshold_mb == 4.0
    assert cfg.optim.base_lr() == DEFAULT_LR["sgd"] == 0.05
    assert OptimConfig(name="adam").base_lr() == 1e-3
    assert OptimConfig(name="adam", lr=0.3).base_lr() == 0.3


def test_replace_validates_again():
    cfg = TrainConfig(workers=2, global_batch=8)
    assert cfg.replace(workers=4).workers == 4
    with pytest.raises(UserError, match="--global-batch 8 does not divide by --workers 3"):
        cfg.replace(workers=3)


def test_configs_are_frozen_and_keyword_only():
    cfg = TrainConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.workers = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        OptimConfig("adam")  # type: ignore[misc]


def _full_config() -> TrainConfig:
    return TrainConfig(
        model="mnist-cnn",
        preset="tiny",
        model_options={"sparse": "true", "hidden-size": "64"},
        strategy="allreduce",
        workers=4,
        steps=7,
        global_batch=16,
        seed=123,
        out="runs/x",
        deterministic=True,
        measure_warmup=2,
        checkpoint_every=3,
        log_every=2,
        optim=OptimConfig(
            name="adam",
            lr=0.002,
            momentum=0.5,
            weight_decay=1e-4,
            lr_warmup_steps=3,
            lr_scaling="sqrt",
            lr_base_batch=32,
        ),
        strategy_options=AllreduceOptions(fusion_threshold_mb=0.5, fp16_compression=True),
        launch=LaunchConfig(
            num_nodes=2,
            node_rank=1,
            master_addr="10.0.0.7",
            master_port=23456,
            timeout_s=12.5,
            threads=3,
            device="cpu",
        ),
    )


def test_json_round_trip_keeps_every_nested_field():
    cfg = _full_config()
    back = TrainConfig.from_json(cfg.to_json())
    assert back == cfg
    assert isinstance(back.optim, OptimConfig)
    assert isinstance(back.strategy_options, AllreduceOptions)
    assert isinstance(back.launch, LaunchConfig)
    assert back.launch.master_port == 23456
    assert back.optim.lr_scaling == "sqrt"
    assert back.model_options == {"sparse": "true", "hidden-size": "64"}


def test_json_round_trip_of_defaults_keeps_none_values():
    back = TrainConfig.from_json(TrainConfig().to_json())
    assert back == TrainConfig()
    assert back.optim.lr is None and back.launch.master_port is None and back.data is None


def test_to_json_is_plain_sorted_json_with_nested_objects():
    raw = json.loads(_full_config().to_json())
    assert list(raw) == sorted(raw)
    assert raw["optim"]["name"] == "adam"
    assert raw["strategy_options"] == {
        "first_bucket_mb": 1.0,
        "fp16_compression": True,
        "fusion_threshold_mb": 0.5,
        "sparse_as_dense": False,
    }
    assert raw["launch"]["num_nodes"] == 2


def test_from_json_validates():
    raw = json.loads(TrainConfig(workers=2, global_batch=8).to_json())
    raw["global_batch"] = 7
    with pytest.raises(UserError, match="--global-batch 7 does not divide by --workers 2"):
        TrainConfig.from_json(json.dumps(raw))


def test_negative_measure_warmup_is_a_user_error():
    with pytest.raises(UserError, match="--measure-warmup"):
        TrainConfig(measure_warmup=-3)


def test_with_strategy_resets_the_options_to_the_new_strategys_defaults():
    cfg = TrainConfig(strategy_options=AllreduceOptions(fusion_threshold_mb=1.0))
    assert cfg.with_strategy("ps", workers=2).strategy_options == PSOptions()


def test_a_bool_option_refuses_a_number():
    with pytest.raises(UserError, match="--fp16-compression must be true or false, got 1"):
        TrainConfig(strategy_options={"fp16_compression": 1})


@pytest.mark.parametrize("strategy", ["ps", "hybrid", "p3"])
def test_colocated_servers_take_no_server_count_for_every_server_strategy(strategy: str) -> None:
    with pytest.raises(UserError, match="--servers with --colocate"):
        TrainConfig(strategy=strategy, workers=2, strategy_options={"servers": 2, "colocate": True})
    config = TrainConfig(strategy=strategy, workers=3, strategy_options={"colocate": True})
    assert config.strategy_options.num_servers(3) == 3  # one per worker
