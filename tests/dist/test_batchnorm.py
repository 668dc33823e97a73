"""Cross-rank BatchNorm: the global batch split over 2 and 4 Gloo ranks computes what one
process computes with ``nn.BatchNorm*d`` over the whole batch.

Each rank returns its shard's results; the test concatenates them and compares with a
single-process reference computed here. Parameter gradients are averaged over ranks, as a
strategy does; each rank's loss is the mean over its own shard, so the input gradient of
rank k is ``world_size`` × the reference's (exactly what averaging upstream gradients undoes).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradsync.comm.batchnorm import GlobalBatchNorm, convert_batchnorm
from gradsync.errors import UserError

TOL = dict(rtol=1e-5, atol=1e-5)
NUM_STEPS = 3
KINDS = {
    "bn2d": (nn.BatchNorm2d, (8, 3, 4, 4)),
    "bn1d": (nn.BatchNorm1d, (8, 5)),
    "bn1d-seq": (nn.BatchNorm1d, (8, 3, 6)),
}


def _make(kind: str, momentum: float | None) -> nn.Module:
    """A BatchNorm layer with non-trivial affine parameters, identical on every rank."""
    make, shape = KINDS[kind]
    channels = shape[1]
    layer = make(channels, momentum=momentum)
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(channels, generator=generator) + 0.5)
        layer.bias.copy_(torch.randn(channels, generator=generator))
    return layer


def _batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (offset, scaled, per-channel different) and loss weights."""
    shape = KINDS[kind][1]
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(shape, generator=generator) * 2.0 + 3.0
    x = x + torch.arange(shape[1], dtype=x.dtype).view(1, -1, *[1] * (len(shape) - 2))
    weights = torch.randn(shape, generator=generator)
    return x, weights


