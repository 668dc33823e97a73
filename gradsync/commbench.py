"""``gradsync commbench``: collective bandwidth over message sizes, the nccl-tests of gradsync.

Each operation runs at each size: warm-up iterations, then timed ones between barriers; the
time of a size is the slowest rank's mean per operation. Bandwidths follow nccl-tests
(``doc/PERFORMANCE.md``): the *algorithm bandwidth* is ``size / time``; the *bus bandwidth*
``algbw · factor`` is what each rank's link carried, comparable with the link rate whatever
the number of ranks:

=========== ================ ===============================================
operation   factor           size means
=========== ================ ===============================================
allreduce   2(n−1)/n         the tensor on each rank
allgather   (n−1)/n          the gathered tensor (each rank contributes size/n)
reduce      1                the tensor on each rank (to rank 0)
broadcast   1                the tensor (from rank 0)
p2p         1                the tensor rank 0 sends to rank 1
exchange    1                the tensor ranks r and r + n/2 send each other at once
wire        2                a message rank 0 sends rank 1 and its answer (a round trip)
=========== ================ ===============================================

``exchange`` (on request) shows whether a link carries both directions at full rate: on a
full-duplex link it takes as long as ``p2p``. Each rank posts its receive before its send,
as gradsync's transport does (:class:`gradsync.comm.wire.Lanes` says why the order matters
to Gloo). ``wire`` (on request) is not a collective: it is a push and its answer through the
server transport that ``ps``, ``hybrid`` and ``p3`` use (:mod:`gradsync.comm.echo`), header,
receiver threads and all. Every row also has ``cpu_s``: the ranks' mean
process CPU time (every thread, user and system) per operation, what moving the bytes costs
the CPU (with ``--busy-ms``: over the whole loop, less the calling thread's compute, so
work done by other threads while it computes counts).

Ranks are started by the usual launcher (:func:`gradsync.launch.launch_local`) with a job of
``kind = "commbench"``; they run on loopback or on emulated hosts (``--hosts``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from gradsync.config import LaunchConfig
from gradsync.errors import UserError
from gradsync.files import atomic_write_text
from gradsync.tables import markdown_table, print_table
from gradsync.topology import RankEnv, default_threads

if TYPE_CHECKING:
    from gradsync.comm.echo import WireEcho

RESULTS_FILE = "commbench.json"
PLOT_FILE = "commbench.png"
TABLE_FILE = "commbench.md"
LOG_FILE = "stdout.log"
ELEMENT_BYTES = 4  # float32
DEFAULT_MIN_BYTES = 4 * 1024
DEFAULT_MAX_BYTES = 256 * 1024**2


def busbw_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor of ``op`` over ``world_size`` ranks.

    Example:
        >>> busbw_factor("allreduce", 4), busbw_factor("allgather", 4), busbw_factor("p2p", 4)
        (1.5, 0.75, 1.0)
    """
    n = world_size
    factors = {
        "allreduce": 2 * (n - 1) / n,
        "allgather": (n - 1) / n,
        "reduce": 1.0,
        "broadcast": 1.0,
        "p2p": 1.0,
        "exchange": 1.0,
        "wire": 2.0,  # the size crosses once each way, one after the other
    }
    return factors[op]


