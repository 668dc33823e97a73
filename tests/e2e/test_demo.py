"""`gradsync demo` runs every registered strategy and writes one side-by-side table."""

from __future__ import annotations

import json
from pathlib import Path

from gradsync.strategies import STRATEGIES
from tests.e2e.conftest import gradsync


def test_demo_runs_every_strategy_and_writes_results(workdir: Path) -> None:
    result = gradsync("demo", "--preset", "tiny", "--steps", "8", "--out", "demo", cwd=workdir)
    assert result.returncode == 0, result.stdout + result.stderr
    payload = json.loads((workdir / "demo" / "results.json").read_text())
    strategies = [o["strategy"] for o in payload["outcomes"]]
    assert sorted(strategies) == sorted(STRATEGIES)
    for outcome in payload["outcomes"]:
        assert outcome["throughput"]["median"] > 0
        assert outcome["verdict"] in ("reference", "match")
    markdown = (workdir / "demo" / "results.md").read_text()
    # A "|" in a header is escaped, so the table renders (session 31)
    assert "samples/s median (min–max)" in markdown and r"max \|Δparam\| vs single" in markdown
    assert "vs ddp" in result.stdout