def _loss(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean over samples (as every gradsync loss is) of a per-sample weighted sum."""
    return (y * weights).flatten(1).sum(1).mean()


def _run_shard(layer: nn.Module, kind: str, lo: int, hi: int, world_size: int) -> list[dict]:
    """Train-mode steps on samples [lo, hi) of every global batch, then one eval forward."""
    records = []
    for step in range(NUM_STEPS):
        x, weights = _batch(kind, step)
        shard = x[lo:hi].clone().requires_grad_(True)
        y = layer(shard)
        _loss(y, weights[lo:hi]).backward()
        grads = torch.stack([layer.weight.grad, layer.bias.grad])
        if world_size > 1:
            dist.all_reduce(grads)
            grads /= world_size  # what a strategy does with every parameter gradient
        records.append(
            {
                "y": y.detach(),
                "grad_x": shard.grad,
                "grad_weight": grads[0].clone(),
                "grad_bias": grads[1].clone(),
                "running_mean": layer.running_mean.clone(),
                "running_var": layer.running_var.clone(),
                "num_batches_tracked": int(layer.num_batches_tracked),
            }
        )
        layer.weight.grad = layer.bias.grad = None
    layer.eval()
    x, _ = _batch(kind, NUM_STEPS)
    records.append({"y": layer(x[lo:hi]).detach()})
    return records


def _reference(kind: str, momentum: float | None) -> list[dict]:
    """One process, the whole global batch, torch's own BatchNorm."""
    return _run_shard(_make(kind, momentum), kind, 0, KINDS[kind][1][0], world_size=1)


def _bn_on_ranks(rank: int, world_size: int, kind: str, momentum: float | None) -> list[dict]:
    torch.manual_seed(0)
    model = nn.Sequential(_make(kind, momentum))
    assert convert_batchnorm(model, group=None) == 1
    assert isinstance(model[0], GlobalBatchNorm)
    per_rank = KINDS[kind][1][0] // world_size
    return _run_shard(model[0], kind, rank * per_rank, (rank + 1) * per_rank, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
def test_global_batchnorm_matches_single_process(run_ranks, world_size, kind, momentum):
    expected = _reference(kind, momentum)
    ranks = run_ranks(world_size, _bn_on_ranks, kind, momentum)
    for step in range(NUM_STEPS):
        want = expected[step]
        got = [ranks[r][step] for r in range(world_size)]
        torch.testing.assert_close(torch.cat([g["y"] for g in got]), want["y"], **TOL)
        torch.testing.assert_close(
            torch.cat([g["grad_x"] for g in got]) / world_size, want["grad_x"], **TOL
        )
        for g in got:
            for key in ("grad_weight", "grad_bias", "running_mean", "running_var"):
                torch.testing.assert_close(g[key], want[key], **TOL, msg=f"{key} step {step}")
            assert g["num_batches_tracked"] == want["num_batches_tracked"] == step + 1
    # eval mode normalizes with the running statistics, not with the batch's
    torch.testing.assert_close(
        torch.cat([ranks[r][-1]["y"] for r in range(world_size)]), expected[-1]["y"], **TOL
    )


def _float64_on_ranks(rank: int, world_size: int, kind: str) -> list[dict]:
    torch.set_default_dtype(torch.float64)
    try:
        return _bn_on_ranks(rank, world_size, kind, 0.1)
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("kind", list(KINDS))
def test_float64_matches_single_process_to_rounding(run_ranks, world_size, kind):
    """The exactness claim, where rounding is ~1e-16: outputs, gradients and running
    statistics agree with torch's own layer to 1e-12. A group of one rank (how
    ``gradsync profile`` times the layer) gathers nothing and computes the same."""
    torch.set_default_dtype(torch.float64)
    try:
        expected = _reference(kind, 0.1)
    finally:
        torch.set_default_dtype(torch.float32)
    ranks = run_ranks(world_size, _float64_on_ranks, kind)
    exact = dict(rtol=1e-12, atol=1e-12)
    for step in range(NUM_STEPS):
        want, got = expected[step], [ranks[r][step] for r in range(world_size)]
        assert want["y"].dtype == torch.float64
        torch.testing.assert_close(torch.cat([g["y"] for g in got]), want["y"], **exact)
        grad_x = torch.cat([g["grad_x"] for g in got]) / world_size
        torch.testing.assert_close(grad_x, want["grad_x"], **exact)
        for g in got:
            for key in ("grad_weight", "grad_bias", "running_mean", "running_var"):
                torch.testing.assert_close(g[key], want[key], **exact, msg=f"{key} step {step}")


def test_reference_is_not_trivial():
    """The checks above would be meaningless if local statistics gave the same numbers."""
    expected = _reference("bn2d", 0.1)
    layer = _make("bn2d", 0.1)
    x, _ = _batch("bn2d", 0)
    half = layer(x[:4])
    assert not torch.allclose(half, expected[0]["y"][:4], atol=1e-3)
    assert expected[0]["grad_x"].abs().max() > 1e-3
    assert not torch.allclose(
        expected[-1]["y"], layer.eval()(_batch("bn2d", NUM_STEPS)[0]), atol=1e-3
    )


def _conv_bn_on_ranks(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Sequential(nn.Conv2d(3, 2, 1), nn.BatchNorm2d(2)),
    )
    assert convert_batchnorm(model, group=None) == 2
    x = torch.randn(8, 2, 5, 5, generator=torch.Generator().manual_seed(7))
    per_rank = 8 // world_size
    shard = x[rank * per_rank : (rank + 1) * per_rank]
    model(shard).square().mean().backward()
    grads = {}
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad)
        grads[name] = param.grad / world_size
    return grads


@pytest.mark.parametrize("world_size", [2, 4])
def test_upstream_parameter_gradients_match_single_process(run_ranks, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Sequential(nn.Conv2d(3, 2, 1), nn.BatchNorm2d(2)),
    )
    x = torch.randn(8, 2, 5, 5, generator=torch.Generator().manual_seed(7))
    model(x).square().mean().backward()
    for grads in run_ranks(world_size, _conv_bn_on_ranks):
        assert set(grads) == {name for name, _ in model.named_parameters()}
        for name, param in model.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, **TOL, msg=name)


def _uneven_forward(rank: int, world_size: int) -> dict:
    layer = nn.Sequential(_make("bn2d", 0.5))
    convert_batchnorm(layer, group=None)
    x, _ = _batch("bn2d", 0)
    lo, hi = (0, 3) if rank == 0 else (3, 8)  # 3 and 5 samples: counts weigh the moments
    y = layer(x[lo:hi])
    return {
        "y": y.detach(),
        "running_var": layer[0].running_var.clone(),
        "running_mean": layer[0].running_mean.clone(),
    }


