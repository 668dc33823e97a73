"""A plain hand-written torch training loop: the yardstick for gradsync's `single` overhead.

It builds the same workload (model, data, loss) and the same optimizer, and times each step
the same way, but uses none of gradsync's launcher, trainer or strategy code. Prints one
JSON object with the throughput.

    python benchmarks/plain_loop.py --model transformer --steps 40
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from gradsync.models import build_workload
from gradsync.stats import throughput


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--preset", default="default")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    workload = build_workload(args.model, preset=args.preset, dropout=False)
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
    print(json.dumps({"throughput": throughput(step_times, size).as_dict()}))


if __name__ == "__main__":
    main()
