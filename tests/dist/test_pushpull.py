"""Push/pull transport and the server loop on real Gloo ranks."""

from __future__ import annotations

import threading

import torch

from gradsync.comm.pushpull import HEADER, Client, Inbox, Outbox
from gradsync.comm.server import ShardState, serve
from gradsync.config import OptimConfig
from gradsync.optim import Updater

LR = 0.5


def _shard(size: int) -> ShardState:
    return ShardState(
        torch.zeros(size), lambda ps: Updater(ps, OptimConfig(lr=LR, momentum=0.0), lr=LR)
    )


def _server_parts(rank: int, workers: int, local_worker: int | None, size: int):
    remote = {w: w for w in range(workers) if w != local_worker}
    # a push is the shard's gradients and one had-a-gradient flag (the shard is one slot)
    inbox = Inbox(size=size + 1, remote=remote, local_worker=local_worker, group=None, timeout_s=20)
    outbox = Outbox(remote=remote, local_worker=local_worker, group=None)
    return inbox, outbox, _shard(size)


def _dedicated(rank: int, world_size: int, synchronous: bool) -> list:
    """Ranks 0, 1: workers; rank 2: the server of 3 values. Three steps, then state, done."""
    workers, size = 2, 3
    if rank == 2:
        rounds = []
        serve(
            *_server_parts(rank, workers, None, size),
            num_workers=workers,
            synchronous=synchronous,
            on_round=rounds.append,
        )
        return [(r.step, r.bytes_recv, r.bytes_sent) for r in rounds]
    client = Client(
        worker=rank, sizes=[size], push_sizes=[size + 1], servers=[2], group=None, timeout_s=20
    )
    pulled = []
    for step in range(3):
        client.push_buffers[0][HEADER:] = float(rank + 1)  # k+1 everywhere; the flag > 0
        client.push_pull(step)
        pulled.append(client.pull_buffers[0][HEADER:].tolist())
    state = client.request_state() if rank == 0 else None
    client.done()
    return [pulled, None if state is None else state[0]["values"].tolist()]


def test_sync_server_averages_pushes_and_answers_everyone(run_ranks) -> None:
    worker0, worker1, rounds = run_ranks(3, _dedicated, True)
    # Mean gradient 1.5 per step at lr 0.5: the values go -0.75, -1.5, -2.25.
    expected = [[-0.75 * (s + 1)] * 3 for s in range(3)]
    assert worker0[0] == expected and worker1[0] == expected
    assert worker0[1] == expected[-1]
    push_bytes, pull_bytes = 4 * (HEADER + 3 + 1), 4 * (HEADER + 3)
    assert rounds == [(s, 2 * push_bytes, 2 * pull_bytes) for s in range(3)]


def test_async_server_applies_every_push(run_ranks) -> None:
    worker0, _, rounds = run_ranks(3, _dedicated, False)
    # Six pushes, each scaled by 1/2: the final values are the same as the sync run's.
    assert worker0[1] == [-2.25] * 3
    assert len(rounds) == 3


def _colocated(rank: int, world_size: int) -> list:
    """Two ranks, each a worker and the server of a 2-value shard (its own through a queue)."""
    inbox, outbox, state = _server_parts(rank, 2, rank, 2)
    thread = threading.Thread(
        target=serve, args=(inbox, outbox, state), kwargs={"num_workers": 2, "synchronous": True}
    )
    thread.start()
    client = Client(
        worker=rank,
        sizes=[2, 2],
        push_sizes=[3, 3],
        servers=[None if s == rank else s for s in range(2)],
        group=None,
        timeout_s=20,
        local=(inbox, outbox),
        alive=thread.is_alive,
    )
    for server in range(2):
        client.push_buffers[server][HEADER:] = float(rank * 2 + 2)  # 2 and 4: mean 3
    sent, received = client.push_pull(0)
    client.done()
    thread.join(timeout=20)
    return [[b[HEADER:].tolist() for b in client.pull_buffers], sent, received]


def test_colocated_server_thread_serves_its_own_worker_and_the_other(run_ranks) -> None:
    for pulled, sent, received in run_ranks(2, _colocated):
        assert pulled == [[-1.5, -1.5], [-1.5, -1.5]]
        # Only the remote shard crosses the network: one push of 2 values and a flag, one
        # pull of 2 values.
        assert (sent, received) == (4 * (HEADER + 3), 4 * (HEADER + 2))
