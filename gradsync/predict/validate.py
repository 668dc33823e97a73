"""``gradsync predict --validate FILE.toml``: run the predicted configurations for real on
emulated hosts and put measured beside predicted.

The file is a grid::

    name = "predict-validation"
    strategies = ["ddp", "allreduce", "ps", "ps:servers=2", "ps:colocate", "hybrid", "p3"]
    bandwidths = ["100mbit", "1gbit", "unshaped"]  # unshaped: links at the cores' speed
    workers = 2
    hosts = 2
    steps = 12
    threads = 1
    global_batch = 48         # optional: every cell's (default: each model's preset's)
    repeats = 3               # optional: each cell measured in this many interleaved rounds
    recommend = true          # also measure what predict recommends per model × bandwidth
    calibrate = true          # fit the network model to a commbench run per bandwidth
    shared_cores = 2          # every emulated host runs on this machine's 2 cores

    [[model]]
    name = "transformer"
    preset = "default"
    options = {}
    bandwidths = ["1gbit"]    # optional: this model at these only (default: the plan's)

Every cell trains with ``gradsync train --hosts H --bandwidth B`` (its median samples/s
after warm-up) and is predicted from the profiles of the same model taken in this process
just before and just after it (averaged) at the cell's per-worker batch and thread count,
on a cluster whose ranks sit on the hosts
:func:`gradsync.netem.place_ranks` puts them on. Results are appended to
``cells.jsonl`` as they come (a rerun skips cells already measured), then summarized in
``validation.md`` / ``validation.json``: per cell the error ``(predicted − measured) /
measured``, and the median and 90th percentile of its absolute value.

With ``repeats = N`` every cell is measured N times, in interleaved rounds (each model ×
bandwidth runs all its strategies once, then all again), each run between two profiles as
above. A cell's measurement is the median of its rounds, its spread their min–max, and it
is predicted from the mean of all its rounds' profiles. Two runs of the same configuration
on 2 shared cores differ by up to a quarter (vgg16 ``ddp`` on unshaped links: 205, 215 and
263 samples/s in three runs), so one run per cell measures that noise as much as the
prediction's error.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradsync.config import TrainConfig
from gradsync.errors import UserError
from gradsync.files import end_line_cut_short, read_cell_records
from gradsync.netem import parse_shaped_rate
from gradsync.predict.network import (
    Cluster,
    Network,
    calibrate,
    calibrate_cpu,
    calibrate_duplex,
    calibrate_sync,
    calibrate_wire,
    check_shared_cores,
    parse_bandwidth,
    ring_rate,
)
from gradsync.predict.profile import Profile, ProfileRequest, measure_profile
from gradsync.predict.simulate import StrategyChoice, predict_step
from gradsync.predict.sweep import parse_choice, recommend
from gradsync.stats import percentile
from gradsync.toml_keys import TomlKeys, read_toml

KEYS = {
    "name",
    "strategies",
    "bandwidths",
    "workers",
    "hosts",
    "steps",
    "threads",
    "recommend",
    "calibrate",
    "model",
    "profile_steps",
    "shared_cores",
    "global_batch",
    "repeats",
}
MODEL_KEYS = {"name", "preset", "options", "bandwidths"}
# Allreduce sizes the calibration times: a BatchNorm sync, a first bucket, fusion buckets,
# a large layer.
CALIBRATION_SIZES = (4 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
SUPPLEMENT = Path("supplement") / "commbench.json"
# Small blocking collectives between ranks that compute between them (BatchNorm's syncs):
# their cost at several compute intervals, where the models' intervals lie (resnet56's
# is about 1.5 ms on a 2-core Xeon).
SYNC = Path("sync") / "commbench.json"
SYNC_BUSY_MS = (0.5, 1.0, 2.0, 4.0)
# A push and its answer through the server transport (commbench's wire echo): what ps,
# hybrid and p3 messages cost, at the sizes of a row pull, a p3 slice, a bundle, a ps chunk.
WIRE = Path("wire") / "commbench.json"
WIRE_SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
# The echo also between ranks that compute this long between messages, as a job's do.
WIRE_BUSY_MS = (0.0, 5.0)
# A bandwidth entry: emulated hosts whose links nothing shapes (the veth pairs run as fast
# as the cores move bytes); the network model takes the rate the calibration's ring measured.
UNSHAPED = "unshaped"


@dataclass(frozen=True, kw_only=True)
class ModelEntry:
    name: str
    preset: str = "default"
    options: dict[str, str] = field(default_factory=dict)
    bandwidths: tuple[str, ...] | None = None  # None: the plan's

    @property
    def label(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.name} ({self.preset}{extra})"


@dataclass(frozen=True, kw_only=True)
class ValidationPlan:
    name: str
    models: tuple[ModelEntry, ...]
    strategies: tuple[str, ...]
    bandwidths: tuple[str, ...]
    workers: int = 2
    hosts: int = 2
    steps: int = 12
    threads: int = 1
    recommend: bool = False
    calibrate: bool | str = False  # true: commbench per bandwidth; a path: that commbench.json
    profile_steps: int = 15
    shared_cores: int | None = None  # the emulated hosts all run on this many cores
    global_batch: int | None = None  # every cell's (None: each model's preset's)
    repeats: int = 1  # interleaved rounds per cell; a cell's measurement is their median

    def bandwidths_of(self, model: ModelEntry) -> tuple[str, ...]:
        """The bandwidths ``model`` is measured at: its own list, else the plan's."""
        return model.bandwidths if model.bandwidths is not None else self.bandwidths


