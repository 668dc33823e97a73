"""Equal workloads: the cells a bench report compares, and what every such pair holds equal.

The report compares cells two ways:

* **strategies side by side** (the reading, the plots, the published-gain table): cells
  that differ only in their strategy and its options, at the same model, workers, link,
  batch, threads and learning-rate rule (:func:`setting`);
* **scaling** (speedup, efficiency): a cell against the same cell at one worker, with the
  same global batch (strong scaling), or the same per-worker batch when the experiment
  gives ``batch_per_worker`` (weak scaling, as Horovod's benchmark) (:func:`one_worker`).

Settings an experiment sweeps on purpose (batch, threads, inter-op threads, learning-rate
rule, link rate) are never compared across: each comparison stays within one value. What
must then be equal in every compared pair is the workload — dropout, BatchNorm mode, data,
batch, intra- and inter-op threads per rank — and :func:`check_equal_workloads` refuses,
before launch, an experiment where it would not be. In practice that is ``threads`` left
unset: each rank then gets the machine's cores / the job's ranks, so ``ps`` (server ranks)
beside ``allreduce``, or one worker beside four, would compute with different threads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gradsync.bench.experiment import Cell, Experiment
from gradsync.config import TrainConfig
from gradsync.errors import UserError
from gradsync.strategies import world_size_of
from gradsync.topology import default_threads, machine_cores

BATCHNORM_TEXT = {"global": "over the global batch", "local": "per worker"}
SETTING_WORDS = {
    "global_batch": "global batch",
    "threads": "intra-op threads",
    "interop_threads": "inter-op threads",
    "lr_scaling": "learning-rate rule",
    "bandwidth": "link rate",
}


@dataclass(frozen=True)
class Swept:
    """The settings an experiment sweeps on purpose besides strategy and workers (cell
    fields): every comparison stays within one value of each.

    Example:
        >>> swept = Swept.of(Experiment(name="x", path="x.toml", threads=[1, 2]))
        >>> swept.names, swept.describe(Cell(model="m", strategy="ddp", workers=2, threads=2))
        (('threads',), '2 threads')
    """

    names: tuple[str, ...] = ()
    per_worker_batch: bool = False

    @classmethod
    def of(cls, experiment: Experiment) -> Swept:
        """The settings with more than one value in ``experiment``."""
        axes = {
            "global_batch": experiment.batch_per_worker or experiment.global_batch,
            "threads": experiment.threads,
            "interop_threads": experiment.interop_threads,
            "lr_scaling": experiment.lr_scaling,
            "bandwidth": experiment.bandwidths,
        }
        names = tuple(name for name, values in axes.items() if len(values) > 1)
        return cls(names, per_worker_batch=bool(experiment.batch_per_worker))

    def without(self, name: str) -> Swept:
        """The same, less ``name`` (where a comparison already names it, e.g. the link)."""
        return Swept(tuple(n for n in self.names if n != name), self.per_worker_batch)

    def describe(self, cell: Cell) -> str:
        """``cell``'s values of the swept settings, e.g. ``batch 64, 2 threads, lr sqrt``."""
        parts = []
        for name in self.names:
            value = getattr(cell, name)
            if name == "global_batch" and self.per_worker_batch and value is not None:
                parts.append(f"per-worker batch {value // cell.workers}")
            elif name == "global_batch":
                parts.append(f"batch {value or 'default'}")
            elif name == "threads":
                parts.append(f"{value or 'default'} thread{'' if value == 1 else 's'}")
            elif name == "interop_threads":
                parts.append(f"{value or 'default'} inter-op")
            elif name == "lr_scaling":
                parts.append(f"lr {value}")
            else:
                parts.append(value or "loopback")
        return ", ".join(parts)

    def words(self) -> str:
        """The swept settings in words, e.g. ``intra-op threads and learning-rate rule``."""
        names = [SETTING_WORDS[name] for name in self.names]
        if not names:
            return ""
        if self.per_worker_batch and "global_batch" in self.names:
            names[self.names.index("global_batch")] = "per-worker batch"
        return ", ".join(names[:-1]) + (" and " if len(names) > 1 else "") + names[-1]


def setting(cell: Cell) -> Cell:
    """What strategies compared side by side share: the cell without its strategy, that
    strategy's options and the repeat (a p3 slice-size sweep still meets the ps baseline).

    Example:
        >>> a = Cell(model="m", strategy="ps", workers=2, options=(("servers", 1),))
        >>> setting(a) == setting(Cell(model="m", strategy="p3", workers=2))
        True
    """
    return dataclasses.replace(cell, strategy="", options=(), repeat=0)


def one_worker(experiment: Experiment, cell: Cell) -> Cell:
    """The cell that ``cell``'s speedup and efficiency are measured against: the same cell
    at one worker, with the same global batch, or per-worker batch under ``batch_per_worker``.

    Example:
        >>> weak = Experiment(name="x", path="x.toml", batch_per_worker=[32])
        >>> one_worker(weak, Cell(model="m", strategy="ddp", workers=4, global_batch=128))
        Cell(model='m', strategy='ddp', workers=1, options=(), global_batch=32, ...)
    """
    batch = cell.global_batch
    if experiment.batch_per_worker and batch is not None:
        batch //= cell.workers
    return dataclasses.replace(cell, workers=1, global_batch=batch)


