"""The cluster a prediction is for: hosts with full-duplex links, and where each rank runs.

Every host has one link to a non-blocking switch, ``bandwidth`` bytes/s in each direction
and ``latency`` seconds one way; ranks on one host share its link and talk to each other
at ``intra_bandwidth``. Costs are those of the algorithms gradsync runs:

- ring allreduce (Gloo's, and NCCL's): ``2(n−1)/n · S / B + 2(n−1) · α`` for n ranks; with
  several ranks per host the ring crosses each host boundary once, so the slowest hop
  decides ``B``;
- point-to-point pushes and pulls: a message of S bytes takes ``S / B + α``, and a link
  carrying k concurrent messages is shared (``k · S / B``): servers' inbound links are
  what parameter servers wait for.

``message_s`` is the per-message software overhead (Gloo's framing, a server's handling),
0 unless calibrated (:func:`calibrate`).

Example:
    >>> net = Network(bandwidth=125e6, latency=0.0)   # 1 Gbit/s
    >>> round(Cluster(workers=4, network=net).ring_allreduce_s(100e6), 3)  # 2·3/4·0.8 s
    1.2
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gradsync.errors import UserError

_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_bandwidth(text: str, option: str = "--bandwidth") -> float:
    """A link rate in tc notation (``10gbit``, ``100mbit``) as bytes per second
    (``option`` names it in errors).

    Example:
        >>> parse_bandwidth("1gbit")
        125000000.0
        >>> parse_bandwidth("0", "--intra-bandwidth")
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: --intra-bandwidth '0' is not a rate; write a number and a unit...
    """
    from gradsync.netem import parse_rate

    return parse_rate(text, option) / 8


def parse_latency(text: str, option: str = "--latency") -> float:
    """A duration such as ``25us``, ``0.5ms`` or ``0`` as seconds (``option`` names it in
    errors). A number other than 0 needs its unit, as a ``--bandwidth`` does: ``25`` could
    be seconds or microseconds.

    Example:
        >>> round(parse_latency("25us") * 1e6, 9), parse_latency("0.5ms"), parse_latency("0")
        (25.0, 0.0005, 0.0)
        >>> parse_latency("25")
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: --latency '25' has no unit; write e.g. 25us, 25ms or 25s
    """
    stripped = text.strip().lower()
    number = stripped.rstrip("smun\u00b5")
    unit = stripped[len(number) :]
    try:
        value = float(number) * _TIME_UNITS[unit or "s"]
    except (ValueError, KeyError):
        raise UserError(
            f"{option} {text!r} is not a duration; write e.g. 25us, 0.5ms or 0"
        ) from None
    if not unit and value != 0:
        raise UserError(
            f"{option} {text!r} has no unit; write e.g. {number}us, {number}ms or {number}s"
        )
    if not 0 <= value < math.inf:  # nan, a negative or an infinite wait: no step ends
        raise UserError(f"{option} must be a finite duration >= 0, got {text}; write e.g. 25us")
    return value


@dataclass(frozen=True, kw_only=True)
class WireCosts:
    """What a message through the server transport costs (pushes and pulls of ``ps``,
    ``hybrid`` and ``p3``: a header and a payload, a receiver thread per peer, a fresh
    buffer per message), measured by commbench's ``wire`` echo (:func:`calibrate_wire`).

    ``message_s``: the fixed time of one message (a push, or its answer).
    ``cpu_s_per_byte``, ``cpu_s_per_message``: CPU time over the whole job (both ends, every
    thread), as :attr:`Network.cpu_s_per_byte` for collectives.
    ``serial_s`` + ``serial_s_per_byte``·S: CPU time one rank's Python threads spend to
    receive one message of S bytes and send one. Those threads take turns under the
    interpreter's lock, so a server's receiving and answering takes turns with its
    updates; Gloo's own threads move the bytes beside them.

    Example:
        >>> WireCosts(message_s=5e-4, serial_s=4e-4).serial_s_per_byte
        0.0
    """

    message_s: float
    cpu_s_per_byte: float = 0.0
    cpu_s_per_message: float = 0.0
    serial_s: float = 0.0
    serial_s_per_byte: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Network:
    """Per-host link: ``bandwidth`` bytes/s each way, ``latency`` s one way, software
    overhead ``message_s`` per message; ``efficiency`` scales the usable bandwidth (the
    share of the nominal rate a calibration measured). ``cpu_s_per_byte`` and
    ``cpu_s_per_message``: the CPU time (both ends together) that moving one byte and one
    message between two ranks costs; it only matters on a cluster whose hosts share cores
    (:attr:`Cluster.shared_cores`), and is measured by :func:`calibrate`.
    ``bidirectional_slowdown``: how many times longer two equal point-to-point transfers
    (a push, a pull) take when they cross a link in opposite directions at once than one
    alone: 1 on a full-duplex network (the default), up to 2 where the directions take
    turns; measured by commbench's ``exchange`` against ``p2p`` (:func:`calibrate`). Ring
    collectives keep the rate their own calibration measured. ``duplex_curve``: the same
    ratio at every size commbench measured, as (one-way seconds, slowdown) pairs, so each
    transfer takes the slowdown of its own duration (:meth:`duplex_slowdown`). A transport
    whose sends wait on receives announced behind opposite traffic shows short transfers at
    full rate and long ones taking turns (Gloo on one process group, send first).
    ``sync_message_s``: (compute between calls, per-message cost) pairs of a small
    blocking collective between ranks that compute between calls, measured by commbench
    ``--busy-ms`` (:func:`calibrate_sync`). On hosts that share cores it prices BatchNorm's
    syncs: each waits for the slower rank and, with every core computing, for a core to run
    the transport's threads. Empty: ``hop_s``, as between idle ranks.
    ``queue_s``: how long a small message waits behind bulk data on a saturated link (the
    depth of the link's queue in seconds): a blocking collective issued while a gradient
    bucket crosses the link waits that long, at most until the bucket is across. 0 (the
    default) for shallow switch buffers; gradsync's emulated hosts queue 50 ms.
    ``wire``: what the server transport's messages cost (:class:`WireCosts`); None: as
    the collectives'."""

    bandwidth: float
    latency: float = 0.0
    message_s: float = 0.0
    efficiency: float = 1.0
    intra_bandwidth: float | None = None
    cpu_s_per_byte: float = 0.0
    cpu_s_per_message: float = 0.0
    bidirectional_slowdown: float = 1.0
    sync_message_s: tuple[tuple[float, float], ...] = ()
    duplex_curve: tuple[tuple[float, float], ...] = ()
    queue_s: float = 0.0
    wire: WireCosts | None = None

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise UserError(f"bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if not self.queue_s >= 0:
            raise UserError(f"the link's queue must be >= 0 s, got {self.queue_s}")
        if not 1.0 <= self.bidirectional_slowdown <= 2.0:
            raise UserError(
                "bidirectional slowdown must be between 1 (full duplex) and 2 (the directions "
                f"take turns), got {self.bidirectional_slowdown}"
            )

    @property
    def rate(self) -> float:
        """Usable bytes per second of one host link, each way."""
        return self.bandwidth * self.efficiency

    @property
    def intra_rate(self) -> float:
        return self.intra_bandwidth if self.intra_bandwidth else self.rate

    @property
    def hop_s(self) -> float:
        """Fixed cost of one message: latency plus software overhead."""
        return self.latency + self.message_s

    @property
    def wire_hop_s(self) -> float:
        """Fixed cost of one server-transport message (a push or an answer)."""
        return self.latency + (self.message_s if self.wire is None else self.wire.message_s)

    def cpu_s(self, num_bytes: float, messages: int, *, wire: bool = False) -> float:
        """CPU time (both ends) of moving ``num_bytes`` in ``messages``, through the server
        transport when ``wire``.

        Example:
            >>> net = Network(bandwidth=1e9, cpu_s_per_byte=1e-9,
            ...               wire=WireCosts(message_s=0.0, cpu_s_per_byte=2e-9))
            >>> net.cpu_s(1e6, 0), net.cpu_s(1e6, 0, wire=True)
            (0.001, 0.002)
        """
        if wire and self.wire is not None:
            return num_bytes * self.wire.cpu_s_per_byte + messages * self.wire.cpu_s_per_message
        return num_bytes * self.cpu_s_per_byte + messages * self.cpu_s_per_message

    def serial_s(self, num_bytes: float) -> float:
        """Seconds a rank's Python threads spend on receiving one server-transport message
        of ``num_bytes`` and sending one: work a server does in turn with its updates
        (0 where it was not measured)."""
        if self.wire is None:
            return 0.0
        return self.wire.serial_s + num_bytes * self.wire.serial_s_per_byte

    def sync_hop_s(self, compute_between_s: float) -> float:
        """Fixed cost of one message of a blocking collective between ranks that compute
        ``compute_between_s`` between calls: :attr:`sync_message_s` interpolated (held at
        its ends), or :attr:`hop_s` where it was not measured.

        Example:
            >>> net = Network(bandwidth=1e9, sync_message_s=((1e-3, 4e-4), (3e-3, 8e-4)))
            >>> round(net.sync_hop_s(2e-3) * 1e6), round(net.sync_hop_s(9.0) * 1e6)
            (600, 800)
        """
        if not self.sync_message_s:
            return self.hop_s
        return _interpolate(self.sync_message_s, compute_between_s)

    def duplex_slowdown(self, seconds: float) -> float:
        """How many times longer a point-to-point transfer of ``seconds`` one way takes
        while one crosses the same link the other way: :attr:`duplex_curve` interpolated
        in log time (held at its ends), or :attr:`bidirectional_slowdown` where only that
        was measured.

        Example:
            >>> net = Network(bandwidth=1e9, duplex_curve=((0.01, 1.0), (0.1, 2.0)))
            >>> net.duplex_slowdown(0.001), round(net.duplex_slowdown(0.0316), 2)
            (1.0, 1.5)
        """
        if not self.duplex_curve:
            return self.bidirectional_slowdown
        points = tuple((math.log(max(t, 1e-12)), d) for t, d in self.duplex_curve)
        return _interpolate(points, math.log(max(seconds, 1e-12)))


def _interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    """The piecewise-linear function through ``points`` (x, y) at ``x``, held at its ends.

    Example:
        >>> _interpolate(((0.0, 1.0), (2.0, 3.0)), 1.0), _interpolate(((0.0, 1.0),), 5.0)
        (2.0, 1.0)
    """
    ordered = sorted(points)
    if x <= ordered[0][0]:
        return ordered[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(ordered):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ordered[-1][1]


def check_shared_cores(value: object, where: str) -> None:
    """``value`` is None or a whole number ≥ 1 of cores; else a one-line UserError.

    Example:
        >>> check_shared_cores(2, "--shared-cores")
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{where} must be a whole number of cores ≥ 1, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """``workers`` ranks, ``ranks_per_host`` to a host, and parameter servers.

    ``servers`` dedicated server ranks each get a host of their own unless
    ``host_of_server`` says where they run; ``colocate`` runs server s inside worker s.
    ``host_of_worker``/``host_of_server`` pin ranks to hosts explicitly (validation on
    emulated hosts uses :func:`gradsync.netem.place_ranks`). ``shared_cores``: every
    host's ranks run on the same this many CPU cores (hosts emulated on one machine), so
    communication's and servers' CPU time that overlaps compute lengthens it; None (a real
    cluster): communication and servers cost the workers no compute. ``server_overlap``:
    the share of the servers' work that falls while the workers compute (found by
    :func:`~gradsync.predict.simulate.predict_step` on shared cores): that work runs at a
    server's share of the cores (:attr:`server_slowdown`).
    """

    workers: int
    network: Network
    ranks_per_host: int = 1
    servers: int = 0
    colocate: bool = False
    host_of_worker: tuple[int, ...] | None = None
    host_of_server: tuple[int, ...] | None = None
    shared_cores: int | None = None
    server_overlap: float = 0.0

    def __post_init__(self) -> None:
        check_shared_cores(self.shared_cores, "shared_cores")
        if not 0.0 <= self.server_overlap <= 1.0:
            raise UserError(f"server_overlap must be in [0, 1], got {self.server_overlap}")

    @property
    def server_slowdown(self) -> float:
        """How many times its CPU time a server's work takes on shared cores: while the
        workers compute, the workers and the servers (processes or threads) share the
        cores evenly, so the :attr:`server_overlap` share of the work runs at
        ``cores / (workers + servers)`` of a core where that is under 1.

        Example:
            >>> net = Network(bandwidth=1e9)
            >>> Cluster(workers=2, network=net, servers=1, shared_cores=2,
            ...         server_overlap=1.0).server_slowdown
            1.5
            >>> Cluster(workers=2, network=net, servers=1).server_slowdown  # a real cluster
            1.0
        """
        if self.shared_cores is None or not self.servers:
            return 1.0
        runnable = (self.workers + self.servers) / self.shared_cores
        return 1.0 + self.server_overlap * max(0.0, runnable - 1.0)

    def with_servers(self, servers: int, *, colocate: bool = False) -> Cluster:
        """The same hosts with another server layout (explicit server hosts dropped)."""
        return replace(self, servers=servers, colocate=colocate, host_of_server=None)

    def worker_host(self, worker: int) -> int:
        if self.host_of_worker is not None:
            return self.host_of_worker[worker]
        return worker // self.ranks_per_host

    def server_host(self, server: int) -> int:
        if self.colocate:
            return self.worker_host(server % self.workers)
        if self.host_of_server is not None:
            return self.host_of_server[server]
        return self.worker_host(self.workers - 1) + 1 + server

    @property
    def num_hosts(self) -> int:
        return len({self.worker_host(w) for w in range(self.workers)})

    def workers_per_host(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for worker in range(self.workers):
            host = self.worker_host(worker)
            counts[host] = counts.get(host, 0) + 1
        return counts

    def ring_allreduce_s(self, num_bytes: float) -> float:
        """One ring allreduce of ``num_bytes`` over the workers."""
        n = self.workers
        if n == 1:
            return 0.0
        return 2 * (n - 1) / n * num_bytes / self._ring_rate + 2 * (n - 1) * self.network.hop_s

    def ring_allgather_s(self, num_bytes: float) -> float:
        """One ring all_gather of ``num_bytes`` from each worker: n−1 hops of it."""
        n = self.workers
        if n == 1:
            return 0.0
        return (n - 1) * (num_bytes / self._ring_rate + self.network.hop_s)

    @property
    def _ring_rate(self) -> float:
        net = self.network
        return net.intra_rate if self.num_hosts == 1 else min(net.rate, net.intra_rate)

    def link_phase_s(self, bytes_per_server: list[float]) -> float:
        """Time for every worker to send ``bytes_per_server[s]`` to each server s at once (or
        receive it: the links are full duplex and symmetric): the busiest host link decides.

        Example:
            >>> net = Network(bandwidth=1e6, message_s=0.0)
            >>> Cluster(workers=2, network=net, servers=1).link_phase_s([1e6])  # 2 MB in
            2.0
        """
        total = sum(bytes_per_server)
        server_load: dict[int, float] = {}
        for server, num_bytes in enumerate(bytes_per_server):
            host = self.server_host(server)
            server_load[host] = server_load.get(host, 0.0) + num_bytes
        on_host = self.workers_per_host()
        # Worker-side direction: each of a host's workers moves what lives off that host.
        worst = max(count * (total - server_load.get(host, 0.0)) for host, count in on_host.items())
        for host, num_bytes in server_load.items():
            worst = max(worst, num_bytes * (self.workers - on_host.get(host, 0)))
        return worst / self.network.rate + (self.network.wire_hop_s if worst else 0.0)

    def remote_workers(self, server: int) -> int:
        """Workers whose messages to ``server`` cross its host's link."""
        host = self.server_host(server)
        return sum(1 for w in range(self.workers) if self.worker_host(w) != host)

    def busiest_worker_host(self) -> int:
        """Most workers sharing one host link."""
        return max(self.workers_per_host().values())


def calibrate(network: Network, commbench_path: str | Path) -> Network:
    """``network`` with latency and efficiency fitted to a ``gradsync commbench`` result.

    The ring model ``t = a + b·S`` of the run's n ranks has ``a = 2(n−1)·α`` (α: the
    per-message cost, latency and software overhead together) and ``b = 2(n−1)/n /
    (efficiency · bandwidth)``, the bandwidth being the run's ``--bandwidth`` (the
    calibration keeps the measured share of it). ``b`` is the slope between the two largest
    sizes (bandwidth-bound) and ``a`` what is left of the smallest size's time
    (latency-bound): a least-squares line over sizes spanning 4 orders of magnitude would
    let the large ones decide the intercept, and a blocking collective of a few bytes (a
    BatchNorm sync) would cost nothing.
    """
    path = Path(commbench_path)
    payload, rows, n = _ring_rows(path)
    slope, intercept = _two_regime_line(_points(path, rows, "time_s"))
    hop = max(0.0, intercept) / (2 * (n - 1))
    efficiency = network.efficiency
    if payload.get("bandwidth") and slope > 0:
        nominal = parse_bandwidth(str(payload["bandwidth"]), f"--calibrate {path}: bandwidth")
        efficiency = min(1.0, (2 * (n - 1) / n) / slope / nominal)
    network = replace(network, latency=0.0, message_s=hop, efficiency=efficiency)
    if all("cpu_s" in r for r in rows):
        network = calibrate_cpu(network, path)
    if any(r.get("busy_s") for r in payload["results"]):
        network = calibrate_sync(network, path)
    ops = {r.get("op") for r in _idle_rows(payload)}
    if "wire" in ops:
        network = calibrate_wire(network, path)
    pair = int(payload.get("world_size", 0)) == 2  # exchange over p2p means one pair's links
    return calibrate_duplex(network, path) if pair and {"p2p", "exchange"} <= ops else network


def _ring_rows(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """A commbench.json's payload, its allreduce rows between idle ranks (two sizes at
    least) and its number of ranks (2 at least); any problem is a UserError."""
    payload = _load_commbench(path)
    rows = [r for r in _idle_rows(payload) if r["op"] == "allreduce"]
    n = _world_size(path, payload)
    _points(path, rows, "time_s")  # two sizes at least, every time a number
    return payload, rows, n


def _world_size(path: Path, payload: dict[str, Any]) -> int:
    """The run's number of ranks, 2 at least; else a one-line UserError naming the file."""
    n = payload.get("world_size")
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        raise UserError(
            f"--calibrate {path}: world_size is {n!r}, not a number of ranks >= 2; {COMMBENCH_HINT}"
        )
    return n


def ring_rate(commbench_path: str | Path) -> float:
    """Bytes per second a link carried each way in a commbench run's ring allreduce (its
    slope between the two largest sizes, as :func:`calibrate` fits it): the rate of links
    that nothing shaped, where the hosts' CPUs and the kernel decide it.

    Example:
        >>> # Network(bandwidth=ring_rate("calibration/unshaped/commbench.json"))
    """
    path = Path(commbench_path)
    _, rows, n = _ring_rows(path)
    slope, _ = _two_regime_line(_points(path, rows, "time_s"))
    if slope <= 0:
        raise UserError(f"{path}: the allreduce times do not grow with size; measure again")
    return 2 * (n - 1) / n / slope


COMMBENCH_HINT = (
    "run `gradsync commbench --hosts 2 --bandwidth RATE --ops allreduce` and pass its "
    "commbench.json"
)


def _load_commbench(path: Path) -> dict[str, Any]:
    """A commbench.json's payload: an object whose ``results`` are objects, each with an
    ``op`` and a positive whole number of ``bytes``; any problem is a one-line UserError
    naming the file."""
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        message = f"--calibrate {path}: not a commbench.json ({error}); {COMMBENCH_HINT}"
        raise UserError(message) from None
    if not isinstance(payload, dict) or not isinstance(payload.get("results"), list):
        raise UserError(
            f"--calibrate {path}: not a commbench.json (no list of results); {COMMBENCH_HINT}"
        )
    for number, row in enumerate(payload["results"]):
        size = row.get("bytes") if isinstance(row, dict) else None
        if not isinstance(row, dict) or not isinstance(row.get("op"), str) or not _is_size(size):
            raise UserError(
                f"--calibrate {path}: results[{number}] needs an op and a whole number of "
                f"bytes > 0, got {row!r}; {COMMBENCH_HINT}"
            )
        busy = row.get("busy_s")
        if busy is not None and not _is_number(busy):
            raise UserError(
                f"--calibrate {path}: results[{number}] has busy_s {busy!r}, not a finite "
                f"number >= 0; {COMMBENCH_HINT}"
            )
    return payload


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_number(value: object) -> bool:
    """A finite number >= 0 (not a bool)."""
    real = isinstance(value, (int, float)) and not isinstance(value, bool)
    return real and math.isfinite(value) and value >= 0  # type: ignore[arg-type]


def _points(path: Path, rows: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """(bytes, ``key``) of ``rows`` (one op's), checked: every value a finite number >= 0
    (a time > 0), at two or more distinct sizes; else a one-line UserError naming the file.

    Example:
        >>> _points(Path("c.json"), [{"op": "p2p", "bytes": 4, "cpu_s": 0.5}], "cpu_s")
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: --calibrate c.json: needs p2p cpu_s at two or more...
    """
    op = rows[0]["op"] if rows else "allreduce"
    for row in rows:
        value = row.get(key)
        if not _is_number(value) or (key == "time_s" and value == 0):
            raise UserError(
                f"--calibrate {path}: {op} {key} at {row['bytes']} bytes is {value!r}, not a "
                f"finite number {'> 0' if key == 'time_s' else '>= 0'}; measure it again "
                "with `gradsync commbench`"
            )
    points = [(float(row["bytes"]), float(row[key])) for row in rows]
    sizes = sorted({int(size) for size, _ in points})
    if len(sizes) < 2:
        raise UserError(
            f"--calibrate {path}: needs {op} {key} at two or more distinct sizes, got "
            f"{sizes or 'none'}; run e.g. `gradsync commbench --ops {op} --sizes 4K,1M,4M`"
        )
    return points


def _idle_rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The results measured between idle ranks (no ``--busy-ms`` compute between calls)."""
    return [r for r in payload["results"] if not r.get("busy_s")]


def _busiest_rows(payload: dict[str, Any], op: str) -> list[dict[str, Any]]:
    """The rows of ``op`` measured with the longest ``--busy-ms`` compute between calls;
    none if it was measured between idle ranks only."""
    busy = [r for r in payload["results"] if r["op"] == op and r.get("busy_s")]
    longest = max((r["busy_s"] for r in busy), default=None)
    return [r for r in busy if r["busy_s"] == longest]


def calibrate_sync(network: Network, commbench_path: str | Path) -> Network:
    """``network`` with :attr:`Network.sync_message_s` measured by ``gradsync commbench
    --ops allreduce --busy-ms 0.5,1,2,4``: at each compute-between-calls value, the
    per-message cost of the smallest allreduce (its time less the bytes' share, over the
    ring's 2(n−1) messages).

    Example:
        >>> # calibrate_sync(Network(bandwidth=125e6), "sync/commbench.json").sync_message_s
    """
    path = Path(commbench_path)
    payload = _load_commbench(path)
    rows = [r for r in payload["results"] if r["op"] == "allreduce" and r.get("busy_s")]
    n = _world_size(path, payload)
    for row in rows:
        if not _is_number(row.get("time_s")):
            raise UserError(
                f"--calibrate {path}: allreduce time_s at {row['bytes']} bytes is "
                f"{row.get('time_s')!r}, not a finite number >= 0; measure it again"
            )
    if not rows:
        raise UserError(
            f"{path}: needs allreduce times between busy ranks on 2+ ranks; measure them with "
            "`gradsync commbench --ops allreduce --sizes 4K --busy-ms 0.5,1,2,4`"
        )
    smallest: dict[float, dict[str, Any]] = {}
    for row in rows:
        if row["busy_s"] not in smallest or row["bytes"] < smallest[row["busy_s"]]["bytes"]:
            smallest[row["busy_s"]] = row
    share = 2 * (n - 1) / n / network.rate
    pairs = tuple(
        (busy, max(0.0, row["time_s"] - share * row["bytes"]) / (2 * (n - 1)))
        for busy, row in sorted(smallest.items())
    )
    return replace(network, sync_message_s=pairs)


def calibrate_cpu(network: Network, commbench_path: str | Path) -> Network:
    """``network`` with the CPU cost of communication measured by ``gradsync commbench``.

    commbench records each rank's process CPU time (user + system, every thread: Gloo's
    copies, its socket calls and the kernel's send and receive work done in them) per
    allreduce. A ring allreduce of S bytes on n ranks sends ``2(n−1)·S`` bytes and
    ``2n(n−1)`` messages over all ranks; the per-rank CPU line ``c = a + b·S`` (fitted as
    :func:`calibrate` fits time) gives the whole job's CPU per byte moved
    ``n·b / (2(n−1))`` and per message ``a / (2(n−1))``. Softirq work the kernel does
    outside the ranks' own time is not in it.

    Example:
        >>> # calibrate_cpu(Network(bandwidth=125e6), "calibration/1gbit/commbench.json")
    """
    path = Path(commbench_path)
    payload = _load_commbench(path)
    rows = [r for r in _idle_rows(payload) if r["op"] == "allreduce" and "cpu_s" in r]
    n = _world_size(path, payload)
    slope, intercept = _two_regime_line(_points(path, rows, "cpu_s"))
    return replace(
        network,
        cpu_s_per_byte=max(0.0, n * slope / (2 * (n - 1))),
        cpu_s_per_message=max(0.0, intercept) / (2 * (n - 1)),
    )


def calibrate_duplex(network: Network, commbench_path: str | Path) -> Network:
    """``network`` with the bidirectional slowdown measured by ``gradsync commbench --ops
    p2p,exchange`` on 2 ranks on 2 hosts: the time of an exchange (both ranks send S to each
    other at once) over a one-way p2p of S (clamped to 1..2), at every size both ran
    (``duplex_curve``, keyed by the p2p time) and at the largest
    (``bidirectional_slowdown``).

    Example:
        >>> # calibrate_duplex(Network(bandwidth=125e6), "commbench.json").bidirectional_slowdown
    """
    path = Path(commbench_path)
    payload = _load_commbench(path)
    times = {(r["op"], r["bytes"]): r.get("time_s") for r in _idle_rows(payload)}
    both = {b for op, b in times if op == "exchange"}
    sizes = sorted({b for op, b in times if op == "p2p"} & both)
    if not sizes:
        raise UserError(f"{path}: needs p2p and exchange times at a common size")
    if int(payload.get("world_size", 2)) != 2:
        raise UserError(
            f"{path}: the bidirectional slowdown is measured by 2 ranks on 2 hosts; this run "
            f"had {payload.get('world_size')} ranks (rerun commbench with --workers 2)"
        )
    curve = []
    for size in sizes:
        one_way, both_ways = times[("p2p", size)], times[("exchange", size)]
        if not (_is_number(one_way) and one_way > 0 and _is_number(both_ways)):
            raise UserError(f"{path}: p2p and exchange times must be positive numbers")
        curve.append((float(one_way), min(2.0, max(1.0, both_ways / one_way))))
    return replace(network, bidirectional_slowdown=curve[-1][1], duplex_curve=tuple(curve))


def calibrate_wire(network: Network, commbench_path: str | Path) -> Network:
    """``network`` with the server transport's costs (:class:`WireCosts`) measured by
    ``gradsync commbench --ops wire``: rank 0 sends S bytes to rank 1 and waits for an
    answer of S bytes (:mod:`gradsync.comm.echo`). Over sizes, the round trip's time
    ``t = a + b·S`` gives the per-message cost ``a / 2`` (a push and its answer); the job's
    CPU time (every rank's process, receiver threads included) ``c = a' + b'·S`` gives
    ``b' / 2`` per byte moved (S each way) and ``a' / 4`` per message (a header and a
    payload each way); a rank's Python threads' CPU time (``python_cpu_s``, a receive and a
    send each) is the serial cost line itself. Lines as :func:`calibrate` fits them. Where
    the file also holds echoes between ranks that compute between them (``--busy-ms``),
    the CPU and serial lines are theirs (the longest compute's): a job's transport threads
    take their turns while the training threads compute, which makes each turn dearer. The
    per-message time stays the idle echo's (a busy round trip also waits for the slower
    rank's compute).

    Example:
        >>> # calibrate_wire(Network(bandwidth=125e6), "wire/commbench.json").wire_hop_s
    """
    path = Path(commbench_path)
    payload = _load_commbench(path)
    rows = [r for r in _idle_rows(payload) if r["op"] == "wire"]
    busiest = _busiest_rows(payload, "wire")
    ranks = _world_size(path, payload)
    times = _points(path, rows, "time_s")
    cpus = [(b, ranks * c) for b, c in _points(path, busiest or rows, "cpu_s")]  # rank → job
    # The echo's two ranks; the others, if any, wait and count for nothing.
    timed = [r for r in busiest or rows if "python_cpu_s" in r]
    if len({r["bytes"] for r in timed}) > 1:
        serial = [(b, ranks / 2 * c) for b, c in _points(path, timed, "python_cpu_s")]
    else:  # not measured (older commbench): no serial work
        serial = []
    _, time_intercept = _two_regime_line(times)
    cpu_slope, cpu_intercept = _two_regime_line(cpus)
    serial_slope, serial_intercept = _two_regime_line(serial) if len(serial) > 1 else (0, 0)
    costs = WireCosts(
        message_s=max(0.0, time_intercept) / 2,
        cpu_s_per_byte=max(0.0, cpu_slope) / 2,
        cpu_s_per_message=max(0.0, cpu_intercept) / 4,
        serial_s=max(0.0, serial_intercept),
        serial_s_per_byte=max(0.0, serial_slope),
    )
    return replace(network, wire=costs)


def _two_regime_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Slope between the two largest sizes; intercept from the smallest.

    Example:
        >>> _two_regime_line([(4, 3.0), (100, 4.0), (200, 5.0)])
        (0.01, 2.96)
    """
    ordered = sorted(points)
    (s1, t1), (s2, t2) = ordered[-2], ordered[-1]
    slope = (t2 - t1) / (s2 - s1) if s2 > s1 else 0.0
    smallest, time_s = ordered[0]
    return slope, round(time_s - slope * smallest, 12)


__all__ = [
    "Cluster",
    "Network",
    "WireCosts",
    "calibrate",
    "calibrate_cpu",
    "calibrate_duplex",
    "calibrate_wire",
    "parse_bandwidth",
    "parse_latency",
    "ring_rate",
]
