"""Throughput statistics (warm-up discarded, windows) and the run summary built from rank files."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync.metrics import (
    SUMMARY_FILE,
    MetricsWriter,
    ServerRecord,
    StepRecord,
    load_summary,
    read_records,
    summarize,
)
from gradsync.stats import Throughput, default_warmup, throughput
from gradsync.tables import markdown_table


@pytest.mark.parametrize(
    ("num_steps", "warmup"),
    [
        (0, 0),
        (1, 0),
        (2, 1),
        (3, 2),
        (5, 4),
        (6, 5),
        (7, 5),
        (20, 5),
        (50, 5),
        (51, 6),
        (59, 6),
        (60, 6),
        (61, 7),
        (100, 10),
        (101, 11),
        (1000, 100),
    ],
)
def test_default_warmup(num_steps, warmup):
    assert default_warmup(num_steps) == warmup


@settings(deadline=None)
@given(st.integers(1, 100_000))
def test_default_warmup_is_ten_percent_at_least_five_leaving_one_step(num_steps):
    warmup = default_warmup(num_steps)
    assert 0 <= warmup <= num_steps - 1
    assert warmup == min(num_steps - 1, max(5, -(-num_steps // 10)))


def test_slow_warmup_is_excluded_and_windows_are_exact():
    warmup = [50.0, 20.0, 10.0, 9.0, 8.0]  # 20 steps → 5 warm-up steps by default
    windows = [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [0.5, 0.5, 0.5], [1.0, 1.0, 2.0], [4.0] * 3]
    times = warmup + [t for window in windows for t in window]
    result = throughput(times, global_batch=12)
    # window rates: 12·3/sum → 12, 6, 24, 9, 3 samples/s
    assert (result.median, result.low, result.high) == (9.0, 3.0, 24.0)
    assert (result.num_windows, result.warmup_steps, result.measured_steps) == (5, 5, 15)
    assert str(result) == "9.0 (3.0–24.0)"
    assert result.as_dict() == {
        "median": 9.0,
        "low": 3.0,
        "high": 24.0,
        "num_windows": 5,
        "warmup_steps": 5,
        "measured_steps": 15,
    }


def test_explicit_warmup_zero_measures_the_slow_steps_too():
    times = [10.0] + [1.0] * 9
    with_warmup = throughput(times, global_batch=2, warmup_steps=1)
    without = throughput(times, global_batch=2, warmup_steps=0)
    assert with_warmup.median == with_warmup.low == with_warmup.high == 2.0
    # 10 steps in 5 windows of 2: the first window is (10 + 1) s for 4 samples
    assert without.low == pytest.approx(4 / 11)
    assert without.median == 2.0 and without.warmup_steps == 0


def test_uneven_windows_split_by_rounding():
    # 12 measured steps in 5 windows: bounds 0, 2, 5, 7, 10, 12 → sizes 2, 3, 2, 3, 2
    sizes = [2, 3, 2, 3, 2]
    step_times = [1.0, 2.0, 4.0, 8.0, 16.0]
    times = [t for size, t in zip(sizes, step_times, strict=True) for _ in range(size)]
    result = throughput(times, global_batch=16, warmup_steps=0)
    assert result.num_windows == 5
    assert (result.high, result.median, result.low) == (16.0, 4.0, 1.0)


def test_fewer_measured_steps_than_windows():
    result = throughput([9.0, 1.0, 2.0, 4.0], global_batch=8, warmup_steps=1)
    assert (result.num_windows, result.measured_steps) == (3, 3)
    assert (result.low, result.median, result.high) == (2.0, 4.0, 8.0)


def test_warmup_longer_than_the_run_leaves_the_last_step():
    result = throughput([5.0, 5.0, 2.0], global_batch=4, warmup_steps=10)
    assert (result.warmup_steps, result.measured_steps, result.median) == (2, 1, 2.0)
    assert throughput([3.0], global_batch=6).median == 2.0  # default warm-up of one step is 0


def test_no_steps_is_an_error():
    with pytest.raises(ValueError, match="no steps"):
        throughput([], global_batch=4)


@settings(deadline=None)
@given(
    st.lists(st.floats(0.01, 100.0), min_size=1, max_size=60),
    st.integers(1, 512),
    st.integers(1, 7),
)
def test_throughput_bounds(times, batch, num_windows):
    result = throughput(times, batch, num_windows=num_windows)
    measured = times[result.warmup_steps :]
    assert result.measured_steps == len(measured) >= 1
    assert result.num_windows == min(num_windows, len(measured))
    assert result.low <= result.median <= result.high
    # every window rate lies between the rates of the fastest and slowest single step
    assert batch / max(measured) * (1 - 1e-9) <= result.low
    assert result.high <= batch / min(measured) * (1 + 1e-9)


def test_throughput_is_frozen():
    result = Throughput(1.0, 1.0, 1.0, 1, 0, 1)
    with pytest.raises(AttributeError):
        result.median = 2.0  # type: ignore[misc]


# ---------------------------------------------------------------- metrics.summarize


def _record(
    step: int,
    rank: int,
    *,
    time: float,
    loss: float,
    sent: int,
    recv: int,
    exposed: float,
    cpu: float = 0.0,
) -> dict:
    return {
        "step": step,
        "rank": rank,
        "loss": loss,
        "step_time_s": time,
        "samples_per_s": 0.0,
        "bytes_sent": sent,
        "bytes_recv": recv,
        "exposed_comm_s": exposed,
        "lr": 0.1,
        "cpu_s": cpu,
    }


def _write_rank(out, rank: int, records: list[dict], *, blank_lines: bool = False) -> None:
    directory = out / "metrics"
    directory.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in records]
    if blank_lines:
        lines = ["", *lines, "   ", ""]
    (directory / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")


def test_summarize_uses_slowest_rank_mean_loss_and_measured_bytes(tmp_path):
    # 7 steps, 2 warm-up steps; steps 2..6 are measured, one per window.
    rank0_times = [9.0, 9.0, 1.0, 2.0, 1.0, 4.0, 1.0]
    rank1_times = [8.0, 9.5, 2.0, 1.0, 1.0, 1.0, 0.5]
    # slowest per step: 9, 9.5, 2, 2, 1, 4, 1 → measured rates (batch 8): 4, 4, 8, 2, 8
    rank0 = [
        _record(
            s,
            0,
            time=t,
            loss=float(s),
            sent=10_000 if s < 2 else 100 + s,
            recv=200,
            exposed=0.5 if s < 2 else 0.1,
            cpu=5.0 if s < 2 else 0.25,
        )
        for s, t in enumerate(rank0_times)
    ]
    rank1 = [
        _record(
            s,
            1,
            time=t,
            loss=float(s) + 1.0,
            sent=10_000 if s < 2 else 300,
            recv=400 + s,
            exposed=0.3,
            cpu=5.0 if s < 2 else 0.5,
        )
        for s, t in enumerate(rank1_times)
    ]
    _write_rank(tmp_path, 0, rank0)
    _write_rank(tmp_path, 1, list(reversed(rank1)), blank_lines=True)

    summary = summarize(
        tmp_path, global_batch=8, measure_warmup=2, run_info={"strategy": "allreduce", "workers": 2}
    )

    assert summary["strategy"] == "allreduce" and summary["workers"] == 2
    assert summary["throughput"] == {
        "median": 4.0,
        "low": 2.0,
        "high": 8.0,
        "num_windows": 5,
        "warmup_steps": 2,
        "measured_steps": 5,
    }
    assert summary["step_time_s_median"] == 2.0  # median of 2, 2, 1, 4, 1
    assert summary["loss"] == [s + 0.5 for s in range(7)]
    assert summary["final_loss"] == 6.5
    ranks = {int(k): v for k, v in summary["ranks"].items()}
    assert ranks[0] == {
        "bytes_sent_per_step": 104.0,
        "bytes_recv_per_step": 200.0,
        "exposed_comm_s_per_step": pytest.approx(0.1),
        "cpu_s_per_step": 0.25,
    }
    assert ranks[1] == {
        "bytes_sent_per_step": 300.0,
        "bytes_recv_per_step": 404.0,
        "exposed_comm_s_per_step": pytest.approx(0.3),
        "cpu_s_per_step": 0.5,
    }
    assert summary["bytes_sent_per_step"] == 202.0
    assert summary["cpu_s_per_step"] == 0.75  # every worker's process, warm-up left out
    assert json.loads((tmp_path / SUMMARY_FILE).read_text()) == json.loads(json.dumps(summary))
    assert load_summary(tmp_path)["final_loss"] == 6.5


def test_summarize_counts_dedicated_servers_cpu_once(tmp_path):
    # 2 workers (rank 1 also runs a colocated server) and a dedicated server on rank 2.
    for rank in (0, 1):
        _write_rank(
            tmp_path,
            rank,
            [
                _record(s, rank, time=1.0, loss=1.0, sent=0, recv=0, exposed=0.0, cpu=0.5)
                for s in range(4)
            ],
        )
    for rank, cpu in ((1, 0.5), (2, 0.125)):  # rank 1's server record is its worker's process
        lines = [
            json.dumps(
                asdict(
                    ServerRecord(
                        step=s,
                        rank=rank,
                        server=rank - 1,
                        bytes_recv=0,
                        bytes_sent=0,
                        busy_s=0.0,
                        step_time_s=1.0,
                        cpu_s=cpu,
                    )
                )
            )
            for s in range(4)
        ]
        (tmp_path / "metrics" / f"server{rank}.jsonl").write_text("\n".join(lines) + "\n")
    summary = summarize(
        tmp_path, global_batch=2, measure_warmup=1, run_info={"workers": 2}, world_size=3
    )
    assert summary["servers"][2]["cpu_s_per_step"] == 0.125
    assert summary["cpu_s_per_step"] == 1.125  # 0.5 + 0.5 + the dedicated server's 0.125


def test_summarize_default_warmup_and_many_ranks(tmp_path):
    times = [5.0] * 5 + [1.0] * 15  # 20 steps → 5 warm-up steps by default
    for rank in (0, 2, 10):
        _write_rank(
            tmp_path,
            rank,
            [
                _record(
                    s, rank, time=t * (1 + rank / 100), loss=1.0, sent=rank, recv=rank, exposed=0.0
                )
                for s, t in enumerate(times)
            ],
        )
    summary = summarize(tmp_path, global_batch=10, measure_warmup=None, run_info={"workers": 11})
    assert summary["throughput"]["warmup_steps"] == 5
    assert summary["throughput"]["median"] == pytest.approx(10 / 1.1)  # rank 10 is slowest
    assert sorted(int(rank) for rank in summary["ranks"]) == [0, 2, 10]
    assert summary["bytes_sent_per_step"] == pytest.approx(4.0)


def test_metrics_writer_and_read_records_round_trip(tmp_path):
    writer = MetricsWriter(tmp_path, rank=3)
    records = [
        StepRecord(
            step=s,
            rank=3,
            loss=1.0 / (s + 1),
            step_time_s=0.5,
            samples_per_s=16.0,
            bytes_sent=s * 10,
            bytes_recv=s * 20,
            exposed_comm_s=0.01,
            lr=0.1,
        )
        for s in range(3)
    ]
    for record in records:
        writer.write(record)
        # flushed per line: readable before close
        assert len(read_records(tmp_path, [3])[3]) == record.step + 1
    writer.close()
    back = read_records(tmp_path, range(4))
    assert list(back) == [3]
    assert [StepRecord(**r) for r in back[3]] == records


def test_read_records_skips_empty_rank_files(tmp_path):
    _write_rank(tmp_path, 0, [])
    assert read_records(tmp_path, [0]) == {}


def test_summary_reads_only_this_runs_ranks(tmp_path):
    """A rank file left by an earlier, wider run never mixes into this run's summary."""
    _write_rank(
        tmp_path,
        0,
        [_record(s, 0, time=1.0, loss=1.0, sent=1, recv=1, exposed=0.0) for s in range(6)],
    )
    _write_rank(
        tmp_path,
        1,
        [_record(s, 1, time=1.0, loss=9.0, sent=1, recv=1, exposed=0.0) for s in range(12)],
    )
    summary = summarize(tmp_path, global_batch=4, measure_warmup=1, run_info={"workers": 1})
    assert len(summary["loss"]) == 6 and summary["final_loss"] == 1.0
    assert list(summary["ranks"]) == [0]


