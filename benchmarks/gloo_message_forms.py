"""What a server-transport message costs in Gloo: header and payload as two sends, or one.

Two processes on loopback; rank 0 sends ``--messages`` messages of a 72-byte header and a
``--size``-value float32 payload to rank 1, with up to 8 sends in flight, in three forms:

- ``two``: a header send, then a payload send (gradsync's transport);
- ``one``: a single send of a buffer that already holds both (the floor);
- ``packed``: one send, the header and payload copied into a fresh buffer by the sender
  and copied out of a kept buffer by the receiver (what packing costs in practice).

Per form and rank: user and system CPU µs a message (every thread of the process, from
``getrusage``), voluntary context switches a message, and wall µs a message. The forms take
turns over ``--rounds`` rounds.

    python benchmarks/gloo_message_forms.py --size 40000 --messages 600 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradsync.launch import free_port

HEADER_BYTES = 72
IN_FLIGHT = 8
FORMS = ("two", "one", "packed")


def _send(form: str, header: torch.Tensor, payload: torch.Tensor, whole: torch.Tensor) -> list:
    if form == "two":
        return [dist.isend(header, 1, tag=1), dist.isend(payload, 1, tag=1)]
    if form == "one":
        return [dist.isend(whole, 1, tag=1)]
    packed = torch.empty(whole.numel(), dtype=torch.uint8)
    packed[:HEADER_BYTES].copy_(header.view(torch.uint8))
    packed[HEADER_BYTES:].copy_(payload.view(torch.uint8))
    return [dist.isend(packed, 1, tag=1)]


def _receive(form: str, header: torch.Tensor, payload: torch.Tensor, whole: torch.Tensor) -> None:
    if form == "two":
        dist.recv(header, 0, tag=1)
        dist.recv(payload, 0, tag=1)
        return
    dist.recv(whole, 0, tag=1)
    if form == "packed":
        torch.empty_like(payload).view(torch.uint8).copy_(whole[HEADER_BYTES:])


def _rank(rank: int, port: int, size: int, messages: int, rounds: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    header = torch.zeros(HEADER_BYTES // 8, dtype=torch.float64)
    payload = torch.randn(size)
    whole = torch.zeros(HEADER_BYTES + 4 * size, dtype=torch.uint8)
    for _ in range(rounds):
        for form in FORMS:
            dist.barrier()
            before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            if rank == 0:
                works: list = []
                for _ in range(messages):
                    works += _send(form, header, payload, whole)
                    while len(works) > IN_FLIGHT:
                        works.pop(0).wait()
                for work in works:
                    work.wait()
            else:
                for _ in range(messages):
                    _receive(form, header, payload, whole)
            dist.barrier()
            after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - started
            mine = torch.tensor(
                [
                    (after.ru_utime - before.ru_utime) / messages * 1e6,
                    (after.ru_stime - before.ru_stime) / messages * 1e6,
                    (after.ru_nvcsw - before.ru_nvcsw) / messages,
                    wall / messages * 1e6,
                ],
                dtype=torch.float64,
            )
            both = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(both, mine)  # rank 0 prints both ranks' lines, in order
            for who, (user, system, waits, per_message) in enumerate(t.tolist() for t in both):
                if rank == 0:
                    print(
                        f"rank {who} {form:7} user {user:5.0f} µs  sys {system:5.0f} µs  "
                        f"waits {waits:4.1f}  wall {per_message:5.0f} µs a message",
                        flush=True,
                    )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=40_000, help="float32 values a payload")
    parser.add_argument("--messages", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    mp.spawn(_rank, args=(free_port(), args.size, args.messages, args.rounds), nprocs=2)


if __name__ == "__main__":
    main()
