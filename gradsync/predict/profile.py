"""A model's measured compute, per layer and per variable: what the simulator replays.

``gradsync profile`` runs forward, backward and the optimizer of one worker's batch in this
process (no communication) and records, as medians over the steps after warm-up:

- per layer (a module that first uses a trainable parameter, numbered in forward order as
  P3 numbers them, :mod:`gradsync.comm.layer_order`) the offset of its forward start;
- per variable its size, its layer, and the offset from the start of backward at which its
  gradient is complete (a ``post_accumulate_grad`` hook: the moment a strategy's hook would
  see it); for a sparse variable (an ``nn.Embedding(sparse=True)`` weight) the rows it
  touches per step;
- the cost per byte of the work communication adds around the wire: the optimizer, a
  buffer copy, a server's aggregation of one contribution and its optimizer apply.

Example:
    >>> # profile = measure_profile(ProfileRequest(model="vgg16", preset="tiny", steps=5))
    >>> # Profile.load(path) == profile after profile.save(path)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import platform
import statistics
import time
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradsync.allocator import keep_step_memory
from gradsync.config import BATCHNORM_MODES, TrainConfig
from gradsync.errors import JobFailed, UserError
from gradsync.stats import percentile

FORMAT = "gradsync-profile/1"
PROFILE_BEGINS = '{\n "format": "gradsync-profile/'  # how a saved profile starts (to_json)


@dataclass(frozen=True, kw_only=True)
class VariableProfile:
    """One trainable parameter: bytes on the wire and when its gradient is ready.

    ``grad_ready_s`` is measured from the start of backward. ``rows_touched`` is the median
    number of distinct rows a sparse variable's gradient has per step (0 for dense ones);
    ``densify_s`` the median seconds of making its gradient dense (``to_dense``, a fresh
    tensor of the whole table: what ``ps``, ``p3`` and ``sparse_as_dense`` do in the
    backward hook), 0 for dense ones and in profiles taken before it was measured.

    A sparse variable's rows as strategies that send rows handle them, timed with their
    code on the profiled steps' rows (:class:`_SparseRowWork`; 0 for dense variables and
    in profiles taken before session 19): ``coalesce_s``, seconds to turn a step's gradient
    into sorted unique rows (every worker, when backward ends); per row,
    ``merge_s_per_row`` of summing two workers' rows (a node's or a server's aggregation,
    an all-gather's sum), ``apply_s_per_row`` of momentum SGD on their union (``hybrid``'s
    server, rows caught up first), and ``read_s_per_row`` of reading one worker's rows for
    its pull; ``apply_call_s`` and ``read_call_s``, the fixed seconds of one such update and
    read (a server makes one per partition it holds), left out of the per-row times.
    ``row_bins``: the share of a step's rows in each of :data:`ROW_BINS` equal ranges of
    rows, first to last (where the rows a step touches lie: a server owns ranges of rows;
    () where not measured: evenly spread).
    """

    name: str
    numel: int
    element_size: int
    layer: int
    grad_ready_s: float
    sparse: bool = False
    num_rows: int = 0
    rows_touched: float = 0.0
    densify_s: float = 0.0
    coalesce_s: float = 0.0
    merge_s_per_row: float = 0.0
    apply_s_per_row: float = 0.0
    read_s_per_row: float = 0.0
    apply_call_s: float = 0.0
    read_call_s: float = 0.0
    row_bins: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "row_bins", tuple(self.row_bins))

    @property
    def num_bytes(self) -> int:
        return self.numel * self.element_size

    def rows_share(self, start: int, stop: int) -> float:
        """The share of a step's rows that lie in rows ``[start, stop)``: from
        :attr:`row_bins`, evenly within a bin; in proportion to the range without them.

        Example:
            >>> v = VariableProfile(name="e", numel=100, element_size=4, layer=0,
            ...                     grad_ready_s=0.0, sparse=True, num_rows=100,
            ...                     row_bins=(0.5, 0.25, 0.25, 0.0))
            >>> v.rows_share(0, 50), v.rows_share(0, 10)
            (0.75, 0.2)
        """
        if not self.row_bins:
            return (stop - start) / self.num_rows

        def below(row: int) -> float:  # share of the rows under `row`
            position = row * len(self.row_bins) / self.num_rows
            whole = int(position)
            share = sum(self.row_bins[:whole])
            if whole < len(self.row_bins):
                share += (position - whole) * self.row_bins[whole]
            return share

        return below(stop) - below(start)

    @property
    def row_bytes(self) -> float:
        return self.num_bytes / self.num_rows if self.num_rows else 0.0

    @property
    def sparse_bytes(self) -> float:
        """Bytes of the rows one worker's step touches (values only)."""
        return self.rows_touched * self.row_bytes


ROW_BINS = 16  # equal row ranges of a sparse variable over which its touched rows are counted
SPARSE_TIMES = (
    "densify_s", "coalesce_s", "merge_s_per_row", "apply_s_per_row", "read_s_per_row",
    "apply_call_s", "read_call_s",
)  # fmt: skip


def _pooled_samples(profiles: Sequence[Profile], compute_s: float) -> tuple[float, ...]:
    """Every profile's compute samples, each profile's scaled to median ``compute_s``: the
    step-to-step spread of all of them, without the drift between the moments they were
    taken (which :meth:`Profile.mean` averages away)."""
    pooled: list[float] = []
    for profile in profiles:
        samples = profile.compute_samples_s
        if samples and min(samples) > 0:
            middle = statistics.median(samples)
            pooled += [s * compute_s / middle for s in samples]
    return tuple(pooled)


