"""Local launcher: spawn the ranks of this node, watch them, fail fast, tear down.

If any rank exits non-zero, the others are terminated at once and the job fails with a
message naming the rank and quoting its last stderr lines, well inside 30 s. Children are
also asked to die with the launcher (``PR_SET_PDEATHSIG``), so nothing is left orphaned.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from gradsync.checkpoint import atomic_write_text
from gradsync.config import LaunchConfig, TrainConfig
from gradsync.errors import JobFailed, UserError
from gradsync.netem import EmulatedHosts, parse_rate, place_ranks
from gradsync.strategies import world_size_of
from gradsync.topology import DEFAULT_PORT, default_threads

STDERR_TAIL_LINES = 15
TERMINATE_GRACE_S = 5.0
USER_ERROR_PREFIX = "gradsync: error: "


class Job(Protocol):
    """Any job config the launcher can start: the runtime dispatches on its ``kind``."""

    @property
    def launch(self) -> LaunchConfig: ...
    @property
    def out(self) -> str: ...
    def to_json(self) -> str: ...


@dataclass
class RankProcess:
    """One child process and the tail of its stderr."""

    rank: int
    popen: subprocess.Popen[bytes]
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=STDERR_TAIL_LINES))
    reader: threading.Thread | None = None
    role: str = "worker"

    def describe_exit(self) -> str:
        code = self.popen.returncode
        if code is not None and code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_port_free(host: str, port: int) -> None:
    """UserError when ``port`` cannot be bound on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as error:
            raise UserError(
                f"--master-port {port} on {host} is not usable ({error.strerror}); "
                "pick a free port or omit --master-port to choose one"
            ) from None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def launch_local(
    config: TrainConfig | Job, *, log_file: Path | None = None, world_size: int | None = None
) -> None:
    """Run this node's ranks of ``config`` as child processes and wait for all of them.

    ``config`` is a training job, or any job config the runtime knows (``kind``, ``launch``,
    ``out``, ``to_json``; e.g. commbench's) with its ``world_size`` given. With
    ``config.launch.hosts`` the ranks run on emulated hosts (:mod:`gradsync.netem`).
    ``log_file`` receives the ranks' stdout instead of the terminal (used by verify/demo).
    Raises JobFailed when a rank fails; a rank's UserError becomes a UserError here.

    Example:
        >>> # launch_local(TrainConfig(model="mnist-cnn", preset="tiny", strategy="ddp", workers=2))
    """
    launch = config.launch
    if world_size is None:
        assert isinstance(config, TrainConfig), "pass world_size for a job other than training"
        world_size = world_size_of(config)
    if world_size % launch.num_nodes:
        raise UserError(f"{world_size} ranks do not divide over --nnodes {launch.num_nodes}")
    local_size = world_size // launch.num_nodes
    placement = None
    if launch.hosts:
        placement = place_ranks(world_size, launch.hosts, launch.ranks_per_host)
    if placement is not None:
        port = launch.master_port or DEFAULT_PORT  # a fresh namespace has every port free
    elif launch.master_port is not None:
        port = launch.master_port
        if launch.node_rank == 0:
            check_port_free(launch.master_addr, port)
    else:
        port = free_port(launch.master_addr) if launch.num_nodes == 1 else DEFAULT_PORT
    threads = launch.threads or default_threads(local_size)
    if placement is not None:
        # Emulated hosts share this machine's cores: pin threads for all local ranks.
        config = dataclasses.replace(config, launch=dataclasses.replace(launch, threads=threads))
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / f".launch-node{launch.node_rank}.json"
    atomic_write_text(config_path, config.to_json())
    base_env = {
        **os.environ,
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_size),
        "MASTER_ADDR": launch.master_addr,
        "MASTER_PORT": str(port),
        "GRADSYNC_LAUNCHER": "gradsync",
        "OMP_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
    }
    if launch.master_addr in ("127.0.0.1", "localhost"):
        base_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    network = (
        EmulatedHosts(max(placement) + 1, launch.bandwidth and parse_rate(launch.bandwidth))
        if placement is not None
        else contextlib.nullcontext()
    )
    stdout: IO[bytes] | None = open(log_file, "ab") if log_file else None  # noqa: SIM115
    ranks: list[RankProcess] = []
    try:
        with network as hosts:
            if hosts is not None:
                print(hosts.describe(), file=sys.stderr, flush=True)
            for local_rank in range(local_size):
                rank = launch.node_rank * local_size + local_rank
                env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(local_rank)}
                argv = [sys.executable, "-m", "gradsync.runtime", str(config_path)]
                if hosts is not None and placement is not None:
                    env.update(_emulated_host_env(hosts, placement, rank))
                    argv = hosts.exec_argv(placement[rank], argv)
                popen = subprocess.Popen(
                    argv,
                    env=env,
                    stdout=stdout,
                    stderr=subprocess.PIPE,
                    preexec_fn=_die_with_parent,
                )
                # Ranks after the workers are a strategy's dedicated servers (ps).
                role = "worker" if rank < config.workers else f"server {rank - config.workers}"
                process = RankProcess(rank, popen, role=role)
                ranks.append(_start_reader(process, echo=stdout is None))
            atomic_write_text(
                out / f"ranks-node{launch.node_rank}.json",
                json.dumps({str(r.rank): r.popen.pid for r in ranks}) + "\n",
            )
            try:
                _watch(ranks)
            finally:
                _terminate(ranks)  # before the namespaces go
    finally:
        _terminate(ranks)
        if stdout is not None:
            stdout.close()
        config_path.unlink(missing_ok=True)


