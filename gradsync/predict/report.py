"""What ``gradsync predict`` writes: a table, JSON, PNGs and the predicted step's trace.

- ``predictions.json``: every grid point and the recommendations;
- ``predictions.md``: the same as a Markdown table;
- ``scaling.png``: throughput and scaling efficiency against workers, one row of panels per
  bandwidth, with the ideal (linear) line;
- ``bandwidth.png``: throughput against bandwidth at the largest worker count;
- ``trace.json``: each strategy's predicted step as a Chrome trace (one process per
  strategy), at the largest worker count and lowest bandwidth, in the phase names of
  ``--timeline`` traces so the two open side by side in Perfetto.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradsync.files import atomic_write_text
from gradsync.predict.profile import Profile
from gradsync.predict.simulate import StepPrediction
from gradsync.predict.sweep import GridPoint, Recommendation, single_step_s
from gradsync.timeline_summary import PREDICTED

# "efficiency" here is against one worker without communication (Horovod's definition),
# not bench's, against the same strategy at 1 worker: the header says which.
HEADERS = [
    "strategy",
    "workers",
    "bandwidth",
    "step (ms)",
    "samples/s",
    "efficiency vs compute only",
    "exposed",
]


def table_rows(points: Sequence[GridPoint]) -> list[list[str]]:
    """One text row per grid point (the table printed and written as Markdown)."""
    return [
        [
            p.prediction.choice.label(),
            str(p.prediction.workers),
            p.bandwidth,
            f"{p.prediction.step_s * 1e3:,.1f}",
            f"{p.prediction.throughput:,.1f}",
            f"{p.efficiency:.0%}",
            f"{p.prediction.exposed_comm_s / p.prediction.step_s:.0%}",
        ]
        for p in points
    ]


def recommendation_lines(recommendations: Sequence[Recommendation]) -> list[str]:
    return [
        f"{r.workers} workers at {r.bandwidth}: {r.best.choice.label()} "
        f"({r.best.throughput:,.1f} samples/s), {r.gain:+.0%} over {r.default.choice.label()} "
        f"({r.default.throughput:,.1f}), {r.knob_gain:+.0%} over "
        f"{r.strategy_default.choice.label()} as listed"
        for r in recommendations
    ]


def write_outputs(
    out: Path,
    profile: Profile,
    points: Sequence[GridPoint],
    recommendations: Sequence[Recommendation],
    settings: dict[str, Any],
) -> list[Path]:
    """Write every output file into ``out``; return their paths."""
    from gradsync.tables import markdown_table

    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "profile": {
            "model": profile.model,
            "preset": profile.preset,
            "batch_per_worker": profile.batch,
            "threads": profile.threads,
            "device": profile.device,
            "single_step_s": single_step_s(profile),
        },
        "settings": settings,
        "points": [_point_dict(p) for p in points],
        "recommendations": [r.to_dict() for r in recommendations],
    }
    files = [out / "predictions.json", out / "predictions.md", out / "trace.json"]
    atomic_write_text(files[0], json.dumps(payload, indent=1) + "\n")
    title = f"# Predicted steps: {profile.model} ({profile.preset}), batch {profile.batch}/worker"
    lines = [title, "", markdown_table(HEADERS, table_rows(points)), ""]
    lines += ["## Recommendation", ""] + [
        f"- {line}" for line in recommendation_lines(recommendations)
    ]
    atomic_write_text(files[1], "\n".join(lines) + "\n")
    largest = max(p.prediction.workers for p in points)
    slowest = min(points, key=lambda p: p.rate).bandwidth
    traced = [
        p.prediction for p in points if p.prediction.workers == largest and p.bandwidth == slowest
    ]
    write_trace(files[2], traced, f"{largest} workers, {slowest}")
    files += plot_scaling(out / "scaling.png", profile, points)
    files += plot_bandwidth(out / "bandwidth.png", points)
    return files


def _point_dict(point: GridPoint) -> dict[str, Any]:
    p = point.prediction
    return {
        "strategy": p.choice.label(),
        "workers": p.workers,
        "bandwidth": point.bandwidth,
        "step_s": p.step_s,
        "throughput": p.throughput,
        "efficiency": point.efficiency,
        "compute_s": p.compute_s,
        "exposed_comm_s": p.exposed_comm_s,
        "bytes_per_worker": p.bytes_per_worker,
    }


def write_trace(path: Path, predictions: Sequence[StepPrediction], where: str) -> None:
    """Chrome-trace JSON: one process per strategy, one thread per track, microseconds."""
    events: list[dict[str, Any]] = []
    for pid, prediction in enumerate(predictions):
        events.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": pid,
                "args": {"name": f"{PREDICTED}{prediction.choice.label()} ({where})"},
            }
        )
        tracks: dict[str, int] = {}
        for span in prediction.spans:
            if span.track not in tracks:
                tracks[span.track] = len(tracks)
                events.append(
                    {
                        "name": "thread_name",
                        "ph": "M",
                        "pid": pid,
                        "tid": tracks[span.track],
                        "args": {"name": span.track},
                    }
                )
            events.append(
                {
                    "name": span.name,
                    "ph": "X",
                    "pid": pid,
                    "tid": tracks[span.track],
                    "ts": span.start * 1e6,
                    "dur": max(span.duration, 0.0) * 1e6,
                }
            )
    atomic_write_text(path, json.dumps({"traceEvents": events}) + "\n")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_scaling(path: Path, profile: Profile, points: Sequence[GridPoint]) -> list[Path]:
    """Throughput and efficiency against workers (log 2), one row per bandwidth."""
    plt = _pyplot()
    bandwidths = list(dict.fromkeys(p.bandwidth for p in points))
    figure, axes = plt.subplots(
        len(bandwidths), 2, figsize=(11, 3.6 * len(bandwidths)), squeeze=False
    )
    single = profile.batch / single_step_s(profile)
    for row, bandwidth in enumerate(bandwidths):
        here = [p for p in points if p.bandwidth == bandwidth]
        counts = sorted({p.prediction.workers for p in here})
        for label in dict.fromkeys(p.prediction.choice.label() for p in here):
            line = sorted(
                (p for p in here if p.prediction.choice.label() == label),
                key=lambda p: p.prediction.workers,
            )
            xs = [p.prediction.workers for p in line]
            axes[row][0].plot(xs, [p.prediction.throughput for p in line], marker="o", label=label)
            axes[row][1].plot(xs, [p.efficiency * 100 for p in line], marker="o", label=label)
        axes[row][0].plot(counts, [n * single for n in counts], "k--", label="ideal (linear)")
        axes[row][1].axhline(100, color="k", linestyle="--", label="ideal")
        for column, ylabel in enumerate(("samples/s", "efficiency vs compute only (%)")):
            ax = axes[row][column]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("workers")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{profile.model} ({profile.preset}) at {bandwidth}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
        axes[row][0].set_yscale("log")
        axes[row][1].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return [path]


def plot_bandwidth(path: Path, points: Sequence[GridPoint]) -> list[Path]:
    """Throughput against link bandwidth at the largest worker count."""
    if len({p.bandwidth for p in points}) < 2:
        return []
    plt = _pyplot()
    largest = max(p.prediction.workers for p in points)
    here = [p for p in points if p.prediction.workers == largest]
    figure, axes = plt.subplots(figsize=(8, 5))
    for label in dict.fromkeys(p.prediction.choice.label() for p in here):
        line = sorted(
            (p for p in here if p.prediction.choice.label() == label),
            key=lambda p: p.rate,
        )
        axes.plot(
            [p.rate * 8 / 1e9 for p in line],
            [p.prediction.throughput for p in line],
            marker="o",
            label=label,
        )
    axes.set_xscale("log")
    axes.set_xlabel("link bandwidth (Gbit/s)")
    axes.set_ylabel("samples/s")
    axes.set_title(f"throughput vs bandwidth, {largest} workers", fontsize=9)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return [path]


__all__ = ["plot_bandwidth", "plot_scaling", "table_rows", "write_outputs", "write_trace"]