def _mean_bins(bins: list[tuple[float, ...]]) -> tuple[float, ...]:
    """Element-wise mean of row histograms (those measured; () if none was)."""
    measured = [b for b in bins if b]
    if not measured:
        return ()
    return tuple(sum(column) / len(measured) for column in zip(*measured, strict=True))


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    """A layer in forward order and the offset of its forward start from the step's."""

    name: str
    forward_start_s: float


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Everything :mod:`gradsync.predict.simulate` needs about one worker's step.

    Costs per byte are seconds per byte of parameters (or gradients) of the run's dtype.
    """

    model: str
    preset: str
    model_options: dict[str, str] = field(default_factory=dict)
    batch: int
    threads: int
    device: str
    dtype: str = "float32"
    concurrent: int = 1
    steps: int
    warmup: int
    forward_s: float
    backward_s: float
    optimizer_s_per_byte: float
    copy_s_per_byte: float
    aggregate_s_per_byte: float
    apply_s_per_byte: float
    # A server's fixed CPU cost per round (one chunk or slice: sum, optimizer call, answer
    # copy), on top of the per-byte costs; 0 in profiles taken before it was measured.
    server_round_s: float = 0.0
    # `Updater.update()` over the dense variables alone, as a `hybrid` worker runs it (its
    # sparse tables live on the servers); 0 for a model without sparse variables and in
    # profiles taken before session 20.
    dense_optimizer_s: float = 0.0
    layers: tuple[LayerProfile, ...]
    variables: tuple[VariableProfile, ...]
    # Channels of each BatchNorm layer, in model order: with global BatchNorm (gradsync's
    # default) each costs a blocking collective in forward and one in backward.
    batchnorm_channels: tuple[int, ...] = ()
    # Which BatchNorm the layers' times include: "global" (gradsync's layer, its own work
    # timed without peers) or "local" (torch's; every profile taken before it was recorded).
    batchnorm: str = "local"
    # Whether the model's dropout ran, as `gradsync train` runs it (not with --deterministic);
    # every profile taken before it was recorded ran without.
    dropout: bool = False
    # Forward plus backward of each step after warm-up, in step order: how one worker's
    # compute varies from step to step, which a synchronous step pays as its slowest
    # worker's (:meth:`straggler_stretch`); () in profiles taken before session 29.
    compute_samples_s: tuple[float, ...] = ()
    host: str = ""
    torch_version: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "variables", tuple(self.variables))
        object.__setattr__(self, "batchnorm_channels", tuple(self.batchnorm_channels))
        object.__setattr__(self, "compute_samples_s", tuple(self.compute_samples_s))

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    def straggler_stretch(self, workers: int) -> float:
        """How many times longer the slowest of ``workers`` workers computes than one
        worker does, in a synchronous job's median step.

        Every worker's compute is a draw from the measured :attr:`compute_samples_s`; the
        slowest of n draws is below x with probability F(x)^n, so the median step's
        slowest is the ``0.5 ** (1 / n)`` quantile (the median for one worker; nearer the
        slowest measured step as n grows, never beyond it). 1.0 without samples.

        Example:
            >>> p = Profile(model="m", preset="p", batch=1, threads=1, device="cpu", steps=5,
            ...             warmup=1, forward_s=1.0, backward_s=1.0, optimizer_s_per_byte=0,
            ...             copy_s_per_byte=0, aggregate_s_per_byte=0, apply_s_per_byte=0,
            ...             layers=(), variables=(), compute_samples_s=(1.0, 2.0, 3.0))
            >>> [round(p.straggler_stretch(n), 3) for n in (1, 2, 10**6)]
            [1.0, 1.207, 1.5]
        """
        samples = self.compute_samples_s
        if workers <= 1 or not samples or min(samples) <= 0:
            return 1.0
        return percentile(samples, 100 * 0.5 ** (1 / workers)) / percentile(samples, 50)

    @property
    def dense_variables(self) -> tuple[VariableProfile, ...]:
        return tuple(v for v in self.variables if not v.sparse)

    @property
    def sparse_variables(self) -> tuple[VariableProfile, ...]:
        return tuple(v for v in self.variables if v.sparse)

    @property
    def num_bytes(self) -> int:
        return sum(v.num_bytes for v in self.variables)

    def with_compute_speedup(self, factor: float) -> Profile:
        """The profile of a device ``factor`` times faster at the workers' work (forward,
        backward, optimizer, buffer copies); the servers' work is left as measured.

        Example:
            >>> # gpu_like = cpu_profile.with_compute_speedup(50)
        """
        factor = check_compute_speedup(factor, "--compute-speedup")
        return dataclasses.replace(
            self,
            forward_s=self.forward_s / factor,
            backward_s=self.backward_s / factor,
            optimizer_s_per_byte=self.optimizer_s_per_byte / factor,
            dense_optimizer_s=self.dense_optimizer_s / factor,
            copy_s_per_byte=self.copy_s_per_byte / factor,
            layers=tuple(
                dataclasses.replace(layer, forward_start_s=layer.forward_start_s / factor)
                for layer in self.layers
            ),
            variables=tuple(
                dataclasses.replace(v, grad_ready_s=v.grad_ready_s / factor) for v in self.variables
            ),
            compute_samples_s=tuple(s / factor for s in self.compute_samples_s),
        )

    def averaged_with(self, other: Profile) -> Profile:
        """The mean of this profile and ``other``, a profile of the same model at the same
        batch taken at another moment: every measured time halfway between the two.
        Profiles taken just before and just after a measured run bracket it, so a machine
        whose speed drifts during the run is seen as it was on average.

        Example:
            >>> # before.averaged_with(after).forward_s == (before.forward_s + after.forward_s) / 2
        """
        return Profile.mean([self, other])

    @staticmethod
    def mean(profiles: Sequence[Profile]) -> Profile:
        """The mean of ``profiles`` (at least one), profiles of the same model at the same
        batch taken at different moments: every measured time averaged, everything else
        the first's.

        Example:
            >>> # Profile.mean([a, b, c]).forward_s == (a.forward_s + b.forward_s + c.forward_s) / 3
        """
        first = profiles[0]
        names = [(v.name, v.numel) for v in first.variables]
        for other in profiles[1:]:
            if [(v.name, v.numel) for v in other.variables] != names or len(other.layers) != len(
                first.layers
            ):
                raise UserError(
                    f"cannot average profiles of different models ({first.model}, {other.model})"
                )

        def average(values: Iterable[float]) -> float:
            numbers = list(values)
            return sum(numbers) / len(numbers)

        times = {
            key: average(getattr(p, key) for p in profiles)
            for key in (
                "forward_s", "backward_s", "optimizer_s_per_byte", "copy_s_per_byte",
                "aggregate_s_per_byte", "apply_s_per_byte", "server_round_s",
                "dense_optimizer_s",
            )
        }  # fmt: skip
        layers = tuple(
            dataclasses.replace(
                layer, forward_start_s=average(p.layers[i].forward_start_s for p in profiles)
            )
            for i, layer in enumerate(first.layers)
        )
        variables = tuple(
            dataclasses.replace(
                variable,
                grad_ready_s=average(p.variables[i].grad_ready_s for p in profiles),
                rows_touched=average(p.variables[i].rows_touched for p in profiles),
                **{
                    key: average(getattr(p.variables[i], key) for p in profiles)
                    for key in SPARSE_TIMES
                },
                row_bins=_mean_bins([p.variables[i].row_bins for p in profiles]),
            )
            for i, variable in enumerate(first.variables)
        )
        samples = _pooled_samples(profiles, times["forward_s"] + times["backward_s"])
        return dataclasses.replace(
            first, layers=layers, variables=variables, compute_samples_s=samples, **times
        )

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **dataclasses.asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str, *, source: str = "profile") -> Profile:
        """Parse a profile; a malformed one is a UserError naming ``source``, the field and
        how to take the profile again (see :func:`check_profile_fields`)."""
        try:
            raw = json.loads(text)
        except ValueError as error:
            raise UserError(f"{source} is not a gradsync profile ({error}); {_RETAKE}") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise UserError(f"{source} is not a gradsync profile (not a {FORMAT} file); {_RETAKE}")
        check_profile_fields(raw, source)
        fields = {key: value for key, value in raw.items() if key != "format"}
        try:
            fields["layers"] = tuple(LayerProfile(**layer) for layer in raw["layers"])
            fields["variables"] = tuple(VariableProfile(**v) for v in raw["variables"])
            return cls(**fields)
        except TypeError as error:  # a missing or unknown field
            raise UserError(f"{source} is not a gradsync profile ({error}); {_RETAKE}") from None

    def save(self, path: Path) -> None:
        from gradsync.files import atomic_write_text

        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read ``path``; a missing, unreadable or malformed file is a UserError (exit 2)."""
        path = Path(path)
        if path.is_dir():
            raise UserError(f"--profile {path} is a folder; name the profile file in it")
        if not path.is_file():
            raise UserError(f"--profile {path} does not exist; {_RETAKE}")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise UserError(f"{path} is not a gradsync profile ({error}); {_RETAKE}") from None
        return cls.from_json(text, source=str(path))


