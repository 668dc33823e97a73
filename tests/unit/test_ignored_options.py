"""Options that another option makes meaningless are refused in one line, not ignored."""

from __future__ import annotations

import pytest

from gradsync.config import OptimConfig
from gradsync.errors import UserError
from gradsync.strategies.allreduce import AllreduceOptions
from gradsync.strategies.p3 import P3Options


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (
            P3Options(slicing=False, slice_size=11),
            "--slice-size with --slicing off",
        ),
        (
            AllreduceOptions(fusion_threshold_mb=0, first_bucket_mb=5),
            "first-bucket-mb.*fusion-threshold-mb",
        ),
    ],
    ids=["p3 slice size without slicing", "first bucket without fusion"],
)
def test_an_option_that_another_switches_off_is_refused(options, words) -> None:
    with pytest.raises(UserError, match=words):
        options.check(2)


def test_the_defaults_and_meaningful_combinations_pass() -> None:
    P3Options(slicing=False).check(2)
    P3Options(slice_size=11).check(2)
    AllreduceOptions(fusion_threshold_mb=0).check(2)
    AllreduceOptions(first_bucket_mb=5).check(2)


def test_a_base_batch_without_a_scaling_rule_is_refused() -> None:
    with pytest.raises(UserError, match=r"--lr-base-batch.*--lr-scaling is none"):
        OptimConfig(lr_base_batch=64).check()
    OptimConfig(lr_base_batch=64, lr_scaling="linear").check()
