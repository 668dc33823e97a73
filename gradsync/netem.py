"""Emulated hosts on one machine: network namespaces joined by a bridge, links shaped by ``tc``.

``gradsync train --workers 4 --hosts 2 --bandwidth 1gbit`` runs ranks 0–1 in one network
namespace and ranks 2–3 in another. Each emulated host has one veth link to a bridge that
lives in a namespace of its own, so nothing is added to the machine's own network::

    namespace gs1a2b3c-h0: gs1a2b3ch0 10.200.0.1/24 ══veth══ gs1a2b3cp0 ┐ bridge gs1a2b3cbr
    namespace gs1a2b3c-h1: gs1a2b3ch1 10.200.0.2/24 ══veth══ gs1a2b3cp1 ┘ in namespace gs1a2b3c-br

Shaping (``--bandwidth RATE``, a token-bucket ``tbf`` qdisc at RATE on both ends of every link):

- **egress** of a host: on its own veth end, inside the host namespace;
- **ingress** of a host: on the bridge-side veth end, whose egress is what the host receives.

So every host has a full-duplex link of RATE to an ideal switch, as in a cluster. Traffic
between ranks of the same host goes over that namespace's loopback and is not shaped.
Latency cannot be emulated: this kernel has no ``netem`` qdisc; only the rate is shaped.

Every run has its own id (``gs`` + 6 hex digits) in every name, its own /24 subnet, and a
state file under ``/run/gradsync/netem`` naming the launcher that owns it. The namespaces are
deleted when the run ends in any way its launcher survives (normal exit, error, Ctrl-C,
SIGTERM, a dead rank); deleting a namespace deletes its veth ends and qdiscs with it. If the
launcher itself is SIGKILLed, ``gradsync netem cleanup`` finds the run's namespaces by name,
sees that the owner is gone and deletes them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from gradsync.errors import UserError
from gradsync.signals import signals_deferred

PREFIX = "gs"
STATE_DIR = Path("/run/gradsync/netem")
NETNS_ETC = Path("/etc/netns")  # ip netns exec bind-mounts /etc/netns/NAME/* over /etc/*
SHAPING_QDISC = "tbf"
QUEUE_MS = 50  # what the shaping queue holds: a small message waits this long behind bulk data
MAX_HOSTS = 250
MAX_SUBNETS = 50 * 256
NAMESPACE_PATTERN = re.compile(rf"^{PREFIX}([0-9a-f]{{6}})-(br|h\d+)$")
NO_DELAY_NOTE = "latency is not emulated: this kernel has no netem qdisc, only the rate is shaped"

_RATE_UNITS = {
    # tc's units: *bit are bits per second (decimal), *bps are bytes per second.
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
}


def parse_rate(text: str, option: str = "--bandwidth") -> int:
    """A link rate in ``tc`` notation, as bits per second (``option`` names it in errors).

    Example:
        >>> parse_rate("1gbit"), parse_rate("200mbit"), parse_rate("2.5Gbit"), parse_rate("1mbps")
        (1000000000, 200000000, 2500000000, 8000000)
        >>> parse_rate("fast", "x.toml: bandwidths")
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: x.toml: bandwidths 'fast' is not a rate; write a number and...
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _RATE_UNITS:
        raise UserError(
            f"{option} {text!r} is not a rate; write a number and a unit, e.g. 1gbit, "
            f"200mbit or 10gbit (units: {', '.join(_RATE_UNITS)})"
        )
    bits = round(float(match.group(1)) * _RATE_UNITS[unit])
    if bits < 10**5:
        raise UserError(f"{option} {text} is below 100kbit; use at least 100kbit")
    return bits


MAX_SHAPED_RATE = 10**12  # 1 Tbit/s: tbf's bucket (4 ms at the rate) must fit 32 bits


