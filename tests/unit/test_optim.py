"""Optimizers, the batch-size scaling rule and the gradual warm-up schedule."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gradsync.config import OptimConfig
from gradsync.optim import Updater, effective_lr


@pytest.mark.parametrize(
    ("scaling", "global_batch", "base_batch", "expected"),
    [
        ("none", 1024, 256, 0.1),
        ("linear", 512, 256, 0.2),
        ("linear", 1024, 256, 0.4),
        ("linear", 128, 256, 0.05),
        ("sqrt", 1024, 256, 0.2),
        ("sqrt", 512, 256, 0.1 * math.sqrt(2)),
        ("sqrt", 64, 256, 0.05),
    ],
)
def test_effective_lr_scaling_rules(scaling, global_batch, base_batch, expected):
    config = OptimConfig(lr=0.1, lr_scaling=scaling)
    assert effective_lr(config, global_batch, base_batch) == pytest.approx(expected, rel=1e-12)


def test_lr_base_batch_overrides_the_presets_batch():
    config = OptimConfig(lr=0.1, lr_scaling="linear", lr_base_batch=64)
    assert effective_lr(config, 256, base_batch=128) == pytest.approx(0.4)


def test_default_lr_per_optimizer_is_scaled_too():
    assert effective_lr(OptimConfig(name="sgd", lr_scaling="linear"), 64, 32) == pytest.approx(0.1)
    assert effective_lr(OptimConfig(name="adam", lr_scaling="none"), 64, 32) == pytest.approx(1e-3)


def _scalar_model() -> nn.Linear:
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    return model


def test_sgd_warmup_ramps_linearly_then_holds():
    model = _scalar_model()
    updater = Updater(
        model.parameters(), OptimConfig(name="sgd", momentum=0.0, lr_warmup_steps=4), lr=1.0
    )
    lrs, weights = [], []
    for _ in range(6):
        lrs.append(updater.lr)
        model(torch.ones(1, 1)).sum().backward()  # d/dw (w·1) = 1 every step
        updater.update()
        weights.append(model.weight.item())
    assert lrs == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    # each step moves the weight by exactly that step's learning rate
    assert weights == [-0.25, -0.75, -1.5, -2.5, -3.5, -4.5]


def test_without_warmup_the_rate_is_constant():
    model = _scalar_model()
    updater = Updater(model.parameters(), OptimConfig(name="sgd", momentum=0.0), lr=0.5)
    for _ in range(3):
        assert updater.lr == 0.5
        model(torch.ones(1, 1)).sum().backward()
        updater.update()
    assert model.weight.item() == -1.5


def test_sgd_uses_momentum_and_weight_decay():
    model = _scalar_model()
    config = OptimConfig(name="sgd", momentum=0.5, weight_decay=0.1)
    updater = Updater(model.parameters(), config, lr=1.0)
    assert isinstance(updater.optimizer, torch.optim.SGD)
    group = updater.optimizer.param_groups[0]
    assert (group["momentum"], group["weight_decay"], group["lr"]) == (0.5, 0.1, 1.0)
    expected_w, velocity = 0.0, 0.0
    for step in range(3):
        model(torch.ones(1, 1)).sum().backward()
        updater.update()
        grad = 1.0 + 0.1 * expected_w  # weight decay adds wd·w to the gradient
        velocity = grad if step == 0 else 0.5 * velocity + grad
        expected_w -= velocity
        assert model.weight.item() == pytest.approx(expected_w, rel=1e-6)


def test_adam_builds_and_steps_by_about_lr():
    model = _scalar_model()
    updater = Updater(model.parameters(), OptimConfig(name="adam", weight_decay=0.01), lr=0.01)
    assert isinstance(updater.optimizer, torch.optim.Adam)
    group = updater.optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"]) == (0.01, 0.01)
    model(torch.ones(1, 1)).sum().backward()
    updater.update()
    # Adam's first step is lr · g / (|g| + eps) ≈ lr, whatever the gradient's size
    assert model.weight.item() == pytest.approx(-0.01, rel=1e-6)
    assert set(updater.optimizer.state[model.weight]) >= {"exp_avg", "exp_avg_sq", "step"}


def test_adam_warmup_schedule():
    model = _scalar_model()
    updater = Updater(model.parameters(), OptimConfig(name="adam", lr_warmup_steps=2), lr=0.002)
    assert updater.lr == pytest.approx(0.001)
    model(torch.ones(1, 1)).sum().backward()
    updater.update()
    assert updater.lr == pytest.approx(0.002)


def test_update_zeroes_gradients():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    updater = Updater(model.parameters(), OptimConfig(name="sgd"), lr=0.1)
    model(torch.randn(5, 3)).square().sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    updater.update()
    assert all(p.grad is None for p in model.parameters())
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_updater_accepts_a_generator_of_parameters():
    model = nn.Linear(2, 2)
    updater = Updater((p for p in model.parameters()), OptimConfig(name="sgd"), lr=0.1)
    assert len(updater.optimizer.param_groups[0]["params"]) == 2


def _sparse_table_steps(table: nn.Embedding, updater: Updater, lookups: list[torch.Tensor]) -> None:
    for rows in lookups:
        table(rows).sin().sum().backward()
        updater.update()


def _lookups(steps: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (12,), generator=generator) for _ in range(steps)]


def test_a_sparse_gradients_momentum_stays_the_size_of_its_table_and_moves_as_torchs():
    """torch's SGD keeps a sparse buffer that grows by each step's rows (its cost and memory
    grow with the run); the Updater's is dense from the first step, with the same values."""
    torch.manual_seed(0)
    table = nn.Embedding(50, 3, sparse=True, dtype=torch.float64)
    reference = nn.Embedding(50, 3, sparse=True, dtype=torch.float64)
    reference.load_state_dict(table.state_dict())
    updater = Updater(table.parameters(), OptimConfig(name="sgd", momentum=0.9), lr=0.1)
    torchs = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for rows in _lookups(40, seed=1):
        table(rows).sin().sum().backward()
        updater.update()
        buffer = updater.optimizer.state[table.weight]["momentum_buffer"]
        assert not buffer.is_sparse and buffer.shape == table.weight.shape
        reference(rows).sin().sum().backward()
        torchs.step()
        torchs.zero_grad()
    grown = torchs.state[reference.weight]["momentum_buffer"]
    assert grown.is_sparse and grown._nnz() > 5 * 50  # entries: 5× the table's rows
    assert torch.allclose(buffer, grown.to_dense(), atol=1e-12, rtol=0)
    assert torch.allclose(table.weight, reference.weight, atol=1e-12, rtol=0)


def test_a_sparse_tables_momentum_resumes_bit_for_bit():
    """A checkpoint stores the buffer dense; the uninterrupted run's is dense as well, so
    the run and its resumption do the same arithmetic."""
    from gradsync.checkpoint import load_model_state, model_state

    torch.manual_seed(0)
    config = OptimConfig(name="sgd", momentum=0.9)
    table = nn.Embedding(50, 3, sparse=True)
    updater = Updater(table.parameters(), config, lr=0.1)
    first, rest = _lookups(10, seed=2), _lookups(10, seed=3)
    _sparse_table_steps(table, updater, first)
    resumed = nn.Embedding(50, 3, sparse=True)
    resumed_updater = Updater(resumed.parameters(), config, lr=0.1)
    load_model_state(resumed, resumed_updater.optimizer, model_state(table, updater.optimizer))
    _sparse_table_steps(table, updater, rest)
    _sparse_table_steps(resumed, resumed_updater, rest)
    assert torch.equal(table.weight, resumed.weight)
