"""Predictions over a grid (strategies × worker counts × bandwidths) and the recommendation.

Example:
    >>> # grid = predict_grid(profile, [StrategyChoice("allreduce", AllreduceOptions())],
    >>> #                     workers=[1, 2, 4], networks={"1gbit": Network(bandwidth=125e6)})
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gradsync.config import TrainConfig
from gradsync.errors import UserError
from gradsync.predict.network import Cluster, Network
from gradsync.predict.profile import Profile
from gradsync.predict.simulate import SIMULATORS, StepPrediction, StrategyChoice, predict_step
from gradsync.strategies.allreduce import AllreduceOptions
from gradsync.strategies.hybrid import HybridOptions
from gradsync.strategies.p3 import P3Options
from gradsync.strategies.ps import PSOptions

FUSION_THRESHOLDS_MB = (0.0, 1.0, 4.0, 16.0, 64.0, 256.0)
SERVER_COUNTS = (1, 2, 4, 8)
SLICE_FACTORS = (0.25, 1.0, 4.0, 16.0)  # × P3's default slice size


@dataclass(frozen=True)
class GridPoint:
    """One prediction of the grid, with the bandwidth's label."""

    bandwidth: str
    rate: float  # the link's nominal bytes/s
    prediction: StepPrediction
    efficiency: float  # throughput / (workers × single-worker throughput without comm)


def parse_choice(
    spec: str, workers: int = 1, given: Mapping[str, Any] | None = None
) -> StrategyChoice:
    """``ps:servers=2:colocate`` → the strategy and its options, as ``verify`` reads
    strategy specs (:func:`gradsync.verify.cell_config`): ``given`` (options from flags
    such as ``--servers``) apply to the strategies that take them, and the spec's own
    options win over them. An option given twice in one spec is a UserError.

    Example:
        >>> parse_choice("p3:slice_size=10000").options.slice_size
        10000
        >>> parse_choice("ps:servers=4", 8, {"servers": 2}).label()
        'ps:servers=4'
    """
    from gradsync.verify import cell_config

    name, *parts = spec.split(":")
    if name not in SIMULATORS:
        raise UserError(
            f"predict cannot model strategy '{name}'; choose from: {', '.join(SIMULATORS)}"
        )
    _check_no_repeated_option(spec, name, parts)
    config = cell_config(TrainConfig(strategy="single"), spec, workers, Path("."), given)
    return StrategyChoice(name, config.strategy_options)


def _check_no_repeated_option(spec: str, name: str, parts: Sequence[str]) -> None:
    """UserError when ``spec`` sets one option twice (``ps:servers=2:servers=1``); a part
    that names no option continues a value that held a colon (``re:emb``)."""
    from gradsync.options import field_names
    from gradsync.strategies import options_class

    names = field_names(options_class(name))
    seen: set[str] = set()
    for part in parts:
        key, equals, _ = part.partition("=")
        if not equals and key not in names:
            continue
        if key in seen:
            raise UserError(
                f"'{spec}' sets {key} twice; give each option once, e.g. "
                f"{name}:{key}={part.partition('=')[2] or '...'}"
            )
        seen.add(key)


def single_step_s(profile: Profile) -> float:
    """One worker without communication: compute and the optimizer (``single``)."""
    return profile.compute_s + profile.num_bytes * profile.optimizer_s_per_byte


def predict_grid(
    profile: Profile,
    choices: Sequence[StrategyChoice],
    *,
    workers: Sequence[int],
    networks: Mapping[str, Network],
    base: Cluster | None = None,
    refused: list[str] | None = None,
    batchnorm: str = TrainConfig.batchnorm,
) -> list[GridPoint]:
    """Every choice at every worker count on every network; ``base`` gives the host layout
    (ranks per host, explicit hosts), its worker count and network replaced per point.
    A configuration gradsync would refuse is left out and described in ``refused``;
    ``batchnorm`` is train's ``--batchnorm``."""
    refused = [] if refused is None else refused
    single = profile.batch / single_step_s(profile)
    points = []
    for label, network in networks.items():
        for count in workers:
            cluster = _cluster(base, count, network)
            for choice in choices:
                try:
                    prediction = predict_step(profile, cluster, choice, batchnorm=batchnorm)
                except UserError as error:  # gradsync would refuse it too (e.g. servers)
                    refused.append(f"{choice.label()} × {count} workers: {error}")
                    continue
                points.append(
                    GridPoint(
                        label,
                        network.bandwidth,
                        prediction,
                        prediction.throughput / (count * single),
                    )
                )
    return points


def _cluster(base: Cluster | None, workers: int, network: Network) -> Cluster:
    if base is None:
        return Cluster(workers=workers, network=network)
    return replace(base, workers=workers, network=network)