def _emulated_host_env(hosts: EmulatedHosts, placement: list[int], rank: int) -> dict[str, str]:
    """A rank's view of its emulated host: it is one node, with its own local ranks."""
    host = placement[rank]
    on_host = [r for r, h in enumerate(placement) if h == host]
    return {
        **hosts.rank_env(host),
        "MASTER_ADDR": hosts.address(0),
        "LOCAL_RANK": str(on_host.index(rank)),
        "LOCAL_WORLD_SIZE": str(len(on_host)),
        "GROUP_RANK": str(host),  # torchrun's name for the node index
    }


def _start_reader(process: RankProcess, *, echo: bool) -> RankProcess:
    def pump() -> None:
        assert process.popen.stderr is not None
        for raw in process.popen.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            process.tail.append(line)
            # A rank's user error is reported once, by the launcher's caller.
            if echo and not line.startswith(USER_ERROR_PREFIX):
                print(f"[rank {process.rank}] {line}", file=sys.stderr, flush=True)

    process.reader = threading.Thread(target=pump, daemon=True)
    process.reader.start()
    return process


def _watch(ranks: list[RankProcess], poll_s: float = 0.05) -> None:
    """Return when every rank exited 0; raise on the first rank that did not."""
    while True:
        codes = [r.popen.poll() for r in ranks]
        failed = [r for r, code in zip(ranks, codes, strict=True) if code not in (None, 0)]
        if failed:
            first = min(failed, key=lambda r: (r.popen.returncode == 1, r.rank))
            _terminate(ranks)
            raise _failure(first)
        if all(code == 0 for code in codes):
            return
        time.sleep(poll_s)


def _failure(rank: RankProcess) -> Exception:
    if rank.reader is not None:
        rank.reader.join(timeout=2)
    user_errors = [line for line in rank.tail if line.startswith(USER_ERROR_PREFIX)]
    if rank.popen.returncode == 2 and user_errors:
        return UserError(user_errors[-1].removeprefix(USER_ERROR_PREFIX))
    tail = "\n".join(f"  {line}" for line in rank.tail) or "  (no stderr output)"
    return JobFailed(
        f"rank {rank.rank} ({rank.role}, pid {rank.popen.pid}) {rank.describe_exit()}; "
        f"its last stderr lines:\n{tail}"
    )


def _terminate(ranks: list[RankProcess]) -> None:
    alive = [r for r in ranks if r.popen.poll() is None]
    for rank in alive:
        with contextlib.suppress(ProcessLookupError):
            rank.popen.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for rank in alive:
        try:
            rank.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rank.popen.kill()
            rank.popen.wait()
    for rank in ranks:
        if rank.reader is not None:
            rank.reader.join(timeout=1)
