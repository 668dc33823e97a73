"""FusedAllreduce on real Gloo process groups: the averaged gradients equal an explicit
``all_reduce`` of every gradient divided by the world size, bytes follow the ring model,
and buckets are reused step after step.

The "exact" model has integer weights, inputs and loss weights, so every gradient and every
partial sum is an integer well inside float32's exact range: whatever order Gloo adds the
ranks' contributions in, fused and explicit results must be bit-identical.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradsync.comm.counters import CommStats
from gradsync.comm.fusion import FusedAllreduce, plan_buckets

NUM_STEPS = 3


def _exact_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 4), nn.Linear(4, 3))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randint(-3, 4, param.shape, generator=generator).float())
    return model


def _float_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))


MODELS = {"exact": _exact_model, "float": _float_model}


def _data(rank: int, step: int, integer: bool) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    if integer:
        return (
            torch.randint(-3, 4, (4, 6), generator=generator).float(),
            torch.randint(-2, 3, (4, 3), generator=generator).float(),
        )
    return torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator)


def _explicit_average(model: nn.Module, world_size: int) -> list[torch.Tensor]:
    """The reference: one blocking all_reduce per gradient, divided by the world size."""
    averaged = []
    for param in model.parameters():
        grad = torch.zeros_like(param) if param.grad is None else param.grad.to_dense().clone()
        dist.all_reduce(grad)
        averaged.append(grad / world_size)
    return averaged


def _fused_vs_explicit(
    rank: int, world_size: int, model_name: str, threshold: int, fp16: bool
) -> dict:
    model = MODELS[model_name]()
    reference = copy.deepcopy(model)
    stats = CommStats()
    fused = FusedAllreduce(
        list(model.parameters()),
        threshold_bytes=threshold,
        group=None,
        world_size=world_size,
        stats=stats,
        fp16=fp16,
    )
    fused.attach()
    buffers = [bucket.buffer.data_ptr() for bucket in fused.buckets]
    steps = []
    for step in range(NUM_STEPS):
        x, weights = _data(rank, step, model_name == "exact")
        (reference(x) * weights).sum().backward()
        expected = _explicit_average(reference, world_size)

        (model(x) * weights).sum().backward()
        launched_in_backward = [bucket.work is not None for bucket in fused.buckets]
        fused.finish()
        steps.append(
            {
                "grads": [p.grad.clone() for p in model.parameters()],
                "expected": expected,
                "launched_in_backward": launched_in_backward,
                "bytes": (stats.bytes_sent, stats.bytes_recv),
                "same_buffers": [b.buffer.data_ptr() for b in fused.buckets] == buffers,
                "pending": [b.pending for b in fused.buckets],
                "sizes": [len(b.params) for b in fused.buckets],
            }
        )
        # alternate both ways of clearing gradients between steps
        for net in (model, reference):
            for param in net.parameters():
                if step % 2:
                    param.grad.zero_()
                else:
                    param.grad = None
    return {"steps": steps, "exposed_comm_s": stats.exposed_comm_s}


def _expected_bytes(model_name: str, threshold: int, world_size: int, element_size: int) -> int:
    params = list(MODELS[model_name]().parameters())
    per_step = 0
    for bucket in plan_buckets(params, threshold):
        flags = len(bucket)  # one had-a-gradient flag per parameter travels with them
        num_bytes = (sum(params[i].numel() for i in bucket) + flags) * element_size
        per_step += 2 * (world_size - 1) * num_bytes // world_size  # ring allreduce, per rank
    return per_step


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("threshold", [0, 100, 64 << 20], ids=["unfused", "small", "large"])
def test_fused_average_equals_explicit_allreduce(run_ranks, world_size, threshold):
    results = run_ranks(world_size, _fused_vs_explicit, "exact", threshold, False)
    num_buckets = len(plan_buckets(list(_exact_model().parameters()), threshold))
    assert num_buckets == {0: 6, 100: 3, 64 << 20: 1}[threshold]
    per_step = _expected_bytes("exact", threshold, world_size, element_size=4)
    for rank, result in enumerate(results):
        for step, record in enumerate(result["steps"]):
            for got, want in zip(record["grads"], record["expected"], strict=True):
                assert got.dtype == torch.float32
                assert torch.equal(got, want), (rank, step)
            # every gradient arrived during backward, so every bucket left before finish()
            assert record["launched_in_backward"] == [True] * num_buckets
            assert record["bytes"] == ((step + 1) * per_step,) * 2
            assert record["same_buffers"]
            assert record["pending"] == record["sizes"]  # reset for the next step
        assert result["exposed_comm_s"] > 0
        # identical averaged gradients on every rank
        for mine, first in zip(
            result["steps"][-1]["grads"], results[0]["steps"][-1]["grads"], strict=True
        ):
            assert torch.equal(mine, first)


def test_gradients_really_differ_between_ranks(run_ranks):
    """Guard against a vacuous comparison: the ranks' local gradients are not all equal."""
    x0, w0 = _data(0, 0, True)
    x1, w1 = _data(1, 0, True)
    local = []
    for x, w in ((x0, w0), (x1, w1)):
        model = _exact_model()
        (model(x) * w).sum().backward()
        local.append(model[0].weight.grad)
    assert not torch.equal(local[0], local[1])
    [result, _] = run_ranks(2, _fused_vs_explicit, "exact", 0, False)
    averaged = result["steps"][0]["grads"][0]
    assert torch.equal(averaged, (local[0] + local[1]) / 2)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("threshold", [0, 64 << 20], ids=["unfused", "large"])
