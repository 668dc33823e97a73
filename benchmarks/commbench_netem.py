"""Allreduce bus bandwidth at 64 MB between emulated hosts on 1 Gbit/s links.

Runs ``gradsync commbench`` a few times for 2 and 4 hosts (one rank per host) and prints the
median and the range of the bus bandwidth as a share of the link rate (target ≥ 85%).
Needs root. Usage::

    python benchmarks/commbench_netem.py [--runs 3] [--hosts 2,4] [--bandwidth 1gbit]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from gradsync.netem import parse_rate


def one_run(hosts: int, bandwidth: str, size: str, out: Path) -> float:
    """Bus bandwidth (bits/s) of one commbench run."""
    command = [
        sys.executable, "-m", "gradsync", "commbench", "--workers", str(hosts),
        "--hosts", str(hosts), "--bandwidth", bandwidth, "--ops", "allreduce",
        "--sizes", size, "--warmup", "3", "--iters", "5", "--time-budget", "10",
        "--out", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    (row,) = json.loads((out / "commbench.json").read_text())["results"]
    return row["busbw_Bps"] * 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--hosts", default="2,4")
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--size", default="64M")
    args = parser.parse_args()
    link = parse_rate(args.bandwidth)
    print(
        f"held equal: allreduce of {args.size}, 3 warm-up and 5 timed iterations, one rank "
        f"per emulated host, every link {args.bandwidth}; varied: hosts ({args.hosts})",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        for hosts in (int(h) for h in args.hosts.split(",")):
            shares = [
                one_run(hosts, args.bandwidth, args.size, Path(tmp) / f"h{hosts}-{i}") / link
                for i in range(args.runs)
            ]
            print(
                f"allreduce {args.size}, {hosts} hosts × {args.bandwidth}: busbw "
                f"{statistics.median(shares) * link / 1e6:.0f} Mbit/s median = "
                f"{statistics.median(shares):.1%} of the link "
                f"(range {min(shares):.1%}–{max(shares):.1%}, {args.runs} runs)",
                flush=True,
            )


if __name__ == "__main__":
    main()
