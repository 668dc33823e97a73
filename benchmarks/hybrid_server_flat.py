"""Is the hybrid server's cost per step flat over a long run? (issue 18, item 4)

Trains ``hybrid`` on lstm-lm (tiny preset, vocabulary 50k, sampled softmax 512, sparse
embedding; momentum 0.9, so the server keeps momentum for every row ever touched) for
1,000 steps, then reads the server's ``busy_s`` per step (``metrics/server<rank>.jsonl``:
time spent aggregating, applying and reading rows) and compares the first and the last
``--window`` steps. A server whose apply touched every row ever seen grows with the run;
one whose cost depends on the step's rows stays flat (ratio ≈ 1).

Held equal between the two windows: one job, same model, data, threads and servers; only
the position in the run differs. The load average is printed with the figures.

    python benchmarks/hybrid_server_flat.py --steps 1000 --window 100
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from gradsync.config import LaunchConfig, OptimConfig, TrainConfig
from gradsync.jobs import run_job

OPTIONS = {"vocab": "50000", "sampled_softmax": "512", "sparse": "true"}


def busy_per_step(out: Path) -> dict[int, float]:
    """Server busy seconds per step, summed over the servers."""
    busy: dict[int, float] = {}
    for path in sorted((out / "metrics").glob("server*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            busy[record["step"]] = busy.get(record["step"], 0.0) + record["busy_s"]
    return busy


def describe(name: str, values: list[float]) -> str:
    return (
        f"{name}: median {statistics.median(values) * 1e3:.3f} ms "
        f"(min {min(values) * 1e3:.3f} – max {max(values) * 1e3:.3f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="runs/bench-hybrid-server-flat")
    args = parser.parse_args()
    config = TrainConfig(
        model="lstm-lm",
        preset="tiny",
        model_options=OPTIONS,
        strategy="hybrid",
        workers=args.workers,
        steps=args.steps,
        out=args.out,
        deterministic=True,
        optim=OptimConfig(momentum=0.9),
        launch=LaunchConfig(threads=1),
    )
    print(
        "held equal between the two windows: one job (model, data, batch, 1 intra-op thread "
        "per rank, servers); only the position in the run differs",
        flush=True,
    )
    summary = run_job(config)
    busy = busy_per_step(Path(args.out))
    steps = sorted(busy)
    first = [busy[s] for s in steps[: args.window]]
    last = [busy[s] for s in steps[-args.window :]]
    ratio = statistics.median(last) / statistics.median(first)
    print(f"hybrid on lstm-lm tiny (vocab 50k, sampled softmax 512), {args.steps} steps")
    print(describe(f"server busy per step, first {args.window} steps", first))
    print(describe(f"server busy per step, last {args.window} steps", last))
    print(f"last / first (medians): {ratio:.2f}")
    print(f"throughput: {summary['throughput']['median']:.1f} samples/s (median)")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
