"""Emulated hosts and commbench without processes: rates, names, placement, busbw factors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gradsync import netem
from gradsync.commbench import (
    CommbenchConfig,
    busbw_factor,
    parse_size,
    size_sweep,
    sizes_from,
)
from gradsync.config import LaunchConfig
from gradsync.errors import UserError


@pytest.mark.parametrize(
    ("text", "bits"),
    [
        ("1gbit", 10**9),
        ("200mbit", 2 * 10**8),
        ("100Mbit", 10**8),
        ("2.5gbit", 25 * 10**8),
        ("10gbit", 10**10),
        ("500kbit", 5 * 10**5),
        ("1mbps", 8 * 10**6),  # tc: bytes per second
        (" 1 gbit ", 10**9),
    ],
)
def test_parse_rate(text: str, bits: int) -> None:
    assert netem.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["1", "fast", "1gb/s", "-1gbit", "1 furlong", "10bit"])
def test_parse_rate_rejects_with_one_line(text: str) -> None:
    with pytest.raises(UserError) as error:
        netem.parse_rate(text)
    assert "\n" not in str(error.value) and "--bandwidth" in str(error.value)


def test_format_rate() -> None:
    assert netem.format_rate(netem.parse_rate("200mbit")) == "200 Mbit/s"


def test_place_ranks_spreads_in_order() -> None:
    assert netem.place_ranks(4, 2) == [0, 0, 1, 1]
    assert netem.place_ranks(5, 2) == [0, 0, 0, 1, 1]
    assert netem.place_ranks(4, 4, 1) == [0, 1, 2, 3]
    assert netem.place_ranks(3, 2, 2) == [0, 0, 1]
    assert netem.place_ranks(1, 4) == [0]  # verify's single reference uses one host


def test_place_ranks_refuses_too_few_slots() -> None:
    with pytest.raises(UserError, match=r"--hosts 2 × --ranks-per-host 1 holds 2 ranks"):
        netem.place_ranks(3, 2, 1)


def test_names_are_unique_per_run_and_fit_interface_limits() -> None:
    a, b = netem.Names("0a0b0c", slot=0), netem.Names("ffffff", slot=257)
    for names in (a, b):
        for host in (0, netem.MAX_HOSTS - 1):
            for interface in (names.host_interface(host), names.bridge_port(host), names.bridge):
                assert len(interface) <= 15  # IFNAMSIZ - 1
                assert interface.startswith("gs")
            assert netem.NAMESPACE_PATTERN.match(names.host_namespace(host))
        assert netem.NAMESPACE_PATTERN.match(names.bridge_namespace)
    assert a.address(0) == "10.200.0.1" and b.address(3) == "10.201.1.4"
    assert {a.host_namespace(0), a.bridge_namespace}.isdisjoint(
        {b.host_namespace(0), b.bridge_namespace}
    )


def test_subnet_slots_skip_the_ones_in_use() -> None:
    assert netem.first_free_slot(set()) == 0
    assert netem.first_free_slot({0, 1, 2, 4}) == 3
    assert len({netem.subnet_of(i) for i in range(netem.MAX_SUBNETS)}) == netem.MAX_SUBNETS


def test_tbf_bucket_holds_a_gso_packet_and_scales_with_rate() -> None:
    slow, fast = netem.tbf_arguments(10**8), netem.tbf_arguments(10**10)
    assert slow[:3] == ["tbf", "rate", "100000000bit"]
    assert int(slow[slow.index("burst") + 1]) == 64 * 1024
    assert int(fast[fast.index("burst") + 1]) == 5_000_000


def test_owner_liveness_uses_pid_and_start_time(tmp_path: Path) -> None:
    me = {"owner_pid": os.getpid(), "owner_start": netem._start_time(os.getpid())}
    assert netem.owner_alive(me)
    assert not netem.owner_alive({**me, "owner_start": "0"})  # a reused pid
    assert not netem.owner_alive({"owner_pid": 0})


def test_find_runs_reports_state_without_namespaces(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(netem, "list_namespaces", lambda: ["gsabcdef-h0", "gsabcdef-br", "other"])
    monkeypatch.setattr(netem, "NETNS_ETC", tmp_path / "etc-netns")
    state = {"run_id": "abcdef", "slot": 0, "owner_pid": 2**22 + 1, "owner_start": "1"}
    (tmp_path / "abcdef.json").write_text(json.dumps(state))
    (run,) = netem.find_runs(tmp_path)
    assert run.run_id == "abcdef" and not run.alive
    assert run.namespaces == ("gsabcdef-br", "gsabcdef-h0")


def test_refuses_when_not_root(monkeypatch) -> None:
    monkeypatch.setattr(netem, "_euid", lambda: 1000)
    with pytest.raises(UserError, match="needs root") as error:
        netem.check_can_emulate()
    assert "\n" not in str(error.value)


def test_refuses_without_tc(monkeypatch) -> None:
    monkeypatch.setattr(netem, "_euid", lambda: 0)
    monkeypatch.setattr(netem, "_which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    with pytest.raises(UserError, match=r"needs the tc command"):
        netem.check_can_emulate()


def test_launch_config_validates_emulation_flags() -> None:
    assert LaunchConfig(hosts=2, bandwidth="1gbit", ranks_per_host=2).hosts == 2
    with pytest.raises(UserError, match="add --hosts"):
        LaunchConfig(bandwidth="1gbit")
    with pytest.raises(UserError, match="--bandwidth 'fast'"):
        LaunchConfig(hosts=2, bandwidth="fast")
    with pytest.raises(UserError, match="--nnodes"):
        LaunchConfig(hosts=2, num_nodes=2)
    with pytest.raises(UserError, match="--ranks-per-host"):
        LaunchConfig(ranks_per_host=2)


@pytest.mark.parametrize(
    ("op", "world_size", "factor"),
    [
        ("allreduce", 2, 1.0),
        ("allreduce", 4, 1.5),
        ("allreduce", 8, 1.75),
        ("allgather", 2, 0.5),
        ("allgather", 4, 0.75),
        ("reduce", 4, 1.0),
        ("broadcast", 8, 1.0),
        ("p2p", 4, 1.0),
    ],
)
def test_busbw_factors_follow_nccl_tests(op: str, world_size: int, factor: float) -> None:
    assert busbw_factor(op, world_size) == factor


def test_sizes() -> None:
    assert parse_size("4K") == 4096 and parse_size("256M") == 256 * 2**20
    assert parse_size("16MB") == parse_size("16MiB") == 16 * 2**20
    default = size_sweep(4 * 1024, 256 * 2**20, 2)
    assert default[0] == 4096 and default[-1] == 256 * 2**20 and len(default) == 17
    assert size_sweep(4096, 2**20, 4) == [4096, 16384, 65536, 262144, 1048576]
    assert sizes_from([8, 16], 4096, 8192, 2) == (8, 16)
    with pytest.raises(UserError):
        parse_size("lots")
    with pytest.raises(UserError, match="--factor"):
        size_sweep(4096, 8192, 3)


def test_commbench_config_round_trips_and_validates() -> None:
    config = CommbenchConfig(
        workers=4, ops=("allreduce", "p2p"), sizes=(4096,), launch=LaunchConfig(hosts=2)
    )
    assert CommbenchConfig.from_json(config.to_json()) == config
    assert json.loads(config.to_json())["kind"] == "commbench"
    with pytest.raises(UserError, match="unknown commbench operation"):
        CommbenchConfig(ops=("alltoall",))
    with pytest.raises(UserError, match="--workers ≥ 2"):
        CommbenchConfig(workers=1)
    with pytest.raises(UserError, match="at least 16 bytes"):
        CommbenchConfig(workers=4, sizes=(8,))


def test_emulated_hosts_keep_gradsyncs_own_sigterm_handler(tmp_path: Path) -> None:
    """gradsync's handler (Stopped: exit 143, held around checkpoint writes) stays; only a
    process without one gets SIGTERM turned into an unwinding KeyboardInterrupt."""
    import signal

    from gradsync.signals import stop_on_signals

    previous = signal.getsignal(signal.SIGTERM)
    try:
        stop_on_signals()
        ours = signal.getsignal(signal.SIGTERM)
        hosts = netem.EmulatedHosts(2, None, state_dir=tmp_path)
        hosts._catch_sigterm()
        assert signal.getsignal(signal.SIGTERM) is ours
        hosts._restore_sigterm()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        hosts._catch_sigterm()
        assert signal.getsignal(signal.SIGTERM) is netem._raise_interrupt
        hosts._restore_sigterm()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_rate_beyond_what_tbf_shapes_is_refused_before_anything_starts() -> None:
    # 10tbit reached tc, whose refusal of the bucket was blamed on a missing qdisc
    with pytest.raises(UserError, match="above 1tbit"):
        LaunchConfig(hosts=2, bandwidth="10tbit")
    assert LaunchConfig(hosts=2, bandwidth="1tbit").bandwidth == "1tbit"


def test_a_signal_during_close_waits_until_every_namespace_is_gone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A second SIGTERM (or Ctrl-C) while the namespaces were deleted left the rest behind
    (session 31's probe): now it is held until the last is gone."""
    import signal

    from gradsync.signals import Stopped, stop_on_signals

    deleted: list[str] = []

    def delete(namespace: str) -> None:
        if not deleted:  # the impatient user, during the first deletion
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
        deleted.append(namespace)

    monkeypatch.setattr(netem, "_delete_namespace", delete)
    hosts = netem.EmulatedHosts(2, None)
    hosts._created = ["gs1-h0", "gs1-h1", "gs1-br"]
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    stop_on_signals()
    try:
        with pytest.raises(Stopped):
            hosts.close()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    assert deleted == ["gs1-br", "gs1-h1", "gs1-h0"]