def load_plan(path: str | Path) -> ValidationPlan:
    """Read a validation grid; every problem is a one-line UserError naming the key."""
    path = Path(path)
    keys = TomlKeys(
        read_toml(path, "--validate", KEYS, example="experiments/predict-validation.toml"), path
    )
    plan = ValidationPlan(
        name=keys.text("name", path.stem, example='"my-validation"'),
        models=tuple(
            _model_entry(model)
            for model in keys.tables("model", example='[[model]] with name = "transformer"')
        ),
        strategies=keys.texts("strategies", example='["ddp", "allreduce"]'),
        bandwidths=keys.texts("bandwidths", example='["1gbit", "100mbit"]'),
        recommend=keys.flag("recommend", False),
        calibrate=keys.raw.get("calibrate", False),  # checked below: a flag or a path
        shared_cores=keys.raw.get("shared_cores"),  # checked below
        **{key: keys.count(key) for key in COUNTS if key in keys},
    )
    if not plan.models:
        raise UserError(f'{path}: no [[model]] tables; add one with name = "transformer"')
    _check_lists(plan, path)
    _check_calibrate(plan.calibrate, path)
    check_shared_cores(plan.shared_cores, f"{path}: shared_cores")
    if plan.workers < 2:
        raise UserError(
            f"{path}: workers = {plan.workers} measures no communication; write workers = 2"
        )
    for model in plan.models:
        _check_batch(plan, model, path)
    _check_hosts(plan, path)
    for bandwidth in {b for m in plan.models for b in plan.bandwidths_of(m)}:
        if bandwidth != UNSHAPED:
            parse_shaped_rate(bandwidth, f"{path}: bandwidth")  # the runs shape it with tc
        elif plan.calibrate is False:
            raise UserError(
                f"{path}: bandwidth '{UNSHAPED}' takes its rate from a calibration; "
                "write calibrate = true"
            )
    return plan


COUNTS = ("workers", "hosts", "steps", "threads", "profile_steps", "global_batch", "repeats")


def _check_lists(plan: ValidationPlan, path: Path) -> None:
    """Strategies and bandwidths (the plan's and each model's) non-empty and each listed
    once, and each model (name, preset and options) once; else a one-line UserError."""
    lists = {"strategies": plan.strategies}
    if plan.bandwidths or any(model.bandwidths is None for model in plan.models):
        lists["bandwidths"] = plan.bandwidths  # some model is measured at the plan's
    for model in plan.models:
        if model.bandwidths is not None:
            lists[f"[[model]] {model.name}: bandwidths"] = model.bandwidths
    lists["[[model]]"] = tuple(model.label for model in plan.models)
    for key, values in lists.items():
        if not values:
            raise UserError(f"{path}: {key} is empty; list at least one, or leave the key out")
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            raise UserError(
                f"{path}: {key} lists {', '.join(twice)} more than once; list each once"
            )


def _check_hosts(plan: ValidationPlan, path: Path) -> None:
    """Every emulated host gets a rank of every job the plan runs, as ``gradsync train``
    and ``gradsync commbench`` demand (:func:`gradsync.netem.check_hosts_filled`): the
    calibration's commbench (the workers) and each model's run of each strategy (workers,
    then the dedicated servers it starts for that model); else a one-line UserError naming
    the plan's keys."""
    if plan.calibrate is True:
        _check_filled(
            plan, plan.workers, path, f"calibrate = true runs commbench on {plan.workers} ranks"
        )
    for spec in plan.strategies:
        choice = parse_choice(spec, plan.workers)
        for model in plan.models:
            ranks = _world_size(_train_config(plan, model), plan.workers, choice)
            job = (
                f"strategies: {spec} on {model.label} runs {ranks} ranks ({plan.workers} "
                f"workers, {ranks - plan.workers} dedicated server(s))"
            )
            _check_filled(plan, ranks, path, job)


