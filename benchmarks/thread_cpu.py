"""Where one rank's CPU goes, thread by thread: CPU time and context switches over a window.

Starts ``gradsync train`` with the given arguments, waits ``--settle`` seconds (start-up and
warm-up), then reads every thread of rank 0's process from ``/proc/<pid>/task`` twice,
``--window`` seconds apart, and prints per thread the user and system CPU milliseconds and
the voluntary (it waited) and involuntary (it was preempted) context switches in between.
Python threads are named with py-spy's dump when py-spy is installed, else by their kernel
name (Gloo's threads have theirs). The job must still be training when the window closes:
give it enough ``--steps``.

    python benchmarks/thread_cpu.py -- --model vgg16 --workers 2 --threads 1 --steps 80 \\
        --strategy p3 --colocate
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TICK_MS = 10  # /proc/<pid>/task/<tid>/stat counts CPU time in clock ticks of 10 ms


def rank_pid(out: str, timeout_s: float = 60.0) -> int:
    """The pid of rank 0 of the job writing to ``out`` (the launcher starts it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in sorted(Path("/proc").glob("[0-9]*"), key=lambda p: int(p.name)):
            try:
                cmdline = (proc / "cmdline").read_text()
            except OSError:
                continue
            if "gradsync.runtime" in cmdline and out in cmdline:
                return int(proc.name)
        time.sleep(0.5)
    sys.exit(f"no rank process of {out} appeared in {timeout_s:g} s")


def snapshot(pid: int) -> dict[int, tuple[str, int, int, int, int]]:
    """tid → (kernel name, user ticks, system ticks, voluntary, involuntary switches)."""
    threads = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        sys.exit(f"rank 0 (pid {pid}) ended before the window closed; give the job more --steps")
    for task in tasks:
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            status = (task / "status").read_text()
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        switches = [
            int(re.search(rf"^{kind}_ctxt_switches:\s+(\d+)", status, re.M).group(1))
            for kind in ("voluntary", "nonvoluntary")
        ]
        threads[int(task.name)] = (name, int(fields[11]), int(fields[12]), *switches)
    return threads


def python_names(pid: int) -> dict[int, str]:
    """tid → Python thread name, from ``py-spy dump`` (empty without py-spy)."""
    if shutil.which("py-spy") is None:
        return {}
    dump = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True)
    names = {}
    for match in re.finditer(r'^Thread (0x[0-9A-Fa-f]+|\d+) \(\w+\): "([^"]+)"', dump.stdout, re.M):
        tid = match.group(1)
        names[int(tid, 16) if tid.startswith("0x") else int(tid)] = match.group(2)
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settle", type=float, default=14.0, help="seconds before the window")
    parser.add_argument("--window", type=float, default=6.0, help="seconds measured")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train arguments")
    args = parser.parse_args()
    train_args = [a for a in args.train_args if a != "--"]
    out = tempfile.mkdtemp(prefix="thread-cpu-")
    command = [sys.executable, "-m", "gradsync", "train", "--out", out, "--overwrite"]
    job = subprocess.Popen([*command, *train_args], stdout=subprocess.DEVNULL)
    try:
        pid = rank_pid(out)
        time.sleep(args.settle)
        names = python_names(pid)
        before, started = snapshot(pid), time.monotonic()
        time.sleep(args.window)
        after, window = snapshot(pid), time.monotonic() - started
    finally:
        if job.wait() != 0:
            sys.exit(f"the job failed (exit {job.returncode}); its output is in {out}")
    print(f"rank 0 (pid {pid}), {window:.1f} s: {' '.join(train_args)}")
    print(f"{'thread':24} {'user ms':>8} {'sys ms':>8} {'waits':>7} {'preempted':>9}")
    rows = []
    for tid, (name, user, system, waits, preempted) in after.items():
        if tid in before:
            _, user0, system0, waits0, preempted0 = before[tid]
            rows.append(
                (names.get(tid, name), (user - user0) * TICK_MS, (system - system0) * TICK_MS,
                 waits - waits0, preempted - preempted0)
            )  # fmt: skip
    for name, user, system, waits, preempted in sorted(rows, key=lambda r: -(r[1] + r[2])):
        if user + system + waits:
            print(f"{name:24} {user:>8} {system:>8} {waits:>7} {preempted:>9}")
    summary = Path(out) / "summary.json"
    if summary.is_file():
        rate = json.loads(summary.read_text())["throughput"]["median"]
        print(f"job: {rate:.1f} samples/s (median after warm-up)")


if __name__ == "__main__":
    main()