def test_resumed_metrics_keep_the_steps_before_the_checkpoint(tmp_path):
    _write_rank(
        tmp_path,
        0,
        [_record(s, 0, time=1.0, loss=1.0, sent=1, recv=1, exposed=0.0) for s in range(12)],
    )
    with (tmp_path / "metrics" / "rank0.jsonl").open("a") as cut:
        cut.write('{"step": 12, "ra')  # the line being written when the run died
    MetricsWriter(tmp_path, rank=0, keep_before=10).close()
    assert [r["step"] for r in read_records(tmp_path, [0])[0]] == list(range(10))


# ---------------------------------------------------------------- tables


def test_markdown_table_escapes_pipes():
    text = markdown_table(["tensor", "diff"], [["a|b", "1.0"], ["c", "2"]])
    assert text.splitlines() == ["| tensor | diff |", "|---|---|", "| a\\|b | 1.0 |", "| c | 2 |"]


def test_markdown_table_without_rows():
    assert markdown_table(["x"], []) == "| x |\n|---|"


def test_summarize_counts_each_asynchronous_worker_at_its_own_rate(tmp_path):
    """Workers taking turns being slow: in lockstep every step waits for the slow one; with
    asynchronous updates each worker's shard counts at its own pace, and the job's samples
    per second is the sum of the workers' (it read 104.5 where the job ran at about 192)."""
    for rank in range(2):
        times = [1.0 if (step + rank) % 2 else 0.25 for step in range(8)]
        records = [
            _record(s, rank, time=t, loss=1.0, sent=0, recv=0, exposed=0.0)
            for s, t in enumerate(times)
        ]
        _write_rank(tmp_path, rank, records)
    info = {"workers": 2}
    lockstep = summarize(tmp_path, global_batch=8, measure_warmup=2, run_info=info)
    free = summarize(tmp_path, global_batch=8, measure_warmup=2, run_info=info, lockstep=False)
    assert lockstep["throughput"]["median"] == 8.0  # 8 samples per 1 s step
    assert free["throughput"]["median"] == pytest.approx(4 / 1.0 + 4 / 0.25)  # 20.0
