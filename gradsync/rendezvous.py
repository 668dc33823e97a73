"""The ranks meet before the process group exists, and check that they belong together.

Every rank connects to one TCP store at the master address (rank 0 hosts it) and writes
what it believes: its world size, its host, its gradsync and torch versions. Rank 0 reads
every rank's entry, compares them with its own and publishes one verdict; every rank then
raises the same one-line :class:`UserError` or goes on to build the process group on that
store. So a cluster user meets these as one clear line instead of a hang or a traceback:

- a master address that does not resolve;
- ranks started with different world sizes (two launches that do not match);
- a node with another gradsync or torch version (the node is named);
- ranks that never arrive (the missing ranks are named).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from gradsync import __version__
from gradsync.errors import UserError
from gradsync.topology import RankEnv

KEY_PREFIX = "gradsync/rendezvous"
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

    @classmethod
    def here(cls, env: RankEnv) -> RankInfo:
        """This process's entry (the emulated host's name where there is one)."""
        host = os.environ.get("GRADSYNC_EMULATED_HOST") or socket.gethostname()
        return cls(rank=env.rank, world_size=env.world_size, host=host)


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
    return None


def _world_size_message(first: RankInfo, other: RankInfo) -> str:
    return (
        f"ranks disagree on the world size: rank 0 on {first.host} was started with "
        f"{first.world_size} ranks, rank {other.rank} on {other.host} with {other.world_size}; "
        "start every rank from one launch (the same -n / --nproc-per-node × --nnodes)"
    )


def rendezvous(env: RankEnv, timeout: timedelta, *, info: RankInfo | None = None) -> dist.Store:
    """Meet the other ranks at ``env.master_addr:master_port``; the store once all agree.

    Example:
        >>> # store = rendezvous(env, timedelta(seconds=60))
        >>> # dist.init_process_group("gloo", store=store, rank=env.rank, world_size=...)
    """
    info = info or RankInfo.here(env)
    check_resolves(env.master_addr)
    store = _connect(env, timeout)
    if env.rank == 0:
        # The store's server lives as long as this process, not as this object: the other
        # ranks may still be reading the verdict when rank 0 raises it or moves on.
        _HOSTED_STORES.append(store)
    store.set(f"{KEY_PREFIX}/rank{env.rank}", json.dumps(asdict(info)))
    if env.rank == 0:
        store.set(f"{KEY_PREFIX}/verdict", json.dumps(_verdict(store, info, timeout)))
    verdict = json.loads(_get(store, f"{KEY_PREFIX}/verdict", env, timeout))
    if verdict["error"]:
        raise UserError(verdict["error"])
    leader = RankInfo(**verdict["leader"])
    if leader.world_size != info.world_size:  # a rank rank 0 does not know of
        raise UserError(_world_size_message(leader, info))
    return store


def join_process_group(backend: str, env: RankEnv, timeout: timedelta) -> None:
    """:func:`rendezvous`, then the default process group on the same store.

    Example:
        >>> # join_process_group("gloo", env, timedelta(seconds=300))
    """
    global _joined
    store = rendezvous(env, timeout)
    dist.init_process_group(
        backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout
    )
    _joined = True


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
            f"rank {env.rank} could not {action} {where} within {timeout.total_seconds():.0f} s "
            f"({first_line[:200]}); check --master-addr/--master-port (and that rank 0 runs)"
        ) from None


def _verdict(store: dist.Store, first: RankInfo, timeout: timedelta) -> dict[str, object]:
    keys = [f"{KEY_PREFIX}/rank{r}" for r in range(first.world_size)]
    try:
        store.wait(keys, timeout)
    except RuntimeError:
        missing = [str(r) for r, key in enumerate(keys) if not store.check([key])]
        return {
            "error": f"rank(s) {', '.join(missing)} of {first.world_size} did not reach the "
            f"rendezvous within {timeout.total_seconds():.0f} s; start every rank (or pass "
            "--timeout with more seconds)",
            "leader": asdict(first),
        }
    infos = [RankInfo(**json.loads(store.get(key))) for key in keys]
    return {"error": disagreement(infos), "leader": asdict(first)}


def _get(store: dist.Store, key: str, env: RankEnv, timeout: timedelta) -> bytes:
    try:
        return store.get(key)
    except RuntimeError:
        raise UserError(
            f"rank {env.rank} waited {timeout.total_seconds():.0f} s at "
            f"{env.master_addr}:{env.master_port} for rank 0's check of the ranks; "
            "rank 0 did not answer (is every rank started with the same world size?)"
        ) from None


__all__ = [
    "RankInfo",
    "check_resolves",
    "disagreement",
    "finish_process",
    "join_process_group",
    "rendezvous",
]
