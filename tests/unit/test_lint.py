"""The code stays ruff-clean (lint and format), as the project's configuration says."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PATHS = ["gradsync", "tests", "benchmarks", "examples"]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is installed by .[test]")
@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff(command: list[str]) -> None:
    result = subprocess.run(
        ["ruff", *command, *PATHS], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
