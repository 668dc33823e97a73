"""Small structured data between ranks as JSON bytes in tensors (never pickle).

``torch.distributed``'s object collectives (``broadcast_object_list``,
``all_gather_object``) unpickle whatever a peer sends; these helpers move JSON text and
named tensors instead, so a rank only ever decodes data.

Example:
    >>> # spec = broadcast_json({"lr": 0.1} if rank == 0 else None)   # on every rank
    >>> # nodes = all_gather_json(node_rank)                          # list, by rank
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def _to_bytes(value: Any) -> Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def _from_bytes(data: Tensor) -> Any:
    return json.loads(data.numpy().tobytes().decode())


def broadcast_json(value: Any, *, src: int = 0, group: Any = None) -> Any:
    """``value`` (JSON-serializable, given on ``src``) on every rank of ``group``."""
    is_source = dist.get_rank() == src
    data = _to_bytes(value) if is_source else torch.zeros(0, dtype=torch.uint8)
    length = torch.tensor([data.numel()], dtype=torch.int64)
    dist.broadcast(length, src=src, group=group)
    if not is_source:
        data = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(data, src=src, group=group)
    return _from_bytes(data)


def all_gather_json(value: Any, *, group: Any = None) -> list[Any]:
    """Every rank's ``value``, in rank order (each rank gives its own)."""
    data = _to_bytes(value)
    size = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([data.numel()], dtype=torch.int64), group=group)
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    return [_from_bytes(g[: int(n.item())]) for g, n in zip(gathered, lengths, strict=True)]


def broadcast_tensors(
    tensors: dict[str, Tensor] | None, *, src: int = 0, group: Any = None
) -> dict[str, Tensor]:
    """Named tensors (given on ``src``) on every rank: names, shapes and dtypes as JSON,
    then one broadcast per tensor."""
    layout = None
    if tensors is not None:
        layout = [
            [n, list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in tensors.items()
        ]
    result = {}
    for name, shape, dtype in broadcast_json(layout, src=src, group=group):
        if tensors is not None:
            tensor = tensors[name].detach().cpu().contiguous().clone()
        else:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
        dist.broadcast(tensor, src=src, group=group)
        result[name] = tensor
    return result


__all__ = ["all_gather_json", "broadcast_json", "broadcast_tensors"]
