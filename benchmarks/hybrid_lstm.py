"""hybrid vs allreduce vs ps vs ddp on lstm-lm with a 50k vocabulary and sampled softmax.

Interleaved repeats (each repeat runs every strategy once, in order), medians and spread of
samples/s, and bytes sent per step per worker (worker ranks' counters). Optionally on
emulated hosts (``--hosts 3 --bandwidth 1gbit``: the ps/hybrid server gets its own host).

    python benchmarks/hybrid_lstm.py --repeats 3 --steps 30
    python benchmarks/hybrid_lstm.py --repeats 2 --hosts 2 --bandwidth 1gbit --colocate
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from gradsync.config import LaunchConfig, OptimConfig, TrainConfig
from gradsync.jobs import run_job

STRATEGIES = ("hybrid", "allreduce", "ps", "ddp")
OPTIONS = {"vocab": "50000", "sampled_softmax": "512", "sparse": "true"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--hosts", type=int, default=0)
    parser.add_argument("--bandwidth")
    parser.add_argument("--colocate", action="store_true", help="ps/hybrid servers in the workers")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--out", default="runs/bench-hybrid")
    args = parser.parse_args()
    base = TrainConfig(
        model="lstm-lm",
        model_options=OPTIONS,
        workers=args.workers,
        steps=args.steps,
        deterministic=True,
        optim=OptimConfig(momentum=0.9),
        launch=LaunchConfig(hosts=args.hosts, bandwidth=args.bandwidth, threads=args.threads),
    )
    print(
        f"held equal: lstm-lm (default, vocab 50k, sampled softmax 512, sparse), dropout off, "
        f"synthetic data and the preset's global batch, {args.threads} intra-op thread(s) per "
        "rank whatever the ranks (ps and hybrid add a server rank), sgd momentum 0.9",
        flush=True,
    )
    rates: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    sent: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    for repeat in range(args.repeats):
        for strategy in STRATEGIES:
            colocate = args.colocate and strategy in ("ps", "hybrid")
            config = base.replace(
                strategy=strategy,
                strategy_options={"colocate": True} if colocate else None,
                out=str(Path(args.out) / f"{strategy}-r{repeat}"),
            )
            summary = run_job(config)
            rates[strategy].append(summary["throughput"]["median"])
            workers = [v for r, v in summary["ranks"].items() if int(r) < args.workers]
            sent[strategy].append(statistics.fmean(v["bytes_sent_per_step"] for v in workers))
            print(
                f"repeat {repeat} {strategy}: {rates[strategy][-1]:.1f} samples/s, "
                f"{sent[strategy][-1] / 2**20:.2f} MB sent/step/worker",
                flush=True,
            )
    link = f"{args.hosts} hosts at {args.bandwidth}" if args.hosts else "loopback"
    print(
        f"\nlstm-lm vocab 50k, sampled softmax 512, {args.workers} workers, {link}, "
        f"{args.steps} steps, {args.repeats} interleaved repeats"
    )
    print(
        "| strategy | samples/s median (min–max) | MB sent/step/worker | hybrid speedup | "
        "bytes vs hybrid |"
    )
    print("|---|---|---|---|---|")
    hybrid_rate = statistics.median(rates["hybrid"])
    hybrid_bytes = statistics.median(sent["hybrid"])
    for s in STRATEGIES:
        rate, moved = statistics.median(rates[s]), statistics.median(sent[s])
        print(
            f"| {s} | {rate:.1f} ({min(rates[s]):.1f}–{max(rates[s]):.1f}) | "
            f"{moved / 2**20:.3f} | {hybrid_rate / rate:.2f}× | {moved / hybrid_bytes:.1f}× |"
        )


if __name__ == "__main__":
    main()
