"""What a parameter server spends per slice (issue 14): aggregation and optimizer apply.

For one slice (default 40,000 float32 values, p3's slice size) on one thread:

- **aggregate**: the average of the workers' gradients in fixed worker order — the old
  form (a copy of the first, then ``+=`` and ``*=``) against :func:`sum_in_order`;
- **apply**: one optimizer step — the old path (the slot's ``.grad`` set, then
  ``Updater.update_at``: ``torch.optim``'s ``step()`` and ``zero_grad()``) against
  :meth:`ShardState.apply` (:meth:`Updater.update_params_at`: torch's functional SGD/Adam
  on the slot), with the bare arithmetic of SGD with momentum as a floor;
- **batch**: SGD on ``--batch`` waiting slices at once — one call each against one
  ``foreach`` call (on CPU torch's foreach loops over the tensors in C++: the same bits, and
  the figure shows whether batching the slices a server has waiting would pay).

Each figure is the median over ``--repeats`` rounds of µs per call (the paths take turns
within a round, so a busy neighbour slows all alike). Both paths are checked to give the
same bits before timing.

    python benchmarks/server_apply.py --size 40000 --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.optim.sgd import sgd

from gradsync.comm.server import ShardState, sum_in_order
from gradsync.config import OptimConfig
from gradsync.optim import Updater

SGD_FLAGS = dict(weight_decay=1e-4, momentum=0.9, lr=0.1, dampening=0.0, nesterov=False)


def old_sum_in_order(items: Sequence[Tensor], scale: float) -> Tensor:
    """Aggregation as it was: a copy of the first, the others added, then scaled."""
    total = items[0].clone()
    for tensor in items[1:]:
        total += tensor
    total *= scale
    return total


def old_apply(state: ShardState, grad: Tensor, step: int) -> None:
    """Apply as it was: the slot's ``.grad``, then ``optimizer.step()`` via ``update_at``."""
    state.slots[0].grad = grad
    state.updater.update_at(step)


def us_per_call(run: Callable[[], object], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - started) / calls * 1e6


def compare(cases: dict[str, Callable[[], object]], *, calls: int, repeats: int) -> None:
    """Print the median µs per call of each case, the cases taking turns every round."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, run in cases.items():
            times[name].append(us_per_call(run, calls))
    for name, values in times.items():
        print(
            f"  {name:<34} {statistics.median(values):7.1f} µs  "
            f"(min {min(values):.1f}, max {max(values):.1f})"
        )


def shard(size: int, config: OptimConfig) -> ShardState:
    torch.manual_seed(0)
    return ShardState(torch.randn(size), lambda ps: Updater(ps, config, lr=config.base_lr()))


def check_same_bits(size: int, config: OptimConfig, grads: list[Tensor]) -> None:
    """Both apply paths, from the same start, end in the same bits."""
    old, new = shard(size, config), shard(size, config)
    for step, grad in enumerate(grads):
        old_apply(old, grad, step)
        new.apply(grad, step, present=[True])
    if not torch.equal(old.values, new.values):
        raise SystemExit(f"{config.name}: the fast apply differs from torch.optim's step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=40_000, help="values per slice")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="slices waiting at once")
    parser.add_argument("--calls", type=int, default=500, help="calls per timed round")
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(1)
    grads = [torch.randn(args.size) for _ in range(args.workers)]
    scale = 1.0 / args.workers
    print(f"slice of {args.size} float32 values, {args.workers} workers, 1 thread")
    timing = dict(calls=args.calls, repeats=args.repeats)

    if not torch.equal(old_sum_in_order(grads, scale), sum_in_order(grads, scale=scale)):
        raise SystemExit("sum_in_order differs from the old aggregation")
    print("aggregate:")
    compare(
        {
            "old (clone, +=, *=)": lambda: old_sum_in_order(grads, scale),
            "new sum_in_order": lambda: sum_in_order(grads, scale=scale),
        },
        **timing,
    )

    grad = grads[0]
    for config in (
        OptimConfig(name="sgd", lr=0.1, momentum=0.9, weight_decay=1e-4),
        OptimConfig(name="adam", lr=1e-3, weight_decay=1e-4),
    ):
        check_same_bits(args.size, config, grads)
        old, new = shard(args.size, config), shard(args.size, config)
        cases = {
            "old (.grad, update_at)": lambda old=old: old_apply(old, grad, 5),
            "new ShardState.apply": lambda new=new: new.apply(grad, 5, present=[True]),
        }
        if config.name == "sgd":
            values, buffer = torch.randn(args.size), torch.randn(args.size)

            def bare(v: Tensor = values, b: Tensor = buffer) -> None:
                g = grad.add(v, alpha=1e-4)
                b.mul_(0.9).add_(g)
                v.add_(b, alpha=-0.1)

            cases["bare arithmetic (floor)"] = bare
        print(f"apply, {config.name} (weight decay {config.weight_decay:g}):")
        compare(cases, **timing)
    compare_batch(args.size, args.batch, timing)


def compare_batch(size: int, batch: int, timing: dict[str, int]) -> None:
    """SGD on ``batch`` slices: a functional call each against one foreach call."""
    values = [torch.randn(size) for _ in range(batch)]
    grads = [torch.randn(size) for _ in range(batch)]
    buffers = [torch.randn(size) for _ in range(batch)]
    values += [v.clone() for v in values]  # the second half: the same start for foreach
    buffers += [b.clone() for b in buffers]
    one, many = slice(0, batch), slice(batch, 2 * batch)

    def each() -> None:
        for v, g, b in zip(values[one], grads, buffers[one], strict=True):
            sgd([v], [g], [b], foreach=False, maximize=False, **SGD_FLAGS)

    def foreach() -> None:
        sgd(values[many], grads, buffers[many], foreach=True, maximize=False, **SGD_FLAGS)

    each(), foreach()
    if not all(torch.equal(a, b) for a, b in zip(values[one], values[many], strict=True)):
        raise SystemExit("foreach SGD differs from single-tensor SGD")
    print(f"apply, sgd, {batch} slices at once (µs per call of all {batch}):")
    compare({"one call per slice": each, "one foreach call": foreach}, **timing)


if __name__ == "__main__":
    main()
