"""One rank of a job: join the process group, build the workload, train, write results.

Started by gradsync's launcher (``python -m gradsync.runtime CONFIG``), or directly by
``gradsync train`` under torchrun, srun or mpirun.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from gradsync.allocator import keep_step_memory
from gradsync.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from gradsync.comm.batchnorm import convert_batchnorm, has_batchnorm
from gradsync.comm.wire import TransportError
from gradsync.config import TrainConfig
from gradsync.data.base import mix_seed, shard_bounds
from gradsync.errors import UserError, say
from gradsync.evaluate import validation_accuracy
from gradsync.files import atomic_write_text
from gradsync.heartbeat import beat, beating
from gradsync.launch import STOPPED_PREFIX, VICTIM_PREFIX, is_lost_connection
from gradsync.metrics import MetricsWriter, StepRecord, environment, summarize
from gradsync.models import workload_of
from gradsync.models.base import Workload
from gradsync.optim import Updater, effective_lr
from gradsync.probe import (
    ProbeUnavailable,
    UnknownGradients,
    missing_on_any_worker,
    params_without_gradient,
)
from gradsync.progress import StepProgress
from gradsync.rendezvous import RankInfo, finish_process, join_process_group
from gradsync.resume import checkpoint_step, restore, rng_tensors, run_settings, worker_buffers
from gradsync.signals import HANDLED, Stopped, stop_on_signals
from gradsync.strategies import Context, Strategy, strategy_class
from gradsync.topology import RankEnv, default_threads
from gradsync.trace import Timeline, merge_rank_files, open_timeline
from gradsync.trainer import LossNotFinite, train

CHECKPOINT_FILE = "checkpoint.safetensors"


def run_rank(config: TrainConfig, env: RankEnv) -> None:
    """Train as rank ``env.rank`` of ``env.world_size``; rank 0 writes the summary."""
    keep_step_memory()
    threads = config.launch.threads or default_threads(env.local_world_size)
    torch.set_num_threads(threads)
    if config.launch.interop_threads is not None:
        torch.set_num_interop_threads(config.launch.interop_threads)
    print(
        f"[rank {env.rank}] {env.launcher}: intra-op threads {threads} "
        f"({os.cpu_count()} cores / {env.local_world_size} local ranks), "
        f"inter-op threads {torch.get_num_interop_threads()}",
        flush=True,
    )
    # float64 (verify's default) makes every tensor gradsync or the model creates float64:
    # parameters, data, gradients, messages, server state, BatchNorm statistics.
    torch.set_default_dtype(getattr(torch, config.dtype))
    device = _proposed_device(config, env)
    distributed = env.world_size > 1 or config.strategy != "single"
    if distributed:
        beat("rendezvous")  # the rendezvous has its own timeout, naming missing ranks
        # The ranks check that they belong together (world size, versions, a GPU each).
        info = RankInfo.here(
            env,
            wants=config.launch.device,
            device=device.type,
            gpu=_gpu_id(device),
            settings=config.shared_settings(),
        )
        timeout = timedelta(seconds=config.launch.timeout_s)
        if join_process_group(env, timeout, info=info) == "cpu":
            device = torch.device("cpu")
    beat("build")
    try:
        _train_and_record(config, env, device, threads)
    finally:
        if distributed and dist.is_initialized():
            dist.destroy_process_group()


def _train_and_record(
    config: TrainConfig, env: RankEnv, device: torch.device, threads: int
) -> None:
    """One rank's whole job: serve (server ranks) or train, checkpoint and summarize."""
    role = "worker" if env.rank < config.workers else "server"
    timeline = open_timeline(
        Path(config.out),
        path=config.timeline,
        window_text=config.timeline_steps,
        rank=env.rank,
        world_size=env.world_size,
        role=role,
    )
    strategy = strategy_class(config.strategy)()
    # Server ranks (strategies that have them) come after the workers. new_group is
    # collective: every rank creates the worker group, even the servers.
    worker_group = (
        dist.new_group(
            list(range(config.workers)), timeout=timedelta(seconds=config.launch.timeout_s)
        )
        if dist.is_initialized() and env.world_size > config.workers
        else None
    )
    if role == "server":  # a dedicated server: no model, no data, no trainer
        _serve(config, env, strategy, device, worker_group, timeline)
        return
    try:
        run = _prepare_worker(config, env, strategy, device, worker_group, timeline, threads)
        _train_with_metrics(run, strategy)
        _finish_worker(run, strategy, timeline)
    finally:
        timeline.close()  # a failed or stopped rank's events reach the disk too (idempotent)


