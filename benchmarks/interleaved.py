"""Interleaved rounds of several `gradsync train` variants: samples/s and bytes side by side.

Each round runs every variant once, in order (A, B, C, A, B, C, …), so load on a shared
machine hits them alike; the table shows the median and min–max over rounds of each run's
samples/s, its median ratio to the first variant (taken within each round), bytes sent per
step per worker, the CPU seconds every process of the job used per step (all threads: the
cores a variant keeps busy, whatever its wall time), and the 1-minute load average before
each run. Every variant gets the
common arguments, so they run the same workload; the script prints them.

    python benchmarks/interleaved.py --rounds 3 \\
        --common "--model transformer --workers 2 --threads 1 --steps 12 --deterministic" \\
        "ddp=--strategy ddp" "allreduce=--strategy allreduce"

``--checkout NAME=DIR`` runs variant NAME with the gradsync of another checkout (a clone of
an earlier commit, say), so a change is measured against its parent side by side; ``--env
NAME=KEY=VALUE`` adds a variable to one variant's environment (an allocator setting, say):

    python benchmarks/interleaved.py --rounds 3 --checkout before=/tmp/parent \\
        --common "--model resnet56 --workers 2 --threads 1" \\
        "before=--strategy allreduce" "after=--strategy allreduce"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

# What makes two runs different workloads (as gradsync compare flags them).
WORKLOAD_FLAGS = {
    "--deterministic",
    "--batchnorm",
    "--threads",
    "--interop-threads",
    "--global-batch",
    "--data",
}


def run(
    args: list[str], out: Path, checkout: str | None = None, env: dict[str, str] | None = None
) -> dict:
    """One `gradsync train` (of ``checkout``'s gradsync if given, with ``env`` added to the
    environment); its summary.json."""
    command = [sys.executable, "-m", "gradsync", "train", "--out", str(out), *args]
    env = dict(os.environ, **(env or {}), **({"PYTHONPATH": checkout} if checkout else {}))
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"{shlex.join(command)} failed:\n{done.stderr[-2000:]}")
    return json.loads((out / "summary.json").read_text())


def spread(values: list[float], digits: int = 1) -> str:
    return (
        f"{statistics.median(values):.{digits}f} "
        f"({min(values):.{digits}f}–{max(values):.{digits}f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", help="NAME=ARGS (gradsync train arguments)")
    parser.add_argument("--common", default="", help="arguments every variant gets")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--out",
        default=f"runs/interleaved/{time.strftime('%Y%m%d-%H%M%S')}",
        help="where the runs go (default: a new folder per invocation, so runs never mix)",
    )
    parser.add_argument(
        "--checkout",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="run variant NAME with the gradsync in DIR (a clone of another commit)",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=KEY=VALUE",
        help="run variant NAME with KEY=VALUE in its environment (repeatable)",
    )
    args = parser.parse_args()
    variants = dict(v.split("=", 1) for v in args.variants)
    checkouts = dict(c.split("=", 1) for c in args.checkout)
    if unknown := sorted(set(checkouts) - set(variants)):
        sys.exit(f"--checkout names no variant: {', '.join(unknown)}")
    for name, directory in checkouts.items():
        if not (Path(directory) / "gradsync" / "__init__.py").is_file():
            sys.exit(f"--checkout {name}={directory}: no gradsync package in {directory}")
        print(f"variant {name} runs the gradsync in {directory}", flush=True)
    envs: dict[str, dict[str, str]] = {}
    for entry in args.env:
        name, _, setting = entry.partition("=")
        key, equals, value = setting.partition("=")
        if name not in variants or not key or not equals:
            sys.exit(f"--env {entry}: expected NAME=KEY=VALUE with NAME one of the variants")
        envs.setdefault(name, {})[key] = value
    for name, added in envs.items():
        print(f"variant {name} runs with {' '.join(f'{k}={v}' for k, v in added.items())}")
    common = shlex.split(args.common)
    print(f"held equal (every variant): {args.common}", flush=True)
    for name, extra in variants.items():
        flags = {token.split("=")[0] for token in shlex.split(extra)}
        if own := sorted(flags & WORKLOAD_FLAGS):
            print(
                f"warning: variant {name} sets {', '.join(own)} itself, so the variants differ "
                "in the workload, not only in how they synchronize; put it in --common",
                flush=True,
            )
    rates: dict[str, list[float]] = {name: [] for name in variants}
    sent: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    loads: list[float] = []
    for round_ in range(args.rounds):
        for name, extra in variants.items():
            loads.append(os.getloadavg()[0])
            out = Path(args.out) / f"{name}-r{round_}"
            summary = run([*common, *shlex.split(extra)], out, checkouts.get(name), envs.get(name))
            rates[name].append(summary["throughput"]["median"])
            sent[name].append(summary["bytes_sent_per_step"])
            cpu[name].append(summary.get("cpu_s_per_step", float("nan")))
            print(f"round {round_ + 1} {name}: {rates[name][-1]:.2f} samples/s", flush=True)
    first = next(iter(variants))
    print(f"\n{args.rounds} interleaved rounds; load average {spread(loads)}")
    columns = ["samples/s median (min–max)", f"vs {first}", "MB/step", "CPU ms/step"]
    print(f"{'variant':28} {columns[0]:>30} {columns[1]:>10} {columns[2]:>9} {columns[3]:>12}")
    for name in variants:
        ratio = statistics.median(a / b for a, b in zip(rates[name], rates[first], strict=True))
        print(
            f"{name:28} {spread(rates[name], 2):>30} {ratio:>9.2f}× "
            f"{statistics.median(sent[name]) / 1e6:>9.3f} "
            f"{statistics.median(cpu[name]) * 1e3:>12.1f}"
        )


if __name__ == "__main__":
    main()
