"""Test tiers: everything under tests/e2e and tests/cluster launches real jobs, so it is
``slow``; ``python -m pytest -m "not slow"`` is the contributors' fast tier (unit tests,
multi-rank tests on a shared pool of ranks, doctests)."""

from __future__ import annotations

from pathlib import Path

import pytest

SLOW_FOLDERS = ("e2e", "cluster")
collect_ignore = ["plugins"]  # imported by the ranks of the plugin test, not collected


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        folder = (
            Path(item.fspath).relative_to(tests).parts[0]
            if tests in Path(item.fspath).parents
            else ""
        )
        if folder in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)
