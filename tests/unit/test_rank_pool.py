"""The dist tests' rank pool: a closed pool is not reused."""

from __future__ import annotations

from tests.dist.conftest import RankPool


def test_a_closed_pool_is_not_alive() -> None:
    pool = RankPool.__new__(RankPool)  # no processes: the state close() leaves behind
    pool.procs, pool.readers, pool.writers = [], [], []
    assert not pool.alive()