@dataclass
class _WorkerRun:
    """What a worker rank's training, checkpoints and summary share."""

    config: TrainConfig
    env: RankEnv
    workload: Workload
    global_batch: int
    context: Context
    meta: dict[str, Any]
    threads: int
    checkpoint: Checkpoint | None  # the one --resume goes on from

    @property
    def out(self) -> Path:
        return Path(self.config.out)


def _prepare_worker(
    config: TrainConfig,
    env: RankEnv,
    strategy: Strategy,
    device: torch.device,
    worker_group: Any,
    timeline: Timeline,
    threads: int,
) -> _WorkerRun:
    """Build the model (same initial parameters on every rank), set BatchNorm's mode, probe
    it, and make the strategy's context."""
    torch.manual_seed(config.seed)  # identical initial parameters on every rank
    workload = workload_of(config, dropout=not config.deterministic)
    global_batch = config.global_batch or workload.global_batch
    workload.model.to(device)
    # BatchNorm's mode before the probe: the probe then runs step 0 as training runs it
    # (global statistics, which a shard of one sample and a CPU SyncBatchNorm need).
    _set_batchnorm_mode(config, workload.model, worker_group, env.rank)
    missing = _probe_gradients(
        config, strategy, workload, global_batch, env.rank, worker_group, device
    )
    if env.rank == 0 and (per_epoch := _iterations_per_epoch(workload, global_batch)):
        print(
            f"[rank 0] data: {workload.num_train_samples:,} training samples, so an epoch is "
            f"{per_epoch:,} iterations at global batch {global_batch}",
            flush=True,
        )
    torch.manual_seed(mix_seed(config.seed, env.rank))  # dropout differs per rank, reproducibly
    lr = effective_lr(config.optim, global_batch, workload.global_batch)
    checkpoint = load_checkpoint(Path(config.out) / CHECKPOINT_FILE) if config.resume else None
    context = _context(
        config,
        env,
        device,
        worker_group,
        timeline,
        make_updater=lambda params: Updater(params, config.optim, lr=lr, timeline=timeline),
        steps_done=int(checkpoint.meta["step"]) if checkpoint else 0,
        lr=lr,
        missing_gradients=missing,
    )
    meta = _run_meta(config, global_batch, lr, threads)
    return _WorkerRun(config, env, workload, global_batch, context, meta, threads, checkpoint)


def _context(
    config: TrainConfig,
    env: RankEnv,
    device: torch.device,
    worker_group: Any,
    timeline: Timeline,
    *,
    make_updater: Callable[[Iterable[torch.nn.Parameter]], Updater],
    steps_done: int,
    role: str = "worker",
    lr: float = 0.0,
    missing_gradients: frozenset[str] | None = None,
) -> Context:
    """The strategy's context on this rank: a worker's index is its rank; a dedicated server
    (``role="server"``) has none (-1)."""
    return Context(
        config=config,
        rank=env.rank,
        world_size=env.world_size,
        worker_index=env.rank if role == "worker" else -1,
        num_workers=config.workers,
        device=device,
        worker_group=worker_group,
        make_updater=make_updater,
        timeline=timeline,
        role=role,
        lr=lr,
        missing_gradients=missing_gradients,
        steps_done=steps_done,
    )


def _set_batchnorm_mode(
    config: TrainConfig, model: torch.nn.Module, worker_group: Any, rank: int
) -> None:
    if config.workers > 1 and config.batchnorm == "global":
        if convert_batchnorm(model, group=worker_group) and rank == 0:
            print("[rank 0] BatchNorm statistics span the global batch (cross-rank BatchNorm)")
    elif config.workers > 1 and has_batchnorm(model) and rank == 0:
        print("[rank 0] BatchNorm statistics per worker shard (--batchnorm local)")


def _run_meta(config: TrainConfig, global_batch: int, lr: float, threads: int) -> dict[str, Any]:
    """The settings recorded with every checkpoint and in the summary."""
    return {**run_settings(config, global_batch, lr), "threads": threads}


def _train_with_metrics(run: _WorkerRun, strategy: Strategy) -> None:
    """The training loop with per-step metrics, progress, periodic checkpoints and resume."""
    config, rank, out = run.config, run.env.rank, run.out
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "config.json", config.to_json() + "\n")
    checkpoint = run.checkpoint
    writer = MetricsWriter(out, rank, keep_before=run.context.steps_done)
    progress = StepProgress(config.steps, enabled=rank == 0, log_every=config.log_every)

    def on_step(record: StepRecord) -> None:
        writer.write(record)
        progress.update(record)
        done = record.step + 1
        if config.checkpoint_every and done % config.checkpoint_every == 0 and done < config.steps:
            beat("checkpoint", record.step)
            _write_checkpoint(strategy, out, {**run.meta, "step": done}, run.context)

    def restore_checkpoint(strategy: Strategy) -> int:
        assert checkpoint is not None
        return restore(checkpoint, strategy, rank)

    with progress:
        train(
            run.workload,
            strategy,
            run.context,
            global_batch=run.global_batch,
            on_step=on_step,
            restore=restore_checkpoint if checkpoint is not None else None,
        )
    writer.close()


