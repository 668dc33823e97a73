"""Checkpoints: one safetensors file (no pickle), written atomically, plus a JSON sidecar.

Tensor names: ``param/<name>``, ``buffer/<name>``, ``optim/<param name>/<state key>``, and
for ``--resume`` only: ``rng/worker<r>`` (every worker's RNG state; ``rng/cuda/worker<r>``
its GPU's, on GPUs) and, for ``hybrid`` with
momentum, ``lazy/<name>/…`` (the rows its servers have not caught up yet, see
:mod:`gradsync.comm.lazy`). The metadata (model, preset, strategy, workers,
step, seed, versions) lives in the safetensors header, which is authoritative: the
checkpoint is that one file, replaced by a rename. The sidecar (``<file>.json``) is a
readable copy written from the header after the rename; a sidecar that disagrees with the
header (a job killed between the two) is ignored with a warning.
"""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from gradsync import __version__
from gradsync.errors import UserError
from gradsync.files import atomic_write_bytes, atomic_write_text
from gradsync.signals import signals_deferred

PARAM, BUFFER, OPTIM = "param/", "buffer/", "optim/"
RNG, LAZY = "rng/", "lazy/"  # --resume only: RNG streams, hybrid's rows not caught up yet
WORKER_BUFFER = "worker-buffer/"  # --resume only: a buffer of worker w ≥ 1 unlike worker 0's
STATE_PREFIXES = (PARAM, BUFFER, OPTIM)  # the training state; the rest is for --resume only


@dataclass(frozen=True)
class Checkpoint:
    """Loaded tensors and metadata."""

    path: Path
    tensors: dict[str, Tensor]
    meta: dict[str, Any]

    def parameters(self) -> dict[str, Tensor]:
        """Parameters and buffers (the model state), without optimizer state."""
        return {k: v for k, v in self.tensors.items() if k.startswith((PARAM, BUFFER))}

    def state(self) -> dict[str, Tensor]:
        """Parameters, buffers and optimizer state: what two runs are compared on (not the
        RNG streams and lazy rows kept for ``--resume``, which differ between strategies)."""
        return {k: v for k, v in self.tensors.items() if k.startswith(STATE_PREFIXES)}


def model_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Tensor]:
    """Flat name → tensor map of parameters, buffers and optimizer state."""
    tensors: dict[str, Tensor] = {}
    names = {}
    for name, param in model.named_parameters():
        tensors[PARAM + name] = param.detach()
        names[param] = name
    for name, buffer in model.named_buffers():
        tensors[BUFFER + name] = buffer.detach()
    if optimizer is not None:
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, Tensor):
                    tensors[f"{OPTIM}{names[param]}/{key}"] = value.detach()
    return {k: (v.to_dense() if v.is_sparse else v).cpu().contiguous() for k, v in tensors.items()}


def load_model_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, tensors: dict[str, Tensor]
) -> None:
    """The inverse of :func:`model_state`: copy ``param/`` and ``buffer/`` tensors into
    ``model`` and the ``optim/`` state of the parameters ``optimizer`` updates into it.

    Example:
        >>> model, copy = nn.Linear(2, 1), nn.Linear(2, 1)
        >>> load_model_state(copy, None, model_state(model, None))
        >>> torch.equal(copy.weight, model.weight)
        True
    """
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[PARAM + name])
        for name, buffer in model.named_buffers():
            buffer.copy_(tensors[BUFFER + name])
    if optimizer is None:
        return
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for key, value in tensors.items():
        if key.startswith(OPTIM):
            name, _, state_key = key.removeprefix(OPTIM).rpartition("/")
            if id(params[name]) in owned:  # hybrid's sparse rows live on its servers
                optimizer.state[params[name]][state_key] = _state_on_device(
                    value, params[name], state_key
                )


def _state_on_device(value: Tensor, param: Tensor, key: str) -> Tensor:
    """A checkpoint's optimizer state as the optimizer keeps it: beside ``param`` (on its
    GPU), except Adam's step count, which torch keeps on the CPU (as its
    ``Optimizer.load_state_dict`` does)."""
    if key == "step":
        return value.clone()
    return value.to(device=param.device, copy=True)


def versions() -> dict[str, str]:
    return {
        "gradsync": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def save_checkpoint(path: Path, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
    """Write ``path`` (safetensors) and ``path.json`` atomically.

    Example:
        >>> import tempfile, torch
        >>> p = Path(tempfile.mkdtemp()) / "ckpt.safetensors"
        >>> save_checkpoint(p, {"param/w": torch.ones(2)}, {"model": "m"})
        >>> load_checkpoint(p).meta["model"]
        'm'
    """
    meta = {**meta, "versions": versions(), TENSOR_COUNTS: tensor_counts(tensors)}
    text = json.dumps(meta, indent=2, sort_keys=True)
    tensors = with_own_storage(tensors)

    def write_tensors(tmp: Path) -> None:
        save_file(tensors, str(tmp), metadata={"gradsync": text})

    with signals_deferred():  # a SIGTERM lands after both files, so they always agree
        atomic_write_bytes(path, write_tensors)
        atomic_write_text(sidecar_path(path), text + "\n")


TENSOR_COUNTS = "tensor_counts"  # in a checkpoint's metadata: what --resume checks it holds


def tensor_counts(names: Iterable[str]) -> dict[str, int]:
    """How many tensors of each kind (``param/``, ``optim/``…) a checkpoint holds.

    Example:
        >>> tensor_counts(["param/a", "param/b", "optim/a/momentum_buffer", "step"])
        {'optim/': 1, 'param/': 2, 'step': 1}
    """
    counts: dict[str, int] = {}
    for name in names:
        kind = name.split("/", 1)[0] + "/" if "/" in name else name
        counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items()))


