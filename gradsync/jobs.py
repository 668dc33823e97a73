"""Run a whole job from Python: validate, claim the run folder, launch locally, return its
summary; with ``max_restarts``, relaunch a job whose rank died from its last checkpoint."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn.parameter import UninitializedParameter

from gradsync.comm.batchnorm import unconvertible_batchnorm
from gradsync.config import TrainConfig
from gradsync.devices import rank_device
from gradsync.devices import resolve as resolve_device
from gradsync.errors import JobFailed, UserError
from gradsync.launch import launch_local
from gradsync.metrics import load_summary
from gradsync.models import check_model, shared_workloads, workload_of
from gradsync.models.user import check_user_step, is_user_model
from gradsync.netem import check_hosts_filled
from gradsync.probe import lookup_tables
from gradsync.resume import check_resume, checkpoint_step, resumable
from gradsync.rundir import check_writable, claim_output_file, claim_run_dir, hold_run_dir
from gradsync.strategies import check_strategy, strategy_class, world_size_of
from gradsync.strategies.base import lost_edit
from gradsync.trace import TRACE_BEGINS

LOG_FILE = "stdout.log"


def validate(config: TrainConfig, *, one_rank: bool = False, local: bool = True) -> None:
    """Every check that can fail before any process starts (UserError on failure).

    A user model is built once here and run on one worker's shard of step 0, so a wrong
    return type, a loss that is not a scalar or a model without parameters is one line
    before launch.
    ``one_rank``: this process is one rank of torchrun's, Slurm's or mpirun's job, which
    cannot count its node's ranks (the rendezvous checks their GPUs). ``local`` False: the
    job's ranks start elsewhere (srun), so this machine's cores do not bound them.
    """
    with shared_workloads():  # one build for every check below
        _validate(config, one_rank=one_rank, local=local)


def _validate(config: TrainConfig, *, one_rank: bool, local: bool) -> None:
    check_model(config.model, config.preset, config.model_options)
    if is_user_model(config.model):  # the strategies' own checks size every parameter
        _check_made(config, workload_of(config).model)
    check_strategy(config)
    if local and not one_rank:
        check_local_ranks(world_size_of(config) // config.launch.num_nodes)
    # --device cuda that this machine cannot give: refused here, before the run folder.
    if one_rank:
        rank_device(config)
    else:
        resolve_device(config)
    if one_rank and not is_user_model(config.model):
        return  # the batch is checked after the rendezvous, which first checks the world size
    # Built here (milliseconds for the zoo) so that bad data and a batch the workers cannot
    # share are refused before the run folder is claimed, not by the ranks after launch.
    workload = workload_of(config)
    _check_parameters_and_layers(config, workload.model)  # before the trial forward below
    if not one_rank and config.global_batch is None and workload.global_batch % config.workers:
        batch, workers = workload.global_batch, config.workers
        raise UserError(
            f"the global batch of {config.model} ({config.preset}), {batch}, does not divide by "
            f"--workers {workers}; pass --global-batch {workers * max(1, batch // workers)} "
            f"(a multiple of {workers}) or choose --workers that divides {batch}"
        )
    if is_user_model(config.model):  # on one worker's shard, as a rank runs it
        # At least 2 samples: a BatchNorm layer here normalizes the shard alone, while in
        # training global BatchNorm sees the whole batch (1 sample a worker is fine there).
        shard = max(2, (config.global_batch or workload.global_batch) // config.workers)
        step = check_user_step(config.model, workload, samples=shard)
        _check_edits_last(config, step.edited)
        _check_lookups_only(config, step.tables_read_elsewhere)


def _check_made(config: TrainConfig, model: torch.nn.Module) -> None:
    """UserError for a parameter that a lazy module has not made yet."""
    lazy = [n for n, p in model.named_parameters() if isinstance(p, UninitializedParameter)]
    if lazy and config.strategy != "single":
        raise UserError(
            f"parameter {lazy[0]} is not made yet (a lazy module, such as nn.LazyLinear): "
            "every strategy sizes its buffers and shares the initial values before the first "
            "forward; run one forward on an example input in your build function"
        )


def _check_parameters_and_layers(config: TrainConfig, model: torch.nn.Module) -> None:
    """What no strategy can train right: complex parameters, lookup tables that
    renormalize the rows a batch reads (``max_norm``), and BatchNorm layers with a forward
    of their own under global BatchNorm (a lazy module's parameters: :func:`_check_made`,
    before the strategies' checks)."""
    if config.workers > 1:
        renormalized = [n for n, t in lookup_tables(model).items() if t.max_norm is not None]
        if renormalized:
            raise UserError(
                f"lookup table {renormalized[0]} has max_norm: forward renormalizes the rows "
                "a batch reads, in place, so each worker would renormalize only its shard's "
                "rows and the copies would drift apart; leave max_norm unset (scale the rows "
                "looked up instead, which changes no parameter)"
            )
    complex_params = [(n, p.dtype) for n, p in model.named_parameters() if p.is_complex()]
    if complex_params:
        name, dtype = complex_params[0]
        raise UserError(
            f"parameter {name} is {str(dtype).removeprefix('torch.')}: gradsync trains real "
            "parameters (its strategies reduce real tensors, its checkpoints are safetensors, "
            "which has no complex type); keep the real and imaginary parts as two parameters"
        )
    overlapping = [
        n
        for n, p in model.named_parameters()
        if not isinstance(p, UninitializedParameter) and overlaps_itself(p)
    ]
    if overlapping:
        raise UserError(
            f"parameter {overlapping[0]} overlaps itself in memory (a view made with expand "
            "or as_strided): an update writes several of its elements to one place, so no "
            "strategy can reproduce it; make it a tensor of its own with .clone() in your "
            "build function"
        )
    if config.workers > 1 and config.batchnorm == "global":
        problem = unconvertible_batchnorm(model)
        if problem:
            raise UserError(problem)


def overlaps_itself(tensor: torch.Tensor) -> bool:
    """Whether two elements of ``tensor`` share memory (a stride 0, overlapping strides).

    Example:
        >>> overlaps_itself(torch.ones(1, 3).expand(2, 3)), overlaps_itself(torch.ones(3, 2).t())
        (True, False)
    """
    verdict = torch._debug_has_internal_overlap(tensor)  # 0: no, 1: yes, 2: too hard to say
    if verdict != 2:
        return verdict == 1
    offsets = torch.zeros((), dtype=torch.long)
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        offsets = (offsets.unsqueeze(-1) + torch.arange(size) * stride).reshape(-1)
    return len(torch.unique(offsets)) < tensor.numel()


def _check_edits_last(config: TrainConfig, edited: set[str]) -> None:
    """UserError when the model changes in place, during forward, a parameter whose values
    the strategy's servers hold: the servers never see the change."""
    lost = sorted(edited & strategy_class(config.strategy).held_by_servers(config))
    if lost:
        raise UserError(lost_edit(lost[0], config.strategy))


def _check_lookups_only(config: TrainConfig, read_elsewhere: set[str]) -> None:
    """UserError when the forward reads, other than by a lookup of its module's input, a
    table whose rows a worker has up to date only where its lookups read them."""
    stale = sorted(read_elsewhere & strategy_class(config.strategy).read_by_lookup_only(config))
    if stale:
        raise UserError(
            f"the model reads lookup table {stale[0]} other than by looking up its module's "
            f"input (.detach(), indexing, F.embedding on other ids, or a subclass whose "
            f"forward looks up other rows), but {config.strategy} brings each worker only the "
            f"rows its lookups read, so those reads would see stale rows; pass --dense-pattern "
            f"{stale[0]} to allreduce that table, or train with allreduce"
        )


def check_every_host_used(config: TrainConfig) -> None:
    """UserError when ``train --hosts H`` asks for hosts its ranks would not fill: the run
    would measure fewer hosts than asked for. (Verify's and bench's sweeps keep such cells:
    a one-worker cell beside two-host ones runs on one host.)

    Example:
        >>> check_every_host_used(TrainConfig(strategy="allreduce", workers=2))  # no --hosts
    """
    if config.launch.hosts:
        check_hosts_filled(world_size_of(config), config.launch.hosts, config.launch.ranks_per_host)


def check_largest_job_fills_hosts(configs: Sequence[TrainConfig]) -> None:
    """UserError when the emulated hosts of a sweep (``verify``, ``bench``) are more than even
    its largest job fills: every cell would measure fewer hosts than asked for. A smaller
    job beside a larger one may leave hosts empty (a one-worker cell runs on one host).

    Example:
        >>> check_largest_job_fills_hosts([TrainConfig(strategy="allreduce", workers=2)])
    """
    shaped = [config for config in configs if config.launch.hosts]
    if shaped:
        largest = max(shaped, key=world_size_of)
        launch = largest.launch
        check_hosts_filled(world_size_of(largest), launch.hosts, launch.ranks_per_host)


MAX_RANKS_PER_CORE = 64  # beyond this a local job measures the scheduler, not training


def check_local_ranks(local_ranks: int) -> None:
    """UserError when this machine would start far more ranks than it has cores (every
    step waits for each rank in turn; 100,000 ranks on 2 cores never finish starting).

    Example:
        >>> check_local_ranks(4)  # fine anywhere
    """
    cores = os.cpu_count() or 1
    limit = max(256, MAX_RANKS_PER_CORE * cores)
    if local_ranks > limit:
        raise UserError(
            f"{local_ranks} ranks on this machine's {cores} core(s) is more than {limit} "
            f"({MAX_RANKS_PER_CORE} a core); lower --workers or --servers, or spread the job "
            "over nodes (--nnodes, torchrun, Slurm)"
        )


def prepare_out(config: TrainConfig, *, overwrite: bool) -> None:
    """Claim ``config.out`` for this job before launch (UserError when it cannot be had).

    A resumed run goes on in its own folder; node 0 of a job claims the folder (refusing a
    used one unless ``overwrite``), other nodes only check that they can write there.

    Example:
        >>> # prepare_out(config, overwrite=False)  # exit 2 if config.out holds a run
    """
    out = Path(config.out)
    if config.launch.node_rank == 0:
        claim_timeline(config, overwrite=overwrite)  # before the folder: nothing made yet
    if config.resume:
        if config.launch.node_rank == 0 and out.is_dir():
            hold_run_dir(out, flag="--resume")
        check_resume(config, out)
    elif config.launch.node_rank == 0:
        claim_run_dir(out, overwrite=overwrite, inputs=inputs_of(config))
    else:
        check_writable(out)


def inputs_of(config: TrainConfig) -> list[str]:
    """The files a run reads that could lie in its own folder: a user model's file, data.

    Example:
        >>> inputs_of(TrainConfig(model="nets/mine.py:build", data="sklearn:digits"))
        ['nets/mine.py']
    """
    location = config.model.rpartition(":")[0] if is_user_model(config.model) else ""
    return [path for path in (location, config.data) if path and ":" not in path]


def claim_timeline(config: TrainConfig, *, overwrite: bool) -> None:
    """Check ``--timeline``'s file before launch (rank 0 writes it at the end): never a
    folder, nor a file already there unless ``overwrite`` (a resumed run writes its own
    again), and then only a trace.

    Example:
        >>> claim_timeline(TrainConfig(timeline=None), overwrite=False)  # nothing to check
    """
    if config.timeline is not None:
        path, again = Path(config.timeline), overwrite or config.resume
        claim_output_file(path, overwrite=again, flag="--timeline", begins=TRACE_BEGINS)


def run_job(
    config: TrainConfig, *, quiet: bool = True, overwrite: bool | None = None
) -> dict[str, Any]:
    """Train ``config`` on local processes and return its ``summary.json`` (on a node other
    than node 0, which writes it: empty).

    With ``quiet`` the ranks' stdout goes to ``<out>/stdout.log``. ``overwrite`` not None:
    claim ``config.out`` first (see :func:`prepare_out`); None: the caller owns the folder.

    Example:
        >>> # summary = run_job(TrainConfig(model="mnist-cnn", preset="tiny", workers=2, steps=5))
        >>> # summary["throughput"]["median"]
    """
    with shared_workloads():  # validation and a resume's settings read one build
        validate(config)
        if overwrite is not None:
            prepare_out(config, overwrite=overwrite)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    restarts = 0
    while True:
        try:
            launch_local(config, log_file=out / LOG_FILE if quiet else None)
            # Node 0's rank 0 writes the summary; another node's --out may not be shared.
            return load_summary(out) if config.launch.node_rank == 0 else {}
        except JobFailed as failure:
            if restarts >= config.launch.max_restarts or failure.final:
                raise
            restarts += 1
            config = _restart_config(config, failure, restarts)


def _restart_config(config: TrainConfig, failure: JobFailed, attempt: int) -> TrainConfig:
    """The config of restart ``attempt``: from the last checkpoint when there is one."""
    out = Path(config.out)
    step = checkpoint_step(out) if resumable(config.strategy) else None
    where = f"the checkpoint at step {step}" if step else "the start (no checkpoint yet)"
    print(
        f"gradsync: {failure.cause or str(failure).splitlines()[0]}; restart {attempt} of "
        f"{config.launch.max_restarts}: all ranks again from {where}",
        file=sys.stderr,
        flush=True,
    )
    return config.replace(resume=bool(step))


__all__ = [
    "LOG_FILE",
    "check_local_ranks",
    "claim_timeline",
    "inputs_of",
    "prepare_out",
    "run_job",
    "validate",
]