def test_uneven_shards_combine_moments_by_count(run_ranks):
    reference = _make("bn2d", 0.5)
    x, _ = _batch("bn2d", 0)
    y = reference(x)
    ranks = run_ranks(2, _uneven_forward)
    torch.testing.assert_close(torch.cat([r["y"] for r in ranks]), y.detach(), **TOL)
    for r in ranks:
        torch.testing.assert_close(r["running_mean"], reference.running_mean, **TOL)
        torch.testing.assert_close(r["running_var"], reference.running_var, **TOL)


VARIANTS = {
    # name: (layer, global batch shape); every layer is compared in train and eval mode
    "no-affine": (lambda: nn.BatchNorm2d(3, affine=False), (8, 3, 4, 4)),
    "batch-stats-only": (lambda: nn.BatchNorm1d(3, track_running_stats=False), (8, 3, 6)),
    "neither": (lambda: nn.BatchNorm1d(5, affine=False, track_running_stats=False), (8, 5)),
    "bn3d": (lambda: nn.BatchNorm3d(2), (8, 2, 3, 3, 3)),
}


def _variant_steps(layer: nn.Module, shape: tuple[int, ...], lo: int, hi: int) -> list[Tensor]:
    """Two train-mode steps and one eval forward on samples [lo, hi): outputs, input grads
    and (where the layer has them) parameter gradients and running statistics."""
    results = []
    for step, training in enumerate((True, True, False)):
        layer.train(training)
        generator = torch.Generator().manual_seed(step)
        x = (torch.randn(shape, generator=generator) * 3 + 1)[lo:hi].requires_grad_(True)
        y = layer(x)
        (y * torch.randn(shape, generator=generator)[lo:hi]).flatten(1).sum(1).mean().backward()
        results += [y.detach(), x.grad]
        for param in layer.parameters():
            grad = param.grad.clone()
            if dist.is_initialized():
                dist.all_reduce(grad)
                grad /= dist.get_world_size()
            results.append(grad)
            param.grad = None
        results += [b.clone() for b in layer.buffers() if b.is_floating_point()]
    return results


def _variant_on_ranks(rank: int, world_size: int, name: str) -> list[Tensor]:
    make, shape = VARIANTS[name]
    model = nn.Sequential(make())
    assert convert_batchnorm(model, group=None) == 1
    per_rank = shape[0] // world_size
    return _variant_steps(model[0], shape, rank * per_rank, (rank + 1) * per_rank)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_batchnorm_configuration_spans_the_global_batch(run_ranks, name):
    """Without affine parameters, without running statistics (then eval mode normalizes
    with the global batch's statistics, as torch's layer does with its whole batch), 3-d."""
    make, shape = VARIANTS[name]
    want = _variant_steps(make(), shape, 0, shape[0])
    ranks = run_ranks(2, _variant_on_ranks, name)
    per_item = len(want) // 3
    for index, expected in enumerate(want):
        if index % per_item in (0, 1):  # outputs and input gradients: concatenated shards
            got = torch.cat([ranks[r][index] for r in range(2)])
            scale = 2 if index % per_item == 1 else 1  # each shard's loss is its own mean
            torch.testing.assert_close(got / scale, expected, **TOL)
        else:
            for r in range(2):
                torch.testing.assert_close(ranks[r][index], expected, **TOL)


# ---------------------------------------------------------------- without processes


def test_convert_replaces_nested_layers_keeping_names_and_identities():
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3),
        nn.BatchNorm2d(4),
        nn.Sequential(nn.Flatten(), nn.BatchNorm1d(4), nn.Linear(4, 2)),
        nn.LayerNorm(2),
        nn.InstanceNorm1d(2),
    )
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    keys = list(model.state_dict())
    assert convert_batchnorm(model, group=None) == 2
    assert isinstance(model[1], GlobalBatchNorm) and isinstance(model[2][1], GlobalBatchNorm)
    assert isinstance(model[3], nn.LayerNorm) and isinstance(model[4], nn.InstanceNorm1d)
    assert list(model.state_dict()) == keys
    assert {n: id(p) for n, p in model.named_parameters()} == {n: id(p) for n, p in params.items()}
    assert {n: id(b) for n, b in model.named_buffers()} == {n: id(b) for n, b in buffers.items()}
    assert convert_batchnorm(model, group=None) == 0  # nothing left to replace


