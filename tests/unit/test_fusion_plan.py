"""Fusion bucket planning and the ring byte model (no processes; see tests/dist for the rest)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gradsync.comm.counters import CommStats, ring_allreduce_bytes
from gradsync.comm.fusion import FusedAllreduce, plan_buckets


def _params(*sizes: int, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]


def test_reverse_order_up_to_the_threshold():
    params = _params(10, 10, 10)  # 40 bytes each
    assert plan_buckets(params, threshold_bytes=80) == [[2, 1], [0]]
    assert plan_buckets(params, threshold_bytes=79) == [[2], [1], [0]]
    assert plan_buckets(params, threshold_bytes=120) == [[2, 1, 0]]


def test_threshold_zero_gives_one_bucket_per_parameter():
    assert plan_buckets(_params(1, 5, 3, 7), threshold_bytes=0) == [[3], [2], [1], [0]]


def test_large_threshold_gives_one_bucket():
    assert plan_buckets(_params(*range(1, 20)), threshold_bytes=64 << 20) == [
        list(range(18, -1, -1))
    ]


def test_parameter_larger_than_the_threshold_travels_alone():
    assert plan_buckets(_params(2, 100, 2, 2), threshold_bytes=16) == [[3, 2], [1], [0]]


def test_bytes_not_elements_count():
    doubles = _params(4, 4, 4, dtype=torch.float64)  # 32 bytes each
    halves = _params(4, 4, 4, dtype=torch.float16)  # 8 bytes each
    assert plan_buckets(doubles, threshold_bytes=48) == [[2], [1], [0]]
    assert plan_buckets(halves, threshold_bytes=48) == [[2, 1, 0]]
    assert plan_buckets(_params(2, 3, dtype=torch.float32), threshold_bytes=12) == [[1], [0]]


def test_multi_dimensional_parameters_count_all_elements():
    params = [nn.Parameter(torch.zeros(3, 4)), nn.Parameter(torch.zeros(2, 2, 2))]  # 48, 32 B
    assert plan_buckets(params, threshold_bytes=80) == [[1, 0]]
    assert plan_buckets(params, threshold_bytes=79) == [[1], [0]]


def test_no_parameters_no_buckets():
    assert plan_buckets([], threshold_bytes=100) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=1, max_size=25), st.integers(0, 1024))
def test_plan_properties(sizes, threshold):
    tensors = [torch.empty(n) for n in sizes]
    buckets = plan_buckets(tensors, threshold_bytes=threshold)
    nbytes = [4 * n for n in sizes]
    # every parameter exactly once, in reverse order (the order backward produces them)
    assert [i for bucket in buckets for i in bucket] == list(reversed(range(len(sizes))))
    for bucket in buckets:
        assert bucket
        total = sum(nbytes[i] for i in bucket)
        assert total <= threshold or len(bucket) == 1
    # greedy: a bucket is closed only when the next parameter would not fit
    for current, following in itertools.pairwise(buckets):
        assert sum(nbytes[i] for i in current) + nbytes[following[0]] > threshold


# ---------------------------------------------------------------- buffers, without collectives


def test_fused_allreduce_lays_out_buffers_by_plan():
    params = _params(3, 5, 2, 4)
    fused = FusedAllreduce(params, threshold_bytes=28, group=None, world_size=2, stats=CommStats())
    plan = plan_buckets(params, threshold_bytes=28)
    assert plan == [[3, 2], [1], [0]]
    assert [[id(p) for p in b.params] for b in fused.buckets] == [
        [id(params[i]) for i in indices] for indices in plan
    ]
    assert [b.offsets for b in fused.buckets] == [[0, 4], [0], [0]]
    # gradients, then one had-a-gradient flag per parameter
    assert [b.buffer.numel() for b in fused.buckets] == [6 + 2, 5 + 1, 3 + 1]
    assert [b.flags.numel() for b in fused.buckets] == [2, 1, 1]
    assert all(b.buffer.dtype == torch.float32 for b in fused.buckets)
    assert [b.pending for b in fused.buckets] == [2, 1, 1]


def test_fp16_compression_uses_half_precision_buffers():
    fused = FusedAllreduce(
        _params(8, 8),
        threshold_bytes=1 << 20,
        group=None,
        world_size=4,
        stats=CommStats(),
        fp16=True,
    )
    assert [b.buffer.dtype for b in fused.buckets] == [torch.float16]
    assert fused.buckets[0].buffer.numel() == 16 + 2


# ---------------------------------------------------------------- ring byte model


@pytest.mark.parametrize(
    ("num_bytes", "world_size", "expected"),
    [
        (1000, 1, 0),
        (1000, 2, 1000),
        (1000, 4, 1500),
        (1000, 8, 1750),
        (1000, 3, 1333),
        (0, 4, 0),
        (7, 2, 7),
    ],
)
def test_ring_allreduce_bytes(num_bytes, world_size, expected):
    assert ring_allreduce_bytes(num_bytes, world_size) == expected


def test_comm_stats_accumulate_and_copy_is_independent():
    stats = CommStats()
    stats.add_allreduce(400, 4)
    stats.add_allreduce(100, 2)
    assert (stats.bytes_sent, stats.bytes_recv) == (700, 700)
    snapshot = stats.copy()
    stats.add_allreduce(1000, 2)
    stats.exposed_comm_s += 1.5
    assert (snapshot.bytes_sent, snapshot.exposed_comm_s) == (700, 0.0)
    assert (stats.bytes_sent, stats.exposed_comm_s) == (1700, 1.5)


def test_row_buffers_round_trip_several_variables() -> None:
    from gradsync.comm.row_allgather import pack_rows, unpack_rows

    rows = [
        (torch.tensor([4, 9]), torch.arange(6, dtype=torch.float64).view(2, 3)),
        (torch.tensor([], dtype=torch.long), torch.zeros(0, 1, dtype=torch.float64)),
        (torch.tensor([0]), torch.full((1, 1), 7.0, dtype=torch.float64)),
    ]
    buffer = pack_rows(rows)
    assert buffer.numel() == 2 * 8 + 6 * 8 + 0 + 1 * 8 + 1 * 8
    padded = torch.cat([buffer, torch.zeros(5, dtype=torch.uint8)])  # allgather pads
    back = unpack_rows(padded, [2, 0, 1], [3, 1, 1], torch.float64)
    for (indices, values), (want_i, want_v) in zip(back, rows, strict=True):
        assert torch.equal(indices, want_i) and torch.equal(values, want_v)


def test_first_bucket_cap_applies_to_the_first_bucket_only() -> None:
    # Ten 10-float parameters (40 bytes each); backward produces the last first.
    params = _params(*[10] * 10)
    assert plan_buckets(params, threshold_bytes=160, first_bucket_bytes=40) == [
        [9],
        [8, 7, 6, 5],
        [4, 3, 2, 1],
        [0],
    ]
    # A first parameter above the cap still travels, alone.
    assert plan_buckets(_params(4, 100, 50), threshold_bytes=1000, first_bucket_bytes=8) == [
        [2],
        [1, 0],
    ]


def test_allreduce_bucket_and_sparse_options() -> None:
    from gradsync.errors import UserError
    from gradsync.strategies.allreduce import AllreduceOptions

    with pytest.raises(UserError, match=r"--first-bucket-mb must be >= 0, got -1\.0"):
        AllreduceOptions(first_bucket_mb=-1.0)
    assert AllreduceOptions(first_bucket_mb=0).first_bucket_bytes is None
    assert AllreduceOptions().first_bucket_bytes == 1 << 20  # DDP's first bucket
    assert not AllreduceOptions().sparse_as_dense
