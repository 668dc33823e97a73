"""Tensor-by-tensor comparison of checkpoints: max abs and max relative difference."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gradsync.checkpoint import Checkpoint
from gradsync.errors import UserError

FLOAT32_TOLERANCE = 1e-5  # a few float32 roundings summed over a run's steps
FLOAT64_TOLERANCE = 1e-9  # float64 rounds near 1e-16: only a real difference exceeds this
RELATIVE_FLOOR = 1e-6  # elements smaller than this in the reference are left out of max rel


@dataclass(frozen=True)
class TensorDiff:
    """How far one tensor is from its reference."""

    name: str
    max_abs: float
    max_rel: float

    def within(self, tolerance: float) -> bool:
        return self.max_abs <= tolerance


def tensor_diff(name: str, reference: torch.Tensor, other: torch.Tensor) -> TensorDiff:
    """Max |a−b|, and max |a−b|/|a| over elements with |a| ≥ 1e-6.

    Elements equal in both (a NaN in both at the same place, an infinity of the same sign)
    differ by 0; a NaN in one only makes both maxima NaN, which no tolerance accepts.

    Example:
        >>> tensor_diff("w", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
        TensorDiff(name='w', max_abs=0.5, max_rel=0.25)
        >>> nan = float("nan")
        >>> tensor_diff("w", torch.tensor([nan, 2.0]), torch.tensor([nan, 2.0]))
        TensorDiff(name='w', max_abs=0.0, max_rel=0.0)
        >>> tensor_diff("w", torch.tensor([nan, 2.0]), torch.tensor([1.0, 2.0]))
        TensorDiff(name='w', max_abs=nan, max_rel=nan)
    """
    a, b = reference.double(), other.double()
    if a.numel() == 0:
        return TensorDiff(name, 0.0, 0.0)
    same = (a == b) | (a.isnan() & b.isnan())
    diff = torch.where(same, torch.zeros_like(a), (a - b).abs())
    if diff.isnan().any():  # a NaN in one only: beyond any tolerance
        return TensorDiff(name, math.nan, math.nan)
    significant = a.abs() >= RELATIVE_FLOOR  # False for NaN: equal there, diff 0
    rel = (diff[significant] / a.abs()[significant]).max().item() if significant.any() else 0.0
    return TensorDiff(name, diff.max().item(), rel)


def diff_checkpoints(
    reference: Checkpoint, other: Checkpoint, *, include_optimizer: bool = True
) -> list[TensorDiff]:
    """Compare ``other`` with ``reference`` tensor by tensor; both must hold the same model."""
    ref_model, other_model = reference.meta.get("model"), other.meta.get("model")
    if ref_model != other_model or reference.meta.get("preset") != other.meta.get("preset"):
        raise UserError(
            f"cannot compare {other.path} ({other_model}/{other.meta.get('preset')}) with "
            f"{reference.path} ({ref_model}/{reference.meta.get('preset')}): different models; "
            "compare checkpoints of the same model and preset"
        )
    # The training state: RNG streams and lazy rows (kept for --resume) say nothing about it.
    ref = reference.state() if include_optimizer else reference.parameters()
    oth = other.state() if include_optimizer else other.parameters()
    ref_keys = {k for k in ref if not k.startswith("optim/")}
    oth_keys = {k for k in oth if not k.startswith("optim/")}
    for checkpoint, keys in ((reference, ref_keys), (other, oth_keys)):
        if not keys:  # two foreign files would compare "within tolerance" on nothing
            raise UserError(
                f"{checkpoint.path} holds no model parameters (param/… or buffer/… tensors); "
                "compare checkpoints written by gradsync train or verify"
            )
    if ref_keys != oth_keys:
        missing = sorted(ref_keys ^ oth_keys)[:3]
        raise UserError(
            f"{other.path} and {reference.path} hold different tensors (e.g. "
            f"{', '.join(missing)}); were they written by the same model options?"
        )
    diffs = []
    for name in sorted(set(ref) & set(oth)):
        if ref[name].shape != oth[name].shape:
            raise UserError(
                f"tensor {name} has shape {tuple(oth[name].shape)} in {other.path} "
                f"but {tuple(ref[name].shape)} in {reference.path}; compare checkpoints "
                "written with the same model options"
            )
        diffs.append(tensor_diff(name, ref[name], oth[name]))
    return diffs


# What makes two runs different workloads: dropout (``deterministic``), BatchNorm mode,
# threads per rank, global batch, data — and the settings of the computation itself.
RUN_SETTINGS = (
    "step",
    "deterministic",
    "batchnorm",
    "threads",
    "data",
    "dtype",
    "optimizer",
    "lr",
    "seed",
    "global_batch",
)


def setting_differences(reference: Checkpoint, other: Checkpoint) -> list[str]:
    """What makes two runs different computations besides their strategy: the settings
    recorded in their checkpoints, tensor dtypes and optimizer-state keys.

    Example:
        >>> w = torch.zeros(1)
        >>> a = Checkpoint(path="a", tensors={"param/w": w}, meta={"step": 6})
        >>> b = Checkpoint(path="b", tensors={"param/w": w.double()}, meta={"step": 12})
        >>> setting_differences(a, b)
        ['step: 6 vs 12', 'tensor dtype: torch.float32 vs torch.float64']
    """
    notes = [
        f"{key}: {reference.meta.get(key)} vs {other.meta.get(key)}"
        for key in RUN_SETTINGS
        if reference.meta.get(key) != other.meta.get(key)
    ]
    ref_types = {str(t.dtype) for t in reference.parameters().values()}
    other_types = {str(t.dtype) for t in other.parameters().values()}
    if ref_types != other_types:
        ref_text, other_text = ", ".join(sorted(ref_types)), ", ".join(sorted(other_types))
        notes.append(f"tensor dtype: {ref_text} vs {other_text}")
    ref_optim = {k for k in reference.tensors if k.startswith("optim/")}
    other_optim = {k for k in other.tensors if k.startswith("optim/")}
    if ref_optim != other_optim:
        only = sorted(ref_optim ^ other_optim)
        notes.append(f"optimizer-state keys ({', '.join(only[:3])} in one only)")
    return notes


def default_tolerance(checkpoints: list[Checkpoint]) -> float:
    """``compare``'s max |Δ| for ``checkpoints`` (a compared pair) when none is given:
    float64's when every one holds only float64 parameters, float32's otherwise (as
    ``verify`` judges each dtype).

    Example:
        >>> w = torch.zeros(1, dtype=torch.float64)
        >>> both = [Checkpoint(path=n, tensors={"param/w": w}, meta={}) for n in "ab"]
        >>> default_tolerance(both)
        1e-09
        >>> default_tolerance([both[0], Checkpoint(path="c", tensors={"param/w": w.float()},
        ...                                        meta={})])
        1e-05
    """
    floats = {
        tensor.dtype
        for checkpoint in checkpoints
        for tensor in checkpoint.parameters().values()
        if tensor.is_floating_point()
    }
    return FLOAT64_TOLERANCE if floats == {torch.float64} else FLOAT32_TOLERANCE


def _largest(values: list[float]) -> float:
    """The largest of ``values`` (0 for none), NaN if any is NaN (Python's max skips a NaN
    that is not first)."""
    return math.nan if any(math.isnan(v) for v in values) else max(values, default=0.0)


def worst(diffs: list[TensorDiff]) -> TensorDiff:
    """The largest max-abs and max-rel over all tensors (each may come from another tensor);
    NaN when any tensor's is.

    Example:
        >>> worst([TensorDiff("a", 3.0, 0.1), TensorDiff("b", 0.5, 0.9)])
        TensorDiff(name='all', max_abs=3.0, max_rel=0.9)
        >>> worst([TensorDiff("a", 3.0, 0.1), TensorDiff("b", float("nan"), 0.9)]).max_abs
        nan
    """
    return TensorDiff(
        "all", _largest([d.max_abs for d in diffs]), _largest([d.max_rel for d in diffs])
    )


__all__ = [
    "FLOAT32_TOLERANCE",
    "FLOAT64_TOLERANCE",
    "TensorDiff",
    "diff_checkpoints",
    "setting_differences",
    "tensor_diff",
    "worst",
]
