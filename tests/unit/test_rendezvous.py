"""The ranks' meeting before the process group: one clear line when they do not belong together.

The ranks are threads of this process around a real TCP store on loopback.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest

from gradsync import rendezvous
from gradsync.config import TrainConfig
from gradsync.errors import UserError
from gradsync.launch import free_port
from gradsync.rendezvous import (
    RankInfo,
    agreed_device,
    check_resolves,
    disagreement,
    first_difference,
    gpu_fallback_note,
)
from gradsync.topology import RankEnv

TIMEOUT = timedelta(seconds=20)


def _env(rank: int, world_size: int, port: int) -> RankEnv:
    return RankEnv(
        launcher="torchrun",
        rank=rank,
        world_size=world_size,
        local_rank=rank,
        local_world_size=world_size,
        master_addr="127.0.0.1",
        master_port=port,
    )


def _meet(infos: list[RankInfo], timeout: timedelta = TIMEOUT) -> list[str]:
    """Run :func:`rendezvous` for every info on its own thread; 'ok' or each error's text."""
    port = free_port()
    outcomes = [""] * len(infos)

    def rank(index: int, info: RankInfo) -> None:
        try:
            rendezvous.rendezvous(_env(info.rank, info.world_size, port), timeout, info=info)
            outcomes[index] = "ok"
        except UserError as error:
            outcomes[index] = str(error)

    threads = [threading.Thread(target=rank, args=item) for item in enumerate(infos)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=2 * timeout.total_seconds())
    return outcomes


def _info(rank: int, world_size: int = 2, *, host: str = "", version: str = "0.1.0") -> RankInfo:
    return RankInfo(rank=rank, world_size=world_size, host=host or f"n{rank}", gradsync=version)


def test_ranks_that_agree_meet() -> None:
    assert _meet([_info(0, 3), _info(1, 3), _info(2, 3)]) == ["ok", "ok", "ok"]


def test_world_size_disagreement_is_one_line_on_every_rank() -> None:
    outcomes = _meet([_info(0, 2), _info(1, 3)])
    expected = "rank 0 on n0 was started with 2 ranks, rank 1 on n1 with 3"
    assert all(expected in text and "\n" not in text for text in outcomes), outcomes


def test_a_rank_beyond_rank_0s_world_is_told() -> None:
    outcomes = _meet([_info(0, 2), _info(1, 2), _info(2, 3)])
    assert outcomes[:2] == ["ok", "ok"]
    assert "rank 0 on n0 was started with 2 ranks, rank 2 on n2 with 3" in outcomes[2]


def test_a_node_with_another_gradsync_is_named() -> None:
    outcomes = _meet([_info(0), _info(1, host="node-b", version="0.2.0")])
    expected = "node node-b (rank 1) runs gradsync 0.2.0 but rank 0 on n0 runs gradsync 0.1.0"
    assert all(text.startswith(expected) for text in outcomes), outcomes


def test_missing_ranks_are_named() -> None:
    (outcome,) = _meet([_info(0, 3)], timeout=timedelta(seconds=1))
    assert outcome.startswith("rank(s) 1, 2 of 3 did not reach the rendezvous within 1 s")


def test_disagreement_prefers_the_world_size_and_names_torch() -> None:
    base = _info(0)
    assert disagreement([base, _info(1)]) is None
    other_torch = RankInfo(rank=1, world_size=2, host="n1", torch="1.0")
    assert "runs torch 1.0" in (disagreement([base, other_torch]) or "")
    both = RankInfo(rank=1, world_size=4, host="n1", gradsync="9")
    assert (disagreement([base, both]) or "").startswith("ranks disagree on the world size")


def test_unresolvable_master_address_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_such_name(host: str, port: object) -> None:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(rendezvous.socket, "getaddrinfo", no_such_name)
    with pytest.raises(UserError) as caught:
        check_resolves("node-7")
    text = str(caught.value)
    assert text.startswith("master address 'node-7' does not resolve on ")
    assert "(Name or service not known); pass --master-addr" in text


