"""Throughput statistics: warm-up discarded, median and min–max over measurement windows."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

NUM_WINDOWS = 5
MIN_WARMUP = 5


def default_warmup(num_steps: int) -> int:
    """10% of the steps, at least 5, always leaving one step to measure.

    Example:
        >>> default_warmup(100), default_warmup(20), default_warmup(3)
        (10, 5, 2)
    """
    return max(0, min(max(MIN_WARMUP, math.ceil(0.1 * num_steps)), num_steps - 1))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated q-th percentile (0..100) of ``values``.

    Example:
        >>> percentile([1.0, 2.0, 3.0, 4.0], 90)
        3.7
    """
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return round(ordered[low] + (ordered[high] - ordered[low]) * (position - low), 12)


@dataclass(frozen=True)
class Throughput:
    """Samples per second: median and range over windows of the measured steps."""

    median: float
    low: float
    high: float
    num_windows: int
    warmup_steps: int
    measured_steps: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.median:,.1f} ({self.low:,.1f}–{self.high:,.1f})"


def throughput(
    step_times: Sequence[float],
    global_batch: int,
    *,
    warmup_steps: int | None = None,
    num_windows: int = NUM_WINDOWS,
) -> Throughput:
    """Throughput of a run from its per-step wall times.

    Example:
        >>> t = throughput([9.0] * 5 + [1.0] * 10, global_batch=10)
        >>> t.median, t.warmup_steps
        (10.0, 5)
    """
    warmup = default_warmup(len(step_times)) if warmup_steps is None else warmup_steps
    warmup = min(warmup, max(0, len(step_times) - 1))
    measured = list(step_times[warmup:])
    if not measured:
        raise ValueError("no steps to measure")
    count = max(1, min(num_windows, len(measured)))
    bounds = [round(i * len(measured) / count) for i in range(count + 1)]
    rates = []
    for low, high in itertools.pairwise(bounds):
        window = measured[low:high]
        rates.append(global_batch * len(window) / sum(window))
    return Throughput(
        median=statistics.median(rates),
        low=min(rates),
        high=max(rates),
        num_windows=count,
        warmup_steps=warmup,
        measured_steps=len(measured),
    )
