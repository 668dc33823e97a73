"""Which device a job's ranks train on: one GPU per rank over NCCL, or the CPU over Gloo.

``--device auto`` (the default) takes the GPUs only when every rank of this node gets its
own: NCCL cannot put two ranks of one communicator on one GPU ("invalid usage"), so on a
machine with fewer GPUs than local ranks the job runs on the CPU, as a Gloo job. Server
strategies (``ps``, ``hybrid``, ``p3``) run on the CPU: their messages travel as CPU
tensors over Gloo point-to-point, and their GPU path (workers staging through host memory,
as BytePS's do) is not built. ``--device cuda`` asks for the GPUs and is refused, before
launch, where they cannot be had.

A set of jobs that is compared (``verify``'s cells, a ``bench`` matrix) trains on one
device: :func:`on_one_device` puts all of them on the CPU when any cannot have the GPUs.

Example:
    >>> job_device("auto", local_ranks=2, servers=False, gpus=1)
    'cpu'
    >>> job_device("auto", local_ranks=1, servers=False, gpus=1)
    'cuda'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from gradsync.errors import UserError

if TYPE_CHECKING:
    from gradsync.config import TrainConfig

Device = Literal["cpu", "cuda"]


def visible_gpus() -> int:
    """CUDA devices this process can see (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def job_device(
    wanted: str, *, local_ranks: int, servers: bool, gpus: int | None = None, strategy: str = ""
) -> Device:
    """The device of every rank of a node running ``local_ranks`` ranks with ``gpus`` GPUs.

    UserError when ``wanted`` is "cuda" and the GPUs cannot be had (none, too few, or a
    server strategy).
    """
    gpus = visible_gpus() if gpus is None else gpus
    if wanted == "cpu":
        return "cpu"
    if wanted == "auto":
        return "cuda" if gpus >= local_ranks and not servers else "cpu"
    if servers:
        raise UserError(
            f"--device cuda: {strategy or 'this strategy'} sends its server messages as CPU "
            "tensors over Gloo and trains on the CPU only; use --device cpu, or allreduce/ddp "
            "on GPUs"
        )
    if gpus == 0:
        raise UserError("--device cuda was asked for but CUDA is not available; use --device cpu")
    if gpus < local_ranks:
        raise UserError(
            f"--device cuda gives each rank its own GPU (NCCL cannot share one between ranks), "
            f"but this node runs {local_ranks} ranks and has {gpus} GPU(s); use at most {gpus} "
            "workers per node, or --device cpu"
        )
    return "cuda"


def resolve(config: TrainConfig, *, gpus: int | None = None) -> TrainConfig:
    """``config`` with its device decided for this node ("cpu" or "cuda", never "auto")."""
    from gradsync.strategies import strategy_class, world_size_of
    from gradsync.strategies.base import ServerStrategy

    local_ranks = world_size_of(config) // config.launch.num_nodes
    device = job_device(
        config.launch.device,
        local_ranks=local_ranks,
        servers=issubclass(strategy_class(config.strategy), ServerStrategy),
        gpus=gpus,
        strategy=config.strategy,
    )
    return config.replace(launch=dataclasses.replace(config.launch, device=device))


def on_one_device(configs: Sequence[TrainConfig], *, gpus: int | None = None) -> list[TrainConfig]:
    """``configs`` resolved to one device: the CPU for all when any of them gets the CPU.

    Example:
        >>> from gradsync.config import TrainConfig
        >>> jobs = on_one_device([TrainConfig(strategy="single"), TrainConfig(workers=2)], gpus=1)
        >>> [job.launch.device for job in jobs]
        ['cpu', 'cpu']
    """
    resolved = [resolve(config, gpus=gpus) for config in configs]
    if all(config.launch.device == "cuda" for config in resolved):
        return resolved
    return [
        config.replace(launch=dataclasses.replace(config.launch, device="cpu"))
        for config in resolved
    ]


__all__ = ["Device", "job_device", "on_one_device", "resolve", "visible_gpus"]