def test_unresolvable_master_address_stops_the_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rendezvous, "check_resolves", _refuse)
    with pytest.raises(UserError, match="refused"):
        rendezvous.rendezvous(_env(0, 2, free_port()), TIMEOUT)


def test_a_rank_waiting_for_an_absent_rank_0_says_so_in_one_line(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """No rank 0 ever listens: one line naming the address, nothing of the C++ client's
    stack traces on stderr."""
    with pytest.raises(UserError) as caught:
        rendezvous.rendezvous(_env(1, 2, free_port()), timedelta(seconds=1))
    assert "rank 1 could not reach the rendezvous at 127.0.0.1:" in str(caught.value)
    assert "Connection refused" in str(caught.value)
    assert "frame #" not in capfd.readouterr().err


def test_a_rank_that_starts_before_rank_0_waits_for_it() -> None:
    port = free_port()
    late = threading.Timer(0.5, lambda: _listen_then_close(port))
    started = time.monotonic()
    late.start()
    rendezvous.wait_until_listening("127.0.0.1", port, timedelta(seconds=10))
    assert time.monotonic() - started >= 0.5  # it waited for the listener (never early)
    late.join()


def _listen_then_close(port: int) -> None:
    with rendezvous.listen_socket("127.0.0.1", port) as sock:
        sock.listen()
        sock.settimeout(10)
        sock.accept()[0].close()


def _refuse(master_addr: str) -> None:
    raise UserError("refused")


def _gpu_rank(rank: int, gpu: str, *, host: str = "n0", wants: str = "auto") -> RankInfo:
    return RankInfo(rank=rank, world_size=2, host=host, wants=wants, device="cuda", gpu=gpu)


def test_ranks_train_on_gpus_only_when_each_has_its_own() -> None:
    assert agreed_device([_gpu_rank(0, "G0"), _gpu_rank(1, "G1")]) == ("cuda", None)
    # the same UUID on two hosts is two GPUs
    assert agreed_device([_gpu_rank(0, "G0"), _gpu_rank(1, "G0", host="n1")]) == ("cuda", None)
    # auto: one GPU for two ranks, or a rank without one, is the CPU for every rank
    assert agreed_device([_gpu_rank(0, "G0"), _gpu_rank(1, "G0")]) == ("cpu", None)
    assert agreed_device([_gpu_rank(0, "G0"), _info(1)]) == ("cpu", None)


def test_gpus_left_unused_under_auto_are_said_in_one_line() -> None:
    """Under torchrun on one H200 (session 24) two ranks trained on the CPU without a word;
    the gradsync launcher says so, and so does rank 0 of any launcher now."""
    shared = gpu_fallback_note([_gpu_rank(0, "G0"), _gpu_rank(1, "G0")])
    assert shared == (
        "gradsync: training on the CPU over Gloo: ranks 0 and 1 on n0 share GPU G0 "
        "(see Devices in the README)"
    )
    assert "rank 1 on n1 has no GPU" in str(gpu_fallback_note([_gpu_rank(0, "G0"), _info(1)]))
    assert gpu_fallback_note([_gpu_rank(0, "G0"), _gpu_rank(1, "G1")]) is None  # GPUs for all
    assert gpu_fallback_note([_info(0), _info(1)]) is None  # no GPU anywhere: nothing unused
    # --device cuda: the refusal says it, not a note
    assert gpu_fallback_note([_gpu_rank(0, "G0", wants="cuda"), _gpu_rank(1, "G0")]) is None


def test_cuda_that_the_ranks_cannot_have_is_one_line_on_every_rank() -> None:
    shared = [_gpu_rank(0, "G0", wants="cuda"), _gpu_rank(1, "G0", wants="cuda")]
    outcomes = _meet(shared)
    expected = (
        "--device cuda gives each rank a GPU of its own, but ranks 0 and 1 on n0 share GPU G0"
    )
    assert all(text.startswith(expected) and "\n" not in text for text in outcomes), outcomes
    assert "--device cpu" in outcomes[0]


def test_the_rendezvous_tells_every_rank_the_device() -> None:
    port = free_port()
    devices = [""] * 2

    def rank(info: RankInfo) -> None:
        _, devices[info.rank] = rendezvous.rendezvous(_env(info.rank, 2, port), TIMEOUT, info=info)

    infos = [_gpu_rank(0, "G0"), _gpu_rank(1, "G0")]  # auto, one GPU for both
    threads = [threading.Thread(target=rank, args=(info,)) for info in infos]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=2 * TIMEOUT.total_seconds())
    assert devices == ["cpu", "cpu"]


