"""Counted bytes vs the wire: each strategy's byte counters against the loopback interface.

Every job runs alone in a fresh network namespace (``unshare -n``, needs root), so the
namespace's loopback interface carries exactly that job's traffic. Each strategy runs twice,
with ``--short`` and ``--long`` steps; the difference of the two runs cancels what happens
once (rendezvous, initial broadcast, final checkpoint), leaving the traffic of
``long − short`` training steps. Compared per step:

* **counted** — the sum over every rank (workers and servers) of ``bytes_sent`` in the
  metrics files; point-to-point bytes are the tensors passed to send/isend, collective
  bytes are modelled from the algorithm (see ``gradsync/comm/counters.py``);
* **wire** — the loopback interface's transmitted bytes, less 66 bytes of Ethernet, IPv4
  and TCP (with timestamps) headers per packet: the TCP payload.

Loopback carries every byte once, so the sum of what the ranks sent is what it counts.

    python benchmarks/wire_bytes.py                       # lstm-lm sparse, 4 strategies
    python benchmarks/wire_bytes.py --strategies ddp allreduce --short 4 --long 12
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HEADER_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 20 + timestamp option 12
MODEL = [
    "--model",
    "lstm-lm",
    "--preset",
    "default",
    "--model-option",
    "sparse=true",
    "--model-option",
    "sampled_softmax=512",
    "--model-option",
    "vocab=50000",
]
MODELLED = {
    "ddp": "all modelled (ring allreduce; sparse = Gloo allgather)",
    "allreduce": "all modelled (ring allreduce of buckets; allgather of sparse rows)",
    "ps": "all counted (point-to-point push/pull)",
    "hybrid": "dense modelled (ring), sparse counted (push/pull), node allgather modelled",
    "p3": "all counted (point-to-point slices)",
}


@dataclass(frozen=True)
class Run:
    """One job's loopback delta and counted bytes (all ranks, all steps)."""

    wire_bytes: int
    packets: int
    counted_bytes: int

    @property
    def payload(self) -> int:
        return self.wire_bytes - HEADER_BYTES * self.packets


def _loopback() -> tuple[int, int]:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            values = fields.split()
            return int(values[8]), int(values[9])  # transmitted bytes, packets
    raise RuntimeError("no loopback interface in /proc/net/dev")


def counted_bytes(out: Path) -> int:
    """Σ bytes_sent over every worker and server record of a run."""
    total = 0
    for path in (out / "metrics").glob("*.jsonl"):
        total += sum(json.loads(line)["bytes_sent"] for line in path.read_text().splitlines())
    return total


def inner(out: Path, train_args: list[str]) -> None:
    """Inside the namespace: bring loopback up, run the job, print the Run as JSON."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    bytes0, packets0 = _loopback()
    job = subprocess.run(
        [sys.executable, "-m", "gradsync", "train", "--out", str(out), *train_args],
        capture_output=True,
        text=True,
    )
    bytes1, packets1 = _loopback()
    if job.returncode != 0:
        sys.exit(f"gradsync train failed:\n{job.stderr[-2000:]}")
    print(json.dumps(vars(Run(bytes1 - bytes0, packets1 - packets0, counted_bytes(out)))))


def run_isolated(out: Path, train_args: list[str]) -> Run:
    command = ["unshare", "-n", sys.executable, __file__, "--inner", str(out), "--", *train_args]
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command[:3])} failed (root needed for unshare -n):\n{done.stderr}")
    return Run(**json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "allreduce", "hybrid", "ps"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--short", type=int, default=4)
    parser.add_argument("--long", type=int, default=14)
    parser.add_argument("--out", default="runs/wire-bytes")
    parser.add_argument("--inner", help=argparse.SUPPRESS)
    parser.add_argument("extra", nargs="*", help="more gradsync train arguments (after --)")
    args = parser.parse_args()
    if args.inner:
        inner(Path(args.inner), args.extra)
        return
    steps = args.long - args.short
    print(
        "held equal per strategy: the same job twice (only --steps differs), lstm-lm default "
        "(sparse, vocab 50k), dropout off, 1 intra-op thread per rank",
        flush=True,
    )
    rows = []
    for strategy in args.strategies:
        common = [*MODEL, "--strategy", strategy, "--workers", str(args.workers)]
        common += ["--threads", "1", "--deterministic", *args.extra]
        runs = [
            run_isolated(Path(args.out) / f"{strategy}-{n}", [*common, "--steps", str(n)])
            for n in (args.short, args.long)
        ]
        counted = (runs[1].counted_bytes - runs[0].counted_bytes) / steps
        payload = (runs[1].payload - runs[0].payload) / steps
        raw = (runs[1].wire_bytes - runs[0].wire_bytes) / steps
        rows.append((strategy, counted, payload, raw, counted / payload - 1))
        print(
            json.dumps({"strategy": strategy, "counted": counted, "payload": payload}), flush=True
        )
    print(f"\nbytes per step, all ranks together ({args.workers} workers, {steps} steps)")
    print(
        f"{'strategy':10} {'counted MB':>11} {'wire MB':>9} {'wire+hdr MB':>12} {'diff':>7}  what"
    )
    for strategy, counted, payload, raw, diff in rows:
        print(
            f"{strategy:10} {counted / 1e6:11.3f} {payload / 1e6:9.3f} {raw / 1e6:12.3f} "
            f"{diff:+7.1%}  {MODELLED.get(strategy, '')}"
        )


if __name__ == "__main__":
    main()