def test_fp16_compression_is_close_and_halves_the_bytes(run_ranks, world_size, threshold):
    results = run_ranks(world_size, _fused_vs_explicit, "float", threshold, True)
    per_step = _expected_bytes("float", threshold, world_size, element_size=2)
    for result in results:
        for step, record in enumerate(result["steps"]):
            for got, want in zip(record["grads"], record["expected"], strict=True):
                assert got.dtype == torch.float32
                torch.testing.assert_close(got, want, rtol=4e-3, atol=1e-3)
            assert record["bytes"] == ((step + 1) * per_step,) * 2
    fp32 = _expected_bytes("float", threshold, world_size, element_size=4)
    assert fp32 - 2 <= 2 * per_step <= fp32  # floor division aside, exactly half


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)  # in the middle of the parameter list
        self.last = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        if self.use_middle:  # a data-dependent branch: some ranks take it, others do not
            hidden = self.unused(hidden)
        return self.last(hidden)

    use_middle = False


def _unused_somewhere(rank: int, world_size: int, threshold: int, on_rank_zero: bool) -> dict:
    """The middle layer is used by rank 0 only (``on_rank_zero``) or by no rank."""
    torch.manual_seed(0)
    model = _WithUnused()
    model.use_middle = on_rank_zero and rank == 0
    reference = copy.deepcopy(model)
    fused = FusedAllreduce(
        list(model.parameters()),
        threshold_bytes=threshold,
        group=None,
        world_size=world_size,
        stats=CommStats(),
    )
    fused.attach()
    records = []
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + step))
        reference(x).square().sum().backward()
        expected = _explicit_average(reference, world_size)
        model(x).square().sum().backward()
        fused.finish()
        records.append(
            {
                "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
                "expected": expected,
            }
        )
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    return {"records": records, "names": [n for n, _ in model.named_parameters()]}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("threshold", [0, 64 << 20], ids=["unfused", "large"])
def test_parameter_without_gradient_on_every_rank_keeps_none(run_ranks, world_size, threshold):
    """single's optimizer skips a parameter whose grad is None; so must every rank's."""
    for result in run_ranks(world_size, _unused_somewhere, threshold, False):
        for record in result["records"]:
            for name, got, want in zip(
                result["names"], record["grads"], record["expected"], strict=True
            ):
                if name.startswith("unused"):
                    assert got is None, name
                else:
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("threshold", [0, 64 << 20], ids=["unfused", "large"])
def test_parameter_with_gradient_on_one_rank_is_averaged_with_zeros(run_ranks, threshold):
    for result in run_ranks(2, _unused_somewhere, threshold, True):
        for record in result["records"]:
            for name, got, want in zip(
                result["names"], record["grads"], record["expected"], strict=True
            ):
                assert got is not None, name  # rank 0's gradient, halved, on both ranks
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=name)


