"""Soak test: do long runs of the server strategies leak memory, file descriptors or threads?

Runs ``gradsync train`` for 1,000 steps with 4 ranks (3 workers + 1 server) of ``ps`` and
``hybrid`` on tiny models (global batch 12), samples every rank's RSS, open file
descriptors and threads after warm-up (step 100) and near the end (step 950), and reports
the growth. Exit 1 when any rank grew by 5% or more in any of them.

    python benchmarks/soak.py                      # ps and hybrid, 1,000 steps
    python benchmarks/soak.py --steps 300 --strategies ps --warmup 50 --end 280
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# hybrid needs sparse variables (lstm-lm's embedding with sparse=true) to have a server rank
MODELS = {"ps": ["mnist-cnn"], "hybrid": ["lstm-lm", "--model-option", "sparse=true"]}
LIMIT = 0.05


@dataclass(frozen=True)
class Sample:
    """One rank's resources at one moment."""

    rss_kib: int
    fds: int
    threads: int


def sample(pid: int) -> Sample:
    """RSS, open fds and threads of ``pid`` from /proc."""
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return Sample(
        rss_kib=int(status["VmRSS"].split()[0]),
        fds=len(list(Path(f"/proc/{pid}/fd").iterdir())),
        threads=int(status["Threads"]),
    )


def steps_done(out: Path) -> int:
    path = out / "metrics" / "rank0.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def soak(strategy: str, steps: int, warmup: int, end: int, workdir: Path) -> dict[str, object]:
    """Run one job and sample its ranks at step ``warmup`` and step ``end``."""
    out = workdir / strategy
    argv = [
        sys.executable, "-m", "gradsync", "train", "--model", *MODELS[strategy],
        "--preset", "tiny", "--strategy", strategy, "--workers", "3", "--steps", str(steps),
        "--out", str(out), "--log-every", str(steps), "--global-batch", "12",
    ]  # fmt: skip
    job = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples: dict[str, dict[str, Sample]] = {}
    try:
        for label, at in (("warm", warmup), ("end", end)):
            while steps_done(out) < at:
                if job.poll() is not None:
                    raise SystemExit(f"{strategy}: the job ended early:\n{job.stderr.read()}")
                time.sleep(0.05)
            pids = json.loads((out / "ranks-node0.json").read_text())
            samples[label] = {rank: sample(pid) for rank, pid in pids.items()}
        _, stderr = job.communicate(timeout=3600)
    finally:
        if job.poll() is None:
            job.kill()
    if job.returncode:
        raise SystemExit(f"{strategy}: exit {job.returncode}:\n{stderr}")
    growth = {
        rank: {
            key: getattr(samples["end"][rank], key) / getattr(samples["warm"][rank], key) - 1
            for key in ("rss_kib", "fds", "threads")
        }
        for rank in samples["warm"]
    }
    return {
        "strategy": strategy,
        "model": " ".join(MODELS[strategy]),
        "steps": steps,
        "samples": {label: {r: asdict(s) for r, s in by.items()} for label, by in samples.items()},
        "growth": growth,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100, help="first sample at this step")
    parser.add_argument("--end", type=int, default=950, help="second sample at this step")
    parser.add_argument("--strategies", default="ps,hybrid")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    print(
        "held equal between the two samples: one job per strategy (model, global batch 12, "
        "ranks, threads); only the position in the run differs",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for strategy in args.strategies.split(","):
            result = soak(strategy, args.steps, args.warmup, args.end, Path(workdir))
            results.append(result)
            for rank, growth in result["growth"].items():  # type: ignore[union-attr]
                warm = result["samples"]["warm"][rank]  # type: ignore[index]
                end = result["samples"]["end"][rank]  # type: ignore[index]
                print(
                    f"{strategy} rank {rank}: RSS {warm['rss_kib'] / 1024:.1f} → "
                    f"{end['rss_kib'] / 1024:.1f} MiB ({growth['rss_kib']:+.1%}), fds "
                    f"{warm['fds']} → {end['fds']}, threads {warm['threads']} → {end['threads']}"
                )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    worst = max(g for r in results for by in r["growth"].values() for g in by.values())  # type: ignore[union-attr]
    print(f"largest growth {worst:+.1%} (limit {LIMIT:.0%})")
    return 0 if worst < LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