def compared_pairs(experiment: Experiment, cells: list[Cell]) -> list[tuple[str, Cell, Cell]]:
    """Every pair of measured cells the report compares, as (comparison, cell, other).

    Strategies at one setting are each paired with the first of them (equality is
    transitive, so that covers the group); every cell above one worker with its one-worker
    counterpart when the experiment has it.

    Example:
        >>> tiny = Experiment(name="x", path="x.toml", strategies=["ddp"], workers=[1, 2])
        >>> [(kind, b.workers) for kind, _, b in compared_pairs(tiny, tiny.cells())]
        [('scaling efficiency', 1)]
    """
    measured = [c for c in cells if c.role == "measure" and c.repeat == 0]
    present = set(measured)
    pairs: list[tuple[str, Cell, Cell]] = []
    first: dict[Cell, Cell] = {}
    for cell in measured:
        head = first.setdefault(setting(cell), cell)
        if head is not cell:
            pairs.append(("strategies side by side", head, cell))
    for cell in measured:
        base = one_worker(experiment, cell)
        if cell.workers > 1 and base in present:
            pairs.append(("scaling efficiency", cell, base))
    return pairs


def workload(
    config: TrainConfig,
    *,
    per_worker_batch: bool = False,
    launcher: str = "local",
    cores: int | None = None,
) -> dict[str, Any]:
    """What a cell's job computes with, as compared between cells: dropout, BatchNorm
    mode, data, batch, intra- and inter-op threads per rank.

    Unset threads are the machine's ``cores`` / the job's ranks (``srun``: the allocation's
    CPUs per task, the same for every cell).

    Example:
        >>> job = TrainConfig(model="mnist-cnn", strategy="ps", workers=2, deterministic=True)
        >>> workload(job, cores=6)["intra-op threads per rank"]  # 2 workers + 1 server
        2
    """
    batch = config.global_batch
    if per_worker_batch and batch is not None:
        batch //= config.workers
    threads: int | str | None = config.launch.threads
    if threads is None:
        ranks = world_size_of(config) // max(1, config.launch.num_nodes)
        threads = "the CPUs per task" if launcher == "srun" else default_threads(ranks, cores)
    return {
        "dropout": "off" if config.deterministic else "on",
        "BatchNorm": BATCHNORM_TEXT.get(config.batchnorm, config.batchnorm),
        "data": config.data or "synthetic",
        "per-worker batch" if per_worker_batch else "global batch": batch or "the preset's",
        "intra-op threads per rank": threads,
        "inter-op threads per rank": config.launch.interop_threads or "torch's default",
    }


def check_equal_workloads(
    experiment: Experiment,
    configs: Mapping[str, TrainConfig],
    *,
    launcher: str = "local",
    cores: int | None = None,
) -> None:
    """UserError (one line: which pair, what differs, how to fix) when a pair of cells the
    report compares would differ in dropout, BatchNorm mode, data, batch or threads.

    ``configs`` maps each cell id to its job, as the sweep runs it.

    Example:
        >>> from pathlib import Path
        >>> from gradsync.bench.sweep import cell_config
        >>> exp = Experiment(name="x", path="x.toml", strategies=["ddp"], workers=[1, 2])
        >>> jobs = {c.id: cell_config(exp, c, Path("out")) for c in exp.cells()}
        >>> check_equal_workloads(exp, jobs, cores=2)
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: x.toml: scaling efficiency would compare ddp at 2 workers ...
    """
    cores = machine_cores() if cores is None else cores
    cells = experiment.cells()
    for kind, cell, other in compared_pairs(experiment, cells):
        weak = kind == "scaling efficiency" and bool(experiment.batch_per_worker)
        mine, theirs = (
            workload(configs[c.id], per_worker_batch=weak, launcher=launcher, cores=cores)
            for c in (cell, other)
        )
        differ = [key for key in mine if mine[key] != theirs[key]]
        if not differ:
            continue
        values = ", ".join(f"{key} {mine[key]} vs {theirs[key]}" for key in differ)
        what = (
            f"{experiment.path}: {kind} would compare {_name(cell)} with {_name(other)}, "
            f"which differ in {values}"
        )
        if differ == ["intra-op threads per rank"] and None in experiment.threads:
            ranks = max(world_size_of(configs[c.id]) for c in cells if c.role == "measure")
            raise UserError(
                f"{what}: threads is not set, so each rank gets this machine's {cores} cores / "
                f"its job's ranks; set threads = [{max(1, cores // ranks)}] in the experiment "
                f"(the largest job has {ranks} ranks) so every cell computes with the same "
                "threads, or sweep threads on purpose"
            )
        raise UserError(
            f"{what}: a ratio between different workloads measures the workload, not the "
            f"strategy; hold {' and '.join(differ)} equal across the experiment's cells"
        )


def _name(cell: Cell) -> str:
    options = ", ".join(f"{key}={value}" for key, value in cell.options)
    text = cell.strategy + (f" ({options})" if options else "")
    text += f" at {cell.workers} worker{'s' if cell.workers > 1 else ''}"
    if cell.bandwidth:
        text += f" behind {cell.bandwidth} links"
    return text


__all__ = [
    "Swept",
    "check_equal_workloads",
    "compared_pairs",
    "one_worker",
    "setting",
    "workload",
]
