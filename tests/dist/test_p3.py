"""P3 on real Gloo ranks: per-layer readiness lets the next forward start early.

Ranks 0 and 1 are workers, rank 2 a dedicated server. The server holds back its answers
for the last layer (a delay injected into the reply of that layer's slices), and the
workers record when each layer's parameters arrived and when their forward passes ran.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch
from torch import nn

from gradsync.config import LaunchConfig, OptimConfig, TrainConfig
from gradsync.strategies.p3 import P3Options
from gradsync.optim import Updater
from gradsync.strategies.base import Context
from gradsync.strategies.p3 import PriorityPropagation

DELAY_S = 0.4
STEPS = 4
LAST_LAYER = 2  # Linear 0, Linear 2, Linear 4: three layers


class SlowLastLayer(PriorityPropagation):
    """The server answers the last layer's slices ``DELAY_S`` late (without blocking others)."""

    def _reply(self, worker: int, header, values, priority: int) -> None:
        if priority == LAST_LAYER:
            threading.Timer(DELAY_S, super()._reply, (worker, header, values, priority)).start()
        else:
            super()._reply(worker, header, values, priority)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2)
    )


def _slow_last_layer(rank: int, world_size: int, out: str) -> dict:
    config = TrainConfig(
        model="mnist-cnn",
        strategy="p3",
        workers=2,
        steps=STEPS,
        out=out,
        optim=OptimConfig(lr=0.1),
        strategy_options=P3Options(slice_size=1000),  # Linear(64, 64) is 5 slices
        launch=LaunchConfig(timeout_s=20),
    )
    context = Context(
        config=config,
        rank=rank,
        world_size=world_size,
        worker_index=rank if rank < 2 else -1,
        num_workers=2,
        device=torch.device("cpu"),
        worker_group=None,
        make_updater=lambda ps: Updater(ps, config.optim, lr=0.1),
        lr=0.1,
        role="worker" if rank < 2 else "server",
    )
    strategy = SlowLastLayer()
    if rank == 2:
        strategy.serve(context)
        return {}
    model = strategy.setup(_model(), context)
    forward_done: dict[str, list[float]] = {"first": [], "last": []}
    model[0].register_forward_hook(lambda *_: forward_done["first"].append(time.perf_counter()))
    model[4].register_forward_hook(lambda *_: forward_done["last"].append(time.perf_counter()))
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        inputs = torch.randn(8, 4, generator=generator)[rank * 4 : rank * 4 + 4]
        model(inputs).square().mean().backward()
        strategy.step()
    checkpoint = strategy.checkpoint_tensors()
    strategy.finish()
    ready = {(step, layer): t for step, layer, t in strategy.ready_log}
    return {
        "forward_done": forward_done,
        "ready": {f"{s},{layer}": t for (s, layer), t in ready.items()},
        "send_log": [(r.priority, r.next_priority) for r in strategy.sender.log],
        "params": [p.detach().clone() for p in model.parameters()],
        "checkpoint": None if checkpoint is None else sorted(checkpoint),
    }


def test_first_layer_runs_before_the_slow_last_layer_has_arrived(run_ranks, tmp_path: Path):
    worker0, worker1, _ = run_ranks(3, _slow_last_layer, str(tmp_path), timeout=60)
    for worker in (worker0, worker1):
        first, last = worker["forward_done"]["first"], worker["forward_done"]["last"]
        ready = {tuple(map(int, k.split(","))): t for k, t in worker["ready"].items()}
        for step in range(STEPS - 1):
            # Forward of step + 1: layer 0 is done before the last layer's values of step
            # have even arrived; the last layer waited for them.
            assert first[step + 1] < ready[(step, LAST_LAYER)], (step, worker)
            assert last[step + 1] > ready[(step, LAST_LAYER)]
            assert ready[(step, 0)] < ready[(step, LAST_LAYER)] - DELAY_S / 2
        # Whenever slices of several layers were queued together, the lowest went first.
        assert worker["send_log"]
        for priority, next_priority in worker["send_log"]:
            assert next_priority is None or priority <= next_priority
    for a, b in zip(worker0["params"], worker1["params"], strict=True):
        assert torch.equal(a, b)
    assert "param/4.weight" in worker0["checkpoint"] and worker1["checkpoint"] is None
