"""Ranks, roles and launcher environments.

gradsync runs under its own launcher (``gradsync train --workers N``), under ``torchrun``,
under Slurm's ``srun`` or under ``mpirun`` (Open MPI or MPICH/Intel MPI). Each of those
publishes the rank layout in environment variables; :func:`detect_environment` reads them
into one :class:`RankEnv`.
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from gradsync.errors import UserError

DEFAULT_PORT = 29500


@dataclass(frozen=True, kw_only=True)
class RankEnv:
    """Where this process sits in the job.

    Example:
        >>> env = detect_environment({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
        ...     "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h0", "MASTER_PORT": "29500"})
        >>> (env.launcher, env.rank, env.world_size, env.node_rank)
        ('torchrun', 1, 2, 0)
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    group_rank: int | None = None  # the node's index where the launcher says (GROUP_RANK)
    job: str = ""  # the launch as the launcher names it (Slurm step, MPI job), "" if unnamed
    attempt: int = 0  # the launcher's restart of this launch (torchrun --max-restarts, requeue)

    @property
    def node_rank(self) -> int:
        if self.group_rank is not None:  # nodes may hold different numbers of ranks
            return self.group_rank
        return self.rank // self.local_world_size

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.local_world_size)


def detect_environment(
    env: Mapping[str, str] | None = None,
    *,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> RankEnv | None:
    """The launcher environment this process runs in, or None when started by hand.

    ``master_addr``/``master_port`` (from the command line) win over the environment.
    """
    env = os.environ if env is None else env
    for reader in (_from_torchrun, _from_slurm, _from_open_mpi, _from_mpich):
        found = reader(env, master_addr, master_port)
        if found is not None:
            return found
    return None


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    if key not in env:
        if default is not None:
            return default
        raise UserError(
            f"environment variable {key} is not set, but the launcher set the others of its "
            "kind; start gradsync with the launcher itself (torchrun, srun or mpirun)"
        )
    try:
        return int(env[key])
    except ValueError:
        raise UserError(f"environment variable {key}={env[key]!r} is not an integer") from None


def _checked(found: RankEnv, rank_key: str, size_key: str) -> RankEnv:
    """``found``, or a UserError naming the launcher's variables when its rank is outside
    its world (two launches mixed, or variables set by hand).

    Example:
        >>> env = RankEnv(launcher="slurm", rank=2, world_size=2, local_rank=0,
        ...               local_world_size=1, master_addr="h", master_port=1)
        >>> _checked(env, "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: SLURM_PROCID=2 is not below SLURM_STEP_NUM_TASKS=2: ...
    """
    if found.world_size < 1 or not 0 <= found.rank < found.world_size:
        raise UserError(
            f"{rank_key}={found.rank} is not below {size_key}={found.world_size}: this "
            "process's rank lies outside its world; start the ranks with one launch"
        )
    if not 0 <= found.local_rank < found.local_world_size:
        raise UserError(
            f"local rank {found.local_rank} is outside the {found.local_world_size} ranks "
            f"of this node ({found.launcher}'s variables); start the ranks with one launch"
        )
    return found


def _from_torchrun(env: Mapping[str, str], addr: str | None, port: int | None) -> RankEnv | None:
    if not {"RANK", "WORLD_SIZE"} <= env.keys():
        return None
    world_size = _int(env, "WORLD_SIZE")
    run_id = env.get("TORCHELASTIC_RUN_ID", "none")
    found = RankEnv(
        launcher=env.get("GRADSYNC_LAUNCHER", "torchrun"),
        rank=_int(env, "RANK"),
        world_size=world_size,
        local_rank=_int(env, "LOCAL_RANK", _int(env, "RANK")),
        local_world_size=_int(env, "LOCAL_WORLD_SIZE", world_size),
        master_addr=addr or env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=port or _int(env, "MASTER_PORT", DEFAULT_PORT),
        group_rank=_int(env, "GROUP_RANK") if "GROUP_RANK" in env else None,
        job="" if run_id == "none" else f"torchrun run {run_id}",
        attempt=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
    )
    return _checked(found, "RANK", "WORLD_SIZE")


def _from_slurm(env: Mapping[str, str], addr: str | None, port: int | None) -> RankEnv | None:
    # SLURM_STEP_NUM_TASKS is set inside an srun step, not in the sbatch script itself.
    if "SLURM_PROCID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
        return None
    world_size = _int(env, "SLURM_STEP_NUM_TASKS")
    tasks_per_node = parse_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", str(world_size)))
    node_list = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "127.0.0.1")
    step = f"{_int(env, 'SLURM_JOB_ID', 0)}.{_int(env, 'SLURM_STEP_ID', 0)}"
    node_id = _int(env, "SLURM_NODEID", 0)
    found = RankEnv(
        launcher="slurm",
        rank=_int(env, "SLURM_PROCID"),
        world_size=world_size,
        local_rank=_int(env, "SLURM_LOCALID", 0),
        local_world_size=tasks_per_node[min(node_id, len(tasks_per_node) - 1)],
        master_addr=addr or env.get("MASTER_ADDR") or expand_nodelist(node_list)[0],
        # Every task must agree on the port without talking: derive it from the job step,
        # so two steps of one job running at once (srun ... &) meet apart.
        master_port=port or _int(env, "MASTER_PORT", slurm_port(step)),
        # Nodes may hold different numbers of tasks ("3,2"): the node index is Slurm's.
        group_rank=node_id if "SLURM_NODEID" in env else None,
        job=f"Slurm step {step}",
        attempt=_int(env, "SLURM_RESTART_COUNT", 0),
    )
    return _checked(found, "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")