def with_own_storage(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """``tensors``, each on a storage of its own: a copy of any that shares memory with an
    earlier one (a buffer that aliases a parameter, two parameters over one storage), which
    safetensors refuses to write.

    Example:
        >>> w = torch.ones(4)
        >>> own = with_own_storage({"param/w": w, "buffer/alias": w[:2]})
        >>> own["param/w"] is w, own["buffer/alias"].untyped_storage().data_ptr() == w.data_ptr()
        (True, False)
    """
    seen: set[int] = set()
    own = {}
    for name, tensor in tensors.items():
        storage = tensor.untyped_storage().data_ptr()
        own[name] = tensor.clone() if storage in seen and tensor.numel() else tensor
        seen.add(storage)
    return own


def sidecar_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint; a missing or corrupt file is a UserError (exit 2)."""
    path = _checkpoint_file(path)
    meta = load_checkpoint_meta(path)
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise _corrupt(path, error) from None
    return Checkpoint(path=path, tensors=tensors, meta=meta)


def tensor_layout(path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor of a checkpoint: its shape and dtype, from the header (no data read).

    Example:
        >>> import tempfile
        >>> p = Path(tempfile.mkdtemp()) / "ckpt.safetensors"
        >>> save_checkpoint(p, {"param/w": torch.ones(2, 3)}, {"step": 1})
        >>> tensor_layout(p)
        {'param/w': ((2, 3), 'float32')}
    """
    path = _checkpoint_file(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {
                name: (tuple(piece.get_shape()), _dtype_name(piece.get_dtype()))
                for name in handle.keys()  # noqa: SIM118 (safe_open is not iterable)
                for piece in [handle.get_slice(name)]
            }
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise _corrupt(path, error) from None


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_SAFETENSORS_DTYPES |= {"I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8"}
_SAFETENSORS_DTYPES |= {"U8": "uint8", "BOOL": "bool"}


def _dtype_name(code: str) -> str:
    return _SAFETENSORS_DTYPES.get(code, code)


def load_checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """A checkpoint's metadata (step, model, strategy…) from its header, no tensors read.

    The header was written with the tensors, so it wins over a possibly stale sidecar.

    Example:
        >>> import tempfile, torch
        >>> p = Path(tempfile.mkdtemp()) / "ckpt.safetensors"
        >>> save_checkpoint(p, {"param/w": torch.ones(2)}, {"step": 7})
        >>> load_checkpoint_meta(p)["step"]
        7
    """
    path = _checkpoint_file(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            header = (handle.metadata() or {}).get("gradsync")
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise _corrupt(path, error) from None
    sidecar = sidecar_path(path)
    try:
        text = header or (sidecar.read_text() if sidecar.is_file() else None)
        meta = json.loads(text) if text else {}
    except (json.JSONDecodeError, OSError) as error:
        raise UserError(
            f"checkpoint metadata of {path} is corrupt ({error}); rerun the job that wrote it"
        ) from None
    if not isinstance(meta, dict):
        raise UserError(
            f"checkpoint metadata of {path} is JSON but not an object ({type(meta).__name__}); "
            "it was not written by gradsync: rerun the job that wrote it"
        )
    if header:
        _warn_if_stale(sidecar, meta)
    return meta


def _checkpoint_file(path: str | Path) -> Path:
    """``path`` itself, or the checkpoint in run folder ``path``; UserError when absent."""
    path = Path(path)
    if path.is_dir():
        path = path / "checkpoint.safetensors"
    if not path.is_file():
        raise UserError(
            f"no checkpoint at {path}; pass a .safetensors file written by gradsync "
            "or its run folder"
        )
    return path


def _corrupt(path: Path, error: Exception) -> UserError:
    return UserError(
        f"checkpoint {path} is corrupt or not a safetensors file ({error}); "
        "rerun the job that wrote it"
    )


def _warn_if_stale(sidecar: Path, meta: dict[str, Any]) -> None:
    """A sidecar that disagrees with the header is ignored, with a warning on stderr."""
    try:
        side = json.loads(sidecar.read_text()) if sidecar.is_file() else meta
    except (json.JSONDecodeError, OSError):
        side = {}
    if side != meta:
        print(
            f"gradsync: warning: {sidecar} disagrees with its checkpoint (step "
            f"{side.get('step', '?')} vs {meta.get('step', '?')} in the header); it is stale "
            "and ignored, the checkpoint's header is authoritative",
            file=sys.stderr,
        )
