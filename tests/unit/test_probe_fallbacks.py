"""The step-0 probe (gradsync/probe.py) on models and losses it once crashed on or changed:
ones deepcopy refuses, a loss object with state, a forward that fails on the copy, and the
safe answer ddp takes when the probe cannot run."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradsync.comm.batchnorm import GlobalBatchNorm, convert_batchnorm
from gradsync.config import TrainConfig
from gradsync.errors import UserError
from gradsync.models.base import Workload
from gradsync.models.user import MapStyleSamples
from gradsync.probe import (
    ProbeUnavailable,
    UnknownGradients,
    missing_on_any_worker,
    params_without_gradient,
)
from gradsync.runtime import _probe_gradients
from gradsync.strategies.base import Context
from gradsync.strategies.ddp import NativeDDP
from tests.models import probe_nocopy, probe_stateful_loss, probe_syncbn

CPU = torch.device("cpu")


def _workload(model: nn.Module, loss=nn.functional.cross_entropy) -> Workload:
    samples = MapStyleSamples([(torch.randn(6), torch.tensor(i % 5)) for i in range(8)], seed=0)
    return Workload(model=model, dataset=samples, loss=loss, global_batch=8, description="m")


def _probe(workload: Workload, stop: int = 4) -> set[str]:
    return params_without_gradient(
        workload, workload.model, global_batch=8, start=0, stop=stop, device=CPU
    )


@pytest.mark.parametrize("kind", ["nonleaf", "weight_norm"])
def test_a_tensor_attribute_that_is_not_a_leaf_is_copied_detached(kind):
    """deepcopy refuses a non-leaf tensor (legacy weight_norm's ``weight``): it crashed ddp."""
    model, _, loss = probe_nocopy.build(kind=kind)
    assert _probe(_workload(model, loss)) == set()
    assert all(p.grad is None for p in model.parameters())


def test_a_model_holding_a_lock_cannot_be_probed():
    model, _, loss = probe_nocopy.build(kind="lock")
    with pytest.raises(
        ProbeUnavailable, match=r"^the model cannot be deep-copied \(TypeError: .*lock"
    ):
        _probe(_workload(model, loss))


def test_the_probe_calls_a_copy_of_a_loss_object():
    """A loss that counts its calls saw one more from the probe: ddp was 2e-3 off single."""
    model, _, loss = probe_stateful_loss.build()
    _probe(_workload(model, loss))
    assert loss.calls == 0
    loss.lock = threading.Lock()
    with pytest.raises(ProbeUnavailable, match=r"^its loss cannot be deep-copied"):
        _probe(_workload(model, loss))
    assert loss.calls == 0


class _PenaltyLoss:
    """A loss object holding the model, with a penalty on a parameter forward never reads."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, targets) + self.model.loose.square().sum()


def test_a_loss_object_holding_the_model_reads_the_copy():
    model = nn.Sequential(nn.Linear(6, 5))
    model.loose = nn.Parameter(torch.ones(2))
    assert _probe(_workload(model, _PenaltyLoss(model))) == set()
    assert all(p.grad is None for p in model.parameters())


class _Raises(nn.Module):
    def __init__(self, error: Exception, *, global_norm: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 5)
        self.norm = GlobalBatchNorm(nn.BatchNorm1d(5), group=None) if global_norm else None
        self.error = error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise self.error


def test_a_forward_that_fails_on_the_copy_cannot_be_probed():
    """Training runs the same forward on the model: a real error surfaces there."""
    error = RuntimeError("fails on purpose")
    with pytest.raises(ProbeUnavailable, match=r"failed on the copy \(RuntimeError: fails on") as e:
        _probe(_workload(_Raises(error)))
    assert repr(e.value.__cause__) == repr(error)  # the copy's error, as training raises it


def test_errors_the_copy_does_not_explain_are_raised():
    """gradsync's own refusals, the data's errors, and a failure in a model with cross-rank
    BatchNorm (the other workers may wait in its collective) are raised as they are."""
    with pytest.raises(UserError, match="refused"):
        _probe(_workload(_Raises(UserError("refused"))))
    with pytest.raises(RuntimeError, match=r"^fails$"):
        _probe(_workload(_Raises(RuntimeError("fails"), global_norm=True)))
    bad_data = Workload(
        model=nn.Linear(6, 5),
        dataset=MapStyleSamples(_BadItems(), seed=0),
        loss=nn.functional.cross_entropy,
        global_batch=8,
        description="m",
    )
    with pytest.raises(ValueError, match="bad item"):
        _probe(bad_data)


class _BadItems:
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        raise ValueError("bad item")


def test_workers_agree_that_the_probe_is_unknown():
    model = nn.Linear(6, 5)
    assert missing_on_any_worker(model, {"bias"}, None) == {"bias"}
    assert missing_on_any_worker(model, None, None) is None


def test_unknown_gradients_are_every_trainable_parameter_and_the_reason():
    """The runtime's safe answer: for ddp, find_unused_parameters on."""
    model, _, loss = probe_nocopy.build(kind="lock")
    model.inp.bias.requires_grad_(False)
    config = TrainConfig(strategy="ddp", workers=2)
    missing = _probe_gradients(config, NativeDDP(), _workload(model, loss), 8, 0, None, CPU)
    assert isinstance(missing, UnknownGradients)
    assert missing == {"inp.weight", "out.weight", "out.bias"}
    assert "cannot be deep-copied" in missing.reason


def test_find_unused_parameters_skips_the_probe():
    """ddp:find_unused_parameters=true still ran the probe, and crashed on a model it cannot
    copy."""
    model, _, loss = probe_nocopy.build(kind="lock")
    config = TrainConfig(
        strategy="ddp", workers=2, strategy_options={"find_unused_parameters": True}
    )
    assert _probe_gradients(config, NativeDDP(), _workload(model, loss), 8, 0, None, CPU) is None


def _context(missing: frozenset[str] | None) -> Context:
    return Context(
        config=TrainConfig(strategy="ddp", workers=2),
        rank=0,
        world_size=2,
        worker_index=0,
        num_workers=2,
        device=CPU,
        worker_group=None,
        make_updater=lambda params: None,  # type: ignore[arg-type,return-value]
        missing_gradients=missing,
    )


def test_ddp_turns_find_unused_parameters_on_when_the_probe_could_not_run(capsys):
    unknown = UnknownGradients({"w"}, reason="the model cannot be deep-copied (TypeError: x)")
    assert NativeDDP._find_unused(_context(unknown))
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert "find_unused_parameters=True (the step-0 probe could not run: the model" in out
    assert not NativeDDP._find_unused(_context(frozenset()))


class _WithUnused(nn.Module):
    def __init__(self, used: nn.Module) -> None:
        super().__init__()
        self.used, self.unused = used, nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield dist.new_group([0])
    finally:
        dist.destroy_process_group()


def test_the_probe_runs_through_global_batchnorm_on_one_sample(one_rank_group):
    """The probe runs after BatchNorm's conversion (a local BatchNorm refuses a shard of one
    sample); the copy shares the layer's process group, which deepcopy cannot copy."""
    model = _WithUnused(probe_syncbn.build()[0])
    convert_batchnorm(model, group=one_rank_group)
    assert _probe(_workload(model), stop=1) == {"unused.weight", "unused.bias"}