def _finish_worker(run: _WorkerRun, strategy: Strategy, timeline: Timeline) -> None:
    """Final checkpoint, release the strategy, validation accuracy; rank 0 merges the
    timeline and writes the summary once every rank's metrics are on disk."""
    config, env, out = run.config, run.env, run.out
    beat("finish")
    _write_checkpoint(strategy, out, {**run.meta, "step": config.steps}, run.context)
    strategy.finish()
    timeline.close()  # after finish: a colocated server thread records until then
    beat("validate")
    workload = run.workload
    device = run.context.device
    accuracy = validation_accuracy(workload.model, workload, device) if env.rank == 0 else None
    beat("barrier")
    if dist.is_initialized():
        dist.barrier()  # every rank's metrics are on disk before rank 0 summarizes
    if env.rank != 0:
        return
    if config.timeline is not None:
        count = merge_rank_files(
            out,
            Path(config.timeline),
            {**run.meta, "steps": config.steps, "measure_warmup": config.measure_warmup},
            world_size=env.world_size,
        )
        print(f"[rank 0] timeline: {count} events in {config.timeline}", flush=True)
    summary = summarize(
        out,
        global_batch=run.global_batch,
        measure_warmup=config.measure_warmup,
        world_size=env.world_size,
        # asynchronous workers go on at their own pace: each counts at its own rate
        lockstep=type(strategy).is_synchronous(config),
        run_info={
            **run.meta,
            "steps": config.steps,
            "launcher": env.launcher,
            "environment": environment(run.threads, run.context.device.type),
            "validation_accuracy": accuracy,
            "iterations_per_epoch": _iterations_per_epoch(workload, run.global_batch),
        },
    )
    print(
        f"[rank 0] {config.strategy}: {summary['throughput']['median']:,.1f} samples/s "
        f"(median after {summary['throughput']['warmup_steps']} warm-up steps), "
        f"final loss {summary['final_loss']:.4f}"
        + ("" if accuracy is None else f", validation accuracy {accuracy:.1%}")
        + f"; results in {out}",
        flush=True,
    )
    if len(summary["ranks"]) < config.workers:  # another node's --out is not this folder
        print(
            f"[rank 0] the summary covers {len(summary['ranks'])} of {config.workers} workers: "
            f"the others' metrics are not in {out} (give every node one --out on a shared "
            "file system)",
            flush=True,
        )


def _probe_gradients(
    config: TrainConfig,
    strategy: Strategy,
    workload: Workload,
    global_batch: int,
    worker: int,
    worker_group: Any,
    device: torch.device,
) -> frozenset[str] | None:
    """For strategies that ask: parameters without a gradient on some worker in step 0.

    Collective over the workers: besides the agreement, the probe runs cross-rank
    BatchNorm's collectives where the model has it (so every worker probes, or none). None
    when the strategy does not ask, or its ``find_unused_parameters`` option is on already
    (``ddp``'s: it has nothing to decide). Where some worker's probe could not run, every
    trainable parameter, as :class:`UnknownGradients` saying why.
    """
    if not strategy.probes_gradients or getattr(
        config.strategy_options, "find_unused_parameters", False
    ):
        return None
    num_workers = dist.get_world_size(worker_group) if dist.is_initialized() else 1
    start, stop = shard_bounds(global_batch, num_workers, worker)
    reason = "it could not run on another worker"
    here: set[str] | None
    try:
        here = params_without_gradient(
            workload,
            workload.model,
            global_batch=global_batch,
            start=start,
            stop=stop,
            device=device,
        )
    except ProbeUnavailable as error:
        here, reason = None, str(error)
    agreed = missing_on_any_worker(workload.model, here, worker_group)
    if agreed is None:
        trainable = (n for n, p in workload.model.named_parameters() if p.requires_grad)
        return UnknownGradients(trainable, reason=reason)
    return frozenset(agreed)


def _iterations_per_epoch(workload: Workload, global_batch: int) -> int | None:
    """Steps per pass over a real training set (None for synthetic data)."""
    if workload.num_train_samples is None:
        return None
    return math.ceil(workload.num_train_samples / global_batch)