def test_ranks_of_two_jobs_at_one_address_are_refused() -> None:
    first = RankInfo(rank=0, world_size=2, host="n0", job="Slurm step 7.0", protocol=2)
    intruder = RankInfo(rank=1, world_size=2, host="n0", job="Slurm step 7.1", protocol=2)
    outcomes = _meet([first, intruder])
    expected = "rank 1 on n0 belongs to Slurm step 7.1 but rank 0 on n0 to Slurm step 7.0"
    assert all(expected in text for text in outcomes), outcomes


def test_a_rank_started_with_other_options_is_named() -> None:
    settings = TrainConfig(seed=3).shared_settings()
    other = {**settings, "--seed": 4}
    first = RankInfo(rank=0, world_size=2, host="n0", settings=settings)
    outcomes = _meet([first, RankInfo(rank=1, world_size=2, host="n1", settings=other)])
    expected = "rank 1 on n1 was started with --seed 4, rank 0 on n0 with 3"
    assert all(expected in text for text in outcomes), outcomes


def test_what_may_differ_between_nodes_does_not_stop_the_job() -> None:
    """Where each node reads and writes, how it launches and logs, and a setting written
    another way (its default typed out, the preset's --global-batch too, sparse=yes for
    sparse=true) are the same job."""
    from gradsync.config import LaunchConfig, OptimConfig

    base = TrainConfig(model="lstm-lm", preset="tiny", strategy="ps", seed=3)
    same_job = base.replace(
        out="node1",
        data=None,
        log_every=7,
        measure_warmup=5,
        timeline=None,
        launch=LaunchConfig(threads=3, timeout_s=99),
        optim=OptimConfig(lr=0.05),
        model_options={"sparse": "no"},
        strategy_options={"servers": 1},
        global_batch=8,  # lstm-lm tiny's own
    )
    assert first_difference(base.shared_settings(), same_job.shared_settings()) is None
    other_batch = base.replace(global_batch=16)
    assert first_difference(base.shared_settings(), other_batch.shared_settings()) == (
        "--global-batch",
        8,
        16,
    )
    sparse = base.replace(model_options={"sparse": "yes"})
    assert first_difference(base.shared_settings(), sparse.shared_settings()) == (
        "--model-option sparse",
        False,
        True,
    )


def test_an_older_gradsync_is_named_as_such_not_as_another_job() -> None:
    old = RankInfo.from_json('{"rank": 1, "world_size": 2, "host": "n1", "gradsync": "0.1.0"}')
    new = RankInfo(rank=0, world_size=2, host="n0", job="Slurm step 7.0", protocol=2)
    assert "rendezvous protocol 1 but rank 0 on n0 one of 2" in (disagreement([new, old]) or "")


def test_a_larger_world_whose_low_ranks_never_come_is_named() -> None:
    # Node 0 started with 2 ranks (rank 0 only here), node 1 with 4 (ranks 2 and 3).
    (outcome, *_) = _meet([_info(0, 2), _info(2, 4), _info(3, 4)], timeout=timedelta(seconds=1))
    assert "rank 0 on n0 was started with 2 ranks, rank 2 on n2 with 4" in outcome
