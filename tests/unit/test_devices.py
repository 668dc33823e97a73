"""Which device a job trains on: a GPU per rank, else the CPU; one device per compared set."""

from __future__ import annotations

import dataclasses

import pytest

from gradsync.config import LaunchConfig, TrainConfig
from gradsync.devices import job_device, on_one_device, rank_device, resolve
from gradsync.errors import UserError


def _job(strategy: str = "allreduce", workers: int = 2, device: str = "auto", **options):
    return TrainConfig(
        model="mnist-cnn",
        preset="tiny",
        strategy=strategy,
        workers=workers,
        strategy_options=options or None,
        launch=LaunchConfig(device=device),  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("local_ranks", "servers", "gpus", "expected"),
    [
        (1, False, 0, "cpu"),  # no CUDA
        (1, False, 1, "cuda"),
        (2, False, 1, "cpu"),  # two ranks cannot share one GPU under NCCL
        (2, False, 2, "cuda"),
        (4, False, 8, "cuda"),
        (2, True, 8, "cpu"),  # server strategies train on the CPU
    ],
)
def test_auto_takes_the_gpus_only_when_every_rank_gets_one(local_ranks, servers, gpus, expected):
    assert job_device("auto", local_ranks=local_ranks, servers=servers, gpus=gpus) == expected


def test_cpu_is_the_cpu_whatever_the_machine_has():
    assert job_device("cpu", local_ranks=1, servers=False, gpus=8) == "cpu"


def test_emulated_hosts_train_on_the_cpu():
    assert job_device("auto", servers=False, local_ranks=2, emulated=True, gpus=8) == "cpu"
    with pytest.raises(UserError, match="bypass their shaped links"):
        job_device("cuda", servers=False, local_ranks=2, emulated=True, gpus=8)


def test_a_rank_of_another_launcher_proposes_a_gpu_where_it_sees_one():
    # torchrun's rank cannot count its node's ranks (Slurm may bind one GPU to each task):
    # it proposes the GPU, and the rendezvous finds ranks that share one.
    assert rank_device(_job("ddp", workers=8), gpus=1) == "cuda"
    assert rank_device(_job("ddp", workers=8), gpus=0) == "cpu"
    assert rank_device(_job("hybrid", workers=2), gpus=8) == "cpu"
    with pytest.raises(UserError, match="CUDA is not available"):
        rank_device(_job("ddp", workers=8, device="cuda"), gpus=0)


@pytest.mark.parametrize(
    ("local_ranks", "servers", "gpus", "says"),
    [
        (1, False, 0, "CUDA is not available"),
        (2, False, 1, "runs 2 ranks and has 1 GPU"),
        (1, True, 4, "trains on the CPU only"),
    ],
)
def test_cuda_that_cannot_be_had_is_one_line(local_ranks, servers, gpus, says):
    with pytest.raises(UserError, match=says) as caught:
        job_device("cuda", local_ranks=local_ranks, servers=servers, gpus=gpus, strategy="ps")
    assert "\n" not in str(caught.value)
    assert "--device cpu" in str(caught.value)  # how to fix it


def test_resolve_counts_server_ranks_and_nodes():
    assert resolve(_job("ps", workers=1), gpus=8).launch.device == "cpu"
    assert resolve(_job("allreduce", workers=2), gpus=2).launch.device == "cuda"
    assert resolve(_job("allreduce", workers=4), gpus=2).launch.device == "cpu"
    two_nodes = _job("allreduce", workers=4)
    two_nodes = two_nodes.replace(launch=dataclasses.replace(two_nodes.launch, num_nodes=2))
    assert resolve(two_nodes, gpus=2).launch.device == "cuda"  # 2 ranks on this node
    with pytest.raises(UserError, match="at most 2 workers per node"):
        resolve(_job("ddp", workers=4, device="cuda"), gpus=2)


def test_a_compared_set_trains_on_one_device():
    reference, pair = _job("single", workers=1), _job("allreduce", workers=2)
    assert [c.launch.device for c in on_one_device([reference, pair], gpus=2)] == ["cuda"] * 2
    # single alone would fit on the one GPU; the pair cannot: both run on the CPU.
    assert [c.launch.device for c in on_one_device([reference, pair], gpus=1)] == ["cpu"] * 2
    with_servers = [reference, _job("p3", workers=2)]
    assert [c.launch.device for c in on_one_device(with_servers, gpus=8)] == ["cpu"] * 2


def test_a_set_that_asks_for_cuda_it_cannot_have_is_refused_before_it_runs():
    with pytest.raises(UserError, match="CUDA is not available"):
        on_one_device([_job("single", workers=1, device="cuda")], gpus=0)


def test_the_first_broadcast_hands_nccl_contiguous_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL refuses strided tensors ("Tensors must be contiguous"), which Gloo takes: on an
    H200 (session 24) a model with a transposed parameter crashed allreduce at its first
    broadcast. A broadcast that refuses them as NCCL does stands in for the GPU here."""
    import torch
    from torch import nn

    import gradsync.strategies.base as base

    def nccl_broadcast(tensor: torch.Tensor, src: int, group: object = None) -> None:
        if not tensor.is_contiguous():
            raise ValueError("Tensors must be contiguous")
        tensor.fill_(7.0)  # rank 0's values arrive

    model = nn.Module()
    model.strided = nn.Parameter(torch.randn(3, 4).t())
    model.plain = nn.Parameter(torch.randn(2))
    monkeypatch.setattr(base.dist, "broadcast", nccl_broadcast)
    base.broadcast_parameters(model)
    assert not model.strided.is_contiguous()  # the parameter itself is left as it was
    assert all(bool((param == 7.0).all()) for param in model.parameters())
