"""A real one-machine Slurm cluster for tests: munged, slurmctld and one slurmd, all ours.

:func:`ensure_packages` installs Debian's ``slurm-wlm``, ``munge`` and ``openmpi-bin`` when
their commands are missing (no apt call when they are present) and says why it cannot
otherwise. :class:`SlurmCluster` writes a private ``slurm.conf`` (one node named
``localhost`` with :data:`NODE_CPUS` CPUs, free ports, its own munge socket and key), starts
the three daemons in the foreground as its own children, waits until ``sinfo`` shows the
node idle, and on exit cancels the jobs of this cluster, stops the daemons by pid and
deletes its folder::

    with SlurmCluster.start() as cluster:
        subprocess.run(["srun", "-n", "2", "hostname"], env=cluster.env(), check=True)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = {  # Debian package → commands it provides that the tests run
    "slurm-wlm": ("slurmctld", "slurmd", "srun", "sbatch", "sinfo", "squeue", "scancel"),
    "munge": ("munged",),
    "openmpi-bin": ("mpirun",),
}
NODE_CPUS = 8  # more than this machine has: slurmd takes the configured count (overrides)
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0
ACTIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED")


def missing_packages() -> list[str]:
    """Debian packages whose commands are not on PATH.

    Example:
        >>> set(missing_packages()) <= set(PACKAGES)
        True
    """
    return [pkg for pkg, tools in PACKAGES.items() if any(shutil.which(t) is None for t in tools)]


def ensure_packages() -> str | None:
    """Install the missing packages with apt; None when all are there, else why not.

    Example:
        >>> # reason = ensure_packages(); reason is None or pytest.skip(reason)
    """
    missing = missing_packages()
    if not missing:
        return None  # the fast path: no apt call
    if os.geteuid() != 0:
        return f"Debian packages {', '.join(missing)} are missing and installing needs root"
    if shutil.which("apt-get") is None:
        return f"Debian packages {', '.join(missing)} are missing and there is no apt-get"
    error = _apt_install(missing)
    if error is not None:  # a fresh machine may have no package lists yet
        _apt(["update"])
        error = _apt_install(missing)
    if error is not None:
        return f"apt-get install {' '.join(missing)} failed: {error}"
    still = missing_packages()
    return f"installed, but commands of {', '.join(still)} are missing" if still else None


def _apt(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(
        ["apt-get", "-q", *args], env=env, capture_output=True, text=True, timeout=900, check=False
    )


def _apt_install(packages: list[str]) -> str | None:
    print(f"installing Debian packages {' '.join(packages)} for the cluster tests", flush=True)
    result = _apt(["install", "-y", "--no-install-recommends", *packages])
    if result.returncode == 0:
        return None
    return (result.stderr.strip().splitlines() or ["(no message)"])[-1]


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def slurm_conf(folder: Path, *, ctld_port: int, slurmd_port: int, cpus: int = NODE_CPUS) -> str:
    """A minimal ``slurm.conf``: one node ``localhost``, no cgroups, no accounting.

    Example:
        >>> text = slurm_conf(Path("/x"), ctld_port=7001, slurmd_port=7002, cpus=4)
        >>> "NodeName=localhost NodeAddr=127.0.0.1 CPUs=4" in text
        True
    """
    return f"""\
ClusterName=gradsynctest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={folder}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={folder}/ctld
SlurmdSpoolDir={folder}/slurmd
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
InactiveLimit=0
KillWait=5
MinJobAge=300
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    """The daemons of one private cluster and its folder (config, state, logs)."""

    folder: Path
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @classmethod
    @contextlib.contextmanager
    def start(cls, cpus: int = NODE_CPUS) -> Iterator[SlurmCluster]:
        """Start munged, slurmctld and slurmd; yield once the node is idle; tear down."""
        cluster = cls(Path(tempfile.mkdtemp(prefix="gradsync-slurm-")))
        try:
            cluster._write_config(cpus)
            cluster._start_daemons()
            cluster._wait_idle()
            yield cluster
        finally:
            cluster.stop()

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a Slurm command of this cluster (and of its jobs)."""
        return {**os.environ, "SLURM_CONF": str(self.conf), **extra}

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """A Slurm client command of this cluster (``sinfo``, ``squeue`` …), captured."""
        return subprocess.run(
            argv, env=self.env(), capture_output=True, text=True, timeout=timeout, check=False
        )

    def sbatch(self, *args: str, cwd: Path, timeout: float = 300) -> int:
        """Submit a batch job, wait until it ends, return its exit code.

        (``sbatch --wait`` polls every 2, 8, 32 … seconds; this polls every 0.2 s.)
        """
        submitted = subprocess.run(
            ["sbatch", "--parsable", *args],
            cwd=cwd,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        job_id = submitted.stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fields = dict(
                item.split("=", 1)
                for item in self.run("scontrol", "-o", "show", "job", job_id).stdout.split()
                if "=" in item
            )
            if fields.get("JobState") not in (None, *ACTIVE_STATES):
                return int(fields["ExitCode"].split(":")[0])
            time.sleep(0.2)
        raise TimeoutError(f"batch job {job_id} did not end within {timeout:.0f} s")

    def logs(self) -> str:
        """The daemons' log tails, for a failing test's message."""
        parts = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log"):
            path = self.folder / name
            if path.exists():
                parts.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-15:]))
        return "\n".join(parts)

    def _write_config(self, cpus: int) -> None:
        for sub in ("munge", "ctld", "slurmd"):
            (self.folder / sub).mkdir(mode=0o700)
        key = self.folder / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        text = slurm_conf(self.folder, ctld_port=free_port(), slurmd_port=free_port(), cpus=cpus)
        self.conf.write_text(text)

    def _start_daemons(self) -> None:
        munge = self.folder / "munge"
        self._spawn(
            "munged", "--foreground", "--force", f"--socket={munge}/munge.socket",
            f"--key-file={munge}/munge.key", f"--pid-file={munge}/munged.pid",
            f"--seed-file={munge}/munged.seed", f"--log-file={self.folder}/munged.log",
        )  # fmt: skip
        self._wait_for(lambda: (munge / "munge.socket").exists(), "munged's socket")
        self._spawn("slurmctld", "-D", "-c", "-f", str(self.conf))
        self._spawn("slurmd", "-D", "-N", "localhost", "-f", str(self.conf))

    def _spawn(self, *argv: str) -> None:
        log = open(self.folder / f"{argv[0]}.out", "wb")  # noqa: SIM115 - closed by the child
        with log:
            self.processes.append(
                subprocess.Popen(argv, env=self.env(), stdout=log, stderr=subprocess.STDOUT)
            )

    def _wait_idle(self) -> None:
        def idle() -> bool:
            return self.run("sinfo", "-h", "-N", "-o", "%T").stdout.strip() == "idle"

        self._wait_for(idle, "the node to be idle in sinfo")

    def _wait_for(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            dead = [p.args[0] for p in self.processes if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"{START_TIMEOUT_S:.0f} s passed"
                raise RuntimeError(f"test Slurm cluster: waiting for {what}, {why}\n{self.logs()}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Cancel this cluster's jobs, stop the daemons (by pid, newest first), delete all."""
        if any(p.args[0] == "slurmctld" and p.poll() is None for p in self.processes):
            jobs = self.run("squeue", "-h", "-o", "%i").stdout.split()
            if jobs:  # every job of this private cluster was started by these tests
                self.run("scancel", *jobs)
        for process in reversed(self.processes):
            _stop(process)
        self.processes.clear()
        shutil.rmtree(self.folder, ignore_errors=True)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
