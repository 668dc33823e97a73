"""End-to-end helpers: run the real ``gradsync`` command in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
USER_MODEL = REPO / "examples" / "user_model.py"


def gradsync(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``gradsync ARGS`` and capture its output (fails the test on timeout)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "gradsync", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def verify_outcomes(out: Path) -> list[dict[str, Any]]:
    return json.loads((out / "verify.json").read_text())["outcomes"]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path
