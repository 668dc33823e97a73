"""``--timeout`` bounds the server strategies' transport: ``ps``, ``hybrid`` and ``p3`` create
their lanes with the run's timeout, not torch's 30-minute default for a new group (a stopped
server then fails the job after ``--timeout``, not at the hang detector)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradsync.config import LaunchConfig, TrainConfig
from gradsync.strategies import strategy_class
from gradsync.strategies.base import Context

TIMEOUT_S = 15.0


class _Created(Exception):
    """Raised by the fake ``new_group``: the test needs only the first group's options."""

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__("new_group called")
        self.options = options


def _fake_new_group(ranks: list[int] | None = None, **options: Any) -> None:
    raise _Created(options)


def _server_context(strategy: str) -> Context:
    """Rank 2 of 3: the dedicated server of two workers, with ``--timeout 15``."""
    config = TrainConfig(
        model="mnist-cnn",
        preset="tiny",
        strategy=strategy,
        workers=2,
        launch=LaunchConfig(timeout_s=TIMEOUT_S),
    )
    return Context(
        config=config,
        rank=2,
        world_size=3,
        worker_index=-1,
        num_workers=2,
        device=torch.device("cpu"),
        worker_group=None,
        make_updater=lambda params: None,  # type: ignore[arg-type,return-value]
        role="server",
    )


@pytest.mark.parametrize("strategy", ["ps", "hybrid", "p3"])
def test_server_strategies_create_their_lanes_with_the_runs_timeout(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dist, "new_group", _fake_new_group)
    with pytest.raises(_Created) as created:
        strategy_class(strategy)().serve(_server_context(strategy))
    assert created.value.options.get("timeout") == timedelta(seconds=TIMEOUT_S)


def test_node_local_groups_take_the_runs_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """hybrid's local aggregation and commbench made their node groups with torch's default
    (30 minutes) whatever --timeout said (session 31)."""
    from gradsync.comm.groups import node_local_group

    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "all_gather", lambda out, tensor: out[0].copy_(tensor))
    monkeypatch.setattr(dist, "new_group", _fake_new_group)
    with pytest.raises(_Created) as created:
        node_local_group(0, timedelta(seconds=TIMEOUT_S))
    assert created.value.options["timeout"] == timedelta(seconds=TIMEOUT_S)
