"""Partitioning and placement of variables on parameter servers (no processes)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync.comm.placement import (
    Variable,
    partition_variables,
    place_greedy,
    place_round_robin,
    plan_placement,
)
from gradsync.errors import UserError
from gradsync.models import build_workload


def _transformer_variables() -> list[Variable]:
    model = build_workload("transformer", preset="default", seed=0, dropout=False).model
    return [Variable(n, p.numel(), p.element_size()) for n, p in model.named_parameters()]


@pytest.mark.parametrize("num_servers", [2, 3])
def test_greedy_balances_the_default_transformer(num_servers: int) -> None:
    variables = _transformer_variables()
    greedy = plan_placement(variables, num_servers=num_servers, policy="greedy")
    round_robin = plan_placement(variables, num_servers=num_servers, policy="round-robin")
    mb = [f"{b / 2**20:.2f}" for b in greedy.bytes_per_server()]
    rr = [f"{b / 2**20:.2f}" for b in round_robin.bytes_per_server()]
    print(
        f"\ntransformer default, {num_servers} servers, MB per server: greedy {mb} "
        f"(max/min {greedy.imbalance():.3f}), round-robin {rr} "
        f"(max/min {round_robin.imbalance():.3f})"
    )
    assert greedy.imbalance() <= 1.15
    assert greedy.imbalance() <= round_robin.imbalance()
    assert sum(greedy.bytes_per_server()) == sum(v.num_bytes for v in variables)


def test_large_variables_are_partitioned_across_servers() -> None:
    variables = [Variable("embedding", 1_000_000), Variable("bias", 10)]
    plan = plan_placement(variables, num_servers=2, threshold_bytes=1 << 20)
    embedding = [p for p in plan.partitions if p.name == "embedding"]
    assert [(p.start, p.stop) for p in embedding] == [(0, 500_000), (500_000, 1_000_000)]
    assert {p.server for p in embedding} == {0, 1}
    assert "embedding[0:500000] → server" in plan.describe()
    assert "bytes per server" in plan.describe()


def test_more_servers_than_variables_is_a_user_error() -> None:
    with pytest.raises(UserError, match="3 parameter servers but only 2 variables"):
        plan_placement([Variable("a", 4), Variable("b", 4)], num_servers=3)


variables_lists = st.lists(st.integers(min_value=1, max_value=5_000), min_size=1, max_size=40).map(
    lambda sizes: [Variable(f"v{i}", n) for i, n in enumerate(sizes)]
)


@settings(max_examples=60, deadline=None)
@given(variables=variables_lists, num_servers=st.integers(1, 6), threshold=st.integers(4, 40_000))
def test_partitions_cover_every_element_once(
    variables: list[Variable], num_servers: int, threshold: int
) -> None:
    partitions = partition_variables(variables, num_servers, threshold)
    for variable in variables:
        mine = sorted((p.start, p.stop) for p in partitions if p.name == variable.name)
        assert mine[0][0] == 0 and mine[-1][1] == variable.numel
        assert all(a[1] == b[0] for a, b in itertools.pairwise(mine))
        assert len(mine) <= num_servers
        if len(mine) > 1:
            assert variable.num_bytes > threshold


@settings(max_examples=60, deadline=None)
@given(variables=variables_lists, num_servers=st.integers(1, 6))
def test_greedy_is_within_one_partition_of_perfect(
    variables: list[Variable], num_servers: int
) -> None:
    partitions = partition_variables(variables, num_servers, 1 << 30)
    placed = place_greedy(partitions, num_servers)
    loads = [sum(p.num_bytes for p in placed if p.server == s) for s in range(num_servers)]
    # Greedy (LPT) never leaves a server more than one partition above the lightest.
    assert max(loads) - min(loads) <= max(p.num_bytes for p in partitions)
    assert [(p.name, p.start) for p in placed] == [(p.name, p.start) for p in partitions]


@settings(max_examples=30, deadline=None)
@given(variables=variables_lists, num_servers=st.integers(1, 6))
def test_round_robin_deals_partitions_in_model_order(
    variables: list[Variable], num_servers: int
) -> None:
    placed = place_round_robin(partition_variables(variables, num_servers, 1 << 30), num_servers)
    assert [p.server for p in placed] == [i % num_servers for i in range(len(placed))]


@settings(max_examples=60, deadline=None)
@given(variables=variables_lists, num_servers=st.integers(1, 6), threshold=st.integers(4, 4_000))
def test_greedy_spreads_a_variables_partitions_over_servers(
    variables: list[Variable], num_servers: int, threshold: int
) -> None:
    placed = place_greedy(partition_variables(variables, num_servers, threshold), num_servers)
    for variable in variables:
        servers = [p.server for p in placed if p.name == variable.name]
        assert len(servers) == len(set(servers)), (variable, servers)
