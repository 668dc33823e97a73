"""P3 against the parameter-server baseline on emulated hosts with a shaped link.

2 workers + 1 dedicated server, one rank per emulated host (``--hosts 3``), every host's
link shaped to ``--bandwidth``. Variants: ``ps`` (no slicing, no overlap), ``p3``, and the
two ablations ``p3 --no-priority`` and ``p3 --no-slicing``. Runs are interleaved (round r
runs every variant once) so drifts of a shared machine hit all of them alike; the report
is the median of the per-run throughput medians with min–max, and the ratio to ``ps``.

    python benchmarks/p3_vs_ps.py --models vgg16,resnet56 --bandwidth 1gbit --rounds 3

Needs root (network namespaces and tc). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    "ps": ["--strategy", "ps"],
    "p3": ["--strategy", "p3"],
    "p3 --no-priority": ["--strategy", "p3", "--no-priority"],
    "p3 --no-slicing": ["--strategy", "p3", "--no-slicing"],
}


def run(model: str, variant: str, args: argparse.Namespace, out: Path) -> float:
    command = [
        sys.executable,
        "-m",
        "gradsync",
        "train",
        "--model",
        model,
        "--preset",
        args.preset,
        "--workers",
        "2",
        "--servers",
        "1",
        "--hosts",
        "3",
        "--bandwidth",
        args.bandwidth,
        "--steps",
        str(args.steps),
        "--measure-warmup",
        str(args.warmup),
        "--deterministic",
        "--threads",
        str(args.threads),
        "--out",
        str(out),
        *VARIANTS[variant],
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{model} {variant} failed:\n{result.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return float(summary["throughput"]["median"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="vgg16,resnet56")
    parser.add_argument("--preset", default="default")
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--out", default=f"runs/p3-bench-{time.strftime('%Y%m%d-%H%M%S')}")
    args = parser.parse_args()
    out = Path(args.out)
    variants = args.variants.split(",")
    results: dict[str, dict[str, list[float]]] = {}
    for model in args.models.split(","):
        rates = results.setdefault(model, {v: [] for v in variants})
        for round_ in range(args.rounds):
            for variant in variants:  # interleaved: every variant once per round
                cell = out / f"{model}-{variant.replace(' ', '').replace('--', '-')}-r{round_}"
                rates[variant].append(run(model, variant, args, cell))
                print(
                    f"{model} {variant} round {round_}: {rates[variant][-1]:.2f} samples/s",
                    flush=True,
                )
    lines = [
        f"# P3 vs ps: 2 workers + 1 server on 3 emulated hosts, links {args.bandwidth}, "
        f"{args.steps} steps ({args.warmup} warm-up), {args.rounds} interleaved rounds",
        "",
        f"Held equal: {args.preset} preset's synthetic data and global batch, dropout off, "
        f"{args.threads} intra-op thread(s) per rank, one rank per host; varied: the variant.",
        "",
        "| model | variant | samples/s median (min–max) | vs ps |",
        "|---|---|---|---|",
    ]
    for model, rates in results.items():
        base = statistics.median(rates["ps"]) if "ps" in rates else None
        for variant, values in rates.items():
            median = statistics.median(values)
            ratio = f"{median / base:.2f}×" if base else "-"
            lines.append(
                f"| {model} | {variant} | {median:.2f} ({min(values):.2f}–"
                f"{max(values):.2f}) | {ratio} |"
            )
    report = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(report + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(report)


if __name__ == "__main__":
    main()
