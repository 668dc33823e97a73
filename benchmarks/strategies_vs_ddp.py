"""Every strategy against `ddp` on the zoo models: samples/s ratios taken within each round.

Writes one experiment file per network (loopback, or emulated hosts at a link rate), runs
it with `gradsync bench` (its repeats are interleaved rounds: every cell once, then every
cell again), and prints a markdown table: per model and strategy, samples/s median
(min–max) over rounds, the median of the per-round ratios to `ddp`, and the bytes each
worker sent per step (counted, not modelled). Servers of ps, hybrid and p3 are colocated
in the workers, so every strategy runs on the same processes and cores.

Held equal in every cell (printed): model and preset, model options, global batch, data
(synthetic, fixed by seed and step), dropout (off, as `gradsync bench` runs every cell),
BatchNorm over the global batch, 1 intra-op thread per rank, workers, steps and warm-up,
the network.

    python benchmarks/strategies_vs_ddp.py --rounds 3 --steps 20
    python benchmarks/strategies_vs_ddp.py --network 1gbit --models transformer lstm-lm
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

MODELS = ("transformer", "lstm-lm", "resnet56", "vgg16", "mnist-cnn")
STRATEGIES = ("ddp", "allreduce", "ps", "hybrid", "p3")
SERVER_STRATEGIES = ("ps", "hybrid", "p3")
# lstm-lm as issue 14 measures it: sparse embedding, 50k vocabulary, sampled softmax.
MODEL_OPTIONS = {"lstm-lm": {"sparse": "true", "vocab": "50000", "sampled_softmax": "512"}}


def experiment_text(args: argparse.Namespace, network: str) -> str:
    """The TOML experiment of one network ("loopback" or a link rate such as "1gbit")."""
    lines = [
        f'name = "strategies-vs-ddp-{network}"',
        'description = "every strategy against ddp, interleaved rounds"',
        f"models = {json.dumps(list(args.models))}",
        f"strategies = {json.dumps(list(args.strategies))}",
        f"workers = [{args.workers}]",
        "threads = [1]",
        f"steps = {args.steps}",
        f"repeats = {args.rounds}",
    ]
    if network != "loopback":
        lines += [f'bandwidths = ["{network}"]', f"hosts = {args.workers}"]
    for model, options in MODEL_OPTIONS.items():
        if model in args.models:
            pairs = ", ".join(f'{key} = "{value}"' for key, value in options.items())
            lines.append(f"model_options.{model} = {{ {pairs} }}")
    for strategy in SERVER_STRATEGIES:
        if strategy in args.strategies:
            lines += [f"[options.{strategy}]", "colocate = true"]
    return "\n".join(lines) + "\n"


def run_bench(args: argparse.Namespace, network: str) -> list[dict]:
    """Run (or resume) the network's experiment; its result records."""
    out = Path(args.out) / network
    out.mkdir(parents=True, exist_ok=True)
    experiment = out.parent / f"{network}.toml"
    experiment.write_text(experiment_text(args, network))
    command = [sys.executable, "-m", "gradsync", "bench", str(experiment), "--out", str(out)]
    print(f"load average before {network}: {os.getloadavg()[0]:.2f}", flush=True)
    subprocess.run(command, check=True)
    print(f"load average after {network}: {os.getloadavg()[0]:.2f}", flush=True)
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("role") == "measure" and r.get("status") == "ok"]


def spread(values: list[float], digits: int = 1) -> str:
    """``median (min–max)``.

    Example:
        >>> spread([1.0, 3.0, 2.0])
        '2.0 (1.0–3.0)'
    """
    return (
        f"{statistics.median(values):.{digits}f} "
        f"({min(values):.{digits}f}–{max(values):.{digits}f})"
    )


def table(records: list[dict], network: str) -> str:
    """Markdown rows: model, strategy, samples/s, ratio to ddp within rounds, MB sent."""
    rate: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    sent: dict[tuple[str, str], list[float]] = defaultdict(list)
    for record in records:
        key = (record["model"], record["strategy"])
        rate[key][record["repeat"]] = record["throughput"]["median"]
        sent[key].append(record["bytes_sent_per_step"] / 1e6)
    rows = [
        f"| {network} | model | strategy | samples/s median (min–max) | vs ddp (per round) "
        "| MB sent/step/worker |",
        "|---|---|---|---|---|---|",
    ]
    for model, strategy in sorted(rate, key=lambda k: (k[0], STRATEGIES.index(k[1]))):
        rounds = rate[(model, strategy)]
        ddp = rate.get((model, "ddp"), {})
        ratios = [rounds[r] / ddp[r] for r in rounds if r in ddp]
        ratio = spread(ratios, 2) + "×" if ratios else "—"
        rows.append(
            f"| | {model} | {strategy} | {spread(list(rounds.values()))} | {ratio} "
            f"| {statistics.median(sent[(model, strategy)]):.2f} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--network", nargs="+", default=["loopback"], help="loopback or RATE")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="runs/strategies-vs-ddp")
    args = parser.parse_args()
    if "ddp" not in args.strategies:
        parser.error("--strategies must include ddp, the baseline")
    print(
        "held equal: model, preset, model options, global batch, synthetic data, dropout off, "
        f"BatchNorm over the global batch, 1 thread per rank, {args.workers} workers, "
        f"{args.steps} steps, servers colocated in the workers",
        flush=True,
    )
    for network in args.network:
        print(table(run_bench(args, network), network), flush=True)


if __name__ == "__main__":
    main()