def _check_filled(plan: ValidationPlan, ranks: int, path: Path, job: str) -> None:
    """UserError unless ``ranks`` ranks fill the plan's hosts; ``job`` says whose they are."""
    from gradsync.netem import check_hosts_filled, place_ranks

    try:
        check_hosts_filled(ranks, plan.hosts, None)
    except UserError:
        used = max(place_ranks(ranks, plan.hosts)) + 1
        raise UserError(
            f"{path}: {job}, {-(-ranks // plan.hosts)} a host: they fill only {used} of "
            f"hosts = {plan.hosts}; write hosts = {used}, or workers (or a strategy's "
            "servers=N) that fill every host"
        ) from None


def _world_size(base: TrainConfig, workers: int, choice: StrategyChoice) -> int:
    """The ranks ``gradsync train`` starts for ``choice`` on ``base``'s model: the workers,
    then the dedicated servers (none for ``hybrid`` on a model without sparse variables)."""
    from gradsync.strategies import world_size_of

    return world_size_of(
        base.replace(workers=workers, strategy=choice.name, strategy_options=choice.options)
    )


def _model_entry(keys: TomlKeys) -> ModelEntry:
    """One ``[[model]]`` table of a plan, its keys typed."""
    if unknown := sorted(set(keys.raw) - MODEL_KEYS):
        raise UserError(
            f"{keys.path}: unknown key '{unknown[0]}' in [[model]]; allowed: "
            f"{', '.join(sorted(MODEL_KEYS))}"
        )
    return ModelEntry(
        name=keys.text("name", example='"transformer"'),
        preset=keys.text("preset", "default", example='"tiny"'),
        options=keys.text_table("options", example='{ vocab = "1000" }', numbers=True),
        bandwidths=keys.texts("bandwidths", None, example='["1gbit"]'),
    )


