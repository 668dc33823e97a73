"""Issue 2 benchmark: allreduce vs ddp, and single vs a plain torch loop, side by side.

Runs are interleaved (ddp, allreduce, single, plain, ddp, ...) so machine noise hits every
variant alike; each ratio is taken within one repeat, and the median ratio is reported.
Every run holds the same workload: dropout off, the same synthetic data and global batch,
``--threads`` intra-op threads per rank, BatchNorm over the global batch; the script prints
what it held equal.

    python benchmarks/core_overhead.py --repeats 3 --steps 40

Targets: allreduce/ddp ≥ 0.95 (transformer default, 2 workers); single/plain ≥ 0.97.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from gradsync.config import LaunchConfig, TrainConfig
from gradsync.jobs import run_job


def gradsync_throughput(strategy: str, workers: int, args: argparse.Namespace, out: Path) -> float:
    config = TrainConfig(
        model=args.model,
        preset=args.preset,
        strategy=strategy,
        workers=workers,
        steps=args.steps,
        deterministic=True,
        batchnorm="global",
        launch=LaunchConfig(threads=args.threads),
        out=str(out),
    )
    return run_job(config)["throughput"]["median"]


def plain_throughput(args: argparse.Namespace) -> float:
    result = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("plain_loop.py")),
            "--model",
            args.model,
            "--preset",
            args.preset,
            "--steps",
            str(args.steps),
            "--threads",
            str(args.threads),
            "--deterministic",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout)["throughput"]["median"]


def describe(name: str, values: list[float]) -> str:
    return (
        f"{name:<22} median {statistics.median(values):8.3f}   "
        f"min {min(values):8.3f}   max {max(values):8.3f}   runs {len(values)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--preset", default="default")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    args = parser.parse_args()
    print(
        f"held equal: {args.model} ({args.preset}), dropout off, synthetic data (seed 0), "
        f"the preset's global batch, {args.threads} thread(s) per rank, BatchNorm global"
    )
    rates: dict[str, list[float]] = {"ddp": [], "allreduce": [], "single": [], "plain": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            base = Path(tmp) / str(repeat)
            rates["ddp"].append(gradsync_throughput("ddp", 2, args, base / "ddp"))
            rates["allreduce"].append(gradsync_throughput("allreduce", 2, args, base / "ar"))
            rates["single"].append(gradsync_throughput("single", 1, args, base / "single"))
            rates["plain"].append(plain_throughput(args))
            print(
                f"repeat {repeat + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()),
                flush=True,
            )
    print(f"\n{args.model} ({args.preset}), {args.steps} steps, samples/s after warm-up")
    for name, values in rates.items():
        print(describe(f"{name} samples/s", values))
    ratios = {
        "allreduce / ddp": ("allreduce", "ddp"),
        "single / plain loop": ("single", "plain"),
    }
    for label, (top, bottom) in ratios.items():
        pairs = zip(rates[top], rates[bottom], strict=True)
        print(describe(label, [a / b for a, b in pairs]))


if __name__ == "__main__":
    main()