_RETAKE = "take it (again) with `gradsync profile --model M --out PROFILE.json`"
# Fields a measured profile always has at 1 or more; every other number may be 0.
_AT_LEAST_ONE = {"batch", "threads", "concurrent", "steps", "element_size"}
# Times the simulator divides by: a measured step always has some forward and backward.
_ABOVE_ZERO = {"forward_s", "backward_s"}


def check_profile_fields(raw: dict[str, Any], source: str) -> None:
    """UserError, one line naming ``source`` and the field, unless every field of the
    profile ``raw`` (as JSON) has the type its dataclass declares, every number is finite
    and at least 0 (``batch``, ``threads`` ... at least 1, forward and backward above 0),
    and it has the layers and variables the simulator replays (each variable in a layer).

    Example:
        >>> check_profile_fields({"batch": 0}, "p.json")
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: p.json: batch = 0 is not a whole number ≥ 1; take it (again) ...
    """
    _check_fields(raw, Profile, source, prefix="")
    for key in ("layers", "variables"):
        if not isinstance(raw.get(key), list) or not raw[key]:
            _refuse(source, key, raw.get(key), "a non-empty list")
    for key, kind in (("layers", LayerProfile), ("variables", VariableProfile)):
        for index, entry in enumerate(raw[key]):
            if not isinstance(entry, dict):
                _refuse(source, f"{key}[{index}]", entry, "an object")
            _check_fields(entry, kind, source, prefix=f"{key}[{index}].")
    layers = len(raw["layers"])
    for index, variable in enumerate(raw["variables"]):
        if variable.get("layer", 0) >= layers:
            where = f"the index of one of its {layers} layers (0 to {layers - 1})"
            _refuse(source, f"variables[{index}].layer", variable["layer"], where)
        if variable.get("sparse") and not variable.get("num_rows"):
            _refuse(source, f"variables[{index}].num_rows", 0, "≥ 1 for a sparse variable")
    _check_values(raw, source)
    _check_within_step(raw, source)


