"""Run a whole job from Python: validate, launch locally, return its summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradsync.config import TrainConfig
from gradsync.launch import launch_local
from gradsync.metrics import load_summary
from gradsync.models import check_model
from gradsync.strategies import check_strategy

LOG_FILE = "stdout.log"


def validate(config: TrainConfig) -> None:
    """Every check that can fail before any process starts (UserError on failure)."""
    check_model(config.model, config.preset, config.model_options)
    check_strategy(config)


def run_job(config: TrainConfig, *, quiet: bool = True) -> dict[str, Any]:
    """Train ``config`` on local processes and return its ``summary.json``.

    With ``quiet`` the ranks' stdout goes to ``<out>/stdout.log``.

    Example:
        >>> # summary = run_job(TrainConfig(model="mnist-cnn", preset="tiny", workers=2, steps=5))
        >>> # summary["throughput"]["median"]
    """
    validate(config)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    launch_local(config, log_file=out / LOG_FILE if quiet else None)
    return load_summary(out)
