"""``--resume RUN_DIR`` and ``--max-restarts``: continue a run from its last checkpoint.

The checkpoint (one safetensors file, see :mod:`gradsync.checkpoint`) holds everything a
run needs to go on as if it had never stopped:

- parameters and buffers (``param/``, ``buffer/``) and optimizer state (``optim/``); for
  ps, hybrid and p3 worker 0 gathers the servers' authoritative values and optimizer state
  into it, and hybrid's rows its servers have not caught up yet (``lazy/``);
- the learning-rate schedule's position and the data position: both are the number of
  steps done (``step`` in the metadata; a step's batch and rate are functions of its
  index, and server strategies send it with every push);
- every worker's torch RNG state (``rng/worker<r>``), so dropout draws the same masks;
- the buffers a worker w ≥ 1 holds unlike worker 0's (``worker-buffer/worker<w>/<name>``:
  per-worker BatchNorm statistics, an EMA its forward keeps), so each worker goes on
  from its own.

Each strategy puts the state back where it keeps it (:meth:`~gradsync.strategies.base.
Strategy.restore_state`): data-parallel strategies into every worker's model and
optimizer; server strategies also send it to every server (a LOAD each server
acknowledges) before any worker pushes or pulls. A resumed run therefore ends
bit-identical to one that was never interrupted (tested per strategy in float64).
"""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradsync.checkpoint import (
    BUFFER,
    OPTIM,
    PARAM,
    RNG,
    TENSOR_COUNTS,
    WORKER_BUFFER,
    Checkpoint,
    load_checkpoint_meta,
    tensor_counts,
    tensor_layout,
)
from gradsync.config import TrainConfig
from gradsync.errors import UserError
from gradsync.metrics import unsummarized
from gradsync.optim import effective_lr
from gradsync.options import flag_of
from gradsync.strategies import Strategy, strategy_class

CHECKPOINT_FILE = "checkpoint.safetensors"


def resumable(strategy: str) -> bool:
    """Whether ``--resume`` and ``--max-restarts`` can restore ``strategy``'s state: every
    built-in strategy; a plugin that saves state its own way only with its own
    ``restore_state``.

    Example:
        >>> resumable("allreduce"), resumable("ps")
        (True, True)
    """
    return strategy_class(strategy).resumable()


def checkpoint_step(run_dir: Path) -> int | None:
    """The step count of the checkpoint in ``run_dir``, or None when it has none.

    Example:
        >>> import tempfile
        >>> checkpoint_step(Path(tempfile.mkdtemp())) is None
        True
    """
    path = run_dir / CHECKPOINT_FILE
    if not path.is_file():
        return None
    return int(load_checkpoint_meta(path).get("step", 0))  # the header alone: no tensors


def check_resume(config: TrainConfig, run_dir: Path) -> int:
    """UserError unless ``config`` can continue the run in ``run_dir``; its step count.

    Example:
        >>> # check_resume(config, Path("runs/a"))  # → 10 (the checkpoint's step)
    """
    if not resumable(config.strategy):
        raise UserError(
            f"--resume: strategy '{config.strategy}' saves its own checkpoint_tensors but has "
            "no restore_state to put them back; add one to it, or start the run again"
        )
    if not run_dir.is_dir():
        raise UserError(f"--resume {run_dir}: no such run folder; pass the --out of the run")
    if not (run_dir / CHECKPOINT_FILE).is_file() and not (run_dir / "config.json").is_file():
        raise UserError(
            f"--resume {run_dir}: not a training run's folder (no config.json, no checkpoint); "
            "pass the --out of a `gradsync train` run"
        )
    if not (run_dir / CHECKPOINT_FILE).is_file():
        raise UserError(
            f"--resume {run_dir}: the run wrote no checkpoint (it stopped before its first "
            "one); start it again with --checkpoint-every N"
        )
    meta = load_checkpoint_meta(run_dir / CHECKPOINT_FILE)
    step = meta.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise UserError(
            f"--resume {run_dir}: the checkpoint's step is {step!r}, not a count of steps "
            "done; the file was not written by gradsync train (or was edited): start the run "
            "again"
        )
    for difference in meta_differences(meta, config):
        raise UserError(
            f"--resume {run_dir}: the run was started with {difference}; resume it with the "
            "same settings"
        )
    if step > config.steps or (step == config.steps and not unsummarized(run_dir)):
        raise UserError(
            f"--resume {run_dir}: the checkpoint is at step {step}, and --steps is "
            f"{config.steps}; pass a larger --steps to train further"
        )
    layout = tensor_layout(run_dir / CHECKPOINT_FILE)
    if (counts := meta.get(TENSOR_COUNTS)) is not None and counts != tensor_counts(layout):
        raise UserError(
            f"--resume {run_dir}: the checkpoint holds {tensor_counts(layout)} tensors by kind, "
            f"but was written with {counts}; it was edited or damaged: start the run again"
        )
    if problem := misfit(config, layout):
        raise UserError(
            f"--resume {run_dir}: the checkpoint does not fit the model: {problem}; the model "
            "(or its file) changed since the run, or the checkpoint was edited: start again"
        )
    return step