OPS = ("allreduce", "reduce", "broadcast", "allgather", "p2p", "exchange", "wire")
# exchange and wire on request (predict's calibration of full duplex and of the transport)
DEFAULT_OPS = OPS[:-2]
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def parse_size(text: str) -> int:
    """A message size in bytes; K, M, G are powers of 1024 (as in nccl-tests).

    Example:
        >>> parse_size("4K"), parse_size("256MB"), parse_size("1mib"), parse_size("4096")
        (4096, 268435456, 1048576, 4096)
    """
    match = re.fullmatch(r"\s*(\d+)\s*([kmgKMG]?)(?:i?[bB])?\s*", text)
    if match is None:
        raise UserError(f"{text!r} is not a message size; write e.g. 4096, 4K, 16M or 1G")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Sizes from ``min_bytes`` to ``max_bytes``, each ``factor`` times the previous.

    Example:
        >>> size_sweep(4096, 65536, 4)
        [4096, 16384, 65536]
    """
    if factor not in (2, 4):
        raise UserError(f"--factor must be 2 or 4, got {factor}")
    if not 0 < min_bytes <= max_bytes:
        raise UserError(f"--min-bytes {min_bytes} must be positive and ≤ --max-bytes {max_bytes}")
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


@dataclass(frozen=True, kw_only=True)
class CommbenchConfig:
    """One commbench job (a job ``kind`` the runtime knows besides training).

    Example:
        >>> cfg = CommbenchConfig(workers=2, ops=("p2p",), sizes=(4096,))
        >>> CommbenchConfig.from_json(cfg.to_json()) == cfg
        True
    """

    kind: str = "commbench"
    workers: int = 2
    ops: tuple[str, ...] = DEFAULT_OPS
    sizes: tuple[int, ...] = tuple(size_sweep(DEFAULT_MIN_BYTES, DEFAULT_MAX_BYTES, 2))
    warmup_iters: int = 5
    iters: int = 20
    time_budget_s: float = 1.0
    # Each value: compute this long (matrix products on the rank's own thread) before every
    # timed operation, not counted in its time. Ranks that train between blocking
    # collectives (BatchNorm's syncs) wait for each other and, on shared cores, for a core;
    # 0: idle ranks. Every operation and size is measured at every value.
    busy_ms: tuple[float, ...] = (0.0,)
    out: str = "runs/commbench"
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def __post_init__(self) -> None:
        if self.workers < 2:
            raise UserError(f"commbench needs --workers ≥ 2, got {self.workers}")
        repeated = sorted({op for op in self.ops if self.ops.count(op) > 1})
        if repeated:
            raise UserError(f"--ops lists {', '.join(repeated)} more than once; name each once")
        unknown = [op for op in self.ops if op not in OPS]
        if unknown or not self.ops:
            raise UserError(
                f"unknown commbench operation(s) {', '.join(unknown) or '(none)'}; "
                f"choose from: {', '.join(OPS)}"
            )
        small = [s for s in self.sizes if s < ELEMENT_BYTES * self.workers]
        if small or not self.sizes:
            raise UserError(
                f"message sizes must be at least {ELEMENT_BYTES * self.workers} bytes "
                f"(one float32 per rank), got {small or 'none'}"
            )
        for flag, values in (("--sizes", self.sizes), ("--busy-ms", self.busy_ms)):
            twice = sorted({f"{v:g}" for v in values if values.count(v) > 1})
            if twice:  # each would be measured twice and drawn as one series
                raise UserError(f"{flag} lists {', '.join(twice)} more than once; give each once")
        if self.launch.hosts:
            from gradsync.netem import check_hosts_filled

            check_hosts_filled(self.workers, self.launch.hosts, self.launch.ranks_per_host)
        if self.warmup_iters < 1 or self.iters < 1:
            raise UserError(
                f"--warmup and --iters must be ≥ 1, got {self.warmup_iters} and {self.iters}"
            )
        if not self.time_budget_s > 0:
            raise UserError(f"--time-budget must be > 0 seconds, got {self.time_budget_s}")
        if not self.busy_ms or not all(0 <= b < 1000 for b in self.busy_ms):
            raise UserError(
                f"--busy-ms needs values ≥ 0 and < 1000 milliseconds, got {list(self.busy_ms)}"
            )
        if self.launch.num_nodes != 1:
            raise UserError("commbench runs on one machine; drop --nnodes")
        self.launch.check(self.workers)  # --master-port, --timeout, --threads

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CommbenchConfig:
        raw = json.loads(text)
        return cls(
            **{k: v for k, v in raw.items() if k not in ("ops", "sizes", "launch", "busy_ms")},
            ops=tuple(raw["ops"]),
            busy_ms=tuple(raw.get("busy_ms", (0.0,))),
            sizes=tuple(raw["sizes"]),
            launch=LaunchConfig(**raw["launch"]),
        )


# -- one rank ---------------------------------------------------------------------------------


def run_rank(config: CommbenchConfig, env: RankEnv) -> None:
    """Measure every operation at every size as rank ``env.rank``; rank 0 writes the results."""
    import torch
    import torch.distributed as dist

    from gradsync.comm.groups import node_local_group
    from gradsync.comm.objects import all_gather_json
    from gradsync.rendezvous import join_process_group

    threads = config.launch.threads or default_threads(env.local_world_size)
    torch.set_num_threads(threads)
    timeout = timedelta(seconds=config.launch.timeout_s)
    join_process_group(env, timeout)  # CPU: Gloo
    try:
        node = node_local_group(env.node_rank, timeout)
        placement = all_gather_json(
            {
                "rank": env.rank,
                "host": os.environ.get("GRADSYNC_EMULATED_HOST", socket.gethostname()),
                "node": node.node,
                "local_rank": env.local_rank,
                "local_world_size": env.local_world_size,
                "node_group": list(node.ranks),
            },
        )
        echo = _start_echo(config, env)
        results = []
        for busy_ms in config.busy_ms:
            for op in config.ops:
                for size in config.sizes:
                    results.append(_measure(op, size, busy_ms / 1e3, config, env, echo))
                    if env.rank == 0:
                        _print_row(results[-1])
        if echo is not None:
            echo.stop()
        if env.rank == 0:
            payload = {
                "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "world_size": env.world_size,
                "hosts": config.launch.hosts,
                "bandwidth": config.launch.bandwidth,
                "threads": threads,
                "torch": torch.__version__,
                "backend": "gloo",
                "placement": placement,
                "results": results,
            }
            out = Path(config.out)
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_text(out / RESULTS_FILE, json.dumps(payload, indent=2) + "\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _start_echo(config: CommbenchConfig, env: RankEnv) -> WireEcho | None:
    """Rank 0's and rank 1's ends of the ``wire`` echo when it is measured (the transport's
    two process groups are created on every rank); None elsewhere or without ``wire``."""
    from gradsync.comm.echo import SERVER, WORKER, WireEcho
    from gradsync.comm.wire import Lanes

    if "wire" not in config.ops:
        return None
    lanes = Lanes.create(env.world_size, timedelta(seconds=config.launch.timeout_s))
    return WireEcho.start(lanes, env.rank) if env.rank in (WORKER, SERVER) else None


def _operation(
    op: str, size: int, rank: int, world_size: int, echo: WireEcho | None = None
) -> tuple[Callable[[], None], int]:
    """A closure running ``op`` once on preallocated tensors, and the bytes it moves."""
    import torch
    import torch.distributed as dist

    if op == "wire":  # ranks 0 and 1 echo; the others wait at the barriers
        payload = torch.ones(size, dtype=torch.uint8)
        return (lambda: None) if echo is None else (lambda: echo.round_trip(payload)), size

    if op == "allgather":
        count = size // (ELEMENT_BYTES * world_size)
        mine = torch.ones(count)
        gathered = [torch.empty(count) for _ in range(world_size)]
        return lambda: dist.all_gather(gathered, mine), count * world_size * ELEMENT_BYTES
    tensor = torch.ones(size // ELEMENT_BYTES)
    moved = tensor.numel() * ELEMENT_BYTES
    if op == "allreduce":
        return lambda: dist.all_reduce(tensor), moved
    if op == "reduce":
        return lambda: dist.reduce(tensor, dst=0), moved
    if op == "broadcast":
        return lambda: dist.broadcast(tensor, src=0), moved
    if op == "exchange":  # rank r and r ± n/2 send to each other at once: both directions
        incoming = torch.empty_like(tensor)
        half = world_size // 2
        if rank >= 2 * half:  # the odd rank out waits at the barriers
            return lambda: None, moved
        peer = rank + half if rank < half else rank - half

        def exchange() -> None:
            # The receive first, as the transport's receivers are: Gloo sends a payload only
            # once the peer has announced its receive, and an announcement posted after this
            # rank's own send would queue behind it (the two sends would take turns).
            for work in (dist.irecv(incoming, peer), dist.isend(tensor, peer)):
                work.wait()

        return exchange, moved
    # p2p: rank 0 sends to rank 1; the other ranks wait at the barriers.
    if rank == 0:
        return lambda: dist.send(tensor, dst=1), moved
    if rank == 1:
        return lambda: dist.recv(tensor, src=0), moved
    return lambda: None, moved


def _timed_between_compute(
    run: Callable[[], None], iters: int, busy_s: float
) -> tuple[float, float, float]:
    """Wall, CPU and Python-thread CPU seconds of ``iters`` calls of ``run``, each after
    ``busy_s`` of matrix products (on this thread: one intra-op thread) that are not
    counted. The transport's work may fall during the compute (a receiver thread taking an
    answer, Gloo's loop sending a payload), so both CPU clocks run over the whole loop and
    leave out only this thread's own time outside the calls: the process's counts every
    other thread, the Python threads' the other Python threads (the transport's receivers
    and senders)."""
    import torch

    block = torch.ones(64, 64)
    wall = own = 0.0
    process_start, thread_start = time.process_time(), time.thread_time()
    others_start = python_threads_cpu_s(include_current=False)
    for _ in range(iters):
        busy_until = time.perf_counter() + busy_s
        while time.perf_counter() < busy_until:
            torch.mm(block, block)
        start, own_start = time.perf_counter(), time.thread_time()
        run()
        wall += time.perf_counter() - start
        own += time.thread_time() - own_start
    computing = time.thread_time() - thread_start - own
    cpu = time.process_time() - process_start - computing
    return wall, cpu, own + python_threads_cpu_s(include_current=False) - others_start


def _over_ranks(seconds: float, reduce: Literal["max", "mean"]) -> float:
    """``seconds`` of every rank reduced to one number each rank gets: the slowest rank's
    (``"max"``) or their average (``"mean"``). A collective: every rank calls it."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64)
    if reduce == "max":
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value.item())
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return float(value.item()) / dist.get_world_size()