# Values a profile's fields take: what `gradsync profile` and the simulator know.
KNOWN_VALUES: dict[str, tuple[Any, ...]] = {
    "device": ("cpu", "cuda"),
    "dtype": ("float16", "bfloat16", "float32", "float64"),
    "batchnorm": BATCHNORM_MODES,
}
ELEMENT_SIZES = (1, 2, 4, 8)  # bytes of a tensor element torch has


def _check_values(raw: dict[str, Any], source: str) -> None:
    """Each of :data:`KNOWN_VALUES` one it lists, every element size one of
    :data:`ELEMENT_SIZES`, and each variable's name given once."""
    for key, known in KNOWN_VALUES.items():
        if key in raw and raw[key] not in known:
            _refuse(source, key, raw[key], f"one of {', '.join(map(str, known))}")
    names: set[str] = set()
    for index, variable in enumerate(raw["variables"]):
        size = variable.get("element_size", ELEMENT_SIZES[0])  # a missing one: refused later
        if size not in ELEMENT_SIZES:
            _refuse(source, f"variables[{index}].element_size", size, "1, 2, 4 or 8 bytes")
        if variable.get("name") in names:
            _refuse(source, f"variables[{index}].name", variable["name"], "a name given once")
        names.add(variable.get("name"))


def _check_within_step(raw: dict[str, Any], source: str) -> None:
    """Each layer starts within forward, each gradient is ready within backward and a
    sparse variable touches at most its rows."""
    for index, layer in enumerate(raw["layers"]):
        if layer.get("forward_start_s", 0.0) > raw.get("forward_s", math.inf):
            where = f"within forward_s ({raw['forward_s']} s)"
            _refuse(source, f"layers[{index}].forward_start_s", layer["forward_start_s"], where)
    for index, variable in enumerate(raw["variables"]):
        if variable.get("grad_ready_s", 0.0) > raw.get("backward_s", math.inf):
            where = f"within backward_s ({raw['backward_s']} s)"
            _refuse(source, f"variables[{index}].grad_ready_s", variable["grad_ready_s"], where)
        if variable.get("rows_touched", 0.0) > variable.get("num_rows", 0):
            where = f"at most num_rows ({variable.get('num_rows', 0)})"
            _refuse(source, f"variables[{index}].rows_touched", variable["rows_touched"], where)


def _check_fields(raw: dict[str, Any], kind: type, source: str, *, prefix: str) -> None:
    """Each field of ``kind`` present in ``raw`` has its declared type (and range)."""
    hints = _type_hints(kind)
    for name, value in raw.items():
        hint = hints.get(name)
        if hint is None or name in ("layers", "variables"):
            continue  # an unknown field is refused when the dataclass is built
        expected = _type_problem(name, value, hint)
        if expected:
            _refuse(source, prefix + name, value, expected)


@functools.cache
def _type_hints(kind: type) -> Mapping[str, Any]:
    """``kind``'s field types, resolved once: resolving them evaluates every annotation
    (they are strings here), and a profile checks one entry per layer and variable.
    Read-only, as every caller shares it."""
    return types.MappingProxyType(typing.get_type_hints(kind))


