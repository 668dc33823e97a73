"""Per-step metrics (one JSON line per step per rank) and the run summary built from them."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import torch

from gradsync import allocator
from gradsync.checkpoint import versions
from gradsync.files import WriteFailed, atomic_write_text, check_folder, device_error, watch_folder
from gradsync.rundir import remove_stale_temps
from gradsync.stats import throughput

METRICS_DIR = "metrics"
SUMMARY_FILE = "summary.json"


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """What one rank measured in one step. Bytes and exposed time are this step's deltas;
    ``cpu_s`` is the CPU time its process used since its previous record, every thread
    counted (a colocated server's, the transport's), so CPU seconds over step seconds shows
    how many cores the rank kept busy."""

    step: int
    rank: int
    loss: float
    step_time_s: float
    samples_per_s: float
    bytes_sent: int
    bytes_recv: int
    exposed_comm_s: float
    lr: float
    cpu_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class ServerRecord:
    """What one parameter server did for one step: bytes pushed to it and pulled from it.

    Written to ``metrics/server<rank>.jsonl`` (apart from the workers' lines, so throughput
    and loss come from workers only); ``busy_s`` is the time spent applying updates,
    ``cpu_s`` the CPU time of the server's process since its previous record (a colocated
    server's process is its worker's, whose records already count it).
    """

    step: int
    rank: int
    server: int
    bytes_recv: int
    bytes_sent: int
    busy_s: float
    step_time_s: float
    cpu_s: float = 0.0


class MetricsWriter:
    """Appends records to ``<out>/metrics/<prefix><r>.jsonl``, flushed per line.

    Workers write :class:`StepRecord` lines (prefix ``rank``), parameter servers
    :class:`ServerRecord` lines (prefix ``server``). A resumed run (``keep_before``: the
    checkpoint's step) keeps the lines of the steps before it and drops the rest.

    ``out`` is this process's run folder from then on (:func:`gradsync.files.watch_folder`):
    once it is removed while the job runs, the next record or checkpoint is one line, never
    lines into a deleted file or a new empty folder. A full disk is one line too.
    """

    def __init__(
        self, out_dir: Path, rank: int, prefix: str = "rank", *, keep_before: int | None = None
    ) -> None:
        directory = out_dir / METRICS_DIR
        self._path = path = directory / f"{prefix}{rank}.jsonl"
        self._out = out_dir
        try:
            directory.mkdir(parents=True, exist_ok=True)
            kept = _lines_before(path, keep_before) if keep_before is not None else []
            self._file: IO[str] = open(path, "w")  # noqa: SIM115
        except OSError as error:
            raise device_error(path, error, folder=out_dir) or error from None
        watch_folder(out_dir)
        self._guard(lambda: self._file.writelines(kept))

    def write(self, record: StepRecord | ServerRecord) -> None:
        self._guard(lambda: self._file.write(json.dumps(asdict(record)) + "\n"))

    def _guard(self, write: Callable[[], object]) -> None:
        """``write`` then flush; a full disk or a removed run folder is one line (WriteFailed)."""
        try:
            write()
            self._file.flush()
            removed = os.fstat(self._file.fileno()).st_nlink == 0
        except OSError as error:
            failed = device_error(self._path, error, folder=self._out)
            if failed is None:
                raise
            self._abandon()
            raise failed from None
        if removed:  # the file was deleted under the job: its lines go nowhere
            self._abandon()
            check_folder(self._path)
            raise WriteFailed(
                f"{self._path} was removed while the job ran; its step records are lost: "
                "start the run again"
            )

    def _abandon(self) -> None:
        """Close without another try at the lines the disk refused (that would fail again,
        when the file is closed or collected)."""
        with contextlib.suppress(OSError):
            self._file.close()

    def close(self) -> None:
        try:
            self._file.close()
        except OSError as error:
            raise device_error(self._path, error, folder=self._out) or error from None


def _lines_before(path: Path, step: int) -> list[str]:
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] < step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short when the run died
    return kept


def read_records(
    out_dir: Path, ranks: Iterable[int], prefix: str = "rank"
) -> dict[int, list[dict[str, Any]]]:
    """The step records of ``ranks`` (workers; with prefix "server", servers), by rank.

    Only the named ranks are read, so files left by another run can never mix in.

    Example:
        >>> import tempfile
        >>> read_records(Path(tempfile.mkdtemp()), range(2))
        {}
    """
    records: dict[int, list[dict[str, Any]]] = {}
    for rank in ranks:
        path = out_dir / METRICS_DIR / f"{prefix}{rank}.jsonl"
        if not path.is_file():
            continue
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if lines:
            records[rank] = lines
    return records


def environment(threads: int, device: str = "cpu") -> dict[str, Any]:
    """Where the numbers were measured; ``device`` is what the ranks trained on."""
    return {
        **versions(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "threads_per_rank": threads,
        "allocator": allocator.applied(),
        "platform": platform.platform(),
        "device": device,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def summarize(
    out_dir: Path,
    *,
    global_batch: int,
    measure_warmup: int | None,
    run_info: dict[str, Any],
    world_size: int | None = None,
    lockstep: bool = True,
) -> dict[str, Any]:
    """Write ``summary.json``: throughput after warm-up, loss curve, bytes per step and rank.

    The job's step time is the slowest worker's step time when the workers move in
    ``lockstep``; otherwise (asynchronous updates: each worker goes on at its own pace) each
    worker's shard counts at its own rate, so the job's step time is the harmonic mean of
    the workers' (samples/s = Σ shard / step time). Loss is the mean over workers
    (equal shards, so it is the global-batch loss). ``cpu_s_per_step`` is the CPU time of
    every process of the job per step: the workers' (colocated servers included) and the
    dedicated servers'. Only this run's ranks are read: the workers of
    ``run_info["workers"]`` and, for servers, the ranks below ``world_size``.
    """
    workers = int(run_info["workers"])
    records = read_records(out_dir, range(workers))
    steps = sorted({r["step"] for lines in records.values() for r in lines})
    by_step = {s: [r for lines in records.values() for r in lines if r["step"] == s] for s in steps}
    job_step_time = max if lockstep else statistics.harmonic_mean
    step_times = [job_step_time([r["step_time_s"] for r in by_step[s]]) for s in steps]
    losses = [statistics.fmean(r["loss"] for r in by_step[s]) for s in steps]
    rate = throughput(step_times, global_batch, warmup_steps=measure_warmup)
    measured = steps[rate.warmup_steps :]
    per_rank = {
        rank: {
            "bytes_sent_per_step": _mean(r["bytes_sent"] for r in lines if r["step"] in measured),
            "bytes_recv_per_step": _mean(r["bytes_recv"] for r in lines if r["step"] in measured),
            "exposed_comm_s_per_step": _mean(
                r["exposed_comm_s"] for r in lines if r["step"] in measured
            ),
            "cpu_s_per_step": _mean(r.get("cpu_s", 0.0) for r in lines if r["step"] in measured),
        }
        for rank, lines in records.items()
    }
    summary = {
        **run_info,
        "throughput": rate.as_dict(),
        "step_time_s_median": statistics.median(step_times[rate.warmup_steps :]),
        "loss": losses,
        "final_loss": losses[-1],
        "bytes_sent_per_step": _mean(v["bytes_sent_per_step"] for v in per_rank.values()),
        "cpu_s_per_step": sum(v["cpu_s_per_step"] for v in per_rank.values()),
        "ranks": per_rank,
    }
    servers = read_records(out_dir, range(world_size or workers), "server")
    if servers:  # parameter servers: bytes per step each, to show load imbalance
        summary["servers"] = {
            rank: {
                "server": lines[0]["server"],
                **{
                    f"{key}_per_step": _mean(r[key] for r in lines if r["step"] in measured)
                    for key in ("bytes_recv", "bytes_sent", "busy_s")
                },
                "cpu_s_per_step": _mean(
                    r.get("cpu_s", 0.0) for r in lines if r["step"] in measured
                ),
            }
            for rank, lines in servers.items()
        }
        summary["cpu_s_per_step"] += sum(  # dedicated servers' processes (colocated: counted)
            v["cpu_s_per_step"] for rank, v in summary["servers"].items() if int(rank) >= workers
        )
    atomic_write_text(out_dir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    remove_stale_temps(out_dir)  # every rank is done: what a killed attempt left goes
    return summary


def _mean(values: Any) -> float:
    values = list(values)
    return statistics.fmean(values) if values else 0.0


def unsummarized(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` trained but has no summary: its metrics are there and
    ``summary.json`` is not (a job killed after its final checkpoint, before rank 0 wrote
    the summary). ``--resume`` with the same ``--steps`` finishes such a run: no step to
    train, the summary built from the metrics on disk.

    Example:
        >>> import tempfile
        >>> run = Path(tempfile.mkdtemp())
        >>> (run / METRICS_DIR).mkdir(); unsummarized(run)
        True
        >>> _ = (run / SUMMARY_FILE).write_text("{}"); unsummarized(run)
        False
    """
    return (run_dir / METRICS_DIR).is_dir() and not (run_dir / SUMMARY_FILE).is_file()


def load_summary(out_dir: Path) -> dict[str, Any]:
    return json.loads((out_dir / SUMMARY_FILE).read_text())
