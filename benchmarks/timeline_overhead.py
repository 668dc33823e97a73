"""Issue 8 benchmark: the throughput cost of --timeline, side by side.

Runs with and without recording are interleaved, so machine noise hits both alike; the
ratio is taken within each repeat and the median reported.

    python benchmarks/timeline_overhead.py --repeats 3 --steps 40

Target: recording costs ≤ 3% on transformer (default preset), 2 workers.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from gradsync.config import TrainConfig
from gradsync.jobs import run_job


def throughput(args: argparse.Namespace, out: Path, timeline: bool) -> float:
    config = TrainConfig(
        model=args.model,
        preset=args.preset,
        strategy=args.strategy,
        workers=args.workers,
        steps=args.steps,
        deterministic=True,
        out=str(out),
        timeline=str(out / "trace.json") if timeline else None,
    )
    return run_job(config)["throughput"]["median"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--preset", default="default")
    parser.add_argument("--strategy", default="allreduce")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(
        f"held equal: {args.strategy} on {args.model} ({args.preset}), {args.workers} workers "
        "(so the same threads per rank), dropout off, synthetic data and the preset's global "
        "batch; varied: --timeline",
        flush=True,
    )
    ratios, plain, traced = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            plain.append(throughput(args, Path(tmp) / f"off{repeat}", timeline=False))
            traced.append(throughput(args, Path(tmp) / f"on{repeat}", timeline=True))
            ratios.append(traced[-1] / plain[-1])
            print(
                f"repeat {repeat + 1}: off {plain[-1]:.1f}, on {traced[-1]:.1f} samples/s, "
                f"ratio {ratios[-1]:.3f}",
                flush=True,
            )
    print(f"\n{args.strategy} on {args.model} ({args.preset}), {args.workers} workers")
    print(
        f"timeline off: median {statistics.median(plain):.1f} samples/s "
        f"({min(plain):.1f}–{max(plain):.1f})"
    )
    print(
        f"timeline on:  median {statistics.median(traced):.1f} samples/s "
        f"({min(traced):.1f}–{max(traced):.1f})"
    )
    print(
        f"on/off ratio: median {statistics.median(ratios):.3f} "
        f"({min(ratios):.3f}–{max(ratios):.3f}); cost {1 - statistics.median(ratios):.1%}"
    )


if __name__ == "__main__":
    main()