def slurm_port(step: str) -> int:
    """The rendezvous port of Slurm job step ``step`` ("JOB.STEP"): one of 1000 after
    :data:`DEFAULT_PORT`, spread by a hash so that neighbouring jobs and steps differ.

    Example:
        >>> slurm_port("7.0") != slurm_port("7.1"), 29500 <= slurm_port("7.0") < 30500
        (True, True)
    """
    return DEFAULT_PORT + zlib.crc32(step.encode()) % 1000


def check_slurm_step(env: Mapping[str, str] | None = None) -> None:
    """UserError when this is a Slurm allocation of several tasks but not an ``srun`` step.

    A batch script (or an ``salloc`` shell) has ``SLURM_JOB_ID`` but no ``SLURM_STEP_ID``:
    ``gradsync train`` there would train alone instead of as one of the job's tasks.

    Example:
        >>> check_slurm_step({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2"})
        >>> check_slurm_step({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2"})
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: this is Slurm job 7 (2 tasks) but not a job step: ...
    """
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" not in env or "SLURM_STEP_ID" in env:
        return
    tasks = _int(env, "SLURM_NTASKS", _int(env, "SLURM_JOB_NUM_NODES", 1))
    if tasks > 1:
        raise UserError(
            f"this is Slurm job {env['SLURM_JOB_ID']} ({tasks} tasks) but not a job step: "
            "start the ranks with srun (srun gradsync train ...), or pass --workers N to "
            "start N local processes on this node"
        )


def _from_open_mpi(env: Mapping[str, str], addr: str | None, port: int | None) -> RankEnv | None:
    if "OMPI_COMM_WORLD_RANK" not in env:
        return None
    return _mpi_env(
        env,
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        addr,
        port,
    )


def _from_mpich(env: Mapping[str, str], addr: str | None, port: int | None) -> RankEnv | None:
    if "PMI_RANK" not in env:
        return None
    return _mpi_env(env, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", addr, port)


def _mpi_env(
    env: Mapping[str, str],
    rank_key: str,
    size_key: str,
    local_rank_key: str,
    local_size_key: str,
    addr: str | None,
    port: int | None,
) -> RankEnv:
    world_size = _int(env, size_key)
    local_world_size = _int(env, local_size_key, world_size)
    master_addr = addr or env.get("MASTER_ADDR")
    if master_addr is None:
        if local_world_size != world_size:
            raise UserError(
                "under mpirun across several nodes gradsync needs the rendezvous "
                "host: pass --master-addr HOST (or export MASTER_ADDR)"
            )
        master_addr = "127.0.0.1"
    job = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid") or ""
    found = RankEnv(
        launcher="mpirun",
        rank=_int(env, rank_key),
        world_size=world_size,
        local_rank=_int(env, local_rank_key, _int(env, rank_key)),
        local_world_size=local_world_size,
        master_addr=master_addr,
        master_port=port or _int(env, "MASTER_PORT", DEFAULT_PORT),
        job=f"MPI job {job}" if job else "",
    )
    return _checked(found, rank_key, size_key)


def parse_tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed tasks-per-node list.

    Example:
        >>> parse_tasks_per_node("2(x3),1")
        [2, 2, 2, 1]
    """
    counts: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise UserError(f"cannot parse Slurm tasks-per-node list {text!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list.

    Example:
        >>> expand_nodelist("gpu[01-03,07],login1")
        ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login1']
    """
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", text):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            width = len(low)
            for number in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{number:0{width}d}")
    return hosts


def default_threads(local_world_size: int, cores: int | None = None) -> int:
    """Intra-op threads per rank so local ranks do not oversubscribe the CPU: ``cores``
    (default: this process's) shared by the ranks on this machine.

    Example:
        >>> default_threads(3, cores=8), default_threads(16, cores=8)
        (2, 1)
    """
    if cores is None:
        cores = machine_cores()
    return max(1, cores // max(1, local_world_size))


def machine_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