def _serve(
    config: TrainConfig,
    env: RankEnv,
    strategy: Strategy,
    device: torch.device,
    worker_group: Any,
    timeline: Timeline,
) -> None:
    """A dedicated server rank: serve until every worker is done (it writes its own metrics),
    then wait at the final barrier with the workers."""
    context = _context(
        config,
        env,
        device,
        worker_group,
        timeline,
        # Unused: servers build their optimizer with the scaled lr worker 0 sends them.
        make_updater=lambda params: Updater(params, config.optim, lr=config.optim.base_lr()),
        steps_done=(checkpoint_step(Path(config.out)) or 0) if config.resume else 0,
        role="server",
    )
    try:
        with beating("serve"):  # the server loop waits on its inbox, not on steps
            strategy.serve(context)
    finally:
        timeline.close()  # its events are on disk before rank 0 merges them
    beat("barrier")
    dist.barrier()  # rank 0 summarizes once every rank's metrics are on disk


def _write_checkpoint(
    strategy: Strategy, out: Path, meta: dict[str, object], context: Context
) -> None:
    # Every worker's RNG state and own buffers too, for --resume (collectives of the workers).
    rng = rng_tensors(context.worker_group, context.num_workers, context.device)
    own = worker_buffers(strategy.model, context.worker_group, context.num_workers)
    tensors = strategy.checkpoint_tensors()
    if tensors is not None:
        save_checkpoint(out / CHECKPOINT_FILE, {**tensors, **rng, **own}, meta)
    elif context.worker_index == 0 and meta["step"] == context.config.steps:  # once, at the end
        print(
            f"gradsync: warning: strategy '{strategy.name}' gave no checkpoint tensors, so the "
            "run wrote no checkpoint and cannot be verified or resumed; set self.model and "
            "self.updater in setup, or override checkpoint_tensors",
            file=sys.stderr,
            flush=True,
        )


def _proposed_device(config: TrainConfig, env: RankEnv) -> torch.device:
    """This rank's device, as it proposes it to the rendezvous: gradsync's launcher already
    decided "cpu" or "cuda"; under torchrun, Slurm or mpirun ("auto") a GPU where the rank
    sees one, the ``local_rank``-th (modulo the visible ones, so a rank bound to its own GPU
    by ``CUDA_VISIBLE_DEVICES`` takes that one)."""
    from gradsync.devices import rank_device

    if rank_device(config) == "cpu":
        return torch.device("cpu")
    index = env.local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _gpu_id(device: torch.device) -> str:
    """The physical GPU behind ``device`` ("" on the CPU): how the rendezvous tells that two
    ranks of a host share one."""
    if device.type != "cuda":
        return ""
    properties = torch.cuda.get_device_properties(device)
    return str(getattr(properties, "uuid", "") or f"{properties.name} #{device.index}")


def main(argv: list[str]) -> int:
    """Entry point of one rank started by gradsync's launcher; its exit code. A signal that
    lands while the rank reports another error (the launcher's teardown SIGTERM after a
    Ctrl-C) ends it with the signal's code, never a traceback."""
    stop_on_signals()  # SIGTERM/SIGHUP: finally blocks run, temp files go, exit 128 + signal
    try:
        return _run(argv)
    except Stopped as stop:
        return stop.exit_code
    except KeyboardInterrupt:
        return 130


def _exit(code: int) -> NoReturn:
    """Exit with ``code``; signals that come now change nothing (the rank is done)."""
    for signum in (*HANDLED, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    sys.exit(finish_process(code))


def _run(argv: list[str]) -> int:
    from gradsync.topology import detect_environment

    text = Path(argv[0]).read_text()
    try:
        env = detect_environment()
        if env is None:
            raise UserError("gradsync.runtime is started by the launcher; use gradsync train")
        if json.loads(text).get("kind") == "commbench":  # a job other than training
            from gradsync import commbench

            commbench.run_rank(commbench.CommbenchConfig.from_json(text), env)
        else:
            run_rank(TrainConfig.from_json(text), env)
    except UserError as error:
        say(f"gradsync: error: {error}")
        return 2
    except LossNotFinite as error:
        say(f"{STOPPED_PREFIX}{error}")
        return 1
    except Stopped as stop:
        return stop.exit_code  # the launcher (or the batch system) stopped this rank
    except KeyboardInterrupt:
        return 130
    except Exception as error:
        if isinstance(error, TransportError | RuntimeError) and is_lost_connection(str(error)):
            # A peer stopped first and says why itself: this rank's part is one line (the
            # server transport's error, or Gloo's in a collective).
            say(f"{VICTIM_PREFIX}{error}")
            return 1
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    return 0


if __name__ == "__main__":
    _exit(main(sys.argv[1:]))

__all__ = ["CHECKPOINT_FILE", "run_rank"]
