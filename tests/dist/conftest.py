"""Run a function on N ranks with real Gloo process groups on loopback.

Starting a process that imports torch costs more than a second of CPU, so the ranks are
kept alive between tests: one pool of N worker processes per world size, started on first
use. Every call gets a fresh TCP port and a fresh process group (created before the
function runs, destroyed after it), so tests stay independent::

    def _allreduce_one(rank, world_size):
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()

    def test_sum(run_ranks):
        assert run_ranks(2, _allreduce_one) == [2.0, 2.0]

The function must be defined at module level of a test file (the workers load that file
by path); it is called as ``fn(rank, world_size, *args)`` and its return values come back
as a list indexed by rank (plain data: tensors, numbers, strings, containers; not instances
of classes defined in the test file, which the parent cannot unpickle). An exception on any
rank fails the test with every failing rank's traceback (:class:`RankFailure`); a rank that
dies or a job that outlasts ``timeout`` seconds fails the test too, and the pool is torn
down and restarted for the next test, so a hang can never block the suite.

Protocol: the parent talks to each worker over the worker's stdin/stdout pipes with
``multiprocessing.connection`` frames; the worker moves its own stdout to stderr, which
goes to a log file whose tail is shown when a rank dies.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as connection_wait
from pathlib import Path
from typing import Any

import pytest

from gradsync.launch import free_port

DEFAULT_TIMEOUT_S = 30.0
HARNESS_MARGIN_S = 10.0  # beyond a job's collective timeout before the harness gives up
ERROR_GRACE_S = 3.0  # after one rank fails, how long the others get to report
START_TIMEOUT_S = 60.0


class RankFailure(AssertionError):
    """One or more ranks raised, died or timed out."""


class RankPool:
    """``world_size`` long-lived worker processes that run one job at a time."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"gradsync-dist{world_size}-"))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.readers: list[Connection] = []
        self.writers: list[Connection] = []
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": "lo",
            "PYTHONUNBUFFERED": "1",
        }
        for rank in range(world_size):
            log = open(self.log_dir / f"rank{rank}.log", "wb")  # noqa: SIM115
            proc = subprocess.Popen(
                [sys.executable, __file__, str(rank), str(world_size)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
            )
            log.close()
            assert proc.stdin is not None and proc.stdout is not None
            self.procs.append(proc)
            self.readers.append(Connection(os.dup(proc.stdout.fileno()), writable=False))
            self.writers.append(Connection(os.dup(proc.stdin.fileno()), readable=False))
            proc.stdout.close()
            proc.stdin.close()
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            for rank in range(world_size):
                self._receive(rank, deadline, "start")
        except BaseException as error:
            tails = "\n".join(self.log_tail(rank) for rank in range(world_size))
            self.close(force=True)
            raise RankFailure(f"{world_size} ranks failed to start: {error}\n{tails}") from None

    def alive(self) -> bool:
        """Every rank still running (a closed pool, which has no ranks, is not alive)."""
        return bool(self.procs) and all(proc.poll() is None for proc in self.procs)

    def log_tail(self, rank: int, num_lines: int = 15) -> str:
        lines = (self.log_dir / f"rank{rank}.log").read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])

    def _receive(self, rank: int, deadline: float, what: str) -> Any:
        reader = self.readers[rank]
        if not reader.poll(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"rank {rank} did not {what} in time")
        try:
            return pickle.loads(reader.recv_bytes())
        except (EOFError, OSError):
            code = self.procs[rank].wait(timeout=5)
            raise RankFailure(
                f"rank {rank} died (exit code {code}) during {what}; "
                f"last output:\n{self.log_tail(rank)}"
            ) from None

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> list[Any]:
        """``fn(rank, world_size, *args)`` on every rank; the results by rank."""
        if "<locals>" in fn.__qualname__ or fn.__name__ == "<lambda>":
            raise TypeError(f"{fn.__qualname__} must be a module-level function of a test file")
        job = (
            "run",
            str(Path(fn.__code__.co_filename).resolve()),
            fn.__name__,
            args,
            free_port(),
            timeout,
        )
        payload = _dumps(job)
        for writer in self.writers:
            writer.send_bytes(payload)
        # The ranks' own collective timeout fires first and reports where they hung (a
        # margin for a loaded machine: a test that waits for that timeout must see it).
        deadline = time.monotonic() + timeout + HARNESS_MARGIN_S
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = set(range(self.world_size))
        while pending:
            waiting = {self.readers[rank]: rank for rank in pending}
            ready = sorted(waiting[c] for c in connection_wait(list(waiting), timeout=0.2))
            for rank in ready:
                pending.discard(rank)
                try:
                    status, value = self._receive(rank, deadline, "answer")
                except RankFailure as died:
                    errors[rank] = str(died)
                    continue
                if status == "ok":
                    results[rank] = value
                else:
                    errors[rank] = value
                if errors:
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
            if pending and time.monotonic() > deadline:
                tails = "".join(f"\n--- rank {r} output ---\n{self.log_tail(r)}" for r in pending)
                self.close(force=True)
                if errors:
                    break
                raise RankFailure(
                    f"{fn.__name__} on {self.world_size} ranks did not finish within "
                    f"{timeout:g} s; ranks still running: {sorted(pending)} (hang?){tails}"
                )
        if errors:
            if pending:
                self.close(force=True)
            details = "\n".join(
                f"--- rank {rank} ---\n{text}" for rank, text in sorted(errors.items())
            )
            still = f"; ranks {sorted(pending)} never answered" if pending else ""
            raise RankFailure(f"{fn.__name__} failed on ranks {sorted(errors)}{still}:\n{details}")
        return [results[rank] for rank in range(self.world_size)]

    def close(self, *, force: bool = False) -> None:
        for writer, proc in zip(self.writers, self.procs, strict=True):
            if not force and proc.poll() is None:
                with contextlib.suppress(OSError):
                    writer.send_bytes(_dumps(("exit",)))
        for proc in self.procs:
            if force:
                proc.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for connection in [*self.readers, *self.writers]:
            connection.close()
        shutil.rmtree(self.log_dir, ignore_errors=True)
        self.procs, self.readers, self.writers = [], [], []


