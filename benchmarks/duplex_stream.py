"""Is an emulated link full duplex for p3's traffic? Messages streamed one way, then both.

Two ranks on 2 emulated hosts (root): rank 0 streams ``--messages`` messages of ``--size``
bytes to rank 1, then both stream to each other at once, each direction on a Gloo group of
its own with 4 sends in flight (as p3's lanes and send window); 3 timed trials each, the
two modes alternated twice. A ratio near 1 between "both" and "one" means the link's two
directions are independent for such a stream (session 25: 1.05–1.15× at 1 Gbit/s).

    sudo python benchmarks/duplex_stream.py --bandwidth 1gbit
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

WINDOW = 4  # sends in flight, as gradsync.comm.priority.SEND_WINDOW
PORT = "29611"
MODES = ("one", "both", "one", "both")


def rank_main(rank: int, address: str, mode: str, messages: int, size: int) -> None:
    """One rank: 3 trials of its part of ``mode``; rank 0 prints each trial's time."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{PORT}", rank=rank, world_size=2)
    lanes = [dist.new_group([0, 1]), dist.new_group([0, 1])]  # lane k: rank k's sends
    peer = 1 - rank
    outgoing, incoming = torch.ones(size // 4), torch.empty(size // 4)

    def send_all() -> None:
        pending = []
        for _ in range(messages):
            pending.append(dist.isend(outgoing, peer, group=lanes[rank]))
            if len(pending) >= WINDOW:
                pending.pop(0).wait()
        for work in pending:
            work.wait()

    def receive_all() -> None:
        for _ in range(messages):
            dist.irecv(incoming, peer, group=lanes[peer]).wait()

    parts = [send_all, receive_all] if mode == "both" else [(send_all, receive_all)[rank]]
    for trial in range(3):
        dist.barrier()
        started = time.perf_counter()
        threads = [threading.Thread(target=part) for part in parts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        dist.barrier()
        seconds = time.perf_counter() - started
        if rank == 0:
            rate = messages * size / seconds / 1e6
            print(json.dumps({"mode": mode, "trial": trial, "s": seconds, "MBps": rate}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--size", type=int, default=160_000, help="bytes (a p3 slice: 160 KB)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.address, args.mode, args.messages, args.size)
        return
    from gradsync.netem import EmulatedHosts, parse_rate

    with EmulatedHosts(2, parse_rate(args.bandwidth)) as hosts:
        for mode in MODES:
            ranks = []
            for rank in range(2):
                argv = [sys.executable, __file__, "--rank", str(rank), "--mode", mode,
                        "--address", hosts.address(0), "--messages", str(args.messages),
                        "--size", str(args.size)]  # fmt: skip
                env = {**os.environ, **hosts.rank_env(rank)}
                ranks.append(subprocess.Popen(hosts.exec_argv(rank, argv), env=env))
            for process in ranks:
                process.wait()


if __name__ == "__main__":
    main()
