"""``--batchnorm global|local``: validated up front; local is an expected difference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradsync.comm.batchnorm import has_batchnorm
from gradsync.config import TrainConfig
from gradsync.errors import UserError
from gradsync.verify import batchnorm_difference, verdict_for


def test_unknown_mode_is_one_line_naming_both_modes() -> None:
    with pytest.raises(UserError) as raised:
        TrainConfig(batchnorm="sync")
    message = str(raised.value)
    assert "--batchnorm 'sync'" in message and "global" in message and "local" in message
    assert "\n" not in message


def test_local_batchnorm_is_an_expected_difference_only_when_it_can_differ() -> None:
    local = TrainConfig(
        model="resnet56", preset="tiny", strategy="ddp", workers=2, batchnorm="local"
    )
    assert batchnorm_difference(local) is not None
    assert batchnorm_difference(local.replace(batchnorm="global")) is None
    assert batchnorm_difference(local.replace(workers=1)) is None
    # A model with BatchNorm differs, and says why; within the tolerance it matches.
    assert verdict_for(local, 1e-12, 1e-9)[0] == "match"
    verdict, reason = verdict_for(local, 3e-3, 1e-9)
    assert verdict == "differs (expected)" and "--batchnorm local" in reason
    # A model without BatchNorm must still match: the flag excuses nothing there (it
    # excused an fp16-compressed hybrid's 1e-3 on transformer).
    plain = local.replace(model="transformer")
    assert batchnorm_difference(plain) is None
    assert verdict_for(plain, 3e-3, 1e-9)[0] == "FAIL"


def test_fp16_compression_is_an_expected_difference_of_hybrid_too() -> None:
    """hybrid's dense path takes allreduce's fusion options; fp16 was reported as FAIL."""
    from gradsync.strategies.hybrid import HybridOptions

    config = TrainConfig(
        strategy="hybrid", workers=2, strategy_options=HybridOptions(fp16_compression=True)
    )
    verdict, reason = verdict_for(config, 2e-5, 1e-9)
    assert verdict == "differs (expected)" and "fp16 compression" in reason


def test_has_batchnorm_finds_nested_layers() -> None:
    assert has_batchnorm(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Sequential(nn.BatchNorm2d(2))))
    assert not has_batchnorm(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)))


def test_flags_of_this_work_parse_into_the_config() -> None:
    from gradsync.cli import _config, _strategy_options, build_parser

    args = build_parser().parse_args(
        [
            "train",
            "--strategy",
            "allreduce",
            "--workers",
            "2",
            "--batchnorm",
            "local",
            "--sparse-as-dense",
            "--first-bucket-mb",
            "1",
        ]
    )
    assert _config(args).batchnorm == "local"
    options = _strategy_options("allreduce", args)
    assert options.sparse_as_dense and options.first_bucket_bytes == 1 << 20


def test_a_batchnorm_under_two_names_becomes_one_global_layer() -> None:
    """convert_batchnorm walked named_children, which skips a module seen before: the
    second name kept the local layer, and a forward through it normalized each worker's
    shard alone (session 24's probe)."""
    from torch import nn

    from gradsync.comm.batchnorm import GlobalBatchNorm, convert_batchnorm

    norm = nn.BatchNorm1d(3)
    model = nn.Module()
    model.first, model.second = norm, norm
    model.inner = nn.Sequential(norm)
    assert convert_batchnorm(model, group=None) == 1
    assert isinstance(model.second, GlobalBatchNorm)
    assert model.first is model.second is model.inner[0]


def test_a_batchnorm_subclass_with_its_own_forward_is_refused_before_launch(tmp_path) -> None:
    """Its forward (here: 2·BN(x) + 0.5) was replaced by the global layer's, silently."""
    import textwrap

    import pytest

    from gradsync.config import TrainConfig
    from gradsync.errors import UserError
    from gradsync.jobs import validate

    path = tmp_path / "scaled.py"
    path.write_text(
        textwrap.dedent("""
        import torch
        from torch import nn

        class ScaledBN(nn.BatchNorm1d):
            def forward(self, x):
                return 2 * super().forward(x) + 0.5

        def build():
            items = [(torch.randn(3), torch.tensor(i % 2)) for i in range(16)]
            model = nn.Sequential(nn.Linear(3, 4), ScaledBN(4), nn.Linear(4, 2))
            return model, items, nn.functional.cross_entropy
    """)
    )
    config = TrainConfig(model=f"{path}:build", strategy="allreduce", workers=2, global_batch=8)
    with pytest.raises(UserError, match="layer 1 is a ScaledBN, a BatchNorm subclass"):
        validate(config)
    validate(config.replace(batchnorm="local"))  # each shard its own statistics: fine


def test_a_verify_spec_takes_option_values_with_colons() -> None:
    """'hybrid:dense_patterns=re:emb' was refused as an unknown option 'emb'."""
    from pathlib import Path

    from gradsync.verify import cell_config

    spec = "hybrid:dense_patterns=re:emb.*:colocate"
    config = cell_config(TrainConfig(model="lstm-lm"), spec, 2, Path("v"))
    assert config.strategy_options.dense_patterns == ("re:emb.*",)
    assert config.strategy_options.colocate


def test_a_strategies_list_keeps_a_tuple_options_values_together() -> None:
    """`--strategies ddp,hybrid:dense_patterns=emb*,fc*` made 'fc*' a strategy of its own."""
    from pathlib import Path

    from gradsync.strategies import split_specs
    from gradsync.verify import cell_config

    specs = split_specs("ddp,hybrid:dense_patterns=emb*,fc*,p3")
    assert specs == ["ddp", "hybrid:dense_patterns=emb*,fc*", "p3"]
    config = cell_config(TrainConfig(model="lstm-lm"), specs[1], 2, Path("v"))
    assert config.strategy_options.dense_patterns == ("emb*", "fc*")


def test_converted_layers_are_named_by_path_and_numbered_in_model_order() -> None:
    """The names and numbers that a global layer's collectives carry, and its errors name."""
    from gradsync.comm.batchnorm import convert_batchnorm

    shared = nn.BatchNorm1d(4)
    model = nn.Sequential(
        nn.BatchNorm2d(3), nn.Sequential(nn.Flatten(), shared), nn.ModuleList([shared])
    )
    assert convert_batchnorm(model, group=None) == 2
    assert (model[0].name, model[0].index) == ("0", 0)
    assert (model[1][1].name, model[1][1].index) == ("1.1", 1)
    assert model[2][0] is model[1][1]


def test_a_calls_tag_tells_layers_directions_and_calls_apart() -> None:
    """Never 0 (a rank that sent zeros, or a gradient of 0, cannot pass for a call), the
    forward's and the backward's differ, and call numbers wrap before squares lose bits."""
    from gradsync.comm.batchnorm import CALL_MODULUS, _Call

    tags = {
        tuple(_Call("bn", index, number).tag(backward=backward))
        for index in (0, 1)
        for number in (1, 2)
        for backward in (False, True)
    }
    assert len(tags) == 8 and all(0 not in tag for tag in tags)
    assert (2**13 * CALL_MODULUS**2) <= 2**53  # Σ tag² over 8192 ranks stays exact


def test_a_mismatch_is_one_line_with_the_rule_and_the_remedy_first() -> None:
    """verify shows 240 characters of a job's error: the details come last."""
    from gradsync.comm.batchnorm import _Call, _checked

    call = _Call("layer3.8.bn2", 54, 7)
    values = torch.ones(3)
    assert _checked(values, torch.tensor([True, True]), call, "forward") is values
    with pytest.raises(UserError) as raised:
        _checked(values, torch.tensor([True, False, False]), call, "forward")
    message = str(raised.value)
    assert message.startswith("BatchNorm layer layer3.8.bn2 ran on some workers only: ")
    assert "same number of times in a step; use --batchnorm local" in message[:240]
    assert message.endswith("(forward call 7; worker(s) 1, 2 in another collective)")
    with pytest.raises(UserError, match=r"\(backward call 7\)$"):
        _checked(values, torch.tensor(False), call, "backward")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_a_mismatch_poisons_the_values_instead_of_stalling_the_device() -> None:
    from gradsync.comm.batchnorm import _Call, _checked

    values = torch.ones(3, device="cuda")
    agree = torch.tensor([True, False], device="cuda")
    assert bool(_checked(values, agree, _Call("bn", 0, 1), "forward").isnan().all())
    assert bool((_checked(values, agree[:1], _Call("bn", 0, 1), "forward") == 1).all())
