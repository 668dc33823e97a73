"""Validation accuracy of a classifier on its workload's held-out samples."""

from __future__ import annotations

import torch
from torch import nn

from gradsync.models.base import Workload

EVAL_BATCH = 500


@torch.no_grad()
def validation_accuracy(model: nn.Module, workload: Workload, device: torch.device) -> float | None:
    """Share of held-out samples whose arg-max class is the label; None without a validation set.

    Example:
        >>> from gradsync.models import build_workload
        >>> workload = build_workload("mnist-cnn", preset="tiny")
        >>> 0.0 <= validation_accuracy(workload.model, workload, torch.device("cpu")) <= 1.0
        True
    """
    if workload.validation is None or workload.num_validation == 0:
        return None
    was_training = model.training
    model.eval()
    correct = 0
    total = workload.num_validation
    for start in range(0, total, EVAL_BATCH):
        stop = min(total, start + EVAL_BATCH)
        batch = workload.validation.batch(step=0, size=total, start=start, stop=stop)
        batch = batch.to(device, torch.get_default_dtype())
        predictions = model(*batch.inputs, **batch.shared).argmax(dim=-1)
        correct += int((predictions == batch.targets).sum())
    model.train(was_training)
    return correct / total
