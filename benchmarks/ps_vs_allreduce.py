"""Issue 3 benchmark: ``ps`` (1 and 2 dedicated servers, colocated) against ``allreduce``.

Runs are interleaved (allreduce, ps S=1, ps S=2, ps colocated, allreduce, ...) so machine
noise hits every variant alike; ratios to allreduce are taken within one repeat and the
median ratio is reported, with samples/s and the bytes each server moves per step.

    python benchmarks/ps_vs_allreduce.py --repeats 3 --steps 40

Byte check: a server owning B bytes of partitions receives (B + header) from each remote
worker per step and sends as much back. Colocated servers do not send their own worker's
share over the network, so there "remote workers" is workers - 1.

Target: colocated sync ps ≥ 0.85 × allreduce throughput (transformer default, 2 workers).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from gradsync.comm.placement import Variable, plan_placement
from gradsync.comm.wire import HEADER
from gradsync.config import LaunchConfig, TrainConfig
from gradsync.jobs import run_job
from gradsync.models import build_workload
from gradsync.strategies.ps import PSOptions

VARIANTS = {
    "allreduce": ("allreduce", None),
    "ps S=1": ("ps", PSOptions(servers=1)),
    "ps S=2": ("ps", PSOptions(servers=2)),
    "ps colocated": ("ps", PSOptions(colocate=True)),
}


def expected_server_bytes(args: argparse.Namespace, ps: PSOptions) -> list[int]:
    """Theory: bytes each server receives per step (and sends back)."""
    model = build_workload(args.model, preset=args.preset, dropout=False).model
    variables = [Variable(n, p.numel(), p.element_size()) for n, p in model.named_parameters()]
    plan = plan_placement(
        variables,
        num_servers=ps.num_servers(args.workers),
        policy=ps.placement,
        threshold_bytes=int(ps.partition_threshold_mb * 2**20),
    )
    remote = args.workers - 1 if ps.colocate else args.workers
    return [(b + 8 * HEADER) * remote for b in plan.bytes_per_server()]  # float64 header


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--preset", default="default")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    args = parser.parse_args()
    print(
        f"held equal: {args.model} ({args.preset}), dropout off, synthetic data and the "
        f"preset's global batch, {args.threads} intra-op thread(s) per rank whatever the ranks "
        "(dedicated servers add ranks), BatchNorm over the global batch",
        flush=True,
    )
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    servers: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="gradsync-ps-bench-") as tmp:
        for repeat in range(args.repeats):
            for name, (strategy, ps) in VARIANTS.items():
                config = TrainConfig(
                    model=args.model,
                    preset=args.preset,
                    strategy=strategy,
                    workers=args.workers,
                    steps=args.steps,
                    deterministic=True,
                    strategy_options=ps,
                    launch=LaunchConfig(threads=args.threads),
                    out=str(Path(tmp) / f"{name.replace(' ', '_')}-{repeat}"),
                )
                summary = run_job(config)
                rates[name].append(summary["throughput"]["median"])
                per_server = sorted(summary.get("servers", {}).values(), key=lambda s: s["server"])
                if strategy == "ps":
                    servers[name] = [s["bytes_recv_per_step"] for s in per_server]
    print(
        f"{args.model} ({args.preset}), {args.workers} workers, {args.steps} steps, "
        f"{args.repeats} interleaved repeats"
    )
    for name, (_, ps) in VARIANTS.items():
        ratios = [r / a for r, a in zip(rates[name], rates["allreduce"], strict=True)]
        line = (
            f"  {name:13s} {statistics.median(rates[name]):9.1f} samples/s "
            f"(min {min(rates[name]):.1f}, max {max(rates[name]):.1f}), "
            f"× allreduce {statistics.median(ratios):.2f}"
        )
        if name in servers:
            theory = expected_server_bytes(args, ps)
            measured = ", ".join(
                f"{m / 2**20:.2f} MB (theory {t / 2**20:.2f}, gap {abs(m - t) / t:.1%})"
                for m, t in zip(servers[name], theory, strict=True)
            )
            line += f"\n      received per step per server: {measured}"
        print(line)


if __name__ == "__main__":
    main()