def _check_batch(plan: ValidationPlan, model: ModelEntry, path: Path) -> None:
    """The workers split ``model``'s global batch evenly, or a one-line UserError."""
    from gradsync.models import workload_of

    batch = plan.global_batch
    if batch is None:
        batch = workload_of(_train_config(plan, model)).global_batch
    if batch % plan.workers:
        even = plan.workers * max(1, batch // plan.workers)
        raise UserError(
            f"{path}: {model.label} trains a global batch of {batch}, which {plan.workers} "
            f"workers cannot split evenly; write global_batch = {even} (a multiple of "
            f"{plan.workers})"
        )


def _train_config(plan: ValidationPlan, model: ModelEntry, **fields: Any) -> TrainConfig:
    """The run of ``model`` the plan's cells train (``fields`` added)."""
    return TrainConfig(
        model=model.name,
        preset=model.preset,
        model_options=dict(model.options),
        global_batch=plan.global_batch,
        **fields,
    )


def shaped_rate(bandwidth: str) -> str | None:
    """The ``--bandwidth`` a cell's emulated hosts are shaped to: None for ``unshaped``.

    Example:
        >>> shaped_rate("1gbit"), shaped_rate(UNSHAPED)
        ('1gbit', None)
    """
    return None if bandwidth == UNSHAPED else bandwidth


def _check_calibrate(value: object, path: Path) -> None:
    """``calibrate`` is true/false or the path of an existing commbench.json."""
    if isinstance(value, bool):
        return
    if not isinstance(value, str) or not Path(value).is_file():
        raise UserError(
            f"{path}: calibrate = {value!r} is neither true/false nor an existing "
            "commbench.json; write calibrate = true to measure one per bandwidth"
        )


CELLS_LOG = "cells.jsonl"  # one line per measured run: what a rerun goes on from
PLAN_COPY = "plan.toml"  # the plan's file, copied in: a rerun goes on only with the same


def claim_validation_dir(out: Path, plan_file: Path, *, overwrite: bool) -> None:
    """Make ``out`` a validation's results folder before anything runs: new or empty, or
    holding an earlier run of the same plan (:data:`PLAN_COPY` the same file), whose
    measured cells are kept, not rerun. Another plan's cells are refused unless
    ``overwrite``, which starts afresh, and so is any other folder with files in it (see
    :func:`gradsync.rundir.claim_resumable_dir`). The plan file is copied in.

    Example:
        >>> # claim_validation_dir(Path("results/v"), Path("experiments/v.toml"), overwrite=False)
    """
    from gradsync.rundir import claim_resumable_dir

    if (out / CELLS_LOG).is_file() and not (out / PLAN_COPY).is_file() and not overwrite:
        raise UserError(
            f"--out {out} holds a validation that does not record its plan (written before "
            f"gradsync kept it there); copy its plan file to {out / PLAN_COPY} to go on with "
            "it, or pass --overwrite to start afresh"
        )
    plan_bytes = plan_file.read_bytes()
    if claim_resumable_dir(
        out,
        plan_file,
        kept_as=PLAN_COPY,
        holds_same=lambda folder: (folder / PLAN_COPY).read_bytes() == plan_bytes,
        other=f"the cells of another validation plan than {plan_file}",
        overwrite=overwrite,
    ):
        print(f"{out} holds an earlier run of this plan: its measured cells are kept, not rerun")


def run_validation(plan: ValidationPlan, out: Path) -> dict[str, Any]:
    """Measure and predict every cell (resuming from ``out/cells.jsonl``); summarize.

    Cells run model by model (in the file's order), every bandwidth and strategy of a
    model before the next, so an interrupted run has every strategy of the first models.
    Each cell is predicted from the mean of the profiles taken just before and just after
    it (the one after is the next cell's before), with ``workers`` ranks computing at once
    (:class:`ProfileRequest` ``concurrent``), so the profiles share the cores as the run's
    ranks do and bracket the machine's speed during the run. Predictions are recomputed
    from the stored profiles when summarizing, so a summary always reflects the current
    simulator.
    """
    out.mkdir(parents=True, exist_ok=True)
    log = out / CELLS_LOG
    done = {_run_key(c): c for c in _read_cells(log)}
    rounds = range(plan.repeats)
    for model in plan.models:
        for bandwidth in plan.bandwidths_of(model):
            specs = list(plan.strategies)
            if not plan.recommend and all(
                (_cell_id(model, s, bandwidth), r) in done for s in specs for r in rounds
            ):
                continue
            if plan.calibrate is True:
                _measure_calibration(plan, bandwidth, out)
            # The first profile: for the recommendation and the first cell; a resumed run
            # keeps it (measured cells were predicted from it) and profiles afresh.
            group = out / "profiles" / f"{model.name}-{bandwidth}.json"
            fresh = not group.is_file()
            profile = _profile(plan, model, group) if fresh else Profile.load(group)
            if plan.recommend:
                specs.append(_recommended(plan, profile, bandwidth, out))
            before: Path | None = group if fresh else None
            for round_, spec in ((r, spec) for r in rounds for spec in dict.fromkeys(specs)):
                cell_id = _cell_id(model, spec, bandwidth)
                if (cell_id, round_) in done:
                    continue
                label = spec.replace(":", "-").replace("=", "") + _round_suffix(round_)
                if before is None:
                    before = out / "profiles" / f"{model.name}-{bandwidth}-{label}-before.json"
                    profile = _profile(plan, model, before)
                after = out / "profiles" / f"{model.name}-{bandwidth}-{label}.json"
                cell = _run_cell(plan, model, profile, spec, bandwidth, out, round_=round_)
                profile = _profile(plan, model, after)  # and the next cell's before
                cell.update(id=cell_id, profile=str(before), profile_after=str(after))
                if plan.repeats > 1:
                    cell["round"] = round_
                done[(cell_id, round_)] = cell
                _append_cell(log, cell)
                print(_cell_line(cell), flush=True)
                before = after
    return summarize_measured(plan, out)


def summarize_measured(plan: ValidationPlan, out: Path) -> dict[str, Any]:
    """Summarize the runs ``out/cells.jsonl`` holds, re-predicted with the current
    simulator: also a validation cut short (a time limit) before every cell ran.

        >>> summarize_measured(load_plan("plan.toml"), Path("runs/validation"))  # doctest: +SKIP
    """
    cells = [_repredict(plan, c, out) for c in combine_rounds(_read_cells(out / CELLS_LOG))]
    return summarize(cells, out, plan)


def _run_key(cell: dict[str, Any]) -> tuple[str, int]:
    """A measured run's place in the plan: its cell and its round (0 without repeats)."""
    return cell["id"], int(cell.get("round", 0))


def _round_suffix(round_: int) -> str:
    """What names round ``round_``'s profiles and run directory apart ("" for the first, so
    a plan without repeats names them as before)."""
    return f"-r{round_}" if round_ else ""


def combine_rounds(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One cell per id from its rounds' runs, in the order cells were first measured: the
    median measurement of the rounds that ran, their samples/s (``rounds``), every profile
    taken around them (``profiles``), and the runs that failed. A cell measured once is
    returned as it is.

    Example:
        >>> runs = [{"id": "a", "round": r, "status": "ok", "measured": m, "load_before": 1.0,
        ...          "profile": f"b{r}", "profile_after": f"a{r}"}
        ...         for r, m in enumerate([3.0, 1.0, 2.0])]
        >>> cell = combine_rounds(runs)[0]
        >>> cell["measured"], cell["rounds"], cell["profiles"][:2]
        (2.0, [3.0, 1.0, 2.0], ['b0', 'a0'])
    """
    by_id: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_id.setdefault(run["id"], []).append(run)
    cells = []
    for group in by_id.values():
        if len(group) == 1:
            cells.append(group[0])
            continue
        group.sort(key=lambda run: int(run.get("round", 0)))
        ok = [run for run in group if run["status"] == "ok"]
        cell = {**(ok or group)[0]}
        cell.pop("round", None)
        cell["profiles"] = [
            run[key] for run in group for key in ("profile", "profile_after") if key in run
        ]
        cell["failed_rounds"] = len(group) - len(ok)
        if ok:
            cell["rounds"] = [run["measured"] for run in ok]
            cell["measured"] = statistics.median(cell["rounds"])
            cell["load_before"] = statistics.median(run["load_before"] for run in ok)
        cells.append(cell)
    return cells


def _cell_id(model: ModelEntry, spec: str, bandwidth: str) -> str:
    return f"{model.label}|{spec}|{bandwidth}"


def _cell_profile(cell: dict[str, Any]) -> Profile:
    """The profile a cell is predicted from: the mean of those taken just before and just
    after each of its rounds (``profiles``), else of those either side of its one run
    (``profile``, ``profile_after``), or the one before (runs that took no other)."""
    paths = cell.get("profiles") or [
        cell[key] for key in ("profile", "profile_after") if key in cell
    ]
    return Profile.mean([Profile.load(path) for path in paths])


def _repredict(plan: ValidationPlan, cell: dict[str, Any], out: Path) -> dict[str, Any]:
    """``cell`` with its prediction recomputed from its stored profiles."""
    profile = _cell_profile(cell)
    choice = parse_choice(cell["strategy"], plan.workers)
    bandwidth = cell["bandwidth"]
    cluster = cluster_for(plan, profile, choice, bandwidth, _calibration(plan, bandwidth, out))
    predicted = predict_step(profile, cluster, choice)
    cell = {**cell, "predicted": predicted.throughput, "predicted_step_s": predicted.step_s}
    if cell["status"] == "ok":
        cell["error"] = (predicted.throughput - cell["measured"]) / cell["measured"]
    return cell


def _read_cells(log: Path) -> list[dict[str, Any]]:
    """Every complete run in ``log``, in the order measured. A line that is not a JSON
    record with an ``id`` (cut short when a validation was killed) is skipped with a
    warning, as ``gradsync bench`` skips one: its cell counts as not measured.

    Example:
        >>> # _read_cells(Path("results/predict-validation/cells.jsonl"))[0]["id"]
    """
    return read_cell_records(log, missing="not measured")


def _append_cell(log: Path, cell: dict[str, Any]) -> None:
    """Add ``cell`` to ``log`` as one line, on a line of its own after one cut short."""
    end_line_cut_short(log)
    with log.open("a") as handle:
        handle.write(json.dumps(cell) + "\n")


def _profile(plan: ValidationPlan, model: ModelEntry, where: Path) -> Profile:
    """A fresh profile of ``model`` at the cells' per-worker batch, ``workers`` ranks
    computing at once; saved as ``where``."""
    profile = measure_profile(
        ProfileRequest(
            model=model.name,
            preset=model.preset,
            model_options=model.options,
            workers=plan.workers,
            batch=None if plan.global_batch is None else plan.global_batch // plan.workers,
            threads=plan.threads,
            steps=plan.profile_steps,
            warmup=min(3, plan.profile_steps - 2),
            concurrent=plan.workers,
            batchnorm=TrainConfig.batchnorm,  # the cells train with the default
        )
    )
    profile.save(where)
    return profile


def _calibration(plan: ValidationPlan, bandwidth: str, out: Path) -> Path | None:
    """The commbench.json the network model of ``bandwidth`` is fitted to, if any."""
    if plan.calibrate is True:
        return out / "calibration" / bandwidth / "commbench.json"
    return Path(plan.calibrate) if plan.calibrate else None


def _measure_calibration(plan: ValidationPlan, bandwidth: str, out: Path) -> None:
    """Time allreduce, p2p and exchange at bucket-like sizes on the cells' emulated hosts
    (once per bandwidth; a rerun keeps it): the per-message cost and the usable share of
    the link, the CPU time of communication, and how much slower transfers both ways at
    once are. Beside it, a 4 KB allreduce between ranks computing :data:`SYNC_BUSY_MS`
    between calls (:func:`calibrate_sync`), and a push and its answer through the server
    transport at :data:`WIRE_SIZES`, between idle ranks and between ranks that compute
    between messages (:func:`calibrate_wire`)."""
    path = _calibration(plan, bandwidth, out)
    assert path is not None
    if not (path.parent / SYNC).is_file():
        _commbench(plan, bandwidth, path.parent / SYNC, ("allreduce",), (4 << 10,), SYNC_BUSY_MS)
        print(f"blocking collectives between busy ranks at {bandwidth}: {path}", flush=True)
    if not (path.parent / WIRE).is_file():
        _commbench(
            plan, bandwidth, path.parent / WIRE, ("wire",), WIRE_SIZES, WIRE_BUSY_MS, iters=1000
        )
        print(f"the server transport at {bandwidth}: {path.parent / WIRE}", flush=True)
    if not path.is_file():
        _commbench(plan, bandwidth, path, ("allreduce", "p2p", "exchange"), CALIBRATION_SIZES)
        print(f"calibration at {bandwidth}: {path}", flush=True)


def _commbench(
    plan: ValidationPlan,
    bandwidth: str,
    path: Path,
    ops: tuple[str, ...],
    sizes: tuple[int, ...],
    busy_ms: tuple[float, ...] = (0.0,),
    iters: int = 100,
) -> None:
    """One commbench run on the cells' emulated hosts, its results written to ``path``.

    Many iterations where they fit in the budget: one small message's time sets the
    per-message cost α, and a 5-iteration mean of a 4 KB allreduce was seen anywhere from
    0.3 to 3 ms on the same hosts. (The wire echo takes 1000 where they fit: the CPU clock
    of its Python threads ticks every 10 ms.)
    """
    from gradsync.commbench import CommbenchConfig, run_commbench
    from gradsync.config import LaunchConfig

    config = CommbenchConfig(
        workers=plan.workers,
        ops=ops,
        sizes=sizes,
        busy_ms=busy_ms,
        warmup_iters=3,
        iters=iters,
        time_budget_s=2.0,
        out=str(path.parent),
        launch=LaunchConfig(
            threads=plan.threads, hosts=plan.hosts, bandwidth=shaped_rate(bandwidth)
        ),
    )
    run_commbench(config, quiet=True)


def cluster_for(
    plan: ValidationPlan,
    profile: Profile,
    choice: StrategyChoice,
    bandwidth: str,
    calibration: Path | None = None,
) -> Cluster:
    """The emulated cluster a cell of ``profile``'s model runs on: ranks placed as
    ``gradsync train --hosts`` places them (workers first, then the dedicated servers the
    strategy starts for this model: ``hybrid`` starts none for a model without sparse
    variables); its network fitted to
    ``calibration`` (a commbench.json) when given: the ring's time, and the CPU cost of
    communication and the bidirectional slowdown of point-to-point transfers from it or
    from ``supplement/commbench.json`` beside it (measured for a calibration taken before
    commbench recorded them), blocking collectives between busy ranks from
    ``sync/commbench.json`` and the server transport's messages from ``wire/commbench.json``
    where they were measured; the plan's ``shared_cores`` says how many
    cores the hosts share. The links queue what the emulated hosts' shaping queues; an
    ``unshaped`` cell's links run at the rate its calibration's ring measured, unqueued."""
    from gradsync.netem import QUEUE_MS, place_ranks

    if bandwidth == UNSHAPED:
        if calibration is None:
            raise UserError(f"bandwidth '{UNSHAPED}' takes its rate from a calibration")
        network = Network(bandwidth=ring_rate(calibration))
    else:
        network = Network(bandwidth=parse_bandwidth(bandwidth), queue_s=QUEUE_MS / 1000)
    if calibration is not None:
        network = calibrate(network, calibration)
        extra = calibration.parent / SUPPLEMENT  # measured after the cells, if at all
        if extra.is_file():
            network = calibrate_duplex(calibrate_cpu(network, extra), extra)
        if (calibration.parent / SYNC).is_file():
            network = calibrate_sync(network, calibration.parent / SYNC)
        if (calibration.parent / WIRE).is_file():
            network = calibrate_wire(network, calibration.parent / WIRE)
    model = TrainConfig(
        model=profile.model, preset=profile.preset, model_options=dict(profile.model_options)
    )
    world = _world_size(model, plan.workers, choice)
    servers = world - plan.workers
    hosts = place_ranks(world, plan.hosts)
    colocate = bool(getattr(choice.options, "colocate", False))
    num_servers = plan.workers if colocate else servers
    return Cluster(
        workers=plan.workers,
        network=network,
        servers=num_servers,
        colocate=colocate,
        host_of_worker=tuple(hosts[: plan.workers]),
        host_of_server=None if colocate else tuple(hosts[plan.workers :]),
        shared_cores=plan.shared_cores,
    )


def _recommended(plan: ValidationPlan, profile: Profile, bandwidth: str, out: Path) -> str:
    listed = [parse_choice(spec, plan.workers) for spec in plan.strategies]
    # Each candidate on the hosts the launcher would put its ranks on (servers included).
    placed = functools.partial(
        cluster_for,
        plan,
        profile,
        bandwidth=bandwidth,
        calibration=_calibration(plan, bandwidth, out),
    )
    return recommend(profile, listed, placed, bandwidth).best.choice.label()


def _run_cell(
    plan: ValidationPlan,
    model: ModelEntry,
    profile: Profile,
    spec: str,
    bandwidth: str,
    out: Path,
    *,
    round_: int = 0,
) -> dict[str, Any]:
    from gradsync.config import LaunchConfig
    from gradsync.errors import JobFailed
    from gradsync.jobs import run_job
    from gradsync.rundir import record_failure
    from gradsync.verify import cell_config

    choice = parse_choice(spec, plan.workers)
    cluster = cluster_for(plan, profile, choice, bandwidth, _calibration(plan, bandwidth, out))
    predicted = predict_step(profile, cluster, choice)
    base = _train_config(
        plan,
        model,
        steps=plan.steps,
        launch=LaunchConfig(
            threads=plan.threads, hosts=plan.hosts, bandwidth=shaped_rate(bandwidth)
        ),
    )
    runs = out / "runs" / f"{model.name}-{bandwidth}{_round_suffix(round_)}"
    config = cell_config(base, spec, plan.workers, runs)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    cell: dict[str, Any] = {
        "model": model.label,
        "strategy": spec,
        "bandwidth": bandwidth,
        "workers": plan.workers,
        "hosts": plan.hosts,
        "predicted": predicted.throughput,
        "predicted_step_s": predicted.step_s,
        "load_before": load_before,
    }
    try:
        summary = run_job(config)
    except (JobFailed, UserError) as error:
        cell.update(status="failed", error=record_failure(Path(config.out), error))
        return cell
    measured = float(summary["throughput"]["median"])
    cell.update(
        status="ok",
        measured=measured,
        error=(predicted.throughput - measured) / measured,
        wall_s=time.perf_counter() - started,
        load_after=os.getloadavg()[0],
    )
    return cell


def _cell_line(cell: dict[str, Any]) -> str:
    if cell["status"] != "ok":
        return f"{cell['model']} {cell['strategy']} {cell['bandwidth']}: failed: {cell['error']}"
    return (
        f"{cell['model']} {cell['strategy']} {cell['bandwidth']}: measured "
        f"{cell['measured']:.2f}, predicted {cell['predicted']:.2f} samples/s "
        f"({cell['error']:+.0%}), load {cell['load_before']:.1f}"
    )


def _with_spread(cell: dict[str, Any], out: Path) -> dict[str, Any]:
    """``cell`` with the min–max of its rounds, or of its one run's measurement windows (the
    noise it had)."""
    if len(cell.get("rounds", ())) > 1:
        return {**cell, "spread": f"{min(cell['rounds']):.2f}–{max(cell['rounds']):.2f}"}
    label = cell["strategy"].replace(":", "-").replace("=", "")
    model = cell["model"].split(" ")[0]
    run = out / "runs" / f"{model}-{cell['bandwidth']}" / f"{label}-w{cell['workers']}"
    summary = run / "summary.json"
    if cell["status"] != "ok" or not summary.is_file():
        return cell
    throughput = json.loads(summary.read_text())["throughput"]
    return {**cell, "spread": f"{throughput['low']:.2f}–{throughput['high']:.2f}"}


def recommendation_checks(
    cells: list[dict[str, Any]], out: Path, plan: ValidationPlan
) -> list[dict[str, Any]]:
    """Per model × bandwidth: what predict recommended (from the profile taken for it) and
    its measured throughput beside the default strategy's (gradsync's ``allreduce``)."""
    from gradsync.config import TrainConfig

    measured = {
        (c["model"], c["bandwidth"], c["strategy"]): c for c in cells if c["status"] == "ok"
    }
    checks = []
    for model in plan.models:
        for bandwidth in plan.bandwidths_of(model):
            path = out / "profiles" / f"{model.name}-{bandwidth}.json"
            if not path.is_file():
                continue
            label = _recommended(plan, Profile.load(path), bandwidth, out)
            best = measured.get((model.label, bandwidth, label))
            default = measured.get((model.label, bandwidth, TrainConfig().strategy))
            if best is None or default is None:
                continue
            checks.append(
                {
                    "model": model.label,
                    "bandwidth": bandwidth,
                    "recommended": label,
                    "measured": best["measured"],
                    "default": default["strategy"],
                    "default_measured": default["measured"],
                    "measured_gain": best["measured"] / default["measured"] - 1,
                }
            )
    return checks


def compute_spread(cells: list[dict[str, Any]]) -> dict[str, tuple[float, float, float]]:
    """Per model, min / median / max of forward + backward over the cells' profiles: how
    much the machine's load moved compute between cells."""
    by_model: dict[str, list[float]] = {}
    for cell in cells:
        if Path(cell.get("profile", "")).is_file():
            profile = Profile.load(cell["profile"])
            by_model.setdefault(cell["model"], []).append(profile.compute_s)
    return {
        model: (min(values), statistics.median(values), max(values))
        for model, values in by_model.items()
    }