def candidates(name: str) -> Iterator[StrategyChoice]:
    """The knob settings the recommendation tries for strategy ``name``."""
    if name == "allreduce":
        for mb in FUSION_THRESHOLDS_MB:
            yield StrategyChoice(name, AllreduceOptions(fusion_threshold_mb=mb))
    elif name == "ps":
        for servers in SERVER_COUNTS:
            yield StrategyChoice(name, PSOptions(servers=servers))
        yield StrategyChoice(name, PSOptions(colocate=True))
    elif name == "hybrid":
        for servers in SERVER_COUNTS:
            yield StrategyChoice(name, HybridOptions(servers=servers))
        yield StrategyChoice(name, HybridOptions(colocate=True))
    elif name == "p3":
        default = P3Options().slice_size
        for servers in SERVER_COUNTS:
            for factor in SLICE_FACTORS:
                yield StrategyChoice(
                    name, P3Options(servers=servers, slice_size=int(default * factor))
                )
    else:
        yield StrategyChoice(name)


@dataclass(frozen=True)
class Recommendation:
    """The fastest setting found for one cluster among the listed strategies' knob
    settings, against the listed ones."""

    workers: int
    bandwidth: str
    best: StepPrediction
    default: StepPrediction  # the baseline: the listed spec of gradsync's default, else the first
    strategy_default: StepPrediction  # the best's strategy as listed (its fastest spec)

    @property
    def gain(self) -> float:
        return self.best.throughput / self.default.throughput - 1

    @property
    def knob_gain(self) -> float:
        return self.best.throughput / self.strategy_default.throughput - 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "bandwidth": self.bandwidth,
            "best": self.best.choice.label(),
            "best_throughput": self.best.throughput,
            "default": self.default.choice.label(),
            "default_throughput": self.default.throughput,
            "gain_over_default": self.gain,
            "gain_over_strategy_default": self.knob_gain,
        }


def recommend(
    profile: Profile,
    listed: Sequence[StrategyChoice],
    cluster: Cluster | Callable[[StrategyChoice], Cluster],
    bandwidth: str,
    *,
    batchnorm: str = TrainConfig.batchnorm,
) -> Recommendation:
    """Try each ``listed`` choice as given, then every candidate knob setting of its
    strategy, on ``cluster`` (or on the cluster a function gives each setting: where its
    server ranks run). Only listed strategies are searched; the baseline is the listed
    choice of gradsync's default strategy, else the first listed that can be modelled.

    Example:
        >>> # recommend(profile, [parse_choice("ps:servers=2")], cluster, "1gbit").best
    """
    cluster_of = cluster if callable(cluster) else (lambda _choice: cluster)

    def predict(choice: StrategyChoice) -> StepPrediction | None:
        try:
            return predict_step(profile, cluster_of(choice), choice, batchnorm=batchnorm)
        except UserError:  # e.g. more servers than the model has variables
            return None

    as_listed = [p for p in map(predict, listed) if p is not None]
    names = dict.fromkeys(choice.name for choice in listed)
    settings = [choice for name in names for choice in (parse_choice(name), *candidates(name))]
    searched = [p for p in map(predict, settings) if p is not None]
    tried = as_listed + searched  # the listed first: a tie goes to what the user asked for
    if not tried:
        raise UserError("no strategy setting could be modelled for this profile")
    default_name = TrainConfig().strategy
    baseline = next((p for p in as_listed if p.choice.name == default_name), tried[0])
    best = pick_recommended(tried, baseline)
    # Against the fastest listed spec of the best's strategy: the gain of its knobs over
    # what the user would pick among the settings they listed.
    own = max(
        (p for p in as_listed if p.choice.name == best.choice.name),
        key=lambda p: p.throughput,
        default=best,
    )
    return Recommendation(best.workers, bandwidth, best, baseline, own)


# A setting replaces the default only when predicted at least this much faster. On the
# validation the model's median error is 7-10% per cell; the error of a ratio between two
# settings of one profile is smaller, but a gain under 5% is within it.
RECOMMEND_MARGIN = 0.05


def pick_recommended(tried: Sequence[StepPrediction], default: StepPrediction) -> StepPrediction:
    """The fastest of ``tried`` if it beats ``default`` by :data:`RECOMMEND_MARGIN`, else
    ``default``. Ties (to 6 significant digits) go to the first tried: each strategy's
    defaults come first, so a knob is recommended only when it is predicted to help.

    Example:
        >>> from gradsync.predict.simulate import StrategyChoice
        >>> def at(name, step_s):
        ...     return StepPrediction(StrategyChoice(name), 2, 8, step_s, 0.0, 0.0)
        >>> default = at("allreduce", 1.0)
        >>> pick_recommended([default, at("ps", 0.98)], default).choice.name  # 2% faster
        'allreduce'
        >>> pick_recommended([default, at("ps", 0.8)], default).choice.name  # 25% faster
        'ps'
    """
    best = max(tried, key=lambda p: float(f"{p.throughput:.6g}"))
    return best if best.throughput >= default.throughput * (1 + RECOMMEND_MARGIN) else default


__all__ = [
    "GridPoint",
    "Recommendation",
    "candidates",
    "parse_choice",
    "pick_recommended",
    "predict_grid",
    "recommend",
    "single_step_s",
]
