"""Push/pull transport and the server loop on real Gloo ranks."""

from __future__ import annotations

import torch

from gradsync.comm.pushpull import Client, DenseServer, chunk_reader, plan_chunks
from gradsync.comm.server import ColocatedServer, ServerMetrics, ShardState, serve
from gradsync.comm.wire import HEADER, TAG_REPLY, Inbox, Lanes, Outbox
from gradsync.config import OptimConfig
from gradsync.optim import Updater

LR = 0.5
HEADER_BYTES = HEADER * 8  # the float64 header of every message


def _server(
    workers: int,
    local: tuple[int, Client] | None,
    size: int,
    lanes: Lanes,
    synchronous: bool = True,
) -> tuple[Inbox, DenseServer, list]:
    """Inbox and policy of a server of ``size`` values (one slot: a push is the gradients
    and one had-a-gradient flag); ``local`` = (worker, client) sharing the process."""
    local_worker = None if local is None else local[0]
    remote = {w: w for w in range(workers) if w != local_worker}
    inbox = Inbox(
        remote=remote.values(),
        lanes=lanes,
        timeout_s=20,
        read_body=chunk_reader(plan_chunks([size], None)),
    )
    outbox = Outbox(
        ranks=remote,
        lanes=lanes,
        tag=TAG_REPLY,
        local_peer=local_worker,
        deliver_local=None if local is None else local[1].local_replies.put,
    )
    state = ShardState(
        torch.zeros(size), lambda ps: Updater(ps, OptimConfig(lr=LR, momentum=0.0), lr=LR)
    )
    records: list = []
    policy = DenseServer(
        state,
        outbox,
        ServerMetrics(write=records.append),
        num_workers=workers,
        synchronous=synchronous,
    )
    return inbox, policy, records


def _dedicated(rank: int, world_size: int, synchronous: bool) -> list:
    """Ranks 0, 1: workers; rank 2: the server of 3 values. Three steps, then state, done."""
    workers, size, lanes = 2, 3, Lanes.create(world_size)
    if rank == 2:
        inbox, policy, records = _server(workers, None, size, lanes, synchronous)
        serve(inbox, policy, num_workers=workers)
        rounds = [(r.step, r.bytes_recv, r.bytes_sent) for r in records]
        return [rounds, policy.state.values.tolist()]  # after every worker's DONE
    client = Client(
        worker=rank, chunks=[plan_chunks([size], None)], servers=[2], lanes=lanes, timeout_s=20
    )
    pulled = []
    for step in range(3):
        client.push_buffers[0][0][:] = float(rank + 1)  # k+1 everywhere; the flag > 0
        client.push_pull(step)
        pulled.append(client.pull_buffers[0].tolist())
    state = client.request_state() if rank == 0 else None
    client.done()
    return [pulled, None if state is None else state[0]["values"].tolist(), client.lr]


def test_sync_server_averages_pushes_and_answers_everyone(run_ranks) -> None:
    worker0, worker1, (rounds, _) = run_ranks(3, _dedicated, True)
    # Mean gradient 1.5 per step at lr 0.5: the values go -0.75, -1.5, -2.25.
    expected = [[-0.75 * (s + 1)] * 3 for s in range(3)]
    assert worker0[0] == expected and worker1[0] == expected
    assert worker0[1] == expected[-1]
    assert worker0[2] == LR  # the learning rate the server applied came back
    value = torch.zeros(0).element_size()
    push_bytes, pull_bytes = HEADER_BYTES + value * (3 + 1), HEADER_BYTES + value * 3
    assert rounds == [(s, 2 * push_bytes, 2 * pull_bytes) for s in range(3)]


def test_async_server_applies_every_push(run_ranks) -> None:
    _, _, (rounds, final) = run_ranks(3, _dedicated, False)
    # Six pushes, each scaled by 1/2: the final values are the same as the sync run's.
    # (Read on the server after both workers are done: worker 0's own state request may
    # come before worker 1's last push.)
    assert final == [-2.25] * 3
    assert len(rounds) == 3


def _colocated(rank: int, world_size: int) -> list:
    """Two ranks, each a worker and the server of a 2-value shard (its own through a queue)."""
    lanes = Lanes.create(world_size)
    client = Client(
        worker=rank,
        chunks=[plan_chunks([2], None)] * 2,
        servers=[None if s == rank else s for s in range(2)],
        lanes=lanes,
        timeout_s=20,
    )
    inbox, policy, _ = _server(2, (rank, client), 2, lanes)
    client.local_inbox = inbox
    server = ColocatedServer(lambda: serve(inbox, policy, num_workers=2), name="test server")
    client.alive = server.alive
    for (buffer,) in client.push_buffers:
        buffer[:] = float(rank * 2 + 2)  # 2 and 4: mean 3
    sent, received = client.push_pull(0)
    client.done()
    server.join(20)
    return [[b.tolist() for b in client.pull_buffers], sent, received]


def test_colocated_server_thread_serves_its_own_worker_and_the_other(run_ranks) -> None:
    value = torch.zeros(0).element_size()
    for pulled, sent, received in run_ranks(2, _colocated):
        assert pulled == [[-1.5, -1.5], [-1.5, -1.5]]
        # Only the remote shard crosses the network: one push of 2 values and a flag, one
        # pull of 2 values.
        assert (sent, received) == (HEADER_BYTES + value * 3, HEADER_BYTES + value * 2)


def _loaded(rank: int, world_size: int) -> list:
    """Worker 0 installs a saved state on the server (resume) before the first push."""
    lanes = Lanes.create(world_size)
    if rank == 2:
        inbox, policy, _ = _server(2, None, 3, lanes)
        serve(inbox, policy, num_workers=2)
        return []
    client = Client(
        worker=rank, chunks=[plan_chunks([3], None)], servers=[2], lanes=lanes, timeout_s=20
    )
    if rank == 0:
        client.load_state([{"values": torch.full((3,), 5.0)}], 0)  # returns once acknowledged
    client.push_buffers[0][0][:] = 1.0
    client.push_pull(0)
    state = client.request_state() if rank == 0 else None
    client.done()
    return [client.pull_buffers[0].tolist(), None if state is None else state[0]]


def test_a_server_loaded_from_a_checkpoint_continues_from_it(run_ranks) -> None:
    worker0, worker1, _ = run_ranks(3, _loaded)
    assert worker0[0] == worker1[0] == [5.0 - LR] * 3  # mean gradient 1 at lr 0.5
    assert worker0[1]["values"].tolist() == [5.0 - LR] * 3