def test_eval_mode_uses_running_statistics_without_a_process_group():
    source = _make("bn2d", 0.1)
    with torch.no_grad():
        source.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0]))
        source.running_var.copy_(torch.tensor([4.0, 0.25, 1.0]))
    reference = copy.deepcopy(source).eval()
    layer = GlobalBatchNorm(source, group=None).eval()
    x, _ = _batch("bn2d", 0)
    torch.testing.assert_close(layer(x), reference(x), rtol=0, atol=0)
    assert int(layer.num_batches_tracked) == 0  # eval does not touch the statistics


def test_convert_keeps_the_training_mode():
    model = nn.Sequential(nn.BatchNorm2d(3)).eval()
    convert_batchnorm(model, group=None)
    assert not model[0].training


# ------------------------------------------------------------------------------------------
# A shard that gives a layer no rows: count 0 and zero sums, in every collective.

EXACT = dict(rtol=1e-12, atol=1e-12)  # float64: rounding is ~1e-16
SHARDS = {
    # name: (layer kind, where each rank's samples of the 8-sample global batch start and end)
    "rank-1-and-3-empty": ("bn1d", (0, 3, 3, 8, 8)),
    "rank-0-empty-2d": ("bn2d", (0, 0, 8)),
    "rank-1-empty-seq": ("bn1d-seq", (0, 8, 8)),
    "all-empty": ("bn1d", (0, 0, 0)),  # torch's layer: empty output, statistics kept
}


def _steps_on_rows(layer: nn.Module, kind: str, lo: int, hi: int, global_rows: int) -> list[dict]:
    """``_run_shard`` with a loss normalized by the global batch (a shard's own mean is NaN
    over no rows), parameter gradients summed over ranks; float64 throughout."""
    records = []
    for step in range(NUM_STEPS):
        x, weights = (t.double()[:global_rows] for t in _batch(kind, step))
        shard = x[lo:hi].clone().requires_grad_(True)
        y = layer(shard)
        ((y * weights[lo:hi]).sum() / len(x)).backward()
        grads = torch.stack([layer.weight.grad, layer.bias.grad])
        if dist.is_initialized():
            dist.all_reduce(grads)
        records.append(
            {
                "y": y.detach(),
                "grad_x": shard.grad,
                "grads": grads,
                "stats": torch.stack([layer.running_mean, layer.running_var]),
                "num_batches_tracked": int(layer.num_batches_tracked),
            }
        )
        layer.weight.grad = layer.bias.grad = None
    layer.eval()
    x = _batch(kind, NUM_STEPS)[0].double()[:global_rows]
    records.append({"y": layer(x[lo:hi]).detach()})
    return records


def _empty_shards_on_ranks(rank: int, world_size: int, name: str) -> list[dict]:
    kind, bounds = SHARDS[name]
    model = nn.Sequential(_make(kind, 0.1).double())
    convert_batchnorm(model, group=None)
    return _steps_on_rows(model[0], kind, bounds[rank], bounds[rank + 1], bounds[-1])


@pytest.mark.parametrize("name", list(SHARDS))
def test_a_rank_with_no_rows_contributes_nothing_and_joins_every_collective(run_ranks, name):
    """A worker whose shard selects no rows for a layer (a masked subset) crashed in torch's
    moments kernel ('input tensor must have at least one element'), and its backward kernel
    dies of SIGFPE on an empty input. Now it sends count 0 and zero sums."""
    kind, bounds = SHARDS[name]
    world_size = len(bounds) - 1
    want = _steps_on_rows(_make(kind, 0.1).double(), kind, 0, bounds[-1], bounds[-1])
    ranks = run_ranks(world_size, _empty_shards_on_ranks, name)
    for step, expected in enumerate(want):
        got = [ranks[r][step] for r in range(world_size)]
        torch.testing.assert_close(torch.cat([g["y"] for g in got]), expected["y"], **EXACT)
        if step == NUM_STEPS:  # the eval forward
            continue
        grad_x = torch.cat([g["grad_x"] for g in got])
        torch.testing.assert_close(grad_x, expected["grad_x"], **EXACT)
        for g in got:
            for key in ("grads", "stats", "num_batches_tracked"):
                torch.testing.assert_close(g[key], expected[key], **EXACT, msg=f"{key} {step}")
    assert bool(want[0]["stats"].isfinite().all())