def _type_problem(name: str, value: Any, hint: Any) -> str | None:
    """What ``value`` of field ``name`` (declared ``hint``) should be, or None if it is."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is float:
        least = "above 0" if name in _ABOVE_ZERO else "≥ 0"
        number = _is_number(value) and math.isfinite(value)
        fits = number and (value > 0 if name in _ABOVE_ZERO else value >= 0)
        return None if fits else f"a finite number {least}"
    if hint is int:
        least = 1 if name in _AT_LEAST_ONE else 0
        fits = isinstance(value, int) and not isinstance(value, bool) and value >= least
        return None if fits else f"a whole number ≥ {least}"
    if hint in (str, bool):
        return None if isinstance(value, hint) else f"a {hint.__name__}"
    if origin is tuple:  # tuple[int, ...] / tuple[float, ...], stored as a JSON list
        fits = isinstance(value, list) and not any(_type_problem(name, v, args[0]) for v in value)
        return None if fits else f"a list of {args[0].__name__} values ≥ 0"
    if origin is dict:
        fits = isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
        return None if fits else "an object of strings"
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _refuse(source: str, field_name: str, value: Any, expected: str) -> typing.NoReturn:
    raise UserError(
        f"{source}: {field_name} = {json.dumps(value)[:40]} is not {expected}; {_RETAKE}"
    )


def check_compute_speedup(value: Any, where: str) -> float:
    """``value`` as a speed-up factor: a finite number above 0, else a one-line UserError
    naming ``where`` (the flag, or the file and key).

    Example:
        >>> check_compute_speedup(100, "--compute-speedup")
        100.0
        >>> check_compute_speedup(float("inf"), "--compute-speedup")
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: --compute-speedup must be a finite number above 0 ...
    """
    if not (_is_number(value) and math.isfinite(value) and value > 0):
        raise UserError(
            f"{where} must be a finite number above 0 (how many times faster the workers "
            f"compute), got {value!r}; e.g. 100"
        )
    return float(value)


@dataclass(frozen=True, kw_only=True)
class ProfileRequest:
    """What to measure: a model (as ``gradsync train`` names it) and a per-worker batch."""

    model: str
    preset: str = "default"
    model_options: dict[str, str] = field(default_factory=dict)
    batch: int | None = None
    workers: int = 1
    steps: int = 10
    warmup: int = 3
    threads: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    optimizer: str = "sgd"
    seed: int = 0
    concurrent: int = 1
    batchnorm: str = TrainConfig.batchnorm
    dropout: bool = not TrainConfig.deterministic  # as `gradsync train` runs the model

    def check(self) -> None:
        if self.batchnorm not in BATCHNORM_MODES:
            raise UserError(
                f"unknown --batchnorm {self.batchnorm!r}; choose {' or '.join(BATCHNORM_MODES)}"
            )
        if self.concurrent < 1:
            raise UserError(f"--concurrent must be a positive integer, got {self.concurrent}")
        if self.warmup < 0:
            raise UserError(f"--warmup must be >= 0 steps, got {self.warmup}")
        if self.steps <= self.warmup:
            raise UserError(
                f"--steps {self.steps} leaves nothing after {self.warmup} warm-up steps; "
                f"use --steps {self.warmup + 5} or more"
            )
        if self.batch is not None and self.batch < 1:
            raise UserError(f"--batch must be a positive number of samples, got {self.batch}")


def measure_profile(request: ProfileRequest) -> Profile:
    """Run ``request.steps`` single-worker steps of the model and return their profile.

    The batch is ``request.batch`` samples, or the preset's global batch split over
    ``request.workers`` (the shard one worker of a ``--workers N`` run computes). With
    ``concurrent`` k > 1, k − 1 sibling processes compute the same steps meanwhile, so the
    profile sees the cores shared as k ranks of one machine share them.
    """
    request.check()
    _check_shard(request)
    with _Siblings(request), _solo_group():
        return _measure(request)


def _check_shard(request: ProfileRequest) -> None:
    """UserError when the preset's global batch does not split over ``--workers``, as
    ``gradsync train`` refuses it (the profile would time a shard no run computes)."""
    if request.batch is not None or request.workers == 1:
        return
    from gradsync.models import build_workload

    batch = build_workload(
        request.model, preset=request.preset, options=request.model_options
    ).global_batch
    if batch % request.workers:
        raise UserError(
            f"the global batch of {request.model} ({request.preset}), {batch}, does not divide "
            f"by --workers {request.workers}; pass --batch N (samples per worker) or --workers "
            f"that divides {batch}"
        )


SIBLING_START_S = 120  # a spawned sibling imports torch and builds its model


class _Siblings:
    """``request.concurrent - 1`` processes running the profiled steps until the exit.

    A sibling that dies before the profile ends (or never starts) fails it: a profile that
    says ``concurrent`` k was taken with fewer ranks computing would be silently wrong.
    """

    def __init__(self, request: ProfileRequest) -> None:
        import multiprocessing

        # spawn, not fork: once a process has run backward on a CUDA build of torch (a
        # validation's earlier profile), its autograd engine has threads, and a forked child
        # cannot run backward at all (seen on a 16-core GPU machine, session 25).
        context = multiprocessing.get_context("spawn")
        self.concurrent = request.concurrent
        self.stop = context.Event()
        self.ready = context.Semaphore(0)
        self.processes = [
            context.Process(target=_sibling, args=(request, self.stop, self.ready), daemon=True)
            for _ in range(request.concurrent - 1)
        ]

    def __enter__(self) -> _Siblings:
        for process in self.processes:
            process.start()
        deadline = time.monotonic() + SIBLING_START_S
        for _ in self.processes:  # each has built its model and started computing
            while not self.ready.acquire(timeout=0.2):
                if code := next((p.exitcode for p in self.processes if not p.is_alive()), None):
                    self._end()
                    raise JobFailed(self._failure(f"ended before it computed (exit code {code})"))
                if time.monotonic() > deadline:
                    self._end()
                    raise JobFailed(self._failure(f"did not start within {SIBLING_START_S} s"))
        return self

    def __exit__(self, exc_type: object, *_exc: object) -> None:
        codes = self._end()
        if exc_type is None and (code := next((c for c in codes if c != 0), None)) is not None:
            raise JobFailed(self._failure(f"ended early (exit code {code})"))

    def _end(self) -> list[int]:
        """Stop the siblings; the exit codes of those that ended by themselves (a stopped
        sibling's is 0; one still computing after 30 s is killed and not counted)."""
        self.stop.set()
        codes = []
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
            elif process.exitcode is not None:
                codes.append(process.exitcode)
        return codes

    def _failure(self, what: str) -> str:
        return (
            f"profile --concurrent {self.concurrent}: a sibling process {what}, so the cores "
            "were not shared as asked; its error, if any, is printed above"
        )


def _sibling(request: ProfileRequest, stop: Any, ready: Any) -> None:
    """A sibling: forward, backward and update of the same batch until told to stop. A
    signal ends it quietly (the parent, which says why it stopped, handles its own)."""
    import signal

    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, signal.SIG_DFL)
    with _solo_group():
        _sibling_steps(request, stop, ready)