def misfit(config: TrainConfig, layout: dict[str, tuple[tuple[int, ...], str]]) -> str | None:
    """What in a checkpoint's tensors (names → shape and dtype) the run of ``config`` could
    not resume from, or None: a parameter or buffer missing, extra, of another shape or
    dtype; a worker's RNG state missing; optimizer state missing, whole or in part.

    Example:
        >>> from gradsync.checkpoint import model_state
        >>> from gradsync.config import OptimConfig
        >>> from gradsync.models import workload_of
        >>> config = TrainConfig(model="mnist-cnn", preset="tiny", optim=OptimConfig(momentum=0))
        >>> model = workload_of(config).model
        >>> layout = {k: (tuple(v.shape), "float32") for k, v in model_state(model, None).items()}
        >>> misfit(config, {**layout, "rng/worker0": ((5056,), "uint8")}) is None
        True
        >>> misfit(config, layout)
        'no RNG state of worker 0 (rng/worker0)'
    """
    from gradsync.models import workload_of

    model = workload_of(config).model
    expected = {f"{PARAM}{n}": t for n, t in model.named_parameters()}
    expected |= {f"{BUFFER}{n}": t for n, t in model.named_buffers()}
    saved = {k: v for k, v in layout.items() if k.startswith((PARAM, BUFFER))}
    if missing := sorted(expected.keys() - saved.keys()):
        return f"no {missing[0]}"
    if extra := sorted(saved.keys() - expected.keys()):
        return f"{extra[0]}, which the model has not"
    for name, tensor in expected.items():
        shape, dtype = saved[name]
        want = (tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
        if (shape, dtype) != want:
            return f"{name} is {list(shape)} {dtype}, the model's {list(want[0])} {want[1]}"
    if missing_rng := [w for w in range(config.workers) if f"{RNG}worker{w}" not in layout]:
        return f"no RNG state of worker {missing_rng[0]} ({RNG}worker{missing_rng[0]})"
    return _optimizer_misfit(config, layout)


def _optimizer_misfit(config: TrainConfig, layout: dict[str, Any]) -> str | None:
    """Optimizer state gone: all of it where the optimizer keeps some (momentum, Adam), or
    part of one parameter's (its keys unlike the other parameters')."""
    keys_of: dict[str, set[str]] = {}
    for key in layout:
        if key.startswith(OPTIM):
            name, _, kind = key.removeprefix(OPTIM).rpartition("/")
            keys_of.setdefault(name, set()).add(kind)
    keeps_state = config.optim.name == "adam" or (config.optim.momentum or 0) > 0
    if keeps_state and not keys_of:
        return "no optimizer state (optim/…), though the optimizer keeps some"
    kinds = [frozenset(k) for k in keys_of.values()]
    usual = max(set(kinds), key=kinds.count, default=frozenset())
    for name, kind in keys_of.items():
        if not usual <= kind:
            return f"optimizer state of {name} lacks {', '.join(sorted(usual - kind))}"
    return None


def run_settings(config: TrainConfig, global_batch: int, lr: float) -> dict[str, Any]:
    """Every setting that changes a run's results, as the run resolved it (its global batch
    and scaled learning rate): recorded with its checkpoints and summary, and what a resume
    must match (:func:`meta_differences`). Of the strategy options, those that change what
    is computed (``changes_results``); a server count or a bucket size may change, as
    ``--threads`` may (it moves rounding, not the arithmetic).

    Example:
        >>> settings = run_settings(TrainConfig(strategy="ps"), global_batch=8, lr=0.1)
        >>> settings["global_batch"], settings["strategy_options"]
        (8, {'async_updates': False, 'staleness': None})
    """
    return {
        "model": config.model,
        "preset": config.preset,
        "model_options": config.model_options,
        "strategy": config.strategy,
        "workers": config.workers,
        "seed": config.seed,
        "global_batch": global_batch,
        "optimizer": config.optim.name,
        "lr": lr,
        "momentum": config.optim.momentum,
        "weight_decay": config.optim.weight_decay,
        "lr_warmup_steps": config.optim.lr_warmup_steps,
        "deterministic": config.deterministic,
        "dtype": config.dtype,
        "batchnorm": config.batchnorm,
        "data": config.data,
        "strategy_options": config.strategy_options.result_changing(),
    }


def meta_differences(meta: dict[str, Any], config: TrainConfig) -> list[str]:
    """``setting X, not Y`` for every :func:`run_settings` entry the run and ``config``
    differ in; a strategy option is named by its flag. A setting the checkpoint does not
    record (an older gradsync) is not compared.

    Example:
        >>> meta = {"model": "mnist-cnn", "preset": "tiny", "workers": 2, "global_batch": 8}
        >>> meta_differences(meta, TrainConfig(model="mnist-cnn", preset="tiny", workers=4))
        ['workers 2, not 4']
        >>> meta_differences(meta, TrainConfig(model="mnist-cnn", preset="tiny", workers=2,
        ...                                    global_batch=16))
        ['global_batch 8, not 16']
        >>> meta = {"strategy_options": {"async_updates": False, "staleness": None}}
        >>> asynchronous = TrainConfig(strategy="ps", strategy_options={"async_updates": True})
        >>> meta_differences(meta, asynchronous)
        ['--async False, not True']
    """
    from gradsync.models import same_options, workload_of
    from gradsync.models.user import same_model

    preset_batch = workload_of(config).global_batch
    global_batch = config.global_batch or preset_batch
    lr = effective_lr(config.optim, global_batch, preset_batch)
    mine = run_settings(config, global_batch, lr)
    differences = [
        f"{key} {meta[key]}, not {value}"
        for key, value in mine.items()
        if key not in ("strategy_options", "model", "model_options")
        and key in meta
        and meta[key] != value
    ]
    recorded_options = meta.get("model_options", config.model_options)
    if not same_options(config.model, recorded_options, config.model_options):
        differences.append(f"model_options {recorded_options}, not {config.model_options}")
    if "model" in meta and not same_model(meta["model"], config.model):
        differences.insert(0, f"model {meta['model']}, not {config.model}")
    flags = {item.name: flag_of(item) for item in dataclasses.fields(config.strategy_options)}
    theirs = meta.get("strategy_options", {})
    for name, value in mine["strategy_options"].items():
        if name in theirs and theirs[name] != value:
            differences.append(f"{flags[name]} {theirs[name]}, not {value}")
    return differences


def rng_tensors(
    worker_group: Any, num_workers: int, device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """Every worker's torch RNG state, and its GPU's where it trains on one (dropout on a
    GPU draws from that generator), gathered (a collective over the workers).

    Example:
        >>> sorted(rng_tensors(None, 1))
        ['rng/worker0']
    """
    states = {"": torch.get_rng_state()}
    if device is not None and device.type == "cuda":
        states["cuda/"] = torch.cuda.get_rng_state(device)
    gathered: dict[str, torch.Tensor] = {}
    for kind, state in states.items():
        if num_workers == 1 or not dist.is_initialized():
            gathered[f"{RNG}{kind}worker0"] = state
            continue
        values = [torch.empty_like(state) for _ in range(num_workers)]
        dist.all_gather(values, state, group=worker_group)
        gathered.update({f"{RNG}{kind}worker{w}": value for w, value in enumerate(values)})
    return gathered


def worker_buffers(
    model: torch.nn.Module | None, worker_group: Any, num_workers: int
) -> dict[str, torch.Tensor]:
    """The buffers each worker w ≥ 1 holds unlike worker 0's (which ``buffer/`` saves),
    gathered (a collective over the workers): a fingerprint of every buffer first, then
    only the buffers whose fingerprints differ.

    Example:
        >>> worker_buffers(torch.nn.BatchNorm1d(2), None, 1)  # one worker: nothing else
        {}
        >>> _fingerprint(torch.tensor(3)) == _fingerprint(torch.tensor([3]))  # 0-dim too
        True
    """
    if model is None or num_workers == 1 or not dist.is_initialized():
        return {}
    buffers = dict(model.named_buffers())
    if not buffers:
        return {}
    prints = torch.tensor([_fingerprint(b) for b in buffers.values()], dtype=torch.int64)
    every = [torch.empty_like(prints) for _ in range(num_workers)]
    dist.all_gather(every, prints, group=worker_group)
    differ = [name for i, name in enumerate(buffers) if any(p[i] != every[0][i] for p in every)]
    gathered: dict[str, torch.Tensor] = {}
    for name in differ:  # in one order on every worker: the fingerprints were all_gathered
        values = [torch.empty_like(buffers[name]) for _ in range(num_workers)]
        dist.all_gather(values, buffers[name].contiguous(), group=worker_group)
        gathered.update(
            {f"{WORKER_BUFFER}worker{w}/{name}": values[w] for w in range(1, num_workers)}
        )
    return gathered


def _fingerprint(tensor: torch.Tensor) -> int:
    data = tensor.detach().cpu().contiguous().reshape(-1)  # 0-dim: num_batches_tracked
    return zlib.crc32(data.view(torch.uint8).numpy().tobytes()) if data.numel() else 0


def restore_worker_buffers(
    model: torch.nn.Module | None, tensors: dict[str, torch.Tensor], worker: int
) -> None:
    """Put back the buffers :func:`worker_buffers` saved for ``worker`` (the others keep
    worker 0's ``buffer/`` values, which they held alike).

    Example:
        >>> layer = torch.nn.BatchNorm1d(2)
        >>> key = "worker-buffer/worker1/running_mean"
        >>> restore_worker_buffers(layer, {key: torch.ones(2)}, worker=1)
        >>> layer.running_mean
        tensor([1., 1.])
    """
    if model is None:
        return
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            saved = tensors.get(f"{WORKER_BUFFER}worker{worker}/{name}")
            if saved is not None:
                buffer.copy_(saved)


def restore(checkpoint: Checkpoint, strategy: Strategy, worker: int) -> int:
    """Put the checkpoint's state where ``strategy`` keeps it (its ``restore_state``) and
    this worker's RNG states back (its GPU's too, where the run trained on one); the
    number of steps done, where training goes on.

    Example:
        >>> # start = restore(load_checkpoint("runs/a"), strategy, worker=0)
    """
    steps_done = int(checkpoint.meta["step"])
    strategy.restore_state(checkpoint.tensors, steps_done)
    restore_worker_buffers(strategy.model, checkpoint.tensors, worker)
    rng = checkpoint.tensors.get(f"{RNG}worker{worker}")
    if rng is not None:
        torch.set_rng_state(rng)
    gpu_rng = checkpoint.tensors.get(f"{RNG}cuda/worker{worker}")
    if gpu_rng is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(gpu_rng)
    return steps_done


__all__ = [
    "check_resume",
    "checkpoint_step",
    "meta_differences",
    "restore",
    "restore_worker_buffers",
    "resumable",
    "rng_tensors",
    "run_settings",
    "worker_buffers",
]
