"""Launcher environments (torchrun, Slurm, Open MPI, MPICH/Intel MPI) and Slurm's host lists."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync.errors import UserError
from gradsync.topology import (
    DEFAULT_PORT,
    RankEnv,
    default_threads,
    detect_environment,
    expand_nodelist,
    parse_tasks_per_node,
    slurm_port,
)

TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "head",
    "MASTER_PORT": "12345",
}

SLURM = {
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "node[07-08]",
    "SLURM_JOB_NODELIST": "node[01-09]",
    "SLURM_JOB_ID": "123456",
}

OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "6",
    "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    "MASTER_ADDR": "mpihead",
}

MPICH = {
    "PMI_RANK": "2",
    "PMI_SIZE": "3",
    "MPI_LOCALRANKID": "2",
    "MPI_LOCALNRANKS": "3",
}


def _fields(env: RankEnv) -> tuple:
    return (
        env.launcher,
        env.rank,
        env.world_size,
        env.local_rank,
        env.local_world_size,
        env.master_addr,
        env.master_port,
    )


def test_torchrun():
    env = detect_environment(TORCHRUN)
    assert _fields(env) == ("torchrun", 5, 8, 1, 4, "head", 12345)
    assert (env.node_rank, env.num_nodes) == (1, 2)


def test_torchrun_minimal_defaults_to_one_node_on_loopback():
    env = detect_environment({"RANK": "1", "WORLD_SIZE": "3"})
    assert _fields(env) == ("torchrun", 1, 3, 1, 3, "127.0.0.1", DEFAULT_PORT)
    assert (env.node_rank, env.num_nodes) == (0, 1)


def test_gradsync_launcher_names_itself():
    env = detect_environment({**TORCHRUN, "GRADSYNC_LAUNCHER": "gradsync"})
    assert env.launcher == "gradsync" and env.rank == 5


def test_slurm_step():
    env = detect_environment(SLURM)
    # Every task derives the same port from the job step (no SLURM_STEP_ID: step 0).
    assert _fields(env) == ("slurm", 3, 4, 1, 2, "node07", slurm_port("123456.0"))
    assert (env.node_rank, env.num_nodes) == (1, 2)
    assert env.job == "Slurm step 123456.0"


def test_slurm_port_differs_between_jobs_and_master_env_wins():
    ports = {
        detect_environment({**SLURM, "SLURM_JOB_ID": job, "SLURM_STEP_ID": step}).master_port
        for job, step in [("123456", "0"), ("123457", "0"), ("123456", "1")]
    }
    assert len(ports) == 3  # two jobs, and two steps of one job running at once
    env = detect_environment({**SLURM, "MASTER_ADDR": "login2", "MASTER_PORT": "40000"})
    assert (env.master_addr, env.master_port) == ("login2", 40000)


def test_slurm_falls_back_on_job_nodelist():
    env = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}
    assert detect_environment(env).master_addr == "node01"


def test_slurm_batch_script_without_step_is_not_a_rank():
    # sbatch sets SLURM_PROCID=0 in the batch script; only srun sets SLURM_STEP_NUM_TASKS.
    assert detect_environment({"SLURM_PROCID": "0", "SLURM_JOB_ID": "5"}) is None


def test_slurm_uneven_tasks_per_node_uses_this_nodes_count():
    # srun -n 4 -N 3: node0 runs ranks 0-1, node1 rank 2, node2 rank 3.
    env = detect_environment(
        {
            "SLURM_PROCID": "3",
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": "2",
            "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_STEP_TASKS_PER_NODE": "2,1(x2)",
            "SLURM_STEP_NODELIST": "n[1-3]",
        }
    )
    assert env.local_world_size == 1


def test_open_mpi():
    env = detect_environment(OPEN_MPI)
    assert _fields(env) == ("mpirun", 6, 8, 2, 4, "mpihead", DEFAULT_PORT)
    assert (env.node_rank, env.num_nodes) == (1, 2)


def test_mpich_single_node_needs_no_master_addr():
    env = detect_environment(MPICH)
    assert _fields(env) == ("mpirun", 2, 3, 2, 3, "127.0.0.1", DEFAULT_PORT)


def test_mpich_multi_node_uses_master_env():
    env = detect_environment(
        {
            "PMI_RANK": "5",
            "PMI_SIZE": "8",
            "MPI_LOCALRANKID": "1",
            "MPI_LOCALNRANKS": "4",
            "MASTER_ADDR": "10.1.2.3",
            "MASTER_PORT": "31000",
        }
    )
    assert _fields(env) == ("mpirun", 5, 8, 1, 4, "10.1.2.3", 31000)
    assert (env.node_rank, env.num_nodes) == (1, 2)


@pytest.mark.parametrize(
    "env",
    [
        {k: v for k, v in OPEN_MPI.items() if k != "MASTER_ADDR"},
        {"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"},
    ],
    ids=["open-mpi", "mpich"],
)
def test_multi_node_mpirun_without_master_addr_is_a_user_error(env):
    with pytest.raises(UserError, match="--master-addr HOST"):
        detect_environment(env)
    # ... and passing the address on the command line fixes it.
    assert detect_environment(env, master_addr="h0").master_addr == "h0"


@pytest.mark.parametrize(
    "env", [TORCHRUN, SLURM, OPEN_MPI, MPICH], ids=["torchrun", "slurm", "ompi", "mpich"]
)
def test_command_line_address_and_port_win_over_the_environment(env):
    found = detect_environment(env, master_addr="cli-host", master_port=40123)
    assert (found.master_addr, found.master_port) == ("cli-host", 40123)
    assert found.rank == detect_environment(env).rank


def test_no_launcher_is_none():
    assert detect_environment({}) is None
    assert detect_environment({"HOME": "/root", "LOCAL_RANK": "0", "MASTER_ADDR": "x"}) is None


def test_reads_os_environ_by_default(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert detect_environment() is None
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "29999")
    env = detect_environment()
    assert (env.rank, env.world_size, env.master_port) == (0, 2, 29999)


def test_torchrun_wins_when_several_launchers_are_visible():
    env = detect_environment({**SLURM, **TORCHRUN})
    assert env.launcher == "torchrun" and env.rank == 5


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"RANK": "zero", "WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "2x"}, "WORLD_SIZE"),
        ({**SLURM, "SLURM_STEP_NUM_TASKS": "four"}, "SLURM_STEP_NUM_TASKS"),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": ""}, "OMPI_COMM_WORLD_SIZE"),
    ],
)
def test_non_integer_rank_variables_are_user_errors(env, key):
    with pytest.raises(UserError, match=f"{key}=.* is not an integer"):
        detect_environment(env)


@pytest.mark.parametrize(
    ("rank", "local", "world", "node_rank", "num_nodes"),
    [
        (0, 4, 8, 0, 2),
        (3, 4, 8, 0, 2),
        (4, 4, 8, 1, 2),
        (7, 4, 8, 1, 2),
        (5, 2, 6, 2, 3),
        (0, 1, 1, 0, 1),
        (4, 3, 5, 1, 2),
    ],
)
def test_node_rank_and_num_nodes(rank, local, world, node_rank, num_nodes):
    env = RankEnv(
        launcher="x",
        rank=rank,
        world_size=world,
        local_rank=rank % local,
        local_world_size=local,
        master_addr="h",
        master_port=1,
    )
    assert (env.node_rank, env.num_nodes) == (node_rank, num_nodes)


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node[07-08]", ["node07", "node08"]),
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("login1,gpu[9-11]", ["login1", "gpu9", "gpu10", "gpu11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("a1,b2", ["a1", "b2"]),
        ("single", ["single"]),
        ("rack-a[1,3],rack-b[2]", ["rack-a1", "rack-a3", "rack-b2"]),
        ("h1.cluster.org", ["h1.cluster.org"]),
    ],
)
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize(
    ("text", "counts"),
    [("2(x2)", [2, 2]), ("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1, 3(x2)", [1, 3, 3])],
)
def test_parse_tasks_per_node(text, counts):
    assert parse_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "2(3)", "x", "2(x)", "-1", "2,,1"])
def test_parse_tasks_per_node_rejects_garbage(text):
    with pytest.raises(UserError, match="cannot parse Slurm tasks-per-node"):
        parse_tasks_per_node(text)


_runs = st.lists(st.tuples(st.integers(1, 16), st.integers(1, 9)), min_size=1, max_size=6)


@settings(deadline=None)
@given(_runs)
def test_parse_tasks_per_node_inverts_slurms_compression(runs):
    text = ",".join(f"{count}(x{repeat})" if repeat > 1 else str(count) for count, repeat in runs)
    assert parse_tasks_per_node(text) == [count for count, repeat in runs for _ in range(repeat)]


_prefix = st.from_regex(r"[a-z][a-z0-9-]{0,5}[a-z-]", fullmatch=True)
_range = st.tuples(st.integers(0, 300), st.integers(0, 12), st.integers(1, 4))


@settings(deadline=None)
@given(
    st.lists(st.tuples(_prefix, st.lists(_range, min_size=1, max_size=3)), min_size=1, max_size=4)
)
def test_expand_nodelist_inverts_slurms_compression(groups):
    text_parts, expected = [], []
    for prefix, ranges in groups:
        parts = []
        for low, span, width in ranges:
            high = low + span
            width = max(width, len(str(high)))  # Slurm pads both ends to one width
            parts.append(f"{low:0{width}d}-{high:0{width}d}" if span else f"{low:0{width}d}")
            expected += [f"{prefix}{n:0{width}d}" for n in range(low, high + 1)]
        text_parts.append(f"{prefix}[{','.join(parts)}]")
    assert expand_nodelist(",".join(text_parts)) == expected


def test_default_threads_divides_cores_over_local_ranks(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert [default_threads(n) for n in (1, 2, 3, 8, 16, 0)] == [8, 4, 2, 1, 1, 8]


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        ({**SLURM, "SLURM_PROCID": "4"}, "SLURM_PROCID=4 is not below SLURM_STEP_NUM_TASKS=4"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1 is not below WORLD_SIZE=2"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "RANK=0 is not below WORLD_SIZE=0"),
        ({**OPEN_MPI, "OMPI_COMM_WORLD_RANK": "8"}, "OMPI_COMM_WORLD_RANK=8 is not below"),
        ({"PMI_RANK": "0"}, "environment variable PMI_SIZE is not set"),
    ],
)
def test_a_rank_outside_its_world_is_one_line(variables: dict[str, str], named: str) -> None:
    with pytest.raises(UserError, match=re.escape(named)):
        detect_environment(variables)
