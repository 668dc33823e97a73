"""Gloo's point-to-point both ways at once: does the posting order halve the link?

Two ranks on two emulated hosts (``gradsync.netem``, the links ``--bandwidth`` shapes) send
each other SIZE bytes at once, posted four ways, and one rank sends alone for reference:

- ``one-way``: rank 0 sends, rank 1 receives;
- ``send-first``: each rank posts ``isend`` then ``irecv`` on one group;
- ``recv-first``: each rank posts ``irecv`` then ``isend`` on one group;
- ``lanes``: ``send-first`` order, but each direction on its own group
  (:class:`gradsync.comm.wire.Lanes`, what ps, hybrid and p3 use).

Gloo sends a payload only once the receiver has announced its receive, and the
announcement queues on the socket behind what that rank is already sending. So
``send-first`` on one group takes turns (about 2× ``one-way``), while ``recv-first`` and
``lanes`` use both directions at once (about 1×). Plain TCP on the same links is full
duplex either way (``benchmarks/tcp_duplex.sh``).

Needs root (namespaces, tc)::

    python benchmarks/gloo_duplex.py --bandwidth 100mbit --size 4M --iters 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

MODES = ("one-way", "send-first", "recv-first", "lanes")


def _rank_main(mode: str, size: int, iters: int) -> None:
    """One rank: ``iters`` timed rounds of ``mode`` after one warm-up; rank 0 prints ms."""
    import torch
    import torch.distributed as dist

    from gradsync.comm.wire import Lanes

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    peer = 1 - rank
    lanes = Lanes.create(2)
    outgoing, incoming = torch.ones(size // 4), torch.empty(size // 4)

    def both_ways(first_recv: bool, send_group: object, recv_group: object) -> None:
        posts = [(dist.isend, outgoing, send_group), (dist.irecv, incoming, recv_group)]
        if first_recv:
            posts.reverse()
        works = [post(tensor, peer, group=group) for post, tensor, group in posts]
        for work in works:
            work.wait()

    def once() -> None:
        if mode == "one-way" and rank == 0:
            dist.send(outgoing, 1)
        elif mode == "one-way":
            dist.recv(incoming, 0)
        elif mode == "lanes":
            both_ways(False, lanes.to(peer), lanes.from_rank(peer))
        else:
            both_ways(mode == "recv-first", None, None)

    times = []
    for i in range(iters + 1):
        dist.barrier()
        start = time.perf_counter()
        once()
        dist.barrier()  # the slower rank's end
        if i:  # the first is warm-up
            times.append(time.perf_counter() - start)
    if rank == 0:
        print(f"{mode} {statistics.median(times) * 1e3:.1f}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth", default="100mbit")
    parser.add_argument("--size", default="4M", help="bytes each way, e.g. 1M, 4M, 16M")
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--as-rank", choices=MODES, help=argparse.SUPPRESS)  # a rank's process
    args = parser.parse_args()
    from gradsync.commbench import parse_size
    from gradsync.netem import EmulatedHosts, parse_rate

    size = parse_size(args.size)
    if args.as_rank:
        _rank_main(args.as_rank, size, args.iters)
        return
    times: dict[str, float] = {}
    with EmulatedHosts(2, parse_rate(args.bandwidth)) as hosts:
        for mode in MODES:
            ranks = []
            for rank in range(2):
                env = {
                    **os.environ,
                    **hosts.rank_env(rank),
                    "MASTER_ADDR": hosts.address(0),
                    "MASTER_PORT": "29517",
                    "RANK": str(rank),
                    "WORLD_SIZE": "2",
                    "OMP_NUM_THREADS": "1",
                }
                argv = [sys.executable, __file__, "--size", args.size, "--iters", str(args.iters)]
                argv += ["--as-rank", mode]
                ranks.append(
                    subprocess.Popen(hosts.exec_argv(rank, argv), env=env, stdout=subprocess.PIPE)
                )
            output = ranks[0].communicate()[0].decode()
            if any(r.wait() for r in ranks):
                sys.exit(f"{mode}: a rank failed")
            times[mode] = float(output.split()[-1])
    print(f"{args.size} each way over {args.bandwidth}, median of {args.iters}:")
    for mode in MODES:
        print(f"  {mode:<11} {times[mode]:9.1f} ms  {times[mode] / times['one-way']:.2f}× one way")


if __name__ == "__main__":
    main()
