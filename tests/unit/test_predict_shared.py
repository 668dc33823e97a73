"""Emulated hosts on one machine: CPU shared by every rank, and point-to-point transfers
that do not run both ways at once. Closed-form answers on hand-made profiles."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gradsync.errors import UserError
from gradsync.predict.network import (
    Cluster,
    Network,
    calibrate,
    calibrate_cpu,
    calibrate_duplex,
    calibrate_sync,
)
from gradsync.predict.simulate import Span, StrategyChoice, predict_step, shared_core_stretch
from gradsync.strategies.p3 import P3Options
from gradsync.strategies.ps import PSOptions
from tests.unit.test_predict import ALLREDUCE, profile_of, variable

BUCKET = (250_000 + 1) * 4  # one 1 MB variable and its had-a-gradient flag


def test_no_shared_cores_means_no_stretch() -> None:
    spans = [Span("compute", "BACKWARD", 0.0, 1.0), Span("communication", "X", 0.0, 1.0, 1e9, 9)]
    net = Network(bandwidth=1e6, cpu_s_per_byte=1.0, cpu_s_per_message=1.0)
    assert shared_core_stretch(spans, Cluster(workers=2, network=net)) == 0.0


def test_overlapping_cpu_work_is_spread_over_the_cores_and_idle_cores_absorb_first() -> None:
    # 1e8 bytes at 1 ns/B and 10 messages at 1 ms: 0.11 s of CPU, half of it during backward
    # (the span runs 0.5–1.5 s, backward 0–1 s); a server span of 0.2 s, all inside.
    net = Network(bandwidth=1e6, cpu_s_per_byte=1e-9, cpu_s_per_message=1e-3)
    spans = [
        Span("compute", "FORWARD", 0.0, 0.0),
        Span("compute", "BACKWARD", 0.0, 1.0),
        Span("compute", "COMM_WAIT", 1.0, 0.5),  # not compute: no stretch from here
        Span("communication", "ALLREDUCE", 0.5, 1.0, num_bytes=1e8, messages=10),
        Span("server 0", "AGGREGATE_APPLY", 0.2, 0.2),
    ]
    work = 0.11 / 2 + 0.2
    two = Cluster(workers=2, network=net, shared_cores=2)
    assert shared_core_stretch(spans, two) == pytest.approx(work / 2)
    # 4 cores, 2 computing workers: 2 idle cores over the 1 s of compute absorb it all.
    assert shared_core_stretch(spans, Cluster(workers=2, network=net, shared_cores=4)) == 0.0
    # 3 cores: one idle core for the 1 s of compute takes all 0.255 core-seconds.
    assert shared_core_stretch(spans, Cluster(workers=2, network=net, shared_cores=3)) == 0.0
    # 1 core under 2 workers: nothing idle, the work spread over one core.
    assert shared_core_stretch(spans, Cluster(workers=2, network=net, shared_cores=1)) == (
        pytest.approx(work)
    )


def test_a_bucket_reduced_during_backward_lengthens_it_by_its_cpu_share() -> None:
    # The gradient is ready when backward starts (t = 1 s): the 1 s ring runs inside the
    # 2 s backward. A 2-rank ring sends 2·S bytes over both ranks: 0.2 s of CPU at 1e-7 s/B,
    # spread over 2 cores. The step is compute plus 0.1 s; without shared cores, 3 s.
    profile = profile_of([variable("a", 250_000, 0.0)])
    net = Network(bandwidth=1e6, cpu_s_per_byte=1e-7)
    plain = predict_step(profile, Cluster(workers=2, network=net), ALLREDUCE)
    assert plain.step_s == pytest.approx(3.0)
    shared = predict_step(profile, Cluster(workers=2, network=net, shared_cores=2), ALLREDUCE)
    assert shared.step_s == pytest.approx(3.0 + 2 * BUCKET * 1e-7 / 2)


def test_the_stretch_of_a_partly_overlapped_bucket_is_a_fixed_point() -> None:
    # Ready 1.5 s into a 2 s backward: the 1 s ring starts at 2.5 s, backward ends at 3 s.
    # A stretch e lengthens backward to 2 + e and moves the gradient to 1.5·(2 + e)/2, so
    # the overlap is 0.5 + e/4 of the ring and e = c·(0.5 + e/4) with c = 2·S·1e-7 / 2:
    # e = 0.5·c / (1 − c/4). The step ends with the ring: 3.5 + 0.75·e.
    profile = profile_of([variable("a", 250_000, 1.5)])
    net = Network(bandwidth=BUCKET, cpu_s_per_byte=1e-7)  # the ring takes exactly 1 s
    step = predict_step(profile, Cluster(workers=2, network=net, shared_cores=2), ALLREDUCE)
    c = 2 * BUCKET * 1e-7 / 2
    stretch = 0.5 * c / (1 - c / 4)
    assert step.step_s == pytest.approx(3.5 + 0.75 * stretch)


@pytest.mark.parametrize("slowdown", [1.0, 1.5, 2.0])
def test_colocated_pushes_crossing_one_link_both_ways_take_the_slowdown(slowdown: float) -> None:
    # Two colocated servers, 1 MB each: every push crosses the link one way while the other
    # worker's crosses it the other way (and so do the pulls). Each phase takes d·1 s.
    profile = profile_of([variable("a", 250_000, 2.0), variable("b", 250_000, 2.0)])
    net = Network(bandwidth=1e6, bidirectional_slowdown=slowdown)
    step = predict_step(
        profile, Cluster(workers=2, network=net), StrategyChoice("ps", PSOptions(colocate=True))
    )
    assert step.step_s == pytest.approx(3.0 + 2 * slowdown)


def test_pushes_then_pulls_one_way_at_a_time_are_not_slowed() -> None:
    # One dedicated server, no overlap: all pushes are in before any pull leaves.
    size = 1_000_000
    profile = profile_of([variable("a", size // 4, 2.0)])
    for slowdown in (1.0, 2.0):
        net = Network(bandwidth=1e6, latency=1e-3, bidirectional_slowdown=slowdown)
        step = predict_step(profile, Cluster(workers=3, network=net), StrategyChoice("ps"))
        assert step.step_s == pytest.approx(3.0 + 2 * (3 * size / 1e6 + 1e-3))


def test_bidirectional_slowdown_is_between_one_and_two() -> None:
    with pytest.raises(UserError, match="between 1"):
        Network(bandwidth=1.0, bidirectional_slowdown=2.5)
    for bad in (0, 2.5, "2", True):
        with pytest.raises(UserError, match="whole number of cores"):
            Cluster(workers=2, network=Network(bandwidth=1.0), shared_cores=bad)  # type: ignore[arg-type]


def test_a_plan_with_bad_shared_cores_is_one_line_before_anything_runs(tmp_path) -> None:
    from gradsync.predict.validate import load_plan

    plan = tmp_path / "plan.toml"
    plan.write_text(
        'strategies = ["allreduce"]\nbandwidths = ["1gbit"]\nshared_cores = "2"\n'
        '[[model]]\nname = "transformer"\n'
    )
    with pytest.raises(UserError, match="shared_cores must be a whole number"):
        load_plan(plan)


def test_duplex_calibration_needs_one_pair(tmp_path) -> None:
    rows = [{"op": "p2p", "bytes": 1 << 20, "time_s": 0.01}]
    rows.append({"op": "exchange", "bytes": 1 << 20, "time_s": 0.02})
    with pytest.raises(UserError, match="2 ranks on 2 hosts"):
        calibrate_duplex(Network(bandwidth=125e6), _commbench(tmp_path / "c.json", rows, n=4))
    rows[0]["time_s"] = 0.0
    with pytest.raises(UserError, match="positive numbers"):
        calibrate_duplex(Network(bandwidth=125e6), _commbench(tmp_path / "c.json", rows))


def _commbench(path: Path, rows: list[dict[str, float | str]], n: int = 2) -> Path:
    path.write_text(json.dumps({"world_size": n, "bandwidth": "1gbit", "results": rows}))
    return path


def test_cpu_calibration_turns_per_rank_cpu_into_per_byte_and_per_message(tmp_path) -> None:
    # Per rank c = a + b·S. A ring of n ranks sends 2(n−1)·S bytes and 2n(n−1) messages,
    # so the job's CPU n·c is n·b/(2(n−1)) per byte and a/(2(n−1)) per message.
    a, b = 4e-4, 1e-9
    for n in (2, 4):
        rows = [
            {"op": "allreduce", "bytes": s, "time_s": 1e-3 + s / 1e8, "cpu_s": a + b * s}
            for s in (4096, 1 << 20, 1 << 24)
        ]
        fitted = calibrate_cpu(Network(bandwidth=125e6), _commbench(tmp_path / "c.json", rows, n))
        assert fitted.cpu_s_per_byte == pytest.approx(n * b / (2 * (n - 1)))
        assert fitted.cpu_s_per_message == pytest.approx(a / (2 * (n - 1)))


def test_duplex_calibration_is_exchange_over_p2p_at_the_largest_size(tmp_path) -> None:
    rows: list[dict[str, float | str]] = [
        {"op": "allreduce", "bytes": 1 << 20, "time_s": 0.01},
        {"op": "allreduce", "bytes": 1 << 24, "time_s": 0.14},
        {"op": "p2p", "bytes": 1 << 20, "time_s": 0.01},
        {"op": "exchange", "bytes": 1 << 20, "time_s": 0.011},
        {"op": "p2p", "bytes": 1 << 24, "time_s": 0.14},
        {"op": "exchange", "bytes": 1 << 24, "time_s": 0.266},
    ]
    path = _commbench(tmp_path / "commbench.json", rows)
    assert calibrate_duplex(Network(bandwidth=125e6), path).bidirectional_slowdown == (
        pytest.approx(1.9)
    )
    # calibrate() picks it up from the same file; without cpu_s the CPU cost stays 0.
    fitted = calibrate(Network(bandwidth=125e6), path)
    assert fitted.bidirectional_slowdown == pytest.approx(1.9)
    assert fitted.cpu_s_per_byte == 0.0
    rows[-1] = {"op": "exchange", "bytes": 1 << 24, "time_s": 0.5}  # clamped: at most 2
    path = _commbench(tmp_path / "commbench.json", rows)
    assert calibrate_duplex(Network(bandwidth=125e6), path).bidirectional_slowdown == 2.0


@pytest.mark.parametrize(("colocate", "stretch"), [(False, 0.4), (True, 0.0)])
def test_p3_slices_cost_cpu_per_message_where_they_cross_processes(
    colocate: bool, stretch: float
) -> None:
    # One 1000-value slice, ready when the 10 s backward starts: its push and its answer
    # (1 s each at 4000 B/s) run inside backward. Each is a header and a payload message at
    # 0.1 s of CPU; on one shared core that 0.4 s lengthens backward. A colocated server's
    # slice never leaves the process: no wire, no CPU.
    profile = profile_of([variable("w", 1000, 0.0)], forward=1.0, backward=10.0)
    net = Network(bandwidth=4000.0, cpu_s_per_message=0.1)
    choice = StrategyChoice("p3", P3Options(slice_size=1000, colocate=colocate))
    plain = predict_step(profile, Cluster(workers=1, network=net), choice)
    shared = predict_step(profile, Cluster(workers=1, network=net, shared_cores=1), choice)
    assert plain.step_s == pytest.approx(11.0)
    assert shared.step_s == pytest.approx(11.0 + stretch)


@pytest.mark.parametrize(("cores", "wall"), [(None, 1.0), (2, 1.0), (1, 2.0)])
def test_a_servers_work_during_compute_runs_at_its_share_of_the_cores(
    cores: int | None, wall: float
) -> None:
    # One worker and one dedicated server; the gradient is ready as the 10 s backward
    # starts and crosses at once, and the server's 1 s of CPU falls inside backward. On one
    # shared core the worker and the server each get half of it: the apply takes 2 s, and
    # its 1 s of CPU lengthens backward by 1 s. On 2 cores each has one; on a real
    # cluster the server has its own.
    import dataclasses

    profile = profile_of([variable("a", 1000, 0.0)], forward=1.0, backward=10.0)
    profile = dataclasses.replace(profile, server_round_s=1.0)
    cluster = Cluster(workers=1, network=Network(bandwidth=1e12), shared_cores=cores)
    step = predict_step(profile, cluster, StrategyChoice("ps"))
    (apply,) = [s for s in step.spans if s.name.startswith("AGGREGATE_APPLY")]
    assert (apply.duration, apply.cpu_s or apply.duration) == pytest.approx((wall, 1.0))
    assert step.step_s == pytest.approx(11.0 + (1.0 if cores == 1 else 0.0))


def test_sync_calibration_is_the_small_allreduce_per_message_at_each_busy_interval(
    tmp_path,
) -> None:
    # A 2-rank ring of S bytes: 2(n−1)/n·S/rate on the wire, 2(n−1) messages. Busy rows
    # give (interval, per-message cost); idle rows still set α, unchanged by them.
    rate, n, size = 125e6, 2, 4096
    wire = 2 * (n - 1) / n * size / rate
    rows: list[dict[str, float | str]] = [
        {"op": "allreduce", "bytes": size, "time_s": 2 * 0.4e-3 + wire},
        {"op": "allreduce", "bytes": 1 << 24, "time_s": 2 * 0.4e-3 + (1 << 24) / rate},
        {"op": "allreduce", "bytes": 1 << 20, "time_s": 2 * 0.4e-3 + (1 << 20) / rate},
    ]
    busy = {0.5e-3: 1.0e-3, 2e-3: 3.0e-3}
    for interval, per_message in busy.items():
        rows.append(
            {"op": "allreduce", "bytes": size, "busy_s": interval, "time_s": 2 * per_message + wire}
        )
        rows.append(  # a larger size at the same interval: the smallest decides
            {"op": "allreduce", "bytes": 1 << 20, "busy_s": interval, "time_s": 1.0}
        )
    path = _commbench(tmp_path / "commbench.json", rows, n)
    synced = calibrate_sync(Network(bandwidth=rate), path)
    flat = [value for pair in synced.sync_message_s for value in pair]
    assert flat == pytest.approx([0.5e-3, 1.0e-3, 2e-3, 3.0e-3])
    fitted = calibrate(Network(bandwidth=rate), path)
    assert fitted.message_s == pytest.approx(0.4e-3)  # from the idle rows alone
    assert fitted.sync_message_s == synced.sync_message_s
    # Interpolated between the measured intervals, held beyond them.
    assert fitted.sync_hop_s(1.25e-3) == pytest.approx(2.0e-3)
    assert fitted.sync_hop_s(1e-6) == pytest.approx(1.0e-3)
    assert fitted.sync_hop_s(1.0) == pytest.approx(3.0e-3)
    assert Network(bandwidth=rate, latency=1e-4, message_s=2e-4).sync_hop_s(1e-3) == (
        pytest.approx(3e-4)
    )
    idle_only = _commbench(tmp_path / "idle.json", rows[:3], n)
    with pytest.raises(UserError, match="--busy-ms"):
        calibrate_sync(Network(bandwidth=rate), idle_only)


def test_batchnorm_syncs_cost_the_busy_ranks_hop_on_shared_cores_only() -> None:
    import dataclasses

    from gradsync.predict.simulate import with_batchnorm_sync

    # 2 layers × 2 syncs over 4 s of compute: 1 s of compute between syncs, where the
    # measured per-message cost is 5 ms (20 ms at 3 s). Idle ranks' hop: 1 ms.
    rate, channels = 1e9, (10, 20)
    base = profile_of([variable("w", 1000, 2.0)], forward=1.0, backward=3.0)
    profile = dataclasses.replace(base, batchnorm_channels=channels)
    net = Network(bandwidth=rate, message_s=1e-3, sync_message_s=((1.0, 5e-3), (3.0, 20e-3)))

    def added(cluster: Cluster) -> float:
        synced = with_batchnorm_sync(profile, cluster)
        return synced.compute_s - profile.compute_s

    def syncs(hop: float) -> float:  # 2 ranks: all_gather 1 hop, allreduce 2 hops a layer
        return sum(((5 * c + 6) * 8 / rate + 3 * hop) for c in channels)

    assert added(Cluster(workers=2, network=net, shared_cores=2)) == pytest.approx(syncs(5e-3))
    assert added(Cluster(workers=2, network=net)) == pytest.approx(syncs(1e-3))  # real hosts
    idle = dataclasses.replace(net, sync_message_s=())
    assert added(Cluster(workers=2, network=idle, shared_cores=2)) == pytest.approx(syncs(1e-3))


def test_duplex_slowdown_follows_each_transfers_duration(tmp_path) -> None:
    # Measured: 1 MB crosses in 10 ms one way and exchanges in 11 ms (1.1×); 16 MB takes
    # 160 ms and 320 ms both ways (2×). Each transfer gets the ratio of its own duration,
    # interpolated in log time; the largest size's ratio stays the scalar one.
    from gradsync.predict.links import SharedLinks

    rows: list[dict[str, float | str]] = [
        {"op": "p2p", "bytes": 1 << 20, "time_s": 0.010},
        {"op": "exchange", "bytes": 1 << 20, "time_s": 0.011},
        {"op": "p2p", "bytes": 1 << 24, "time_s": 0.160},
        {"op": "exchange", "bytes": 1 << 24, "time_s": 0.320},
    ]
    net = calibrate_duplex(Network(bandwidth=1e8), _commbench(tmp_path / "c.json", rows))
    assert net.bidirectional_slowdown == pytest.approx(2.0)
    assert net.duplex_slowdown(0.001) == pytest.approx(1.1)  # held below the smallest
    assert net.duplex_slowdown(0.040) == pytest.approx(1.55)  # halfway in log time
    assert net.duplex_slowdown(9.0) == pytest.approx(2.0)
    assert Network(bandwidth=1e8, bidirectional_slowdown=1.5).duplex_slowdown(0.04) == 1.5
    for seconds, slowdown in ((0.001, 1.1), (0.160, 2.0)):
        links = SharedLinks(Cluster(workers=1, network=net, servers=1, host_of_server=(1,)))
        num_bytes = seconds * net.rate
        links.push(0.0, server=0, num_bytes=num_bytes, tag="out")
        links.pull(0.0, server=0, num_bytes=num_bytes, tag="back")
        # Each shares its link direction with the other's (d − 1)·t: both in at d·t.
        both = {"out": slowdown * seconds, "back": slowdown * seconds}
        assert _arrivals(links) == pytest.approx(both)
        alone = SharedLinks(Cluster(workers=1, network=net, servers=1, host_of_server=(1,)))
        alone.push(0.0, server=0, num_bytes=num_bytes, tag="out")
        assert _arrivals(alone) == pytest.approx({"out": seconds})  # one way alone: full rate


def _arrivals(links: Any) -> dict[str, float]:
    """When each transfer started on ``links`` is in."""
    arrived = {}
    while links.busy:
        now = links.next_event()
        arrived |= {tag: now for tag in links.advance(now)}
    return arrived