def parse_shaped_rate(text: str, option: str = "--bandwidth") -> int:
    """:func:`parse_rate` for a link gradsync shapes with ``tc``: at most 1 Tbit/s, which
    no veth on one machine reaches anyway (tbf refuses the bucket of a faster rate).

    Example:
        >>> parse_shaped_rate("10gbit")
        10000000000
        >>> parse_shaped_rate("10tbit")
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: --bandwidth 10tbit is above 1tbit, the most tc's tbf ...
    """
    bits = parse_rate(text, option)
    if bits > MAX_SHAPED_RATE:
        raise UserError(
            f"{option} {text} is above 1tbit, the most tc's tbf qdisc can shape; use at "
            "most 1tbit, or leave the links unshaped (no --bandwidth)"
        )
    return bits


def format_rate(bits_per_s: float) -> str:
    """A rate for people.

    Example:
        >>> format_rate(1e9), format_rate(2.5e8), format_rate(64e3)
        ('1 Gbit/s', '250 Mbit/s', '64 kbit/s')
    """
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g} {unit}"
    return f"{bits_per_s:g} bit/s"


def place_ranks(world_size: int, num_hosts: int, ranks_per_host: int | None = None) -> list[int]:
    """The emulated host of every rank: rank r runs on host ``r // ranks_per_host``.

    ``ranks_per_host`` defaults to spreading the ranks evenly (the last host may get fewer).
    Hosts that would get no rank are not created (verify's one-process reference runs on one).

    Example:
        >>> place_ranks(4, 2), place_ranks(3, 2), place_ranks(4, 4, 2), place_ranks(1, 2)
        ([0, 0, 1, 1], [0, 0, 1], [0, 0, 1, 1], [0])
    """
    per_host = ranks_per_host or -(-world_size // num_hosts)
    if world_size > num_hosts * per_host:
        raise UserError(
            f"--hosts {num_hosts} × --ranks-per-host {per_host} holds {num_hosts * per_host} "
            f"ranks but the job has {world_size}; raise --hosts or --ranks-per-host"
        )
    return [rank // per_host for rank in range(world_size)]


def check_host_count(num_hosts: int) -> None:
    """UserError unless 1..:data:`MAX_HOSTS` emulated hosts are asked for.

    Example:
        >>> check_host_count(2)
    """
    if not 1 <= num_hosts <= MAX_HOSTS:
        raise UserError(
            f"--hosts must be in 1..{MAX_HOSTS} (the emulated hosts share one /24 subnet), "
            f"got {num_hosts}; pass at most {MAX_HOSTS}, or leave --hosts out to run on "
            "loopback"
        )


def check_hosts_filled(world_size: int, num_hosts: int, ranks_per_host: int | None) -> None:
    """UserError when ``--hosts`` asks for hosts the job's ranks would not fill: the run
    would measure fewer hosts than asked for (and say it measured them).

    Example:
        >>> check_hosts_filled(4, 2, None)
        >>> check_hosts_filled(2, 3, None)
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: --hosts 3, but the job's 2 rank(s) fill only 2 host(s) ...
    """
    used = max(place_ranks(world_size, num_hosts, ranks_per_host)) + 1
    if used < num_hosts:
        raise UserError(
            f"--hosts {num_hosts}, but the job's {world_size} rank(s) fill only {used} "
            f"host(s) and the others would stay empty; pass --hosts {used}, or more --workers"
        )


def subnet_of(index: int) -> str:
    """The /24 subnet of allocation slot ``index`` (10.200.0.0/24 upwards).

    Example:
        >>> subnet_of(0), subnet_of(257)
        ('10.200.0', '10.201.1')
    """
    return f"10.{200 + index // 256}.{index % 256}"


def first_free_slot(used: set[int]) -> int:
    """The lowest subnet slot no live run holds.

    Example:
        >>> first_free_slot({0, 1, 3})
        2
    """
    for index in range(MAX_SUBNETS):
        if index not in used:
            return index
    raise UserError(
        f"all {MAX_SUBNETS} emulated-network subnets are taken; run gradsync netem cleanup"
    )


@dataclass(frozen=True)
class Names:
    """Every name of one run: namespaces, interfaces, addresses.

    Example:
        >>> n = Names("1a2b3c", slot=0)
        >>> n.host_namespace(1), n.host_interface(1), n.address(1), n.bridge_namespace
        ('gs1a2b3c-h1', 'gs1a2b3ch1', '10.200.0.2', 'gs1a2b3c-br')
    """

    run_id: str
    slot: int

    @property
    def bridge_namespace(self) -> str:
        return f"{PREFIX}{self.run_id}-br"

    @property
    def bridge(self) -> str:
        return f"{PREFIX}{self.run_id}br"

    def host_namespace(self, host: int) -> str:
        return f"{PREFIX}{self.run_id}-h{host}"

    def host_interface(self, host: int) -> str:
        return f"{PREFIX}{self.run_id}h{host}"

    def bridge_port(self, host: int) -> str:
        return f"{PREFIX}{self.run_id}p{host}"

    def address(self, host: int) -> str:
        return f"{subnet_of(self.slot)}.{host + 1}"


# Seams for tests: the effective user id and the tool lookup.
_euid = os.geteuid
_which = shutil.which


def check_can_emulate() -> None:
    """UserError (one line) unless this process can create namespaces and shape links."""
    if _euid() != 0:
        raise UserError(
            f"--hosts needs root to create network namespaces and shape links (running as "
            f"uid {_euid()}); run gradsync as root, or drop --hosts to run on loopback"
        )
    missing = [tool for tool in ("ip", "tc") if _which(tool) is None]
    if missing:
        raise UserError(
            f"--hosts needs the {' and '.join(missing)} command(s) from iproute2, not found on "
            "PATH; install iproute2 (apt-get install iproute2) or drop --hosts"
        )


def tbf_arguments(bits_per_s: int) -> list[str]:
    """``tc`` arguments of the shaping qdisc at ``bits_per_s``.

    The bucket holds 4 ms at the rate (at least 64 KiB so a GSO packet of the veth passes
    whole); the queue holds 50 ms, enough to keep TCP at the rate without deep buffering.

    Example:
        >>> tbf_arguments(10**9)
        ['tbf', 'rate', '1000000000bit', 'burst', '500000', 'latency', '50ms']
    """
    burst = max(64 * 1024, bits_per_s // 8 * 4 // 1000)
    rate, queue = f"{bits_per_s}bit", f"{QUEUE_MS}ms"
    return [SHAPING_QDISC, "rate", rate, "burst", str(burst), "latency", queue]


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ctrl-C ignored inside the block (in the main thread; elsewhere signals cannot be
    set, and arrive in the main thread anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class EmulatedHosts:
    """Context manager owning one run's namespaces, links and qdiscs.

    Example:
        >>> # with EmulatedHosts(2, parse_rate("1gbit")) as net:
        >>> #     subprocess.run(net.exec_argv(1, ["ip", "addr"]))
    """

    def __init__(self, num_hosts: int, bits_per_s: int | None, *, state_dir: Path = STATE_DIR):
        check_host_count(num_hosts)
        self.num_hosts = num_hosts
        self.bits_per_s = bits_per_s
        self.state_dir = state_dir
        self.names: Names | None = None
        self._created: list[str] = []
        self._previous_sigterm: Any = None

    # -- what the launcher needs -------------------------------------------------------------

    def address(self, host: int) -> str:
        assert self.names is not None
        return self.names.address(host)

    def rank_env(self, host: int) -> dict[str, str]:
        """Environment of a rank on ``host``: Gloo talks over the host's own link."""
        assert self.names is not None
        return {
            "GLOO_SOCKET_IFNAME": self.names.host_interface(host),
            "GRADSYNC_EMULATED_HOST": self.names.host_namespace(host),
        }

    def exec_argv(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace (``ip netns exec`` execs it in place)."""
        assert self.names is not None
        return ["ip", "netns", "exec", self.names.host_namespace(host), *argv]

    def describe(self) -> str:
        assert self.names is not None
        rate = f"{format_rate(self.bits_per_s)} links" if self.bits_per_s else "unshaped links"
        return (
            f"emulated hosts: {self.num_hosts}, {rate}, on {subnet_of(self.names.slot)}.0/24 "
            f"(run {PREFIX}{self.names.run_id}); {NO_DELAY_NOTE}"
        )

    # -- lifetime ----------------------------------------------------------------------------

    def __enter__(self) -> EmulatedHosts:
        check_can_emulate()
        self._catch_sigterm()
        try:
            self.names = self._allocate()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Delete every namespace of this run (their links and qdiscs go with them); a
        signal that arrives meanwhile waits until the last is gone (a second Ctrl-C or
        SIGTERM of an impatient user left namespaces behind)."""
        with signals_deferred(), _sigint_ignored():
            failures = [f for n in reversed(self._created) if (f := _delete_namespace(n))]
            self._created.clear()
            if self.names is not None and not failures:
                (self.state_dir / f"{self.names.run_id}.json").unlink(missing_ok=True)
            if failures:
                print(
                    f"gradsync: warning: could not delete {'; '.join(failures)}; "
                    "run gradsync netem cleanup",
                    file=sys.stderr,
                )
            self._restore_sigterm()

    def _allocate(self) -> Names:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with _locked(self.state_dir):
            states = list(_read_states(self.state_dir))
            taken_ids = {s["run_id"] for s in states} | {
                m.group(1) for m in map(NAMESPACE_PATTERN.match, list_namespaces()) if m
            }
            run_id = secrets.token_hex(3)
            while run_id in taken_ids:
                run_id = secrets.token_hex(3)
            names = Names(run_id, first_free_slot({int(s["slot"]) for s in states}))
            state = {
                "run_id": run_id,
                "slot": names.slot,
                "owner_pid": os.getpid(),
                "owner_start": _start_time(os.getpid()),
                "hosts": self.num_hosts,
                "bits_per_s": self.bits_per_s,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            }
            # Written before anything exists, so a launcher killed mid-setup is detectable.
            (self.state_dir / f"{run_id}.json").write_text(json.dumps(state) + "\n")
        return names

    def _build(self) -> None:
        names = self.names
        assert names is not None
        bridge_ns = names.bridge_namespace
        self._add_namespace(bridge_ns)
        _ip("-n", bridge_ns, "link", "add", names.bridge, "type", "bridge")
        _ip("-n", bridge_ns, "link", "set", names.bridge, "up")
        for host in range(self.num_hosts):
            host_ns, link, port = (
                names.host_namespace(host),
                names.host_interface(host),
                names.bridge_port(host),
            )
            self._add_namespace(host_ns)
            _ip("-n", host_ns, "link", "set", "lo", "up")
            _ip("link", "add", link, "netns", host_ns, "type", "veth", "peer", "name", port,
                "netns", bridge_ns)  # fmt: skip
            _ip("-n", bridge_ns, "link", "set", port, "master", names.bridge)
            _ip("-n", host_ns, "addr", "add", f"{names.address(host)}/24", "dev", link)
            if self.bits_per_s:
                _shape(host_ns, link, self.bits_per_s)  # the host's egress
                _shape(bridge_ns, port, self.bits_per_s)  # the host's ingress
            _ip("-n", bridge_ns, "link", "set", port, "up")
            _ip("-n", host_ns, "link", "set", link, "up")
        self._write_hosts_files()

    def _add_namespace(self, namespace: str) -> None:
        self._created.append(namespace)
        _ip("netns", "add", namespace)

    def _write_hosts_files(self) -> None:
        # Every emulated host resolves the others' names and addresses (Gloo looks them up).
        names = self.names
        assert names is not None
        # The IPv4-mapped forms too: c10d's store listens on IPv6 and names its peers.
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        for h in range(self.num_hosts):
            lines += [
                f"{prefix}{names.address(h)} {names.host_namespace(h)}"
                for prefix in ("", "::ffff:")
            ]
        # The machine's own name resolves to the host's address, as on a real host: a
        # library that binds to the address of gethostname() (Horovod's Gloo process sets)
        # gets the emulated link, not a loopback another namespace cannot reach.
        for host in range(self.num_hosts):
            folder = NETNS_ETC / names.host_namespace(host)
            folder.mkdir(parents=True, exist_ok=True)
            own = [f"{names.address(host)} {socket.gethostname()}"]
            (folder / "hosts").write_text("\n".join(lines + own) + "\n")

    def _catch_sigterm(self) -> None:
        # SIGTERM to the launcher unwinds like Ctrl-C, so the namespaces are deleted. A
        # handler already installed (gradsync's own, raising Stopped) unwinds too, and
        # keeps its exit code and its deferral around checkpoint writes: it stays.
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)

    def _restore_sigterm(self) -> None:
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=False)


def _ip(*args: str) -> None:
    result = _run(["ip", *args])
    if result.returncode:
        message = (result.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise UserError(f"emulated hosts: 'ip {' '.join(args)}' failed: {message}")


def _shape(namespace: str, device: str, bits_per_s: int) -> None:
    args = ["-n", namespace, "qdisc", "add", "dev", device, "root", *tbf_arguments(bits_per_s)]
    result = _run(["tc", *args])
    if result.returncode:
        message = (result.stderr.strip().splitlines() or ["(no message)"])[0]
        raise UserError(
            f"tc could not add the '{SHAPING_QDISC}' qdisc that --bandwidth needs ({message}); "
            f"if the kernel lacks it, load it (modprobe sch_{SHAPING_QDISC}), or drop --bandwidth"
        )


def _delete_namespace(namespace: str) -> str | None:
    shutil.rmtree(NETNS_ETC / namespace, ignore_errors=True)
    result = _run(["ip", "netns", "del", namespace])
    if result.returncode and namespace in list_namespaces():
        return f"namespace {namespace} ({result.stderr.strip()})"
    return None


def list_namespaces() -> list[str]:
    """Names of the network namespaces ``ip netns`` knows."""
    if _which("ip") is None:
        return []
    result = _run(["ip", "netns", "list"])
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


@contextlib.contextmanager
def _locked(state_dir: Path) -> Iterator[None]:
    with open(state_dir / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _read_states(state_dir: Path) -> Iterator[dict[str, Any]]:
    for path in sorted(state_dir.glob("*.json")):
        with contextlib.suppress(OSError, ValueError, KeyError):
            state = json.loads(path.read_text())
            if isinstance(state, dict) and "run_id" in state and "slot" in state:
                yield state


def _start_time(pid: int) -> str | None:
    """The start time of ``pid`` (tells a reused pid from the original owner)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def owner_alive(state: dict[str, Any]) -> bool:
    """Whether the launcher that created a run still runs."""
    pid = int(state.get("owner_pid", 0))
    return pid > 0 and _start_time(pid) is not None and _start_time(pid) == state.get("owner_start")


@dataclass(frozen=True)
class Leftover:
    run_id: str
    namespaces: tuple[str, ...]
    owner_pid: int | None
    alive: bool


def find_runs(state_dir: Path = STATE_DIR) -> list[Leftover]:
    """Every emulated-network run on this machine, live or left over."""
    states = {s["run_id"]: s for s in _read_states(state_dir)} if state_dir.is_dir() else {}
    by_run: dict[str, list[str]] = {run_id: [] for run_id in states}
    etc_folders = [p.name for p in NETNS_ETC.iterdir()] if NETNS_ETC.is_dir() else []
    for namespace in sorted(set(list_namespaces()) | set(etc_folders)):
        match = NAMESPACE_PATTERN.match(namespace)
        if match:
            by_run.setdefault(match.group(1), []).append(namespace)
    runs = []
    for run_id, namespaces in sorted(by_run.items()):
        state = states.get(run_id)
        runs.append(
            Leftover(
                run_id=run_id,
                namespaces=tuple(sorted(namespaces)),
                owner_pid=int(state["owner_pid"]) if state else None,
                alive=state is not None and owner_alive(state),
            )
        )
    return runs


def cleanup(state_dir: Path = STATE_DIR) -> list[Leftover]:
    """Delete the namespaces and state of every run whose launcher is gone; return them."""
    check_can_emulate()
    removed = []
    for run in find_runs(state_dir):
        if run.alive:
            continue
        for namespace in run.namespaces:
            _delete_namespace(namespace)
        (state_dir / f"{run.run_id}.json").unlink(missing_ok=True)
        removed.append(run)
    return removed
