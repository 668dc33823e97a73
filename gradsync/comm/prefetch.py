"""Which rows a step's lookups will read, known before the forward runs (hybrid's prefetch).

A sparse lookup reads the rows its index tensor names, and that tensor is usually one of
the forward's inputs or built from them without touching any parameter: the token ids of
an embedding, the targets and the sampled candidates of a sampled softmax (``lstm-lm``
concatenates them). :class:`RowPredictor` learns, per table, which integer inputs feed it:
an input *feeds* a table when every value it holds was read from that table in the step
just finished. It then predicts a step's rows per table, before the forward, as the union
of the feeding inputs' values, so every table's rows can be fetched in one request.

The prediction is a guess that a caller must check: rows a lookup reads that were not
predicted (indices drawn inside the forward, a changed model path) are fetched then, and
rows predicted but not read only cost bytes. Nothing is keyed on a model: any
``nn.Embedding`` whose indices come from the inputs is predicted exactly.

Example:
    >>> predictor = RowPredictor({"emb": 10})
    >>> inputs = forward_indices((torch.tensor([[3, 1], [1, 4]]),), {"n": torch.tensor(7)})
    >>> predictor.learn({"emb": torch.tensor([1, 3, 4])}, inputs)
    >>> predictor.sources
    {'emb': ('args.0',)}
    >>> step_2 = forward_indices((torch.tensor([[2, 2]]),), {"n": torch.tensor(8)})
    >>> predictor.predict(step_2)["emb"].tolist()
    [2]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


def forward_indices(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Tensor]:
    """Every integer tensor among a forward's inputs (nested in tuples, lists and dicts
    too), by its path, as sorted unique values.

    Example:
        >>> found = forward_indices((torch.ones(2), [torch.tensor([5, 2, 5])]), {})
        >>> {path: values.tolist() for path, values in found.items()}
        {'args.1.0': [2, 5]}
    """
    found: dict[str, Tensor] = {}
    _collect("args", args, found)
    _collect("kwargs", dict(kwargs), found)
    return found


def _collect(path: str, value: Any, found: dict[str, Tensor]) -> None:
    if isinstance(value, Tensor):
        if not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool:
            found[path] = torch.unique(value.detach().reshape(-1).cpu().long())
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            _collect(f"{path}.{i}", item, found)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _collect(f"{path}.{key}", item, found)


class RowPredictor:
    """Per table (name → number of rows), the forward inputs that fed it in the last step.

    Example:
        >>> predictor = RowPredictor({"w": 100})
        >>> predictor.predict({"args.0": torch.tensor([1])})  # nothing learned yet
        {}
    """

    def __init__(self, num_rows: Mapping[str, int]) -> None:
        self.num_rows = dict(num_rows)
        self.sources: dict[str, tuple[str, ...]] = {}

    def learn(self, read: Mapping[str, Tensor], inputs: Mapping[str, Tensor]) -> None:
        """Remember, per table that the step read (``read``: its unique rows), the inputs
        (:func:`forward_indices`) whose every value was among those rows."""
        self.sources = {
            name: tuple(
                path
                for path, values in inputs.items()
                if len(values) and bool(torch.isin(values, rows).all())
            )
            for name, rows in read.items()
        }

    def predict(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Sorted unique rows per table that its feeding inputs name in this step's
        ``inputs`` (tables with no feeding input present are left out)."""
        predicted = {}
        for name, paths in self.sources.items():
            present = [inputs[p] for p in paths if p in inputs]
            if not present:
                continue
            rows = torch.unique(torch.cat(present))
            predicted[name] = rows[(rows >= 0) & (rows < self.num_rows[name])]
        return predicted


def missing_rows(rows: Tensor, fresh: Tensor | None) -> Tensor:
    """The sorted ``rows`` not in the sorted ``fresh`` (all of them when None).

    Example:
        >>> missing_rows(torch.tensor([1, 4, 6]), torch.tensor([0, 1, 6])).tolist()
        [4]
    """
    if fresh is None or not len(fresh):
        return rows
    return rows[~torch.isin(rows, fresh)]


__all__ = ["RowPredictor", "forward_indices", "missing_rows"]
