"""The server transport's own costs (commbench's ``wire`` echo) in the network model, and
P3's answers as its server sends them. Closed-form answers on hand-made profiles."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from gradsync.errors import UserError
from gradsync.predict.network import Cluster, Network, WireCosts, calibrate, calibrate_wire
from gradsync.predict.simulate import Span, StrategyChoice, predict_step, shared_core_stretch
from gradsync.strategies.p3 import P3Options
from tests.unit.test_predict import ALLREDUCE, profile_of, ring, variable

SIZES = (4096, 1 << 20, 4 << 20)


def _echo_rows(hop: float, rate: float, cpu: tuple[float, float], python: tuple[float, float]):
    """commbench rows of a wire echo on 2 ranks: a round trip of S each way takes
    2·hop + 2·S/rate; each rank's CPU is cpu[0] + cpu[1]·S, its Python threads' python[0] +
    python[1]·S."""
    return [
        {
            "op": "wire",
            "bytes": size,
            "time_s": 2 * hop + 2 * size / rate,
            "cpu_s": cpu[0] + cpu[1] * size,
            "python_cpu_s": python[0] + python[1] * size,
        }
        for size in SIZES
    ]


def _write(path: Path, rows: list[dict], n: int = 2) -> Path:
    path.write_text(json.dumps({"world_size": n, "bandwidth": "1gbit", "results": rows}))
    return path


def test_wire_calibration_reads_hop_cpu_and_serial_costs_from_the_echo(tmp_path) -> None:
    # The job's CPU per round trip is 2·(a + b·S) over 2·S bytes and 4 messages (a header
    # and a payload each way): b per byte, a/2 per message. The Python threads' line is the
    # serial cost of one receive and one send, as measured.
    rows = _echo_rows(5e-4, 1e8, cpu=(6e-4, 1.5e-9), python=(4e-4, 2e-11))
    costs = calibrate_wire(Network(bandwidth=125e6), _write(tmp_path / "w.json", rows)).wire
    assert costs == pytest.approx(
        WireCosts(
            message_s=5e-4,
            cpu_s_per_byte=1.5e-9,
            cpu_s_per_message=3e-4,
            serial_s=4e-4,
            serial_s_per_byte=2e-11,
        )
    )
    # In a calibration beside allreduce rows, calibrate() reads them too.
    rows += [{"op": "allreduce", "bytes": s, "time_s": ring(2, s, 1e8, 1e-3)} for s in SIZES]
    fitted = calibrate(Network(bandwidth=125e6), _write(tmp_path / "c.json", rows))
    assert fitted.wire_hop_s == pytest.approx(5e-4) and fitted.hop_s == pytest.approx(1e-3)


def test_wire_calibration_takes_the_cpu_and_python_lines_of_the_busiest_echo(tmp_path) -> None:
    # Idle echoes price the hop; with --busy-ms rows beside them, the job's CPU line and
    # the Python threads' line are those of the longest compute between messages (5 ms).
    idle = _echo_rows(5e-4, 1e8, cpu=(6e-4, 1.5e-9), python=(4e-4, 2e-11))
    busy = [
        {**row, "busy_s": busy_s, "time_s": 1.0}
        for busy_s, cpu, python in ((0.002, 1e-3, 8e-4), (0.005, 2e-3, 1.2e-3))
        for row in _echo_rows(5e-4, 1e8, cpu=(cpu, 3e-9), python=(python, 0.0))
    ]
    costs = calibrate_wire(Network(bandwidth=125e6), _write(tmp_path / "w.json", idle + busy))
    assert costs.wire == pytest.approx(
        WireCosts(
            message_s=5e-4,
            cpu_s_per_byte=3e-9,
            cpu_s_per_message=1e-3,
            serial_s=1.2e-3,
            serial_s_per_byte=0.0,
        )
    )


def test_wire_calibration_without_two_sizes_is_one_line(tmp_path) -> None:
    rows = _echo_rows(5e-4, 1e8, cpu=(6e-4, 0.0), python=(0.0, 0.0))[:1]
    with pytest.raises(UserError, match="--ops wire"):
        calibrate_wire(Network(bandwidth=125e6), _write(tmp_path / "w.json", rows))


def test_ps_messages_take_the_wire_hop_and_collectives_keep_theirs() -> None:
    # One dedicated server, pushes after backward: 3 workers move 3 MB each way through the
    # server's link. The transport's hop is 1 ms; a collective's would be 0.5 s.
    size = 1_000_000
    profile = profile_of([variable("a", size // 4, 2.0)])
    net = Network(bandwidth=1e6, message_s=0.5, wire=WireCosts(message_s=1e-3))
    ps = predict_step(profile, Cluster(workers=3, network=net), StrategyChoice("ps"))
    assert ps.step_s == pytest.approx(3.0 + 2 * (3 * size / 1e6 + 1e-3))
    allreduce = predict_step(profile, Cluster(workers=3, network=net), ALLREDUCE)
    assert allreduce.step_s == pytest.approx(3.0 + ring(3, (size // 4 + 1) * 4, 1e6, 0.5))


def test_a_servers_python_work_per_message_delays_its_answers() -> None:
    # The same step with 0.1 s of serial work per message received and answered: the server
    # takes each of 3 workers' pushes in and answers it before the pulls can leave.
    size = 1_000_000
    profile = profile_of([variable("a", size // 4, 2.0)])
    costs = WireCosts(message_s=1e-3, serial_s=0.1)
    net = Network(bandwidth=1e6, wire=costs)
    step = predict_step(profile, Cluster(workers=3, network=net), StrategyChoice("ps"))
    assert step.step_s == pytest.approx(3.0 + 2 * (3 * size / 1e6 + 1e-3) + 3 * 0.1)


def test_server_transport_spans_cost_the_wires_cpu_on_shared_cores() -> None:
    # 1e8 bytes and 10 messages inside a 1 s backward, on 2 cores under 2 workers: a
    # collective at 1 ns/B and 1 ms a message, the transport at 3 ns/B and 2 ms.
    wire = WireCosts(message_s=0.0, cpu_s_per_byte=3e-9, cpu_s_per_message=2e-3)
    net = Network(bandwidth=1e6, cpu_s_per_byte=1e-9, cpu_s_per_message=1e-3, wire=wire)
    cluster = Cluster(workers=2, network=net, shared_cores=2)
    backward = Span("compute", "BACKWARD", 0.0, 1.0)
    collective = Span("communication", "ALLREDUCE", 0.0, 1.0, num_bytes=1e8, messages=10)
    pushed = dataclasses.replace(collective, name="PUSH", wire=True)
    assert shared_core_stretch([backward, collective], cluster) == pytest.approx(0.11 / 2)
    assert shared_core_stretch([backward, pushed], cluster) == pytest.approx(0.32 / 2)


def _p3_two_slices(server_round_s: float) -> float:
    """One worker, one dedicated server, 4 KB/s links; one layer of 2 slices of 4 KB ready
    when a 1 s backward starts, 2 slices a message; forward 1 s."""
    profile = dataclasses.replace(
        profile_of([variable("w", 2000, 0.0)], forward=1.0, backward=1.0),
        server_round_s=server_round_s,
    )
    cluster = Cluster(workers=1, network=Network(bandwidth=4000.0))
    options = P3Options(slice_size=1000, slices_per_message=2)
    return predict_step(profile, cluster, StrategyChoice("p3", options)).step_s


def test_p3_answers_leave_as_their_slices_are_applied() -> None:
    # The bundle is in 2 s after backward starts. Free applies: both answers are waiting
    # when the link is free and share a message (2 s): back at +4, the next backward at +5.
    assert _p3_two_slices(0.0) == pytest.approx(5.0)
    # 1 s a slice: the first is applied at +3 and leaves alone (+3..+4); the second,
    # applied at +4, follows (+4..+5). Back at +5, next backward at +6 (answering the
    # whole bundle after both applies would give +7).
    assert _p3_two_slices(1.0) == pytest.approx(6.0)
