"""The ``horovod`` strategy's parts that need no Horovod: its slot plan, its refusal where
Horovod is absent, and help texts of options it shares with other defaults."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from gradsync.errors import UserError
from gradsync.options import StrategyOptions, add_option_flags, option
from gradsync.strategies import STRATEGIES, UNAVAILABLE, strategy_class
from gradsync.strategies.horovod import slot_plan, unavailable


def test_slots_keep_the_rank_order_on_interleaved_hosts() -> None:
    """Ranks 0 and 2 on host a, 1 and 3 on host b (not horovodrun's host-by-host order):
    each keeps its rank; local ranks count within a host, cross ranks across hosts."""
    assert slot_plan(["a", "b", "a", "b"]) == [
        ("a", 0, 0, 0, 4, 2, 2),
        ("b", 1, 0, 1, 4, 2, 2),
        ("a", 2, 1, 0, 4, 2, 2),
        ("b", 3, 1, 1, 4, 2, 2),
    ]


def test_a_host_with_fewer_ranks_leaves_the_cross_group_of_higher_local_ranks() -> None:
    plan = slot_plan(["a", "a", "b"])
    assert [slot[3] for slot in plan] == [0, 0, 1]  # cross ranks
    assert [slot[6] for slot in plan] == [2, 1, 2]  # cross sizes: local rank 1 only on a


@pytest.mark.skipif(unavailable() is None, reason="horovod.torch imports here")
def test_without_horovod_the_strategy_is_one_line_saying_how_to_install_it() -> None:
    assert "horovod" not in STRATEGIES and "horovod" in UNAVAILABLE
    with pytest.raises(UserError, match=r"horovod\.torch does not import here .*pip install"):
        strategy_class("horovod")


def test_a_shared_flag_shows_each_strategys_default_where_they_differ() -> None:
    @dataclass(frozen=True, kw_only=True)
    class Small(StrategyOptions):
        size_mb: float = option(4.0, help="bucket size")

    @dataclass(frozen=True, kw_only=True)
    class Large(StrategyOptions):
        size_mb: float = option(128.0, help="bucket size")

    parser = argparse.ArgumentParser()
    add_option_flags(parser, {"one": Small, "two": Small, "big": Large})
    text = " ".join(parser.format_help().split())
    assert "[one, two, big; default 4; big: 128]" in text


@pytest.mark.skipif(unavailable() is None, reason="horovod.torch imports here")
def test_an_experiment_naming_horovod_without_it_says_how_to_install_it(tmp_path) -> None:
    from gradsync.bench.experiment import load_experiment

    path = tmp_path / "x.toml"
    path.write_text('name = "x"\nmodels = ["mnist-cnn"]\nstrategies = ["allreduce", "horovod"]\n')
    with pytest.raises(UserError, match=r"x\.toml: strategy 'horovod' runs real Horovod, but"):
        load_experiment(path)
