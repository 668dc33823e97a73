"""``gradsync report RESULTS``: a Markdown report with tables, plots and an automatic reading.

Per model: one table (throughput with its range and spread, speedup, scaling efficiency,
bytes per step, exposed communication, correctness against ``single``), a paragraph that
reads it (who wins, by how much, and whether the ranges make the call uncertain), and
plots: throughput by strategy, scaling with the ideal line, speedup vs bandwidth, loss vs
step, and throughput against every strategy option the experiment sweeps.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from gradsync.bench.analysis import Row, analyse
from gradsync.bench.equal import Swept, setting
from gradsync.bench.experiment import Experiment, PublishedGain, load_experiment
from gradsync.bench.sweep import experiment_results, load_records, record_problem, stale_cells
from gradsync.errors import UserError
from gradsync.files import atomic_write_text
from gradsync.tables import markdown_table

PLOTS_DIR = "plots"
REPORT_FILE = "report.md"
HEADERS = [
    "strategy",
    "workers",
    "options",
    "batch",
    "threads",
    "inter-op",
    "link",
    "lr rule",
    "samples/s median (min–max)",
    "spread",
    "speedup",
    "efficiency",
    "bytes sent/step",
    "exposed comm/step",
    "max |Δ| vs single",
    "verdict",
    "val. accuracy",
    "iters/epoch",
]


def write_report(out: Path) -> Path:
    """Write ``report.md`` and ``plots/*.png`` for the sweep in ``out``; return the report."""
    if not (out / "experiment.toml").exists():
        raise UserError(f"{out} holds no sweep (no experiment.toml); run gradsync bench first")
    experiment = load_experiment(out / "experiment.toml")
    recorded = load_records(out)  # read once: a line cut short warns once
    records = experiment_results(out, experiment, recorded)
    rows = analyse(experiment, records, out)
    lines = [f"# {experiment.name}", ""]
    if experiment.description:
        lines += [experiment.description, ""]
    lines += _environment(records)
    lines += [held_equal(experiment), ""]
    if stale := stale_cells(out, experiment, recorded):
        lines += [stale_note(stale), ""]
    swept = Swept.of(experiment)
    for model in experiment.models:
        mine = [row for row in rows if row.cell.model == model]
        lines += [f"## {model} ({experiment.preset})", ""]
        if not mine:
            lines += ["No successful cells.", ""]
            continue
        lines += [_table(mine), ""]
        lines += [
            "Bytes sent/step: point-to-point messages are counted from the tensors sent; "
            "collectives (allreduce, allgather, ddp's buckets) from the tensors passed, "
            "times the ring algorithm's factor (checked against the wire by "
            "`benchmarks/wire_bytes.py`).",
            "",
        ]
        lines += [reading(mine, swept) + _cores_caveat(mine, records), ""]
        for kind, path in _plots(out, model, mine, experiment.swept_options(), swept).items():
            lines += [f"![{kind}]({path.relative_to(out)})", ""]
    if experiment.published_gain is not None and rows:
        lines += gain_section(experiment.published_gain, rows)
        plot = _gain_plot(out, experiment.published_gain, rows)
        lines += [f"![measured vs published gain]({plot.relative_to(out)})", ""]
    failed = [[r["id"], problem] for r in records if (problem := record_problem(r))]
    if failed:
        lines += ["## Failed cells", ""]
        lines += [markdown_table(["cell", "error"], failed), ""]
    report = out / REPORT_FILE
    atomic_write_text(report, "\n".join(lines) + "\n")
    return report


def stale_note(stale: list[str]) -> str:
    """Which cells the report leaves out because their only records are of other settings.

    Example:
        >>> stale_note(["measure-a", "measure-b"])[:52]
        'Left out: 2 cell(s) recorded only at other settings '
    """
    shown = ", ".join(stale[:5]) + (f" and {len(stale) - 5} more" if len(stale) > 5 else "")
    return (
        f"Left out: {len(stale)} cell(s) recorded only at other settings than this "
        f"experiment file's (an earlier version of it): {shown}. Run `gradsync bench` on "
        "the experiment again to measure them at the current settings."
    )


def held_equal(experiment: Experiment) -> str:
    """What every compared cell shares, what the experiment varies on purpose, and how the
    report compares like with like (one line).

    Example:
        >>> held_equal(Experiment(name="x", path="x.toml", workers=[1, 2]))[-30:]
        'per rank is refused at launch.'
    """
    swept = Swept.of(experiment)
    varied = [
        key
        for key, values in (
            ("workers", experiment.workers),
            ("global batch", experiment.batch_per_worker or experiment.global_batch),
            ("intra-op threads", experiment.threads),
            ("inter-op threads", experiment.interop_threads),
            ("link rate", experiment.bandwidths),
            ("learning-rate rule", experiment.lr_scaling),
        )
        if len(values) > 1
    ] + experiment.swept_options()
    if len(experiment.strategies) > 1:
        varied.insert(0, "strategy")
    data = experiment.data or "synthetic data"
    (threads, *others) = experiment.threads
    if others:
        threads_text = ""  # swept: among the varied
    elif threads is None:
        threads_text = "intra-op threads per rank (equal in every compared pair), "
    else:
        threads_text = f"{threads} intra-op thread{'s' if threads > 1 else ''} per rank, "
    scaling = (
        "per-worker batch (weak scaling)"
        if experiment.batch_per_worker
        else "global batch (strong scaling)"
    )
    within = f"; each within one value of the swept {swept.words()}" if swept.names else ""
    base_batch = (
        f" (the rules scale it from a global batch of {experiment.lr_base_batch})"
        if experiment.lr_base_batch
        else ""
    )
    return (
        f"Held equal in every cell: the model and preset, {data} with seed "
        f"{experiment.seed}, dropout off, BatchNorm over the global batch, {threads_text}"
        f"{experiment.optimizer} at the same base learning rate{base_batch} and warm-up, "
        f"{experiment.length}. Varied: {', '.join(varied) or 'nothing'}. Compared like "
        "with like: strategies at the same workers, link, batch, threads and learning-rate "
        f"rule; speedup and efficiency against the same cell at 1 worker with the same "
        f"{scaling}{within}; a compared pair differing in dropout, BatchNorm, data, batch "
        "or threads per rank is refused at launch."
    )


def _environment(records: list[dict]) -> list[str]:
    ok = [r for r in records if record_problem(r) is None]
    if not ok:
        return []
    env = ok[0].get("environment", {})
    steps = sorted({len(r["step_times_s"]) for r in ok})  # several: epochs at several batches
    steps_text = str(steps[0]) if len(steps) == 1 else f"{steps[0]}–{steps[-1]}"
    return [
        f"Measured with gradsync {env.get('gradsync')}, torch {env.get('torch')}, on "
        f"{env.get('cpu')} ({env.get('cores')} cores); steps per job "
        f"{steps_text}, warm-up {ok[0]['throughput'].get('warmup_steps')} "
        "steps left out; throughput is the whole job's samples/s. "
        f"Allocator: {env.get('allocator', 'not recorded')}.",
        "",
    ]


def _table(rows: list[Row]) -> str:
    """The model's table, without columns that are empty in every row."""
    cells = [_cells(row) for row in rows]
    keep = [
        i
        for i, header in enumerate(HEADERS)
        if header in ("strategy", "workers", "samples/s median (min–max)")
        or any(row[i] not in ("-", "") for row in cells)
    ]
    return markdown_table([HEADERS[i] for i in keep], [[row[i] for i in keep] for row in cells])


def _cores_caveat(rows: list[Row], records: list[dict]) -> str:
    """Say so when the workers' threads outnumber the cores: then scaling measures
    overheads only."""
    ok = [r for r in records if record_problem(r) is None]
    cores = next((r.get("environment", {}).get("cores") for r in ok), None)
    threads = min((r.get("environment", {}).get("threads_per_rank") or 1 for r in ok), default=1)
    most = max(row.cell.workers for row in rows)
    if not cores or most * threads <= cores:
        return ""
    fit = max(1, cores // threads)
    return (
        f" This machine has {cores} cores, so {most} workers of {threads} intra-op "
        f"thread{'s' if threads > 1 else ''} share them beyond {fit} worker"
        f"{'s' if fit > 1 else ''}: there the ideal line is out of reach, and the efficiency "
        "shows what communication and oversubscription cost rather than how well the "
        "strategy scales."
    )


def _cells(row: Row) -> list[str]:
    cell = row.cell
    return [
        cell.strategy,
        str(cell.workers),
        ", ".join(f"{key}={value}" for key, value in cell.options) or "-",
        _dash(cell.global_batch),
        _dash(cell.threads),
        _dash(cell.interop_threads),
        cell.bandwidth or "loopback",
        cell.lr_scaling,
        f"{row.median:,.1f} ({row.low:,.1f}–{row.high:,.1f})",
        f"{row.spread:.0%}" + (" noisy" if row.noisy else ""),
        "-" if row.speedup is None else f"{row.speedup:.2f}×",
        "-" if row.efficiency is None else f"{row.efficiency:.0%}",
        f"{row.bytes_per_step / 2**20:,.2f} MB",
        f"{row.exposed_comm_ms:.1f} ms" if _times_exposed_comm(cell.strategy) else "not timed",
        "-" if row.max_abs is None else f"{row.max_abs:.1e} (tol {row.tolerance:.0e})",
        row.verdict,
        "-" if row.accuracy is None else f"{row.accuracy:.1%}",
        _dash(row.iterations_per_epoch),
    ]


def _times_exposed_comm(strategy: str) -> bool:
    """Whether ``strategy`` times its exposed communication (an unknown one: yes)."""
    from gradsync.strategies import STRATEGIES

    return getattr(STRATEGIES.get(strategy), "times_exposed_comm", True)


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def reading(rows: list[Row], swept: Swept | None = None) -> str:
    """One paragraph: per setting, which strategy wins, by how much, and how sure that is.

    Strategies are ranked only against others at the same setting (workers, link, batch,
    threads, learning-rate rule); ``swept`` names the settings the experiment sweeps, said
    in each sentence.

    Example:
        >>> reading([])
        'Only one strategy per setting: nothing to compare.'
    """
    swept = swept or Swept()
    sentences = []
    settings: dict[object, list[Row]] = defaultdict(list)
    for row in rows:
        settings[setting(row.cell)].append(row)
    for group in settings.values():
        if len(group) < 2:
            continue
        ranked = sorted(group, key=lambda row: -row.median)
        best, runner = ranked[0], ranked[1]
        workers, bandwidth = best.cell.workers, best.cell.bandwidth
        where = f"at {workers} worker{'s' if workers > 1 else ''}" + (
            f" behind {bandwidth} links" if bandwidth else ""
        )
        if context := swept.without("bandwidth").describe(best.cell):
            where += f" ({context})"
        sentence = (
            f"{where.capitalize()}, {_label(best)} is fastest with "
            f"{best.median:,.1f} samples/s, {best.median / runner.median:.2f}× "
            f"{_label(runner)}"
        )
        if len(ranked) > 2:
            sentence += f" and {best.median / ranked[-1].median:.2f}× {_label(ranked[-1])}"
        if best.low <= runner.high:
            sentence += (
                f"; the ranges overlap ({best.low:,.1f}–{best.high:,.1f} vs "
                f"{runner.low:,.1f}–{runner.high:,.1f}), so the order of these two is "
                "uncertain"
            )
        elif best.noisy or runner.noisy:
            sentence += "; the ranges do not overlap, but one of the two is noisy"
        sentences.append(sentence + ".")
    scaled = [row for row in rows if row.efficiency is not None and row.cell.workers > 1]
    if scaled:
        top = max(row.cell.workers for row in scaled)
        at_top = sorted(
            (row for row in scaled if row.cell.workers == top),
            key=lambda row: -(row.efficiency or 0),
        )
        sentences.append(
            f"Scaling to {top} workers, {_label(at_top[0], swept)} keeps the highest "
            f"efficiency ({at_top[0].efficiency:.0%} of ideal)"
            + (
                f", {_label(at_top[-1], swept)} the lowest ({at_top[-1].efficiency:.0%})"
                if len(at_top) > 1
                else ""
            )
            + "."
        )
    checked = [row for row in rows if row.max_abs is not None]
    if checked:
        failing = [row for row in checked if row.verdict == "FAIL"]
        held = [row for row in checked if row.verdict in ("match", "FAIL")]
        if failing:
            sentences.append(
                "Beyond tolerance: " + ", ".join(_label(row, swept) for row in failing) + "."
            )
        elif held:  # "differs (expected)" rows are not held to the tolerance
            sentences.append("Every synchronous strategy matches single within tolerance.")
    noisy = [row for row in rows if row.noisy]
    if noisy:
        sentences.append(
            f"{len(noisy)} result(s) have a spread above 10% and are flagged "
            "noisy; rerun them with more steps or repeats before relying on them."
        )
    return " ".join(sentences) or "Only one strategy per setting: nothing to compare."


def measured_gains(published: PublishedGain, rows: list[Row]) -> list[tuple[Row, Row]]:
    """Pairs (baseline row, strategy row) measured in the same setting, in table order.

    Example:
        >>> measured_gains(PublishedGain(strategy="p3", baseline="ps", source="x"), [])
        []
    """
    baselines: dict[object, Row] = {}
    for row in rows:
        if row.cell.strategy == published.baseline:
            baselines.setdefault(setting(row.cell), row)
    pairs = []
    for row in rows:
        if row.cell.strategy == published.strategy and (base := baselines.get(setting(row.cell))):
            pairs.append((base, row))
    return pairs


def gain_section(published: PublishedGain, rows: list[Row]) -> list[str]:
    """Markdown: the measured gain per model and link beside the published one."""
    strategy, baseline = published.strategy, published.baseline
    table = []
    for base, row in measured_gains(published, rows):
        gain = row.median / base.median - 1
        overlap = " (ranges overlap)" if row.low <= base.high and base.low <= row.high else ""
        paper = published.gains.get(row.cell.model)
        table.append(
            [
                row.cell.model,
                row.cell.bandwidth or "loopback",
                str(row.cell.workers),
                f"{base.median:,.1f} ({base.low:,.1f}–{base.high:,.1f})",
                f"{row.median:,.1f} ({row.low:,.1f}–{row.high:,.1f})",
                f"{gain:+.0%}{overlap}",
                "-" if paper is None else f"{paper:+.0%}",
            ]
        )
    headers = [
        "model",
        "link",
        "workers",
        f"{baseline} samples/s",
        f"{strategy} samples/s",
        f"measured {strategy}/{baseline} gain",
        "published gain",
    ]
    return [
        f"## `{strategy}` over `{baseline}`: measured beside {published.source}",
        "",
        markdown_table(headers, table) if table else "No setting has both strategies.",
        "",
        f"Gain = {strategy}'s samples/s / {baseline}'s - 1, on the medians of the tables "
        "above (ranges as there: min–max over repeats, over measurement windows for a single "
        "repeat). The published figures are the paper's best case on its own cluster; '-' "
        "where it gives no single figure for the model.",
        "",
    ]


def _gain_plot(out: Path, published: PublishedGain, rows: list[Row]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = measured_gains(published, rows)
    models = list(dict.fromkeys(row.cell.model for _, row in pairs))
    links = sorted({row.cell.bandwidth or "loopback" for _, row in pairs}, key=_rate_order)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / (len(links) + 1)
    for index, link in enumerate(links):
        gains = {
            row.cell.model: 100 * (row.median / base.median - 1)
            for base, row in pairs
            if (row.cell.bandwidth or "loopback") == link
        }
        xs = [i + index * width for i, model in enumerate(models) if model in gains]
        ax.bar(xs, [gains[m] for m in models if m in gains], width, label=f"measured, {link}")
    paper = [(i, 100 * published.gains[m]) for i, m in enumerate(models) if m in published.gains]
    if paper:
        ax.bar(
            [i + len(links) * width for i, _ in paper],
            [gain for _, gain in paper],
            width,
            color="grey",
            label="published",
        )
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks([i + len(links) * width / 2 for i in range(len(models))], models)
    ax.set_ylabel(f"{published.strategy} over {published.baseline} (% samples/s)")
    ax.set_title(f"{published.strategy} over {published.baseline}: measured vs published")
    ax.legend(fontsize=8)
    directory = out / PLOTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    return _save(fig, directory / "gain-vs-published.png", plt)


def _label(row: Row, swept: Swept | None = None) -> str:
    """The strategy and its options, and the values of the ``swept`` settings."""
    parts = [f"{key}={value}" for key, value in row.cell.options]
    if swept is not None and (context := swept.describe(row.cell)):
        parts.append(context)
    return f"`{row.cell.strategy}`" + (f" ({', '.join(parts)})" if parts else "")


def _plots(
    out: Path, model: str, rows: list[Row], options: list[str], swept: Swept
) -> dict[str, Path]:
    """The model's plots: throughput by strategy, scaling, speedup vs bandwidth, loss, and
    throughput vs each swept strategy option. A line or bar series holds one value of each
    setting the experiment sweeps (``swept``), so no line joins unlike cells."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = out / PLOTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    slug = model.replace("/", "_").replace(":", "_").replace(".", "_")
    drawings = {
        "throughput by strategy": ("throughput", _throughput_bars),
        "scaling": ("scaling", _scaling_lines),
        "speedup vs bandwidth": ("bandwidth", _bandwidth_lines),
        "loss vs step": ("loss", _loss_lines),
    }
    # a plot along an axis the experiment does not sweep would show one point: left out
    if len({row.cell.workers for row in rows}) < 2:
        del drawings["scaling"]
    if len({row.cell.bandwidth for row in rows}) < 2:
        del drawings["speedup vs bandwidth"]
    paths = {}
    for kind, (name, draw) in drawings.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        draw(ax, model, _series(rows, swept.without("bandwidth") if name == "bandwidth" else swept))
        paths[kind] = _save(fig, directory / f"{slug}-{name}.png", plt)
    for option in options:
        if any(row.cell.option(option) is not None for row in rows):
            fig, ax = plt.subplots(figsize=(7, 4))
            _option_lines(ax, model, rows, option, swept.without("bandwidth"))
            paths[f"throughput vs {option}"] = _save(fig, directory / f"{slug}-{option}.png", plt)
    return paths


def _series(rows: list[Row], swept: Swept) -> dict[str, list[Row]]:
    """Rows by strategy, options and values of the swept settings, in table order."""
    series: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        series[_label(row, swept).replace("`", "")].append(row)
    return series


def _throughput_bars(ax: Any, model: str, series: dict[str, list[Row]]) -> None:
    workers = sorted({row.cell.workers for rows in series.values() for row in rows})
    width = 0.8 / max(1, len(series))
    for index, (name, mine) in enumerate(series.items()):
        for row in mine:
            x = workers.index(row.cell.workers) + index * width
            ax.bar(
                x,
                row.median,
                width,
                color=f"C{index}",
                yerr=[[row.median - row.low], [row.high - row.median]],
                capsize=3,
                label=name if row is mine[0] else None,
            )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workers))], [str(w) for w in workers])
    ax.set_xlabel("workers")
    ax.set_ylabel("samples/s (median, min–max)")
    ax.set_title(f"{model}: throughput by strategy")
    ax.legend(fontsize=8)


def _scaling_lines(ax: Any, model: str, series: dict[str, list[Row]]) -> None:
    workers = sorted({row.cell.workers for rows in series.values() for row in rows})
    for index, (name, mine) in enumerate(series.items()):
        points = sorted((row.cell.workers, row.median) for row in mine)
        ax.plot(*zip(*points, strict=True), marker="o", color=f"C{index}", label=name)
        one = next((m for w, m in points if w == 1), None)
        if one is not None:
            ideal = [w * one for w in workers]
            ax.plot(workers, ideal, linestyle="--", color=f"C{index}", alpha=0.5)
    ax.set_xticks(workers, [str(w) for w in workers])  # worker counts, not 1.5 workers
    ax.set_xlabel("workers")
    ax.set_ylabel("samples/s")
    ax.set_title(f"{model}: scaling (dashed: ideal N·T(1))")
    ax.legend(fontsize=7)


def _bandwidth_lines(ax: Any, model: str, series: dict[str, list[Row]]) -> None:
    rows = [row for mine in series.values() for row in mine]
    top = max(row.cell.workers for row in rows)
    links = sorted({row.cell.bandwidth or "loopback" for row in rows}, key=_rate_order)
    baseline_name = _label(rows[0]).replace("`", "")
    for index, (name, mine) in enumerate(series.items()):
        points = []
        for link in links:
            row = _find(mine, top, link)
            base = None if row is None else _baseline(rows, rows[0], row)
            if row is not None and base is not None:
                points.append((links.index(link), row.median / base.median))
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", color=f"C{index}", label=name)
    ax.set_xticks(range(len(links)), links)
    ax.set_xlabel("link rate")
    ax.set_ylabel(f"speedup over {baseline_name}")
    ax.set_title(f"{model}: speedup vs bandwidth ({top} workers)")
    ax.legend(fontsize=8)


def _baseline(rows: list[Row], first: Row, row: Row) -> Row | None:
    """The row of ``first``'s strategy and options at ``row``'s setting."""
    return next(
        (r for r in rows if _label(r) == _label(first) and setting(r.cell) == setting(row.cell)),
        None,
    )


def _loss_lines(ax: Any, model: str, series: dict[str, list[Row]]) -> None:
    for index, (name, mine) in enumerate(series.items()):
        row = max(mine, key=lambda r: r.cell.workers)
        label = f"{name} ({row.cell.workers} workers)"
        ax.plot(range(len(row.loss)), row.loss, color=f"C{index}", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over workers)")
    ax.set_title(f"{model}: loss vs step")
    ax.legend(fontsize=8)


def _option_lines(ax: Any, model: str, rows: list[Row], option: str, swept: Swept) -> None:
    """Samples/s against one swept option's values, a line per strategy, workers, link and
    value of each other swept setting."""
    lines: dict[str, list[tuple[Any, Row]]] = defaultdict(list)
    for row in rows:
        value = row.cell.option(option)
        if value is not None:
            link = row.cell.bandwidth or "loopback"
            name = f"{row.cell.strategy}, {row.cell.workers} workers, {link}"
            if context := swept.describe(row.cell):
                name += f", {context}"
            lines[name].append((value, row))
    for index, (name, points) in enumerate(lines.items()):
        points.sort(key=lambda point: point[0])
        xs = [value for value, _ in points]
        medians = [row.median for _, row in points]
        errors = [[r.median - r.low for _, r in points], [r.high - r.median for _, r in points]]
        ax.errorbar(xs, medians, yerr=errors, marker="o", capsize=3, color=f"C{index}", label=name)
    if all(isinstance(v, int | float) and v > 0 for pts in lines.values() for v, _ in pts):
        ax.set_xscale("log")
    ax.set_xlabel(option)
    ax.set_ylabel("samples/s (median, min–max)")
    ax.set_title(f"{model}: throughput vs {option}")
    ax.legend(fontsize=8)


def _find(rows: list[Row], workers: int, link: str) -> Row | None:
    return next(
        (r for r in rows if r.cell.workers == workers and (r.cell.bandwidth or "loopback") == link),
        None,
    )


def _rate_order(link: str) -> float:
    from gradsync.netem import parse_rate

    return float("inf") if link == "loopback" else parse_rate(link)


def _save(fig: object, path: Path, plt: object) -> Path:
    fig.tight_layout()  # type: ignore[attr-defined]
    fig.savefig(path, dpi=110)  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[attr-defined]
    return path


__all__ = ["write_report"]
