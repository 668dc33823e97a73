"""The ranks meet before the process group exists, and check that they belong together.

Every rank connects to one TCP store at the master address (rank 0 hosts it) and writes
what it believes: its world size, its host, its gradsync and torch versions. Rank 0 reads
every rank's entry, compares them with its own and publishes one verdict; every rank then
raises the same one-line :class:`UserError` or goes on to build the process group on that
store. So a cluster user meets these as one clear line instead of a hang or a traceback:

- a master address that does not resolve;
- ranks started with different world sizes (two launches that do not match);
- ranks of two jobs that met at one address (two Slurm steps, two ``mpirun`` jobs on one
  port): the launchers' job identities differ;
- ranks started with different options (``--seed 3`` on one node, ``--seed 4`` on the
  other): the first option that differs is named;
- a node with another gradsync or torch version (the node is named);
- ranks that never arrive (the missing ranks are named);
- ``--device cuda`` where a rank has no GPU, or two ranks of a host share one (NCCL refuses
  that). Under ``--device auto`` the same finding puts every rank on the CPU instead: the
  ranks train on one device, which the verdict names (:func:`agreed_device`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradsync import __version__
from gradsync.errors import UserError
from gradsync.topology import RankEnv

KEY_PREFIX = "gradsync/rendezvous"
PROTOCOL = 2  # 2: entries carry the launch's identity and the run's settings
AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"  # set by torchrun when its agent hosts the store
_HOSTED_STORES: list[dist.Store] = []
_joined = False  # this process joined a process group (it is a rank)


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    """What one rank believes about the job and itself."""

    rank: int
    world_size: int
    host: str
    gradsync: str = __version__
    torch: str = torch.__version__
    wants: str = "cpu"  # --device as the rank was started: auto, cpu or cuda
    device: str = "cpu"  # what it can train on: "cuda" with a GPU of its own, else "cpu"
    gpu: str = ""  # that GPU's UUID
    job: str = ""  # the launcher's identity of the launch (RankEnv.job), "" where it has none
    settings: dict[str, Any] = field(default_factory=dict)  # what every rank must share
    protocol: int = 1  # what this entry holds; an entry without the field is of protocol 1

    @classmethod
    def from_json(cls, text: str | bytes) -> RankInfo:
        """An entry as a rank wrote it; fields a newer gradsync adds are left out.

        Example:
            >>> RankInfo.from_json('{"rank": 1, "world_size": 2, "host": "n1", "new": 0}').rank
            1
        """
        known = {item.name for item in fields(cls)}
        return cls(**{k: v for k, v in json.loads(text).items() if k in known})

    @classmethod
    def here(
        cls,
        env: RankEnv,
        *,
        wants: str = "cpu",
        device: str = "cpu",
        gpu: str = "",
        settings: dict[str, Any] | None = None,
    ) -> RankInfo:
        """This process's entry (the emulated host's name where there is one)."""
        host = os.environ.get("GRADSYNC_EMULATED_HOST") or socket.gethostname()
        return cls(
            rank=env.rank,
            world_size=env.world_size,
            host=host,
            wants=wants,
            device=device,
            gpu=gpu,
            job=env.job,
            settings=settings or {},
            protocol=PROTOCOL,
        )


def check_resolves(master_addr: str) -> None:
    """UserError (one line) when ``master_addr`` is not a name or address this node resolves.

    Example:
        >>> check_resolves("127.0.0.1")
        >>> # check_resolves("node-7")  # not in DNS or /etc/hosts:
        >>> # UserError: master address 'node-7' does not resolve on vm (Name or service ...
    """
    try:
        socket.getaddrinfo(master_addr, None)
    except (OSError, UnicodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise UserError(
            f"master address {master_addr!r} does not resolve on {socket.gethostname()} "
            f"({reason}); pass --master-addr (or MASTER_ADDR) with a name or IP address "
            "every node can resolve"
        ) from None


def disagreement(infos: Sequence[RankInfo]) -> str | None:
    """The first way the ranks disagree with rank 0 (``infos[0]``), or None.

    Example:
        >>> a = RankInfo(rank=0, world_size=2, host="n1", gradsync="0.1.0")
        >>> b = RankInfo(rank=1, world_size=2, host="n2", gradsync="0.2.0")
        >>> disagreement([a, b]).split(";")[0]
        'node n2 (rank 1) runs gradsync 0.2.0 but rank 0 on n1 runs gradsync 0.1.0'
    """
    first = infos[0]
    for info in infos[1:]:
        if info.world_size != first.world_size:
            return _world_size_message(first, info)
        for package in ("gradsync", "torch"):
            theirs, ours = getattr(info, package), getattr(first, package)
            if theirs != ours:
                return (
                    f"node {info.host} (rank {info.rank}) runs {package} {theirs} but rank 0 on "
                    f"{first.host} runs {package} {ours}; install the same {package} on every node"
                )
        if info.protocol != first.protocol:
            return (
                f"node {info.host} (rank {info.rank}) runs a gradsync of rendezvous protocol "
                f"{info.protocol} but rank 0 on {first.host} one of {first.protocol}; install the "
                "same gradsync on every node"
            )
        if info.job != first.job:
            return (
                f"rank {info.rank} on {info.host} belongs to {info.job or 'another launch'} but "
                f"rank 0 on {first.host} to {first.job or 'another launch'}: two jobs met at one "
                "rendezvous address; give each job its own --master-port (or MASTER_PORT)"
            )
        if differs := first_difference(first.settings, info.settings):
            key, ours, theirs = differs
            return (
                f"rank {info.rank} on {info.host} was started with {key} {theirs}, rank 0 on "
                f"{first.host} with {ours}; start every rank with the same options"
            )
    return None


def first_difference(ours: dict[str, Any], theirs: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """The first key (sorted) whose value differs between two ranks' settings
    (:meth:`TrainConfig.shared_settings`, by flag), with both values; None when equal.

    Example:
        >>> first_difference({"--seed": 3, "--lr": 0.1}, {"--seed": 3, "--lr": 1})
        ('--lr', 0.1, 1)
    """
    for key in sorted(ours.keys() | theirs.keys()):
        if ours.get(key) != theirs.get(key):
            return key, ours.get(key), theirs.get(key)
    return None


def agreed_device(infos: Sequence[RankInfo]) -> tuple[str, str | None]:
    """The device every rank trains on, and the error when rank 0 asked for the GPUs
    (``--device cuda``) and they cannot be had: a rank without one, or two ranks of one host
    on the same GPU. Otherwise (``auto``) that finding means the CPU for every rank.

    Example:
        >>> a = RankInfo(rank=0, world_size=2, host="n1", wants="auto", device="cuda", gpu="G0")
        >>> b = RankInfo(rank=1, world_size=2, host="n1", wants="auto", device="cuda", gpu="G0")
        >>> agreed_device([a, b])
        ('cpu', None)
        >>> from dataclasses import replace
        >>> agreed_device([a, replace(b, gpu="G1")])
        ('cuda', None)
    """
    reason = _gpu_conflict(infos)
    if reason is None:
        return "cuda", None
    if infos[0].wants != "cuda":
        return "cpu", None
    return "cpu", (
        f"--device cuda gives each rank a GPU of its own, but {reason}; start one process per "
        "GPU (or set CUDA_VISIBLE_DEVICES per rank), or use --device cpu"
    )


def _gpu_conflict(infos: Sequence[RankInfo]) -> str | None:
    """Why the ranks cannot have a GPU each (a rank without one, two ranks of one host on
    the same GPU), or None when they can."""
    seen: dict[tuple[str, str], RankInfo] = {}
    for info in infos:
        if info.device != "cuda":
            return f"rank {info.rank} on {info.host} has no GPU"
        other = seen.setdefault((info.host, info.gpu), info)
        if other is not info:
            return f"ranks {other.rank} and {info.rank} on {info.host} share GPU {info.gpu}"
    return None


def gpu_fallback_note(infos: Sequence[RankInfo]) -> str | None:
    """The line rank 0 prints when ``auto`` leaves GPUs unused (some rank saw one, but the
    ranks cannot have one each), as the gradsync launcher does; None otherwise.

    Example:
        >>> a = RankInfo(rank=0, world_size=2, host="n1", wants="auto", device="cuda", gpu="G0")
        >>> b = RankInfo(rank=1, world_size=2, host="n1", wants="auto", device="cuda", gpu="G0")
        >>> print(gpu_fallback_note([a, b]))  # doctest: +ELLIPSIS
        gradsync: training on the CPU over Gloo: ranks 0 and 1 on n1 share GPU G0 (see ...)
    """
    if infos[0].wants == "cuda" or not any(info.device == "cuda" for info in infos):
        return None
    reason = _gpu_conflict(infos)
    return (
        reason and f"gradsync: training on the CPU over Gloo: {reason} (see Devices in the README)"
    )


def _world_size_message(first: RankInfo, other: RankInfo) -> str:
    return (
        f"ranks disagree on the world size: rank 0 on {first.host} was started with "
        f"{first.world_size} ranks, rank {other.rank} on {other.host} with {other.world_size}; "
        "start every rank from one launch (the same -n / --nproc-per-node × --nnodes)"
    )


def rendezvous(
    env: RankEnv, timeout: timedelta, *, info: RankInfo | None = None, refusal: str = ""
) -> tuple[dist.Store, str]:
    """Meet the other ranks at ``env.master_addr:master_port``; once all agree, the store
    and the device every rank trains on (:func:`agreed_device`). Rank 0's ``refusal`` (why
    the job cannot run, e.g. its ``--out`` is taken) is every rank's one-line error.

    Example:
        >>> # store, device = rendezvous(env, timedelta(seconds=60))
        >>> # dist.init_process_group("gloo", store=store, rank=env.rank, world_size=...)
    """
    info = info or RankInfo.here(env)
    check_resolves(env.master_addr)
    store = _connect(env, timeout)
    if env.rank == 0:
        # The store's server lives as long as this process, not as this object: the other
        # ranks may still be reading the verdict when rank 0 raises it or moves on.
        _HOSTED_STORES.append(store)
    prefix = _prefix(env)
    store.set(f"{prefix}/rank{env.rank}", json.dumps(asdict(info)))
    if env.rank == 0:
        verdict = _verdict(store, prefix, info, timeout, refusal=refusal)
        store.set(f"{prefix}/verdict", json.dumps(verdict))
    verdict = json.loads(_get(store, f"{prefix}/verdict", env, timeout))
    if verdict["error"]:
        raise UserError(verdict["error"])
    leader = RankInfo.from_json(json.dumps(verdict["leader"]))
    if leader.world_size != info.world_size:  # a rank rank 0 does not know of
        raise UserError(_world_size_message(leader, info))
    return store, verdict["device"]


def join_process_group(env: RankEnv, timeout: timedelta, *, info: RankInfo | None = None) -> str:
    """:func:`rendezvous`, then the default process group on the same store; returns the
    device the ranks agreed on. On GPUs, CUDA tensors travel over NCCL and the CPU tensors
    of gradsync's own bookkeeping (probes, RNG states, objects) over Gloo, in the same groups.

    Example:
        >>> # device = join_process_group(env, timedelta(seconds=300))  # "cpu": Gloo only
    """
    global _joined
    store, device = rendezvous(env, timeout, info=info)
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    dist.init_process_group(
        backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout
    )
    _joined = True
    return device


def finish_process(code: int) -> int:
    """``code``, or, in a process that joined a process group, exit with it at once.

    A rank skips the interpreter's teardown. A Gloo worker thread may still be releasing its
    last collective when the main thread moves on; dropping a C++ reference to a tensor
    that Python also holds decrefs its Python object (torch 2.13's ``intrusive_ptr``), which
    needs the GIL, and taking the GIL during teardown aborts the process (SIGABRT,
    "terminate called without an active exception", seen on rank 1 right after the final
    barrier). A rank's results are on disk before this point; its output is flushed here.

    Example:
        >>> finish_process(0)  # this process never joined a process group
        0
    """
    if not _joined:
        return code
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone, or a stream closed
            stream.flush()
    os._exit(code)


def listen_socket(master_addr: str, port: int) -> socket.socket:
    """A TCP socket bound to ``master_addr:port`` itself, never to the wildcard address.

    A local job's store thus listens on loopback only, and a multi-node job's on the one
    interface the other nodes were told to reach (security: the rendezvous has no
    authentication, so it should not listen where nobody needs to reach it).

    Example:
        >>> with listen_socket("127.0.0.1", 0) as sock:
        ...     sock.getsockname()[0]
        '127.0.0.1'
    """
    family, kind, proto, _, address = socket.getaddrinfo(
        master_addr, port, type=socket.SOCK_STREAM
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def _connect(env: RankEnv, timeout: timedelta) -> dist.TCPStore:
    where = f"{env.master_addr}:{env.master_port}"
    # Under torchrun the agent already hosts the store on the master port; ranks join it.
    hosts_store = env.rank == 0 and os.environ.get(AGENT_STORE, "").lower() != "true"
    try:
        listen_fd = None
        if hosts_store:  # the store's server listens on the master address only
            listen_fd = listen_socket(env.master_addr, env.master_port).detach()
        else:  # wait here, quietly: the C++ client logs a stack trace per failed try
            wait_until_listening(env.master_addr, env.master_port, timeout)
        return dist.TCPStore(
            env.master_addr,
            env.master_port,
            is_master=hosts_store,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listen_fd,
        )
    except (RuntimeError, OSError) as error:
        first_line = (str(error).strip().splitlines() or ["no message"])[0]
        action = "listen on" if env.rank == 0 else "reach the rendezvous at"
        raise UserError(
            f"rank {env.rank} could not {action} {where} within {timeout.total_seconds():g} s "
            f"({first_line[:200]}); check --master-addr/--master-port (and that rank 0 runs)"
        ) from None


def wait_until_listening(host: str, port: int, timeout: timedelta, *, poll_s: float = 0.2) -> None:
    """Return once ``host:port`` accepts a TCP connection; raise :class:`OSError` (the last
    connection error) after ``timeout``. A rank that starts before rank 0 waits here rather
    than in the C++ store client, which logs a 40-line stack trace on every failed try and
    tries twice (twice the timeout).

    Example:
        >>> with listen_socket("127.0.0.1", 0) as sock:
        ...     sock.listen()
        ...     wait_until_listening("127.0.0.1", sock.getsockname()[1], timedelta(seconds=1))
    """
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(left, 5.0))):
                return
        except OSError:
            if time.monotonic() + poll_s >= deadline:
                raise
        time.sleep(poll_s)


def _verdict(
    store: dist.Store, prefix: str, first: RankInfo, timeout: timedelta, *, refusal: str = ""
) -> dict[str, object]:
    """Rank 0's verdict once every rank's entry is in (or the wait timed out): the first
    error (its own ``refusal`` first), rank 0's entry, the device they train on."""
    keys = [f"{prefix}/rank{r}" for r in range(first.world_size)]
    try:
        store.wait(keys, timeout)
    except RuntimeError:
        missing = [str(r) for r, key in enumerate(keys) if not store.check([key])]
        error = (
            f"rank(s) {', '.join(missing)} of {first.world_size} did not reach the "
            f"rendezvous within {timeout.total_seconds():g} s; start every rank (or pass "
            "--timeout with more seconds)"
        )
        if beyond := _rank_beyond(store, prefix, first.world_size):  # a launch with a larger world
            error = _world_size_message(first, beyond)
        return {"error": refusal or error, "leader": asdict(first), "device": "cpu"}
    if refusal:  # no device to agree on: nothing will train
        return {"error": refusal, "leader": asdict(first), "device": "cpu"}
    infos = [RankInfo.from_json(store.get(key)) for key in keys]
    device, error = agreed_device(infos)
    note = gpu_fallback_note(infos)
    if note:
        print(note, file=sys.stderr, flush=True)
    return {"error": disagreement(infos) or error, "leader": asdict(first), "device": device}


def _prefix(env: RankEnv) -> str:
    """The rendezvous keys' prefix, one per attempt of the launch (:attr:`RankEnv.attempt`):
    torchrun's agent keeps its store across a restart of the ranks (``--max-restarts``), so
    a restarted rank must never read the previous attempt's verdict."""
    return f"{KEY_PREFIX}/attempt{env.attempt}"


BEYOND_FACTOR = 4  # ranks looked for beyond rank 0's world: up to a 4× larger launch


def _rank_beyond(store: dist.Store, prefix: str, world_size: int) -> RankInfo | None:
    """The entry of a rank outside rank 0's world that came to its store, if any (ranks
    started with a larger world size: their ranks 0..n-1 may never come)."""
    for rank in range(world_size, BEYOND_FACTOR * world_size + BEYOND_FACTOR):
        key = f"{prefix}/rank{rank}"
        if store.check([key]):
            return RankInfo.from_json(store.get(key))
    return None


def _get(store: dist.Store, key: str, env: RankEnv, timeout: timedelta) -> bytes:
    try:
        return store.get(key)
    except RuntimeError:
        raise UserError(
            f"rank {env.rank} waited {timeout.total_seconds():g} s at "
            f"{env.master_addr}:{env.master_port} for rank 0's check of the ranks; "
            "rank 0 did not answer (is every rank started with the same world size?)"
        ) from None


__all__ = [
    "RankInfo",
    "agreed_device",
    "check_resolves",
    "disagreement",
    "finish_process",
    "first_difference",
    "join_process_group",
    "rendezvous",
]
