"""A plain hand-written torch training loop: the yardstick for gradsync's `single` overhead.

It builds the same workload (model, data, loss) and the same optimizer, and times each step
the same way, but uses none of gradsync's launcher, trainer or strategy code. Prints one
JSON object with the throughput, what it held equal, and the ``gradsync train`` command
that runs the same workload (same dropout, data, global batch, threads; one process, so
BatchNorm statistics are the whole batch's, as ``single``'s). It sets glibc's thresholds as
every gradsync rank does (``gradsync/allocator.py``), so the comparison measures the
harness and not the allocator; ``--system-allocator`` leaves glibc's defaults.

    python benchmarks/plain_loop.py --model transformer --steps 40
    python benchmarks/plain_loop.py --model transformer --deterministic   # dropout off
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from gradsync import allocator
from gradsync.models import build_workload
from gradsync.stats import throughput


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--preset", default="default")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument(
        "--deterministic", action="store_true", help="dropout off (gradsync's flag of that name)"
    )
    parser.add_argument(
        "--system-allocator",
        action="store_true",
        help="leave glibc's thresholds as they are (gradsync's ranks set them)",
    )
    args = parser.parse_args()

    if not args.system_allocator:
        allocator.keep_step_memory()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    workload = build_workload(args.model, preset=args.preset, dropout=not args.deterministic)
    model, size = workload.model, workload.global_batch
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model.train()
    step_times = []
    for step in range(args.steps):
        started = time.perf_counter()
        batch = workload.dataset.batch(step=step, size=size, start=0, stop=size)
        loss = workload.loss(model(*batch.inputs, **batch.shared), batch.targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        step_times.append(time.perf_counter() - started)
    held_equal = {
        "model": args.model,
        "preset": args.preset,
        "dropout": not args.deterministic,
        "data": "synthetic, batch fixed by (seed 0, step)",
        "global_batch": size,
        "threads": args.threads,
        "batchnorm": "one process: statistics of the whole global batch",
        "optimizer": f"sgd lr {args.lr} momentum 0.9",
        "allocator": allocator.applied(),
    }
    same = (
        f"gradsync train --strategy single --model {args.model} --preset {args.preset} "
        f"--steps {args.steps} --threads {args.threads} --lr {args.lr} --momentum 0.9"
        + (" --deterministic" if args.deterministic else "")
    )
    print(
        json.dumps(
            {
                "throughput": throughput(step_times, size).as_dict(),
                "held_equal": held_equal,
                "same_workload": same,
            }
        )
    )


if __name__ == "__main__":
    main()
