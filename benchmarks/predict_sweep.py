"""Issue 15 benchmark: how long `gradsync predict` takes for a full sweep, interleaved.

The sweep of the issue: 5 strategies × 10 worker counts (1–512) × 5 bandwidths from the
stored vgg16 profile, with the recommendation (its knob settings are most of the work).
Each round runs every variant once, in order, as a fresh process; the script reports, per
variant, the median (min–max) of the command's own "predictions in" figure and of the
whole command's wall time (imports, table and figures included), and the load average.

    python benchmarks/predict_sweep.py --rounds 3
    python benchmarks/predict_sweep.py --rounds 3 --checkout before=/tmp/parent

``--checkout NAME=DIR`` adds variant NAME: the gradsync of another checkout (a worktree of
an earlier commit). Every variant runs in its own checkout's folder with ``PYTHONPATH`` set
to it (``python -m`` puts the working folder first on the import path). Target: under 10 s.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # this checkout
PROFILE = HERE / "docs" / "predict" / "profiles" / "vgg16.json"
SWEEP = [
    "--workers", "1,2,4,8,16,32,64,128,256,512",
    "--bandwidth", "100mbit,1gbit,10gbit,25gbit,100gbit",
    "--latency", "25us",
]  # fmt: skip
PREDICTED = re.compile(r"(\d+) predictions in ([0-9.]+) s")


def run_once(checkout: Path, out: Path) -> tuple[int, float, float]:
    """One sweep by ``checkout``'s gradsync as its own process: (predictions made, their
    seconds, the command's wall seconds)."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    command = [sys.executable, "-m", "gradsync", "predict", "--profile", str(PROFILE), *SWEEP]
    started = time.perf_counter()
    result = subprocess.run(
        [*command, "--out", str(out), "--overwrite"],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"predict failed ({result.returncode}): {result.stderr.strip()[-400:]}")
    match = PREDICTED.search(result.stdout)
    if match is None:
        sys.exit("predict printed no 'N predictions in S s' line")
    return int(match.group(1)), float(match.group(2)), wall


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--checkout", action="append", default=[], metavar="NAME=DIR")
    args = parser.parse_args()
    variants = {"this": HERE}
    for item in args.checkout:
        name, _, directory = item.partition("=")
        if (
            not name
            or name in variants
            or not directory
            or not Path(directory, "gradsync").is_dir()
        ):
            sys.exit(f"--checkout {item}: want NAME=DIR, a new name and a worktree DIR")
        variants[name] = Path(directory).resolve()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    counts: set[int] = set()
    loads = []
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(1, args.rounds + 1):
            for name, checkout in variants.items():
                loads.append(os.getloadavg()[0])
                count, predicted, wall = run_once(checkout, Path(scratch, name))
                counts.add(count)
                times[name].append((predicted, wall))
                done = f"{count} predictions in {predicted:.2f} s"
                print(f"round {round_} {name}: {done}, wall {wall:.2f} s")
    if len(counts) > 1:
        sys.exit(f"the variants made different numbers of predictions ({sorted(counts)})")
    print(f"\nload average (1 min) before each run: {spread(loads)}")
    print("| variant | predictions, s | whole command, s |\n|---|---|---|")
    for name, pairs in times.items():
        print(f"| {name} | {spread([p for p, _ in pairs])} | {spread([w for _, w in pairs])} |")


if __name__ == "__main__":
    main()
