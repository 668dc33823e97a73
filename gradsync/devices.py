"""Which device a job's ranks train on: one GPU per rank over NCCL, or the CPU over Gloo.

``--device auto`` (the default) takes the GPUs only when every rank gets one of its own:
NCCL cannot put two ranks of one communicator on one GPU ("invalid usage"), so where a
node has fewer GPUs than ranks the job runs on the CPU, as a Gloo job. Server strategies
(``ps``, ``hybrid``, ``p3``) run on the CPU: their messages travel as CPU tensors over Gloo
point-to-point, and their GPU path (workers staging through host memory, as BytePS's do)
is not built. Emulated hosts run on the CPU too: NCCL between processes of one machine
would bypass their shaped links. ``--device cuda`` asks for the GPUs and is refused, in one
line, where they cannot be had.

Who decides:

- gradsync's launcher knows how many ranks its node runs and decides before it starts them
  (:func:`resolve`); ``verify`` and ``bench`` put all their jobs on one device
  (:func:`on_one_device`).
- Under torchrun, Slurm or mpirun each rank proposes its own (:func:`rank_device`: a GPU
  where it sees one) and the rendezvous settles it for all: the GPUs only if every rank
  has one of its own (:func:`gradsync.rendezvous.agreed_device`).

Example:
    >>> job_device("auto", servers=False, local_ranks=2, gpus=1)
    'cpu'
    >>> job_device("auto", servers=False, local_ranks=1, gpus=1)
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
    """CUDA devices this process can see (0 without CUDA).

    Example:
        >>> visible_gpus() >= 0
        True
    """
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def job_device(
    wanted: str,
    *,
    servers: bool,
    local_ranks: int | None = None,
    emulated: bool = False,
    gpus: int | None = None,
    strategy: str = "",
) -> Device:
    """The device for ranks that see ``gpus`` GPUs; ``local_ranks`` of them share a node
    (None: not known here, the rendezvous checks that no two ranks share a GPU).

    UserError when ``wanted`` is "cuda" and the GPUs cannot be had.

    Example:
        >>> job_device("cuda", servers=False, local_ranks=4, gpus=8)
        'cuda'
        >>> job_device("auto", servers=True, gpus=8)  # ps, hybrid and p3 train on the CPU
        'cpu'
    """
    gpus = visible_gpus() if gpus is None else gpus
    enough = gpus >= (local_ranks or 1)
    if wanted == "cpu" or (wanted == "auto" and (servers or emulated or not enough)):
        return "cpu"
    if wanted == "auto":
        return "cuda"
    if servers:
        raise UserError(
            f"--device cuda: {strategy or 'this strategy'} sends its server messages as CPU "
            "tensors over Gloo and trains on the CPU only; use --device cpu, or allreduce/ddp "
            "on GPUs"
        )
    if emulated:
        raise UserError(
            "--device cuda with --hosts: emulated hosts share this machine's GPUs, and NCCL "
            "between them would bypass their shaped links; use --device cpu with --hosts"
        )
    if gpus == 0:
        raise UserError("--device cuda was asked for but CUDA is not available; use --device cpu")
    if not enough:
        raise UserError(
            f"--device cuda gives each rank its own GPU (NCCL cannot share one between ranks), "
            f"but this node runs {local_ranks} ranks and has {gpus} GPU(s); use at most {gpus} "
            "workers per node, or --device cpu"
        )
    return "cuda"


def _has_servers(config: TrainConfig) -> bool:
    from gradsync.strategies import strategy_class
    from gradsync.strategies.base import ServerStrategy

    return issubclass(strategy_class(config.strategy), ServerStrategy)


def resolve(config: TrainConfig, *, gpus: int | None = None) -> TrainConfig:
    """``config`` with its device decided by gradsync's launcher for this node ("cpu" or
    "cuda", never "auto"): it knows how many ranks the node runs.

    Example:
        >>> from gradsync.config import TrainConfig
        >>> resolve(TrainConfig(strategy="allreduce", workers=2), gpus=2).launch.device
        'cuda'
    """
    from gradsync.strategies import world_size_of

    device = job_device(
        config.launch.device,
        servers=_has_servers(config),
        local_ranks=world_size_of(config) // config.launch.num_nodes,
        emulated=config.launch.hosts > 0,
        gpus=gpus,
        strategy=config.strategy,
    )
    return config.replace(launch=dataclasses.replace(config.launch, device=device))


def rank_device(config: TrainConfig, *, gpus: int | None = None) -> Device:
    """What one rank proposes in the rendezvous: a GPU wherever it sees one that the job may
    use (a rank of torchrun, Slurm or mpirun cannot count its node's ranks; the rendezvous
    finds ranks that share a GPU). UserError for "cuda" without a GPU here.

    Example:
        >>> from gradsync.config import TrainConfig
        >>> rank_device(TrainConfig(strategy="ddp", workers=8), gpus=1)
        'cuda'
    """
    return job_device(
        config.launch.device,
        servers=_has_servers(config),
        emulated=config.launch.hosts > 0,
        gpus=gpus,
        strategy=config.strategy,
    )


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


__all__ = ["Device", "job_device", "on_one_device", "rank_device", "resolve", "visible_gpus"]