@pytest.fixture(scope="session")
def run_ranks() -> Iterator[Callable[..., list[Any]]]:
    """``run_ranks(world_size, fn, *args, timeout=30)`` → ``[fn's result on rank 0, ...]``."""
    pools: dict[int, RankPool] = {}

    def run(
        world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT_S
    ) -> list[Any]:
        pool = pools.get(world_size)
        if pool is None or not pool.alive():
            if pool is not None:
                pool.close(force=True)
            pool = pools[world_size] = RankPool(world_size)
        return pool.run(fn, args, timeout)

    yield run
    for pool in pools.values():
        pool.close()


def _dumps(message: Any) -> bytes:
    # Plain pickle: Connection.send would use torch's shared-memory reductions for tensors,
    # which only work between processes that share a multiprocessing authkey.
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


# ------------------------------------------------------------------------------------------
# Worker side: ``python conftest.py RANK WORLD_SIZE``.


def _load(path: str, modules: dict[str, Any]) -> Any:
    if path not in modules:
        name = f"_gradsync_dist_{Path(path).stem}_{len(modules)}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        modules[path] = module
    return modules[path]


def _worker(rank: int, world_size: int) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    reader = Connection(os.dup(0), writable=False)
    writer = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # prints from the code under test must not corrupt the protocol
    writer.send_bytes(_dumps(("ready", None)))
    modules: dict[str, Any] = {}
    while True:
        try:
            message = pickle.loads(reader.recv_bytes())
        except EOFError:
            return
        if message[0] == "exit":
            return
        _, path, name, args, port, timeout = message
        try:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout),
            )
            try:
                result = getattr(_load(path, modules), name)(rank, world_size, *args)
            finally:
                dist.destroy_process_group()
            answer = _dumps(("ok", result))
        except BaseException:  # everything, even SystemExit, goes back to the test
            answer = _dumps(("error", traceback.format_exc()))
        writer.send_bytes(answer)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]))