def _sparse_embedding(rank: int, world_size: int, threshold: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 4, sparse=True), nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    stats = CommStats()
    fused = FusedAllreduce(
        list(model.parameters()),
        threshold_bytes=threshold,
        group=None,
        world_size=world_size,
        stats=stats,
    )
    fused.attach()
    records = []
    for step in range(2):
        # overlapping and repeated rows; rows 16..19 are never looked up
        ids = torch.tensor([rank, rank + 1, 2 * rank + step, 15, rank]) % 16
        reference(ids).square().sum().backward()
        was_sparse = reference[0].weight.grad.is_sparse
        expected = _explicit_average(reference, world_size)
        model(ids).square().sum().backward()
        fused.finish()
        records.append(
            {
                "grads": [p.grad.clone() for p in model.parameters()],
                "sparse_after": model[0].weight.grad.is_sparse,
                "expected": expected,
                "was_sparse": was_sparse,
            }
        )
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    return {"records": records, "bytes_sent": stats.bytes_sent}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("threshold", [0, 64 << 20], ids=["unfused", "large"])
def test_sparse_embedding_gradient_is_densified_and_averaged(run_ranks, world_size, threshold):
    """The fusion path (``--sparse-as-dense``): a sparse gradient travels densified."""
    results = run_ranks(world_size, _sparse_embedding, threshold)
    dense_bytes = (20 * 4 + 4 * 2 + 2 + 3) * 4  # + one had-a-gradient flag per parameter
    for result in results:
        for record in result["records"]:
            assert record["was_sparse"] and not record["sparse_after"]
            for got, want in zip(record["grads"], record["expected"], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            assert torch.count_nonzero(record["grads"][0][16:]) == 0
            assert torch.count_nonzero(record["grads"][0][:16]) > 0
        if threshold:  # one bucket of the whole dense model per step
            assert result["bytes_sent"] == 2 * (2 * (world_size - 1) * dense_bytes // world_size)


# ---------------------------------------------------------------- harness self-checks


def _echo(rank: int, world_size: int, payload: dict) -> tuple:
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank, world_size, payload, total.item()


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    dist.barrier()
    assert rank != 1, "rank one says no"
    return rank


def _hang_on_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(60)


def test_harness_passes_arguments_and_returns_results_by_rank(run_ranks):
    assert run_ranks(4, _echo, {"k": [1, 2]}) == [(r, 4, {"k": [1, 2]}, 6.0) for r in range(4)]


def test_harness_reports_a_failing_rank_and_recovers(run_ranks):
    with pytest.raises(AssertionError, match=r"failed on ranks \[1\]") as raised:
        run_ranks(2, _fail_on_rank_one)
    assert "rank one says no" in str(raised.value)
    assert run_ranks(2, _echo, None)[1] == (1, 2, None, 1.0)


def test_harness_rejects_local_functions(run_ranks):
    def local(rank: int, world_size: int) -> None:
        return None

    with pytest.raises(TypeError, match="module-level function"):
        run_ranks(2, local)


# These two end the file: they take the 2-rank pool down (it restarts on the next use).


def _partially_unused(rank: int, world_size: int) -> list:
    torch.manual_seed(0)
    model = _WithUnused()
    reference = copy.deepcopy(model)
    fused = FusedAllreduce(
        list(model.parameters()),
        threshold_bytes=0,
        group=None,
        world_size=world_size,
        stats=CommStats(),
    )
    fused.attach()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))

    def forward(net: nn.Module) -> torch.Tensor:
        hidden = net.first(x)
        if rank == 0:  # data-dependent branch: only rank 0 uses the middle layer
            hidden = net.unused(hidden)
        return net.last(hidden).square().sum()

    forward(reference).backward()
    expected = _explicit_average(reference, world_size)
    forward(model).backward()
    fused.finish()
    for got, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(got.grad, want)
    return [p.grad for p in model.parameters()]


def test_parameter_without_gradient_on_some_ranks(run_ranks):
    run_ranks(2, _partially_unused, timeout=10)


def test_harness_fails_a_hung_job_instead_of_blocking(run_ranks):
    started = time.monotonic()
    with pytest.raises(
        AssertionError,
        match=r"did not finish within 1 s; ranks still running: "
        r"\[0\]",
    ):
        run_ranks(2, _hang_on_rank_zero, timeout=1)
    assert time.monotonic() - started < 30  # the rank sleeps 60 s
