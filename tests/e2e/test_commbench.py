"""``gradsync commbench`` on loopback: table, JSON and PNG with nccl-tests' bandwidths."""

from __future__ import annotations

import json
from pathlib import Path

from gradsync.commbench import DEFAULT_OPS, busbw_factor
from tests.e2e.conftest import gradsync


def _gradsync(workdir: Path, command: str):
    """``gradsync COMMAND`` (split on spaces) in ``workdir``."""
    return gradsync(*command.split(), cwd=workdir)


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_commbench_on_loopback_writes_table_json_and_plot(workdir: Path) -> None:
    result = _gradsync(
        workdir, "commbench --workers 3 --sizes 4K,1M --warmup 2 --iters 3 --out bench"
    )
    assert result.returncode == 0, result.stderr
    out = workdir / "bench"
    payload = json.loads((out / "commbench.json").read_text())
    assert payload["world_size"] == 3 and payload["hosts"] == 0
    rows = payload["results"]
    assert [(r["op"], r["bytes"]) for r in rows] == [
        (op, size)
        for op in DEFAULT_OPS  # exchange only on request
        # allgather's size is the gathered tensor: 3 equal float32 shards of it.
        for size in ((4092 if op == "allgather" else 4096), 2**20 - (4 if op == "allgather" else 0))
    ]
    for row in rows:
        assert row["time_s"] > 0 and row["iters"] >= 1 and row["cpu_s"] > 0
        assert row["algbw_Bps"] == row["bytes"] / row["time_s"]
        assert row["busbw_factor"] == busbw_factor(row["op"], 3)
        assert row["busbw_Bps"] == row["algbw_Bps"] * row["busbw_factor"]
        assert 1e3 < row["busbw_Bps"] < 1e12  # between 1 kB/s and 1 TB/s on loopback
    factors = {r["op"]: r["busbw_factor"] for r in rows}
    assert factors == {
        "allreduce": 4 / 3,
        "allgather": 2 / 3,
        "reduce": 1,
        "broadcast": 1,
        "p2p": 1,
    }
    assert "busbw (GB/s)" in result.stdout and "allgather" in result.stdout
    assert "| allreduce | 1 MB |" in (out / "commbench.md").read_text()
    assert (out / "commbench.png").read_bytes().startswith(PNG_SIGNATURE)


def test_exchange_on_an_odd_number_of_ranks_leaves_the_odd_one_out(workdir: Path) -> None:
    # 3 ranks: 0 and 1 exchange, rank 2 waits at the barriers (it once waited for rank 1).
    result = _gradsync(
        workdir, "commbench --workers 3 --ops exchange,p2p --sizes 64K --warmup 1 --iters 2 --out x"
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads((workdir / "x" / "commbench.json").read_text())["results"]
    assert [r["op"] for r in rows] == ["exchange", "p2p"]


def test_wire_echoes_through_the_server_transport_and_counts_its_python_threads(
    workdir: Path,
) -> None:
    # 3 ranks: 0 sends, 1 answers, 2 waits at the barriers; the receiver threads end cleanly.
    result = _gradsync(
        workdir,
        "commbench --workers 3 --ops wire,p2p --sizes 4K,1M --warmup 1 --iters 20 "
        "--busy-ms 0,1 --out w",
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads((workdir / "w" / "commbench.json").read_text())["results"]
    assert [(r["op"], r["bytes"], r["busy_s"]) for r in rows] == [
        (op, size, busy)
        for busy in (0.0, 0.001)
        for op in ("wire", "p2p")
        for size in (4096, 2**20)
    ]
    wire = [r for r in rows if r["op"] == "wire"]
    for row in wire:  # a round trip: the size crosses once each way
        assert row["busbw_factor"] == 2 and row["time_s"] > 0 and row["cpu_s"] > 0
        assert row["python_cpu_s"] >= 0
        if not row["busy_s"]:  # a mean over 3 ranks, 2 busy, counted during the calls
            assert row["python_cpu_s"] <= row["cpu_s"] * 3
    assert all("python_cpu_s" not in r for r in rows if r["op"] == "p2p")


def test_busy_ranks_compute_between_calls_and_every_interval_gets_its_rows(
    workdir: Path,
) -> None:
    result = _gradsync(
        workdir, "commbench --ops allreduce --sizes 4K --busy-ms 0,2 --warmup 1 --iters 5 --out b"
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads((workdir / "b" / "commbench.json").read_text())["results"]
    assert [(r["op"], r["busy_s"]) for r in rows] == [("allreduce", 0.0), ("allreduce", 0.002)]
    assert all(r["time_s"] > 0 for r in rows)
    assert "| allreduce (busy 2 ms) | 4 KB |" in (workdir / "b" / "commbench.md").read_text()


def test_commbench_refuses_bad_input_in_one_line(workdir: Path) -> None:
    for argv in (
        "commbench --ops alltoall",
        "commbench --workers 1",
        "commbench --sizes lots",
        "commbench --bandwidth 1gbit",
        "commbench --busy-ms lots",
        "commbench --busy-ms=-1",
    ):
        result = gradsync(*argv.split(), cwd=workdir)
        assert result.returncode == 2, argv
        assert result.stderr.count("\n") == 1, result.stderr
