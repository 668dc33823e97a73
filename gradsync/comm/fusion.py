"""Tensor fusion: gradients packed into flat buckets, each allreduced as soon as it is full.

Horovod's fusion buffer and DDP's gradient buckets both exist because one allreduce of a
large buffer costs far less than many small ones. Buckets are formed once, in reverse
parameter order (the order backward produces gradients), up to a size threshold. When a
bucket's last gradient is accumulated, its gradients are copied into the bucket's flat
buffer (as Horovod's MEMCPY_IN_FUSION_BUFFER) and the allreduce is launched
asynchronously, overlapping the rest of backward.

Who had a gradient travels with the gradients: each bucket ends with one flag per
parameter (1 where this rank's gradient exists). After the sum, a parameter whose flag is
0 on every rank got no gradient anywhere and keeps ``grad = None``, so the optimizer
skips it exactly as ``single``'s does (no momentum, no weight decay); one with a gradient
on some ranks only is averaged with zeros from the others, as the global batch gives.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import Work
from torch.futures import Future

from gradsync.comm.counters import CommStats
from gradsync.comm.ready import READ_AFTER_BACKWARD, ReadyOnce
from gradsync.trace import COMPUTE, NullTimeline, Phase, Timeline


@dataclass
class Bucket:
    """Parameters whose gradients travel together in one flat buffer, followed by one
    had-a-gradient flag per parameter."""

    name: str
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    buffer: Tensor
    pending: int = 0
    # The allreduce in flight: its Work, or, with the timeline on, the Future chained to it
    # that stamps the end (on CUDA a Future's wait() orders streams; Work.wait() blocks).
    work: Work | Future[None] | None = None
    queued: bool = False

    def reset(self) -> None:
        self.pending = len(self.params)
        self.work = None
        self.queued = False

    @property
    def flags(self) -> Tensor:
        """The per-parameter had-a-gradient flags at the end of the buffer."""
        return self.buffer[self.buffer.numel() - len(self.params) :]


def plan_buckets(
    params: Sequence[nn.Parameter], threshold_bytes: int, first_bucket_bytes: int | None = None
) -> list[list[int]]:
    """Indices of ``params`` grouped into buckets, last parameter first, up to ``threshold_bytes``.

    A threshold of 0 disables fusion (one bucket per parameter). ``first_bucket_bytes``
    (DDP's ``bucket_cap_mb`` for the first bucket, 1 MB there) caps the first bucket only:
    the gradients backward produces first leave early instead of waiting for a full bucket.
    A bucket holds one dtype (a float32 gradient in a float64 bucket would be widened, a
    float64 one in a float32 bucket rounded): a change of dtype starts the next bucket.

    Example:
        >>> ps = [nn.Parameter(torch.zeros(n)) for n in (10, 10, 10)]
        >>> plan_buckets(ps, threshold_bytes=80)
        [[2, 1], [0]]
        >>> plan_buckets(ps, threshold_bytes=120, first_bucket_bytes=40)
        [[2], [1, 0]]
        >>> ps[1] = nn.Parameter(torch.zeros(10, dtype=torch.float64))
        >>> plan_buckets(ps, threshold_bytes=1000)
        [[2], [1], [0]]
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for index in reversed(range(len(params))):
        size = params[index].numel() * params[index].element_size()
        cap = threshold_bytes
        if not buckets and first_bucket_bytes is not None:
            cap = min(cap, first_bucket_bytes)
        other_dtype = current and params[current[0]].dtype != params[index].dtype
        if current and (current_bytes + size > cap or other_dtype):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += size
    if current:
        buckets.append(current)
    return buckets


class FusedAllreduce:
    """Average gradients over ``group`` with fused, asynchronous allreduces.

    Call :meth:`attach` once; then every backward launches bucket allreduces as gradients
    become ready, and :meth:`finish` waits for them and writes the averaged gradients back.

    Example:
        >>> # fused = FusedAllreduce(list(model.parameters()), threshold_bytes=64 << 20,
        >>> #                        group=None, world_size=2, stats=CommStats())
        >>> # fused.attach(); loss.backward(); fused.finish(); optimizer.step()
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        *,
        names: Sequence[str] | None = None,
        timeline: Timeline | None = None,
        threshold_bytes: int,
        first_bucket_bytes: int | None = None,
        group: Any,
        world_size: int,
        stats: CommStats,
        fp16: bool = False,
    ) -> None:
        self.group = group
        self.world_size = world_size
        self.stats = stats
        self.wire_dtype = torch.float16 if fp16 else None
        self.timeline = timeline or NullTimeline()
        names = list(names) if names is not None else [f"param{i}" for i in range(len(params))]
        self.buckets: list[Bucket] = []
        self._next_launch = 0
        self._ready = ReadyOnce("allreduce", READ_AFTER_BACKWARD)
        self._slot: dict[int, tuple[Bucket, int]] = {}
        for number, indices in enumerate(plan_buckets(params, threshold_bytes, first_bucket_bytes)):
            members = [params[i] for i in indices]
            offsets, total = [], 0
            for param in members:
                offsets.append(total)
                total += param.numel()
            dtype = self.wire_dtype or members[0].dtype
            bucket = Bucket(
                f"bucket{number}",
                members,
                [names[i] for i in indices],
                offsets,
                torch.zeros(total + len(members), dtype=dtype, device=members[0].device),
            )
            bucket.reset()
            self.buckets.append(bucket)
            for position, param in enumerate(members):
                self._slot[id(param)] = (bucket, position)

    def attach(self) -> None:
        """Register a post-accumulate-grad hook on every parameter."""
        for bucket in self.buckets:
            for param in bucket.params:
                param.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, param: Tensor) -> None:
        bucket, index = self._slot[id(param)]
        self._ready.mark(bucket.names[index])
        self._queue(bucket)
        bucket.pending -= 1
        # Launch strictly in bucket order, as DDP does: every rank must issue the same
        # collectives in the same order even if gradients arrive in another order.
        while (
            self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0
        ):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _queue(self, bucket: Bucket) -> None:
        """The bucket waits for the rest of its gradients from its first one on (QUEUE)."""
        if not bucket.queued:
            bucket.queued = True
            self.timeline.begin(bucket.name, Phase.QUEUE, tensor=bucket.name)

    def _fill(self, bucket: Bucket) -> None:
        """Copy every gradient of a complete bucket into its fusion buffer (Horovod's
        MEMCPY_IN_FUSION_BUFFER); a parameter that got no gradient contributes zeros and
        a 0 flag."""
        with self.timeline.span(
            bucket.name,
            Phase.MEMCPY_IN_FUSION_BUFFER,
            tensor=bucket.name,
            bytes=bucket.buffer.numel() * bucket.buffer.element_size(),
        ):
            flags = bucket.flags
            for index, (param, start) in enumerate(zip(bucket.params, bucket.offsets, strict=True)):
                view = bucket.buffer[start : start + param.numel()]
                grad = param.grad
                flags[index] = grad is not None
                if grad is None:
                    view.zero_()
                else:
                    # Sparse gradients are densified, like Horovod's sparse_as_dense.
                    view.copy_((grad.to_dense() if grad.is_sparse else grad).reshape(-1))

    def _launch(self, bucket: Bucket) -> None:
        num_bytes = bucket.buffer.numel() * bucket.buffer.element_size()
        self.timeline.end(bucket.name, Phase.QUEUE)
        self._fill(bucket)
        self.timeline.begin(
            bucket.name,
            Phase.ALLREDUCE,
            tensor=bucket.name,
            bytes=num_bytes,
            tensors=len(bucket.params),
        )
        work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
        if self.timeline.enabled:
            # The end is stamped when the allreduce completes, not when step() waits for it.
            bucket.work = work.get_future().then(
                lambda _: self.timeline.end(bucket.name, Phase.ALLREDUCE)
            )
        else:
            bucket.work = work
        self.stats.add_allreduce(num_bytes, self.world_size)

    def _copy_out(self, bucket: Bucket) -> None:
        bucket.buffer.div_(self.world_size)
        present = bucket.flags.gt(0).tolist()
        for param, start, anywhere in zip(bucket.params, bucket.offsets, present, strict=True):
            if not anywhere:  # no rank had a gradient: the optimizer must skip it
                param.grad = None
                continue
            averaged = bucket.buffer[start : start + param.numel()].view_as(param)
            # The bucket's own slice becomes the gradient (DDP's gradient_as_bucket_view,
            # after the reduce): no copy (``to`` returns the slice itself unless fp16 compression
            # put it in another dtype). The optimizer reads it before the next backward
            # refills the bucket, and its zero_grad(set_to_none) lets autograd allocate anew.
            param.grad = averaged.to(param.dtype)

    def launch_remaining(self) -> None:
        """Launch, in bucket order, the buckets backward did not complete (parameters that
        got no gradient this step: zeros stand in). After it, every rank has issued the
        same collectives in the same order."""
        for bucket in self.buckets[self._next_launch :]:
            self._queue(bucket)
            self._launch(bucket)
        self._next_launch = len(self.buckets)

    def finish(self) -> None:
        """Wait for every bucket, average in place and make each parameter's slice of its
        bucket its ``param.grad`` (valid until the next backward refills the bucket), reset."""
        started = time.perf_counter()
        self.launch_remaining()
        self._next_launch = 0
        self._ready.reset()
        for bucket in self.buckets:
            with self.timeline.span(COMPUTE, Phase.COMM_WAIT, tensor=bucket.name):
                bucket.work.wait()
            with self.timeline.span(
                bucket.name, Phase.MEMCPY_OUT_FUSION_BUFFER, tensor=bucket.name
            ):
                self._copy_out(bucket)
            bucket.reset()
        self.stats.exposed_comm_s += time.perf_counter() - started