def summarize(cells: list[dict[str, Any]], out: Path, plan: ValidationPlan) -> dict[str, Any]:
    """Write ``validation.json`` and ``validation.md``; return the summary."""
    from gradsync.files import atomic_write_text
    from gradsync.tables import markdown_table

    cells = [_with_spread(c, out) for c in cells]
    ok = [c for c in cells if c["status"] == "ok"]
    errors = [abs(c["error"]) for c in ok]
    summary = {
        "cells": cells,
        "num_ok": len(ok),
        "num_failed": len(cells) - len(ok),
        "median_abs_error": statistics.median(errors) if errors else None,
        "p90_abs_error": percentile(errors, 90) if errors else None,
        "load_average": os.getloadavg(),
        "recommendations": recommendation_checks(cells, out, plan),
        "profile_compute_s": compute_spread(cells),
    }
    atomic_write_text(out / "validation.json", json.dumps(summary, indent=1) + "\n")
    rows = [
        [
            c["model"],
            c["strategy"],
            c["bandwidth"],
            f"{c['measured']:.2f}" if c["status"] == "ok" else "failed",
            c.get("spread", ""),
            f"{c['predicted']:.2f}",
            f"{c['error']:+.0%}" if c["status"] == "ok" else c["error"][:60],
            f"{c['load_before']:.1f}",
        ]
        for c in cells
    ]
    headers = [
        "model",
        "strategy",
        "bandwidth",
        "measured",
        "measured min–max",
        "predicted",
        "error",
        "load",
    ]
    lines = ["# Prediction vs measurement on emulated hosts", "", markdown_table(headers, rows)]
    if errors:
        lines += [
            "",
            f"{len(ok)} cells: median |error| {summary['median_abs_error']:.1%}, "
            f"90th percentile {summary['p90_abs_error']:.1%}",
        ]
    for model, (low, middle, high) in summary["profile_compute_s"].items():
        lines.append(
            f"- {model}: forward + backward in the cells' profiles {low:.2f} / {middle:.2f} / "
            f"{high:.2f} s (min / median / max)"
        )
    if summary["recommendations"]:
        lines += ["", "## Recommended vs default, both measured", ""]
        lines.append(
            markdown_table(
                ["model", "bandwidth", "recommended", "measured", "default", "measured gain"],
                [
                    [
                        r["model"],
                        r["bandwidth"],
                        r["recommended"],
                        f"{r['measured']:.2f}",
                        f"{r['default']} {r['default_measured']:.2f}",
                        f"{r['measured_gain']:+.0%}",
                    ]
                    for r in summary["recommendations"]
                ],
            )
        )
    atomic_write_text(out / "validation.md", "\n".join(lines) + "\n")
    return summary


__all__ = [
    "ValidationPlan",
    "cluster_for",
    "combine_rounds",
    "load_plan",
    "run_validation",
    "summarize",
]
