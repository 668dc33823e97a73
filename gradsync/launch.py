"""Local launcher: spawn the ranks of this node, watch them, fail fast, tear down.

If any rank exits non-zero, the others are terminated at once and the job fails with a
message naming the rank and quoting its last stderr lines, well inside 30 s. When several
fail, the cause is the earliest, and a rank whose own error is a lost connection is a victim
of another's death, not the cause. Every rank heartbeats through a pipe
(:mod:`gradsync.heartbeat`); a rank silent longer than the hang timeout is named with its
last phase and step and the job is torn down. Children are also asked to die with the
launcher (``PR_SET_PDEATHSIG``), so nothing is left orphaned.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import random
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

from gradsync.config import LaunchConfig, TrainConfig
from gradsync.devices import resolve as resolve_device
from gradsync.devices import visible_gpus
from gradsync.errors import JobFailed, UserError
from gradsync.files import atomic_write_text
from gradsync.heartbeat import ENV_FD, LastBeat
from gradsync.netem import EmulatedHosts, parse_rate, place_ranks
from gradsync.signals import signals_deferred
from gradsync.strategies import world_size_of
from gradsync.topology import DEFAULT_PORT, default_threads

STDERR_TAIL_LINES = 15
TERMINATE_GRACE_S = 5.0
USER_ERROR_PREFIX = "gradsync: error: "
STOPPED_PREFIX = "gradsync: stopped: "  # a rank's one-line reason to end the run (exit 1)
# A rank whose peer stopped first: the peer's own line says why (kept in failure.txt).
VICTIM_PREFIX = "gradsync: stopped after a peer: "
OVERSUBSCRIBED = 4  # local ranks per core above which the launcher warns
HANG_STEP_FACTOR = 5  # a rank may be silent for this many of its slowest steps
FIRST_STEP_FACTOR = 5  # … and this many hang timeouts before its first step is done
STARTING = ("startup", "rendezvous")  # phases the rendezvous timeout watches instead
VICTIM_GRACE_S = 1.0  # how long a lost connection waits for its cause to exit
# What a rank prints when a peer died under it: it is a victim, not the cause.
LOST_CONNECTION = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "ECONNRESET",
    "Connection refused",
    "connection closed",
)


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
    last_beat: LastBeat = field(default_factory=lambda: LastBeat(at=time.monotonic()))
    exited_at: float | None = None

    def describe_exit(self) -> str:
        code = self.popen.returncode
        if code is not None and code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        if code is not None and code > 128:
            with contextlib.suppress(ValueError):  # 128 + N: the rank was stopped by signal N
                return f"exited with code {code} (stopped by {signal.Signals(code - 128).name})"
        return f"exited with code {code}"

    def lost_connection(self) -> bool:
        """Whether this rank's own error is a connection a dead peer closed (a victim)."""
        return any(is_lost_connection(line) for line in self.tail)


def is_lost_connection(text: str) -> bool:
    """Whether ``text`` (an error) says a peer closed or refused the connection.

    Example:
        >>> is_lost_connection("pair.cc:553] Connection closed by peer"), is_lost_connection("x")
        (True, False)
    """
    return any(marker in text for marker in LOST_CONNECTION)


EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
PORT_TRIES = 100


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host``, below the kernel's ephemeral range.

    Binding port 0 would give a port from that range, which the kernel also hands out as
    the source port of outgoing connections. A rank that connects to the rendezvous port
    before its master listens could then get it as its own source port and connect to
    itself, or take the port from the master. Ports below the range are never handed out.

    Example:
        >>> free_port() < ephemeral_range()[0]
        True
    """
    low = ephemeral_range()[0]
    candidates = range(max(1024, low - 16384), low)
    for port in random.sample(candidates, min(PORT_TRIES, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # all taken: any port
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections (Linux's default where
    it cannot be read)."""
    try:
        low, high = (int(part) for part in EPHEMERAL_PORTS.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


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
    if world_size is None:
        assert isinstance(config, TrainConfig), "pass world_size for a job other than training"
        world_size = world_size_of(config)
        config = _decide_device(config)
    launch = config.launch
    if world_size % launch.num_nodes:
        workers = getattr(config, "workers", world_size)
        servers = world_size - workers
        fix = (
            f"choose --workers and --servers so their sum ({workers} + {servers}) is a "
            "multiple of --nnodes, or --colocate the servers in the workers"
            if servers
            else "choose --workers as a multiple of --nnodes"
        )
        raise UserError(
            f"{world_size} ranks do not divide over --nnodes {launch.num_nodes}: every node "
            f"starts as many ranks; {fix}"
        )
    local_size = world_size // launch.num_nodes
    placement = None
    if launch.hosts:
        placement = place_ranks(world_size, launch.hosts, launch.ranks_per_host)
    port = _master_port(launch, emulated=placement is not None)
    threads = launch.threads or default_threads(local_size)
    _warn_if_oversubscribed(local_size)
    if placement is not None:
        # Emulated hosts share this machine's cores: pin threads for all local ranks.
        config = dataclasses.replace(config, launch=dataclasses.replace(launch, threads=threads))
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / f".launch-node{launch.node_rank}.json"
    atomic_write_text(config_path, config.to_json())
    base_env = _job_environment(launch.master_addr, port, world_size, local_size, threads)
    network = (
        EmulatedHosts(max(placement) + 1, launch.bandwidth and parse_rate(launch.bandwidth))
        if placement is not None
        else contextlib.nullcontext()
    )
    stdout: IO[bytes] | None = open(log_file, "ab") if log_file else None  # noqa: SIM115
    ranks: list[RankProcess] = []
    ranks_path = out / f"ranks-node{launch.node_rank}.json"
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
                ranks.append(_spawn(rank, _role(rank, config.workers), argv, env, stdout))
            atomic_write_text(
                ranks_path, json.dumps({str(r.rank): r.popen.pid for r in ranks}) + "\n"
            )
            try:
                _watch(ranks, hang_timeout_s=launch.hang_timeout_s)
            finally:
                _terminate(ranks)  # before the namespaces go
    finally:
        try:
            _terminate(ranks)
        finally:  # also when a held signal or Ctrl-C ends the terminating
            if stdout is not None:
                stdout.close()
            config_path.unlink(missing_ok=True)
            ranks_path.unlink(missing_ok=True)


def _decide_device(config: TrainConfig) -> TrainConfig:
    """``config`` on the device every local rank trains on; says why when GPUs go unused."""
    decided = resolve_device(config)
    if config.launch.device == "auto" and decided.launch.device == "cpu" and visible_gpus():
        print(
            f"gradsync: training on the CPU over Gloo: {config.strategy} with "
            f"{world_size_of(config) // config.launch.num_nodes} ranks on this node cannot "
            "have a GPU per rank here (see Devices in the README)",
            file=sys.stderr,
            flush=True,
        )
    return decided


def _master_port(launch: LaunchConfig, *, emulated: bool) -> int:
    """The rendezvous port: the given one (checked free on node 0), a free one for a local
    job, the default on emulated hosts (a fresh namespace has every port free) and for
    multi-node jobs (every node must agree without talking)."""
    if emulated:
        return launch.master_port or DEFAULT_PORT
    if launch.master_port is not None:
        if launch.node_rank == 0:
            check_port_free(launch.master_addr, launch.master_port)
        return launch.master_port
    return free_port(launch.master_addr) if launch.num_nodes == 1 else DEFAULT_PORT


def _job_environment(
    master_addr: str, port: int, world_size: int, local_size: int, threads: int
) -> dict[str, str]:
    """The environment every rank of this node starts with (RANK and LOCAL_RANK added)."""
    env = {
        **os.environ,
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port),
        "GRADSYNC_LAUNCHER": "gradsync",
        "OMP_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
    }
    if master_addr in ("127.0.0.1", "localhost"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def _role(rank: int, workers: int) -> str:
    """Ranks after the workers are a strategy's dedicated servers."""
    return "worker" if rank < workers else f"server {rank - workers}"


def _spawn(
    rank: int, role: str, argv: list[str], env: dict[str, str], stdout: IO[bytes] | None
) -> RankProcess:
    """Start one rank with a heartbeat pipe; readers follow its stderr and its beats."""
    beat_read, beat_write = os.pipe()
    try:
        popen = subprocess.Popen(
            argv,
            env={**env, ENV_FD: str(beat_write)},
            stdout=stdout,
            stderr=subprocess.PIPE,
            pass_fds=(beat_write,),
            preexec_fn=_die_with_parent,
        )
    except BaseException:
        os.close(beat_read)
        raise
    finally:
        os.close(beat_write)  # the child holds it; EOF here once the child is gone
    process = RankProcess(rank, popen, role=role)
    _start_beat_reader(process, beat_read)
    return _start_reader(process, echo=stdout is None)


def _start_beat_reader(process: RankProcess, fd: int) -> None:
    def pump() -> None:
        with open(fd, "rb") as beats:
            for raw in beats:
                process.last_beat.update(raw.decode(errors="replace"), time.monotonic())

    threading.Thread(target=pump, daemon=True).start()


def _warn_if_oversubscribed(local_size: int) -> None:
    """Warn, with the arithmetic, when the ranks far outnumber this machine's cores."""
    cores = os.cpu_count() or 1
    if local_size > OVERSUBSCRIBED * cores:
        print(
            f"gradsync: warning: {local_size} ranks on {cores} core(s) is "
            f"{local_size / cores:.3g} ranks per core (more than {OVERSUBSCRIBED}); each step "
            "waits for every rank in turn, so expect slow steps (and raise --hang-timeout)",
            file=sys.stderr,
            flush=True,
        )


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
            # A rank's user error is reported once, by the launcher's caller; a victim's
            # line is noise beside its cause's.
            if echo and not line.startswith((USER_ERROR_PREFIX, STOPPED_PREFIX, VICTIM_PREFIX)):
                print(f"[rank {process.rank}] {line}", file=sys.stderr, flush=True)

    process.reader = threading.Thread(target=pump, daemon=True)
    process.reader.start()
    return process


def _watch(ranks: list[RankProcess], *, hang_timeout_s: float, poll_s: float = 0.05) -> None:
    """Return when every rank exited 0; raise on the first rank that failed or hung."""
    while True:
        now = time.monotonic()
        for rank in ranks:
            if rank.exited_at is None and rank.popen.poll() is not None:
                rank.exited_at = now
        failed = [r for r in ranks if r.popen.returncode not in (None, 0)]
        if failed and _cause_is_known(failed, now):
            first = min(failed, key=_blame_order)
            frozen = _stopped_rank(ranks)  # the others timed out waiting for it
            _terminate(ranks)
            if frozen is not None:
                raise _stopped_failure(frozen, first)
            raise _failure(first, victims=[r for r in failed if r is not first])
        if all(r.popen.returncode == 0 for r in ranks):
            return
        if hung := _silent_rank(ranks, hang_timeout_s, now):
            message = _hang_message(hung, ranks, hang_timeout_s, now)
            _terminate(ranks)
            raise JobFailed(message, cause=message.split(";")[0])
        time.sleep(poll_s)


def _blame_order(rank: RankProcess) -> tuple[bool, float, bool, int]:
    """Causes before victims, then the earliest exit, then a signal before exit 1."""
    return (rank.lost_connection(), rank.exited_at or 0.0, rank.popen.returncode == 1, rank.rank)


def _cause_is_known(failed: list[RankProcess], now: float) -> bool:
    """A victim (lost connection) alone waits a moment for its cause to exit too."""
    if not all(r.lost_connection() for r in failed):
        return True
    return now - min(r.exited_at or now for r in failed) >= VICTIM_GRACE_S


def _silent_rank(ranks: list[RankProcess], hang_timeout_s: float, now: float) -> RankProcess | None:
    """The rank to blame when one has been silent too long, or None.

    The limit is ``hang_timeout_s``, or several of the slowest step seen when that is longer
    (more before a rank's first step is done).
    Ranks still starting (importing) or meeting at the rendezvous are left to the
    rendezvous's own timeout, which names the ranks that never arrived. Among the silent, a
    stopped process comes first, then a rank busy in its own work (not waiting for peers),
    then the least advanced, then the one silent longest.
    """
    alive = [r for r in ranks if r.popen.returncode is None and r.last_beat.phase not in STARTING]
    slowest = max((r.last_beat.slowest_step_s for r in ranks), default=0.0)
    limit = max(hang_timeout_s, HANG_STEP_FACTOR * slowest)
    # Before its first step is done, a rank builds the model, probes it and warms up: it
    # gets FIRST_STEP_FACTOR times the limit (a hang there is still named, later).
    if not any(
        now - r.last_beat.at > (limit if r.last_beat.step >= 1 else FIRST_STEP_FACTOR * limit)
        for r in alive
    ):
        return None
    return min(
        alive,
        key=lambda r: (
            _process_state(r.popen.pid) not in ("T", "t"),
            r.last_beat.waiting,
            r.last_beat.step,
            r.last_beat.at,
        ),
    )


def _stopped_rank(ranks: list[RankProcess]) -> RankProcess | None:
    """A rank still running whose process is stopped (SIGSTOP, a debugger), or None."""
    running = [r for r in ranks if r.popen.poll() is None]
    return next((r for r in running if _process_state(r.popen.pid) in ("T", "t")), None)


def _stopped_failure(frozen: RankProcess, first: RankProcess) -> JobFailed:
    """A rank failed while another was stopped: the stopped one is the cause, the failed
    one (a collective that timed out waiting for it) its victim."""
    cause = f"rank {frozen.rank} ({frozen.role}, pid {frozen.popen.pid}) is stopped (SIGSTOP?)"
    return JobFailed(
        f"{cause}, last seen in {frozen.last_beat.describe()}; rank {first.rank} "
        f"{first.describe_exit()} waiting for it (--timeout); the job was torn down",
        cause=cause,
    )


def _hang_message(
    hung: RankProcess, ranks: list[RankProcess], hang_timeout_s: float, now: float
) -> str:
    state = _process_state(hung.popen.pid)
    how = {"T": "; its process is stopped (SIGSTOP?)", "t": "; it is stopped by a debugger"}
    others = [
        f"rank {r.rank} in {r.last_beat.describe()}"
        for r in ranks
        if r is not hung and r.popen.returncode is None
    ]
    return (
        f"rank {hung.rank} ({hung.role}, pid {hung.popen.pid}) hung: no heartbeat for "
        f"{now - hung.last_beat.at:.0f} s (--hang-timeout {hang_timeout_s:g} s), last seen in "
        f"{hung.last_beat.describe()}{how.get(state, '')}; "
        + (f"the others waited ({', '.join(others)}); " if others else "")
        + "the job was torn down (raise --hang-timeout if a step legitimately takes longer)"
    )


def _process_state(pid: int) -> str:
    """The one-letter state of ``pid`` from /proc (R, S, T, …), or '' when unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[0]


def _failure(rank: RankProcess, victims: list[RankProcess] | None = None) -> Exception:
    if rank.reader is not None:
        rank.reader.join(timeout=2)
    user_errors = [line for line in rank.tail if line.startswith(USER_ERROR_PREFIX)]
    if rank.popen.returncode == 2 and user_errors:
        return UserError(user_errors[-1].removeprefix(USER_ERROR_PREFIX))
    tail = "\n".join(f"  {line}" for line in rank.tail) or "  (no stderr output)"
    cause = f"rank {rank.rank} ({rank.role}, pid {rank.popen.pid}) {rank.describe_exit()}"
    stopped = [line for line in rank.tail if line.startswith(STOPPED_PREFIX)]
    if stopped:  # the rank said why in one line (e.g. a loss that is not finite)
        return JobFailed(stopped[-1].removeprefix(STOPPED_PREFIX), cause=cause, final=True)
    lost = [r.rank for r in victims or [] if r.lost_connection()]
    aftermath = (
        f" (rank(s) {', '.join(map(str, lost))} then lost their connection to it)" if lost else ""
    )
    return JobFailed(f"{cause}{aftermath}; its last stderr lines:\n{tail}", cause=cause)


def _terminate(ranks: list[RankProcess]) -> None:
    """Stop every rank still running (SIGTERM, SIGKILL after a grace period). A SIGTERM
    or SIGHUP that arrives meanwhile is held until every rank is gone, so an impatient
    second signal cannot leave ranks running."""
    with signals_deferred():
        _stop_ranks(ranks)


def _stop_ranks(ranks: list[RankProcess]) -> None:
    alive = [r for r in ranks if r.popen.poll() is None]
    for rank in alive:
        with contextlib.suppress(ProcessLookupError):
            rank.popen.terminate()
            rank.popen.send_signal(signal.SIGCONT)  # a stopped rank then handles its SIGTERM
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