def _sibling_steps(request: ProfileRequest, stop: Any, ready: Any) -> None:
    import torch

    from gradsync.config import OptimConfig
    from gradsync.models import build_workload
    from gradsync.optim import Updater

    keep_step_memory()  # as a training rank's process does
    torch.set_num_threads(request.threads)
    torch.set_default_dtype(getattr(torch, request.dtype))
    workload = build_workload(
        request.model,
        preset=request.preset,
        dropout=request.dropout,
        options=request.model_options,
    )
    _use_batchnorm(workload.model, request.batchnorm)
    batch = request.batch or max(1, workload.global_batch // request.workers)
    # The profiled worker's optimizer, momentum and all: a sibling works as hard as it does.
    updater = Updater(workload.model.parameters(), OptimConfig(name=request.optimizer), lr=1e-3)  # type: ignore[arg-type]
    parent = os.getppid()
    ready.release()
    step = 0
    while not stop.is_set() and os.getppid() == parent:  # ends with its parent, killed or not
        data = workload.dataset.batch(step=step, size=batch, start=0, stop=batch)
        workload.loss(workload.model(*data.inputs, **data.shared), data.targets).backward()
        updater.update()
        step += 1


def _measure(request: ProfileRequest) -> Profile:
    import torch

    from gradsync.comm.layer_order import LayerOrder
    from gradsync.config import OptimConfig
    from gradsync.models import build_workload
    from gradsync.optim import Updater
    from gradsync.probe import sparse_lookup_weights

    if request.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible; profile on cpu")
    keep_step_memory()  # as a training rank's process does
    torch.set_num_threads(request.threads)
    dtype = getattr(torch, request.dtype)
    torch.set_default_dtype(dtype)
    device = torch.device(request.device)
    workload = build_workload(
        request.model,
        preset=request.preset,
        seed=request.seed,
        dropout=request.dropout,
        options=request.model_options,
    )
    batch = request.batch or max(1, workload.global_batch // request.workers)
    model = workload.model.to(device)
    channels = _use_batchnorm(model, request.batchnorm)
    model.train()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    config = OptimConfig(name=request.optimizer)  # type: ignore[arg-type]
    updater = Updater(params.values(), config, lr=1e-3)
    sparse = sparse_lookup_weights(model)
    dense = {n: p for n, p in params.items() if n not in sparse} if sparse else {}
    dense_updater = Updater(dense.values(), config, lr=1e-3) if dense else None
    clock = _StepClock(params, device)
    server = _SparseRowWork(config.momentum)
    order = LayerOrder(model)
    for step in range(request.steps):
        data = workload.dataset.batch(step=step, size=batch, start=0, stop=batch)
        data = data.to(device, dtype)
        clock.begin_forward()
        output = model(*data.inputs, **data.shared)
        loss = workload.loss(output, data.targets)
        clock.begin_backward()
        loss.backward()
        clock.end_backward()
        if step == 0:
            layers = order.finish()
            clock.watch_layers(layers.modules)
        clock.measure_sparse_gradients(params, server)
        grads = {n: p.grad.clone() for n, p in dense.items() if p.grad is not None}
        clock.time(lambda: updater.update(), "optimizer")
        if dense_updater is not None:  # the same gradients, stepped as hybrid's worker does
            for name, grad in grads.items():
                dense[name].grad = grad
            clock.time(lambda: dense_updater.update(), "optimizer:dense")
        clock.settle()
    profile = _assemble(request, batch, clock, layers, params, sparse)
    return dataclasses.replace(
        profile,
        batchnorm_channels=channels,
        batchnorm=request.batchnorm,
        dropout=request.dropout,
    )


def _use_batchnorm(model: Any, batchnorm: str) -> tuple[int, ...]:
    """Make ``model``'s BatchNorm layers those a multi-worker ``--batchnorm`` run trains
    with; return their channels in model order.

    Global BatchNorm does its own work (moments, normalization, gradient sums) in a
    process group of this process alone (:func:`_solo_group`), so nothing is gathered:
    ``predict`` adds the collectives among the workers of the cluster it simulates.
    """
    from torch.nn.modules.batchnorm import _BatchNorm

    from gradsync.comm.batchnorm import convert_batchnorm

    channels = tuple(m.num_features for m in model.modules() if isinstance(m, _BatchNorm))
    if channels and batchnorm == "global":
        convert_batchnorm(model, group=None)
    return channels


@contextlib.contextmanager
def _solo_group() -> Iterator[None]:
    """A default process group of this process alone while the profile runs."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise UserError("gradsync profile runs outside a distributed job; start it alone")
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _StepClock:
    """Timestamps of one worker's steps: layer starts, gradient-ready times, phases.

    On the CPU a timestamp is ``time.perf_counter()``. On a GPU it is a CUDA event recorded
    on the stream, read when the step is over (:meth:`settle`): the host never waits inside
    the step, so a model whose kernels are short is timed as it runs, not at one
    synchronization per layer.
    """

    def __init__(self, params: dict[str, Any], device: Any) -> None:
        self.device = device
        self.samples: dict[str, list[float]] = {}
        self._on_gpu = device.type == "cuda"
        self._pending: list[tuple[str, Any, Any]] = []  # (key, start event, end event)
        self._params = params
        self._forward_start: Any = 0.0
        self._backward_start: Any = 0.0
        self._layer_modules: list[Any] = []
        for name, param in params.items():
            param.register_post_accumulate_grad_hook(
                lambda _p, name=name: self._mark(f"grad:{name}", self._backward_start)
            )

    def _now(self) -> Any:
        if self._on_gpu:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _span(self, key: str, start: Any, end: Any) -> None:
        if self._on_gpu:
            self._pending.append((key, start, end))
        else:
            self.record(key, end - start)

    def _mark(self, key: str, origin: Any) -> None:
        self._span(key, origin, self._now())

    def settle(self) -> None:
        """Record the step's GPU timestamps (waits for the step's kernels to end)."""
        if not self._pending:
            return
        import torch

        torch.cuda.synchronize(self.device)
        for key, start, end in self._pending:
            self.record(key, start.elapsed_time(end) / 1e3)
        self._pending.clear()

    def watch_layers(self, modules: list[Any]) -> None:
        for index, module in enumerate(modules):
            module.register_forward_pre_hook(
                lambda *_a, index=index: self._mark(f"layer:{index}", self._forward_start)
            )

    def begin_forward(self) -> None:
        self._forward_start = self._now()

    def begin_backward(self) -> None:
        self._backward_start = self._now()
        self._span("forward", self._forward_start, self._backward_start)

    def end_backward(self) -> None:
        self._mark("backward", self._backward_start)

    def measure_sparse_gradients(self, params: dict[str, Any], server: _SparseRowWork) -> None:
        """Rows each sparse gradient touches, how long making it dense takes, and what
        ``hybrid``'s server does with them (``server``)."""
        from gradsync.comm.sparse import coalesce_rows

        for name, param in params.items():
            if param.grad is not None and param.grad.is_sparse:
                started = time.perf_counter()
                rows = coalesce_rows(param.grad, param.shape[0])  # sorted unique rows
                self.record(f"coalesce:{name}", time.perf_counter() - started)
                self.record(f"rows:{name}", float(len(rows[0])))
                self.time(param.grad.to_dense, f"densify:{name}")
                server.measure(name, param, rows, self)

    def record(self, key: str, value: float) -> None:
        self.samples.setdefault(key, []).append(value)

    def time(self, work: Callable[[], None], key: str) -> None:
        started = self._now()
        work()
        self._mark(key, started)

    def kept(self, key: str, warmup: int) -> list[float]:
        """``key``'s samples after ``warmup`` steps (all of them if no more were taken)."""
        values = self.samples.get(key, [])
        return values[warmup:] or values

    def median(self, key: str, warmup: int) -> float:
        kept = self.kept(key, warmup)
        return statistics.median(kept) if kept else 0.0


class _SparseRowWork:
    """What strategies that send rows do with each sparse variable's gradient, timed on the
    profiled steps' rows with their code (:mod:`gradsync.comm.sparse`,
    :mod:`gradsync.comm.lazy`).

    Per step and variable, given its gradient coalesced into rows (timed by the caller as
    ``coalesce:``): where the rows lie (``bin<i>:``); then, in a ``hybrid`` server's
    order, this step's rows read (``read:``, a pull: rows not updated last step are caught
    up first), the rows of this step and of the step before (standing in for a second
    worker's) summed (``merge:``), and their union applied under momentum SGD to a copy of
    the table (``apply:``); these three in seconds per row, the
    read and the update less a call's fixed cost (``read-call:``, ``apply-call:``: one row
    on a scratch table), which a server pays once per partition it holds.

    Example:
        >>> # work = _SparseRowWork(momentum=0.9); work.measure(name, param, rows, clock)
    """

    def __init__(self, momentum: float) -> None:
        self.momentum = momentum
        self.tables: dict[str, Any] = {}
        self.previous: dict[str, Any] = {}
        self.scratch: dict[str, Any] = {}

    def measure(self, name: str, param: Any, mine: Any, clock: _StepClock) -> None:
        """Time the server's work on ``mine``, this step's coalesced (rows, values) of
        ``param``, and record where the rows lie. On the CPU whatever the profiled device:
        servers are CPU processes."""
        import torch

        from gradsync.comm.lazy import LazyMomentumRows

        num_rows = param.shape[0]
        mine = tuple(part.cpu() for part in mine)
        if name not in self.tables:
            values = param.detach().reshape(num_rows, -1).cpu().clone()
            self.tables[name] = LazyMomentumRows(values, momentum=self.momentum)
        bins = torch.bincount(mine[0] * ROW_BINS // num_rows, minlength=ROW_BINS)
        for i, share in enumerate((bins / max(1, len(mine[0]))).tolist()):
            clock.record(f"bin{i}:{name}", share)
        other = self.previous.get(name, mine)
        self.previous[name] = mine
        self._time_server(name, mine, other, clock)

    def _time_server(self, name: str, mine: Any, other: Any, clock: _StepClock) -> None:
        """A server's round on ``mine`` (this step's rows) and ``other`` (a second
        worker's): read, sum, update; per row, less a call's fixed cost."""
        from gradsync.comm.sparse import sum_rows

        table = self.tables[name]
        started = time.perf_counter()
        table.read(mine[0])  # the pull of this step comes before its update
        read = time.perf_counter()
        rows, grad = sum_rows([mine, other], len(table.values))
        merged = time.perf_counter()
        table.apply(rows, grad, lr=1e-3)
        applied = time.perf_counter()
        read_call, apply_call = self._call_costs(name, table.values.shape[1])
        clock.record(f"read-call:{name}", read_call)
        clock.record(f"apply-call:{name}", apply_call)
        clock.record(f"read:{name}", max(0.0, read - started - read_call) / max(1, len(mine[0])))
        clock.record(f"merge:{name}", (merged - read) / max(1, len(mine[0]) + len(other[0])))
        clock.record(f"apply:{name}", max(0.0, applied - merged - apply_call) / max(1, len(rows)))

    def _call_costs(self, name: str, width: int) -> tuple[float, float]:
        """Seconds of a read and of an update of one row behind (a call's fixed cost: a
        server runs one per partition it holds), on a small scratch table as wide."""
        import torch

        from gradsync.comm.lazy import LazyMomentumRows

        scratch = self.scratch.setdefault(
            name, LazyMomentumRows(torch.zeros(2, width), momentum=self.momentum)
        )
        row = torch.tensor([scratch.count % 2])  # last updated two steps ago: behind
        started = time.perf_counter()
        scratch.read(row)
        read = time.perf_counter()
        scratch.apply(row, torch.ones(1, width), lr=1e-3)
        return read - started, time.perf_counter() - read


def _assemble(
    request: ProfileRequest,
    batch: int,
    clock: _StepClock,
    layers: Any,
    params: dict[str, Any],
    sparse: set[str],
) -> Profile:
    import torch

    warmup = request.warmup
    # Layer hooks exist from step 1 on: their first sample is step 1's.
    layer_warmup = max(0, warmup - 1)
    total_bytes = sum(p.numel() * p.element_size() for p in params.values())
    variables = [
        VariableProfile(
            name=name,
            numel=param.numel(),
            element_size=param.element_size(),
            layer=layers.layer_of[name],
            grad_ready_s=clock.median(f"grad:{name}", warmup),
            sparse=name in sparse,
            num_rows=param.shape[0] if name in sparse else 0,
            rows_touched=clock.median(f"rows:{name}", warmup) if name in sparse else 0.0,
            densify_s=clock.median(f"densify:{name}", warmup) if name in sparse else 0.0,
            coalesce_s=clock.median(f"coalesce:{name}", warmup),
            merge_s_per_row=clock.median(f"merge:{name}", warmup),
            apply_s_per_row=clock.median(f"apply:{name}", warmup),
            read_s_per_row=clock.median(f"read:{name}", warmup),
            apply_call_s=clock.median(f"apply-call:{name}", warmup),
            read_call_s=clock.median(f"read-call:{name}", warmup),
            row_bins=_row_bins(clock, name, warmup) if name in sparse else (),
        )
        for name, param in params.items()
    ]
    copy, aggregate, apply = _byte_costs(min(total_bytes, 64 << 20), request)
    return Profile(
        model=request.model,
        preset=request.preset,
        model_options=dict(request.model_options),
        batch=batch,
        threads=request.threads,
        device=request.device,
        dtype=request.dtype,
        concurrent=request.concurrent,
        steps=request.steps,
        warmup=warmup,
        forward_s=clock.median("forward", warmup),
        backward_s=clock.median("backward", warmup),
        optimizer_s_per_byte=clock.median("optimizer", warmup) / max(1, total_bytes),
        dense_optimizer_s=clock.median("optimizer:dense", warmup),
        copy_s_per_byte=copy,
        aggregate_s_per_byte=aggregate,
        apply_s_per_byte=apply,
        server_round_s=_server_round_s(request),
        layers=tuple(
            LayerProfile(name=name, forward_start_s=clock.median(f"layer:{i}", layer_warmup))
            for i, name in enumerate(layers.names)
        ),
        variables=tuple(variables),
        compute_samples_s=_compute_samples(clock, warmup),
        host=platform.node(),
        torch_version=torch.__version__,
    )


def _compute_samples(clock: _StepClock, warmup: int) -> tuple[float, ...]:
    """Forward plus backward of each step after ``warmup``, in step order."""
    pairs = zip(clock.kept("forward", warmup), clock.kept("backward", warmup), strict=True)
    return tuple(forward + backward for forward, backward in pairs)


def _row_bins(clock: _StepClock, name: str, warmup: int) -> tuple[float, ...]:
    """The median share of a step's rows in each of :data:`ROW_BINS` equal row ranges of
    ``name``, normalized to sum to 1 (() where no step had rows)."""
    medians = [clock.median(f"bin{i}:{name}", warmup) for i in range(ROW_BINS)]
    total = sum(medians)
    return tuple(m / total for m in medians) if total else ()


def _byte_costs(num_bytes: int, request: ProfileRequest) -> tuple[float, float, float]:
    """Seconds per byte of a worker's buffer copy (on the profiled device), of adding one
    worker's contribution to a sum (a server's aggregation) and of the optimizer's apply on
    a flat shard (a server's).

    Server work is timed on the CPU whatever the device: gradsync's servers are CPU
    processes, as TensorFlow's parameter servers and BytePS's servers are beside GPU workers.
    """
    import torch

    from gradsync.config import OptimConfig
    from gradsync.optim import Updater

    worker, server = torch.device(request.device), torch.device("cpu")
    numel = max(
        1, num_bytes // torch.tensor([], dtype=getattr(torch, request.dtype)).element_size()
    )
    source = torch.randn(numel, device=server)
    target = torch.empty_like(source)
    shard = torch.nn.Parameter(torch.zeros(numel, device=server))
    updater = Updater([shard], OptimConfig(name=request.optimizer), lr=1e-3)  # type: ignore[arg-type]

    def apply() -> None:
        shard.grad = source
        updater.update()

    on_worker, into = source.to(worker), target.to(worker)
    nbytes = numel * source.element_size()
    return (
        _median_time(lambda: into.copy_(on_worker), worker) / nbytes,
        _median_time(lambda: target.add_(source), server) / nbytes,
        _median_time(apply, server) / nbytes,
    )


def _server_round_s(request: ProfileRequest, rounds: int = 200) -> float:
    """Seconds of one server round on a 16-value slot, 2 contributions: what a round costs
    whatever its size (the server code's own sum, apply and answer copy)."""
    import torch

    from gradsync.comm.server import ShardState, sum_in_order
    from gradsync.config import OptimConfig
    from gradsync.optim import Updater

    dtype = getattr(torch, request.dtype)
    config = OptimConfig(name=request.optimizer)  # type: ignore[arg-type]
    state = ShardState(torch.zeros(16, dtype=dtype), lambda ps: Updater(ps, config, lr=1e-3))
    pushes = [torch.ones(16, dtype=dtype) for _ in range(2)]

    def many_rounds() -> None:
        for step in range(rounds):
            state.apply(sum_in_order(pushes, scale=0.5), step)
            state.values.detach().clone()

    return _median_time(many_rounds, torch.device("cpu")) / rounds


def _median_time(work: Callable[[], Any], device: Any, repeats: int = 5) -> float:
    import torch

    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


__all__ = ["LayerProfile", "Profile", "ProfileRequest", "VariableProfile", "measure_profile"]
