"""Does a sparse model's optimizer step cost the same at step 5 and at step 60?

Trains lstm-lm (default preset, vocabulary 50k, sampled softmax 512, sparse embedding and
softmax; SGD with momentum 0.9) in one process, one thread, and times forward, backward and
the optimizer every step, twice over the same batches: with ``torch.optim.SGD`` stepped as
torch ships it (its momentum buffer for a sparse gradient starts as a copy of that
gradient, sparse, and every step appends the step's rows to it) and with gradsync's
``Updater`` (the buffer dense from the first step: ``dense_momentum_for_sparse_grads``).
Prints the median of each phase over windows of steps, and the buffer's stored entries.

Held equal: model, data, seed, thread count; the two runs alternate, ``--rounds`` times.

    python benchmarks/sparse_momentum.py --steps 60 --window 10 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from gradsync.config import OptimConfig
from gradsync.models import build_workload
from gradsync.optim import Updater

OPTIONS = {"sparse": "true", "vocab": "50000", "sampled_softmax": "512"}


def run(steps: int, dense_buffer: bool) -> list[tuple[float, float, float, int]]:
    """Per step: forward, backward and optimizer seconds, and the momentum buffers' entries."""
    workload = build_workload("lstm-lm", dropout=False, options=OPTIONS)
    model = workload.model.train()
    updater = Updater(model.parameters(), OptimConfig(name="sgd", momentum=0.9), lr=0.1)
    step_optimizer = updater.update if dense_buffer else _torch_step(updater.optimizer)
    timings = []
    for step in range(steps):
        data = workload.dataset.batch(
            step=step, size=workload.global_batch, start=0, stop=workload.global_batch
        )
        started = time.perf_counter()
        loss = workload.loss(model(*data.inputs, **data.shared), data.targets)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        step_optimizer()
        done = time.perf_counter()
        timings.append((forward - started, backward - forward, done - backward, _entries(updater)))
    return timings


def _torch_step(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _entries(updater: Updater) -> int:
    """Elements stored in every momentum buffer (a sparse one's values, all of a dense one)."""
    total = 0
    for state in updater.optimizer.state.values():
        buffer = state.get("momentum_buffer")
        if buffer is not None:
            total += buffer._values().numel() if buffer.is_sparse else buffer.numel()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average {os.getloadavg()[0]:.1f}; ms per phase, median over each window")
    for round_ in range(1, args.rounds + 1):
        for name, dense in (("torch SGD", False), ("gradsync Updater", True)):
            timings = run(args.steps, dense)
            for start in range(0, args.steps, args.window):
                window = timings[start : start + args.window]
                forward, backward, optimizer = (
                    statistics.median(t[i] for t in window) * 1e3 for i in range(3)
                )
                print(
                    f"round {round_} {name:17s} steps {start:3d}–{start + len(window) - 1:3d}: "
                    f"forward {forward:6.1f}  backward {backward:6.1f}  optimizer {optimizer:6.1f}"
                    f"  buffer entries {window[-1][3] / 1e6:5.1f}M"
                )


if __name__ == "__main__":
    main()
