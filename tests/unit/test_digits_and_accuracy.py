"""Real handwritten digits (scikit-learn) and validation accuracy."""

from __future__ import annotations

import torch
from torch import nn

from gradsync.data.digits import digits_split
from gradsync.evaluate import validation_accuracy
from gradsync.models import build_workload
from gradsync.models.base import Workload


def test_digits_split_is_disjoint_deterministic_and_resized() -> None:
    train, validation = digits_split(seed=3, image_size=28)
    again, _ = digits_split(seed=3, image_size=28)
    assert (train.num_samples, validation.num_samples) == (1438, 359)
    batch = train.batch(step=2, size=16, start=0, stop=16)
    assert batch.inputs[0].shape == (16, 1, 28, 28)
    assert float(batch.inputs[0].min()) >= 0.0 and float(batch.inputs[0].max()) <= 1.0
    assert torch.equal(batch.inputs[0], again.batch(step=2, size=16, start=0, stop=16).inputs[0])
    held_out = {tuple(x.flatten().tolist()) for x in validation.images}
    assert not any(tuple(x.flatten().tolist()) in held_out for x in train.images[:200])


def test_mnist_cnn_on_digits_reports_iterations_and_validation() -> None:
    workload = build_workload("mnist-cnn", preset="tiny", data="sklearn:digits")
    assert workload.num_train_samples == 1438 and workload.num_validation == 359


class _Oracle(nn.Module):
    """Predicts class 0 for every sample."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(len(images), 10)
        logits[:, 0] = 1
        return logits


def test_validation_accuracy_counts_correct_predictions() -> None:
    workload = build_workload("mnist-cnn", preset="tiny", data="sklearn:digits")
    labels = workload.validation.batch(step=0, size=359, start=0, stop=359).targets
    expected = int((labels == 0).sum()) / 359
    oracle = Workload(
        model=_Oracle(),
        dataset=workload.dataset,
        loss=workload.loss,
        global_batch=8,
        validation=workload.validation,
        num_validation=359,
    )
    assert validation_accuracy(oracle.model, oracle, torch.device("cpu")) == expected
    without = Workload(
        model=_Oracle(), dataset=workload.dataset, loss=workload.loss, global_batch=8
    )
    assert validation_accuracy(without.model, without, torch.device("cpu")) is None