# ------------------------------------------------------------------------------------------
# A layer that some workers run and others do not, in one step: a one-line UserError on at
# least one rank (never statistics of another layer, never a silent hang).

BRANCH_TIMEOUT_S = 8.0  # the wait-alone test waits this long; ample for a loaded rendezvous


def _two_layers() -> nn.Module:
    """Two global layers of the same width, so their collectives have the same size."""
    model = nn.ModuleDict({"a": nn.BatchNorm1d(5), "b": nn.BatchNorm1d(5)}).double()
    convert_batchnorm(model, group=None)
    return model


def _user_error(run: Any) -> str:
    """What ``run()`` raised as a UserError ('' when it returned)."""
    try:
        run()
    except UserError as error:
        return str(error)
    return ""


def _skip_a_layer(rank: int, world_size: int) -> str:
    """Rank 0 runs a then b; the others b alone: a's collective meets b's."""
    model = _two_layers()
    x = torch.randn(4, 5, dtype=torch.float64)
    return _user_error(lambda: model["b"](model["a"](x) if rank == 0 else x))


def _skip_a_backward(rank: int, world_size: int) -> str:
    """Both ranks run a's forward; rank 1's loss ignores it, so rank 1 has no backward of
    a and reduces a gradient bucket of the size of a's sums (and their tags) instead. (A
    bucket of another size makes Gloo abort one of the processes: loud already.)"""
    model = _two_layers()
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    y = model["a"](x)
    if rank == 0:
        return _user_error(lambda: y.square().sum().backward())
    x.square().sum().backward()
    dist.all_reduce(torch.randn(2 * 5 + 4, dtype=torch.float64))
    return ""


def _wait_alone(rank: int, world_size: int, flag: str) -> str:
    """Rank 0 runs a; rank 1 runs no collective at all until rank 0 has given up."""
    if rank == 0:
        message = _user_error(lambda: _two_layers()["a"](torch.randn(4, 5, dtype=torch.float64)))
        Path(flag).touch()
        return message
    deadline = time.monotonic() + 3 * BRANCH_TIMEOUT_S
    while not Path(flag).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return ""


def _assert_one_run_each(message: str, layer: str, details: str) -> None:
    """One line that names the layer, the rule and the remedy within what a report shows
    of it (240 characters), then the details."""
    assert message.startswith(f"BatchNorm layer {layer} ") and "\n" not in message, message
    rule = "every worker to run every BatchNorm layer the same number of times in a step"
    assert rule in message[:240] and "use --batchnorm local" in message[:240]
    assert details in message


def test_a_layer_skipped_on_one_rank_is_named_not_paired_with_another_layer(run_ranks):
    """a's statistics on rank 0 met b's on rank 1 (same size): rank 0 normalized with b's
    input too, silently. Every rank sees every tag, so both say so."""
    first, second = run_ranks(2, _skip_a_layer)  # found at once: no timeout involved
    _assert_one_run_each(first, "a", "forward call 1; worker(s) 1 in another collective")
    _assert_one_run_each(second, "b", "forward call 1; worker(s) 0 in another collective")


def test_a_backward_skipped_on_one_rank_is_named_not_summed_with_a_gradient(run_ranks):
    """Rank 0's Σ dy met a gradient bucket of rank 1: a bucket of the same size would add
    gradients to its sums, silently. The tags' sums (and their squares') give it away."""
    message, other = run_ranks(2, _skip_a_backward)  # found at once: no timeout involved
    _assert_one_run_each(message, "a", "backward call 1")
    assert other == ""


def test_a_rank_waiting_alone_in_a_layer_names_it_at_the_timeout(run_ranks, tmp_path):
    """The other rank runs no collective at all: rank 0 waits until the group's timeout,
    then names the layer instead of Gloo's 'Timed out waiting … for recv'."""
    flag = str(tmp_path / "rank0-gave-up")
    message, _ = run_ranks(2, _wait_alone, flag, timeout=BRANCH_TIMEOUT_S)
    assert f"timed out after {BRANCH_TIMEOUT_S:g} s waiting for the other workers" in message
    _assert_one_run_each(message, "a", "(forward call 1)")