def _print_row(row: dict[str, Any]) -> None:
    busy = f"  busy {row['busy_s'] * 1e3:g} ms" if row["busy_s"] else ""
    print(
        f"[commbench] {row['op']:>9} {row['bytes']:>11} B  {row['time_s'] * 1e6:>12.1f} us"
        f"  busbw {row['busbw_Bps'] / 1e9:8.3f} GB/s{busy}",
        flush=True,
    )


def _measure(
    op: str,
    size: int,
    busy_s: float,
    config: CommbenchConfig,
    env: RankEnv,
    echo: WireEcho | None = None,
) -> dict[str, Any]:
    import torch.distributed as dist

    run, moved = _operation(op, size, env.rank, env.world_size, echo)
    # The first warm-up iteration also sizes the rest, so slow links stay within the budget.
    dist.barrier()
    start = time.perf_counter()
    run()
    first = _over_ranks(time.perf_counter() - start, "max")
    fits = int(config.time_budget_s / max(first, 1e-9))
    iters = max(1, min(config.iters, fits))
    warmup = 1 + max(0, min(config.warmup_iters - 1, fits // 2))
    for _ in range(warmup - 1):
        run()
    dist.barrier()
    if busy_s > 0:
        wall, cpu, python = _timed_between_compute(run, iters, busy_s)
    else:
        python_start = python_threads_cpu_s() if op == "wire" else 0.0
        start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(iters):
            run()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        python = python_threads_cpu_s() - python_start if op == "wire" else 0.0
    seconds = _over_ranks(wall, "max") / iters  # the clocks are read before these collectives
    cpu_s = _over_ranks(cpu / iters, "mean")
    factor = busbw_factor(op, env.world_size)
    algbw = moved / seconds
    extra = {}
    if op == "wire":  # what of it runs under the interpreter's lock
        extra["python_cpu_s"] = _over_ranks(python / iters, "mean")
    return {
        "op": op,
        "bytes": moved,
        "count": moved // ELEMENT_BYTES,
        "warmup_iters": warmup,
        "iters": iters,
        "time_s": seconds,
        "algbw_Bps": algbw,
        "busbw_factor": factor,
        "busbw_Bps": algbw * factor,
        "cpu_s": cpu_s,
        "busy_s": busy_s,
        **extra,
    }


def python_threads_cpu_s(*, include_current: bool = True) -> float:
    """CPU seconds (user + system) of this process's Python threads so far: the threads
    that take turns under the interpreter's lock, without the transport's native threads
    (Gloo's event loops); without the calling thread unless ``include_current``. 0 where
    the OS does not say (no ``/proc``).

    Example:
        >>> python_threads_cpu_s() >= 0.0
        True
    """
    import threading

    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0
    for thread in threading.enumerate():
        if not include_current and thread is threading.current_thread():
            continue
        try:
            fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text()
        except OSError:
            continue
        utime, stime = fields.rsplit(")", 1)[1].split()[11:13]
        total += int(utime) + int(stime)
    return total / tick


# -- the whole job ----------------------------------------------------------------------------


# Buffers a rank holds for one operation, in message sizes: an exchange's two, an
# allgather's input and output, and Gloo's own staging.
BUFFERS_PER_RANK = 3


def check_memory(config: CommbenchConfig, available: int | None = None) -> None:
    """UserError when the largest message cannot be held by every rank at once (read
    before launch, so a size beyond this machine's memory is one line, not every rank's
    allocator traceback). ``available``: bytes (default: the kernel's MemAvailable).

    Example:
        >>> check_memory(CommbenchConfig(workers=2, sizes=(1 << 20,)), available=1 << 30)
        >>> check_memory(CommbenchConfig(workers=2, sizes=(1 << 30,)), available=1 << 30)
        Traceback (most recent call last):
        gradsync.errors.UserError: messages of up to 1.0 GiB need about 6.0 GiB ...
    """
    available = _available_memory() if available is None else available
    largest = max(config.sizes)
    needed = BUFFERS_PER_RANK * largest * config.workers
    if available is not None and needed > available:
        raise UserError(
            f"messages of up to {largest / 2**30:.1f} GiB need about {needed / 2**30:.1f} GiB "
            f"({BUFFERS_PER_RANK} buffers on each of {config.workers} ranks), and this machine "
            f"has {available / 2**30:.1f} GiB available; pass smaller --sizes or --max-bytes"
        )


def _available_memory() -> int | None:
    """The kernel's MemAvailable in bytes; None where /proc/meminfo does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def run_commbench(config: CommbenchConfig, *, quiet: bool = False) -> dict[str, Any]:
    """Launch the ranks, wait, and return the results rank 0 wrote.

    Example:
        >>> # run_commbench(CommbenchConfig(workers=2, ops=("allreduce",), sizes=(1 << 20,)))
    """
    from gradsync.launch import launch_local

    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULTS_FILE).unlink(missing_ok=True)
    launch_local(config, world_size=config.workers, log_file=out / LOG_FILE if quiet else None)
    return json.loads((out / RESULTS_FILE).read_text())


def report(payload: dict[str, Any], out: Path) -> None:
    """Print the table; write ``commbench.md`` and the ``commbench.png`` plot under ``out``."""
    headers = [
        "op",
        "size",
        "count (float32)",
        "iters",
        "time (us)",
        "algbw (GB/s)",
        "busbw (GB/s)",
        "busbw (Gbit/s)",
    ]
    rows = [
        [
            _series(r),
            _size(r["bytes"]),
            str(r["count"]),
            str(r["iters"]),
            f"{r['time_s'] * 1e6:,.1f}",
            f"{r['algbw_Bps'] / 1e9:.3f}",
            f"{r['busbw_Bps'] / 1e9:.3f}",
            f"{r['busbw_Bps'] * 8 / 1e9:.3f}",
        ]
        for r in payload["results"]
    ]
    title = _title(payload)
    print_table(title, headers, rows)
    atomic_write_text(out / TABLE_FILE, f"# {title}\n\n" + markdown_table(headers, rows) + "\n")
    plot(payload, out / PLOT_FILE)
    print(f"results written to {out}/{RESULTS_FILE}, {TABLE_FILE} and {PLOT_FILE}")


def _title(payload: dict[str, Any]) -> str:
    from gradsync.netem import NO_DELAY_NOTE, format_rate, parse_rate

    where = "loopback"
    if payload.get("hosts"):
        num_hosts = len({p["node"] for p in payload["placement"]})
        rate = payload.get("bandwidth")
        where = f"{num_hosts} emulated hosts, " + (
            f"{format_rate(parse_rate(rate))} links ({NO_DELAY_NOTE})" if rate else "unshaped"
        )
    return f"gradsync commbench: {payload['world_size']} ranks, gloo, {where}"


def plot(payload: dict[str, Any], path: Path) -> None:
    """Bus bandwidth against message size, one line per operation (and the link rate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gradsync.netem import parse_rate

    figure, axes = plt.subplots(figsize=(8, 5))
    for label in dict.fromkeys(_series(r) for r in payload["results"]):
        rows = [r for r in payload["results"] if _series(r) == label]
        axes.plot(
            [r["bytes"] for r in rows],
            [r["busbw_Bps"] * 8 / 1e9 for r in rows],
            marker="o",
            label=label,
        )
    if payload.get("bandwidth"):
        link = parse_rate(payload["bandwidth"]) / 1e9
        axes.axhline(link, color="gray", linestyle="--", label=f"link rate {payload['bandwidth']}")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("message size (bytes)")
    axes.set_ylabel("bus bandwidth (Gbit/s)")
    axes.set_title(_title(payload), fontsize=9)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _series(row: dict[str, Any]) -> str:
    """A result row's operation, with the compute between calls if there was any."""
    busy = row.get("busy_s", 0.0)
    return f"{row['op']} (busy {busy * 1e3:g} ms)" if busy else row["op"]


def _size(num_bytes: int) -> str:
    for unit, scale in (("GB", 1024**3), ("MB", 1024**2), ("KB", 1024)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:g} {unit}"
    return f"{num_bytes} B"


def sizes_from(
    sizes: Sequence[int] | None, min_bytes: int, max_bytes: int, factor: int
) -> tuple[int, ...]:
    """The sizes given, or the sweep from ``min_bytes`` to ``max_bytes``."""
    return tuple(sizes) if sizes else tuple(size_sweep(min_bytes, max_bytes, factor))
