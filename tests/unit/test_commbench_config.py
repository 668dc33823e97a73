"""commbench's configuration: what a job file carries, and bad values refused in one line."""

from __future__ import annotations

import pytest

from gradsync.commbench import CommbenchConfig
from gradsync.config import LaunchConfig
from gradsync.errors import UserError


def test_busy_intervals_survive_the_job_file() -> None:
    config = CommbenchConfig(workers=2, ops=("allreduce",), sizes=(4096,), busy_ms=(0.0, 1.5))
    assert CommbenchConfig.from_json(config.to_json()) == config
    assert CommbenchConfig(workers=2).busy_ms == (0.0,)  # idle ranks unless asked


@pytest.mark.parametrize("busy_ms", [(), (-1.0,), (0.0, 1000.0)])
def test_busy_intervals_must_be_milliseconds_below_a_second(busy_ms: tuple[float, ...]) -> None:
    with pytest.raises(UserError, match="--busy-ms"):
        CommbenchConfig(workers=2, busy_ms=busy_ms)


def test_an_operation_named_twice_is_refused() -> None:
    with pytest.raises(UserError, match="--ops lists allreduce more than once"):
        CommbenchConfig(ops=("allreduce", "p2p", "allreduce"))


def test_sizes_beyond_memory_are_refused_before_the_folder_is_claimed(tmp_path) -> None:
    """`commbench --sizes 64G --overwrite` cleared the previous results, then every rank
    died in its allocator (session 24's probe)."""
    from gradsync.cli import main

    out = tmp_path / "bench"
    out.mkdir()
    (out / "commbench.json").write_text("{}")  # a previous run's results
    argv = ["commbench", "--sizes", "1048576G", "--ops", "p2p", "--out", str(out), "--overwrite"]
    assert main(argv) == 2
    assert (out / "commbench.json").read_text() == "{}"


def test_more_hosts_than_the_ranks_fill_is_refused() -> None:
    # commbench.md said "2 emulated hosts" while commbench.json recorded 3
    with pytest.raises(UserError, match="--hosts 3, but the job's 2 rank"):
        CommbenchConfig(workers=2, launch=LaunchConfig(hosts=3))
    assert CommbenchConfig(workers=2, launch=LaunchConfig(hosts=2)).launch.hosts == 2
