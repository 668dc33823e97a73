"""The ``profile`` and ``predict`` subcommands: their parsers and what they run.

:func:`add_parsers` is the one call ``gradsync.cli`` makes; :data:`COMMANDS` its dispatch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradsync.config import BATCHNORM_MODES, TrainConfig
from gradsync.errors import UserError
from gradsync.toml_keys import TomlKeys, read_toml

if TYPE_CHECKING:
    from gradsync.predict.network import Network
    from gradsync.predict.profile import Profile
    from gradsync.predict.simulate import StrategyChoice
    from gradsync.predict.sweep import GridPoint, Recommendation

DEFAULT_STRATEGIES = "ddp,allreduce,ps,hybrid,p3"
DEFAULT_WORKERS = "1,2,4,8,16,32,64"
DEFAULT_BANDWIDTHS = "1gbit,10gbit,25gbit"
EXIT_OK = 0
# predict's flags that an --experiment key may set. Their parser default is None, so that a
# flag typed on the command line (even with its default value) is told from one left out;
# the values below fill what neither the command line nor the file gave.
PREDICT_DEFAULTS: dict[str, Any] = {
    "strategies": DEFAULT_STRATEGIES,
    "workers": DEFAULT_WORKERS,
    "bandwidth": DEFAULT_BANDWIDTHS,
    "latency": "25us",
    "queue": "0",
    "ranks_per_host": 1,
    "colocate": False,
    "compute_speedup": 1.0,
}


_QUEUE_NOTE = ": shallow switch buffers; gradsync's emulated hosts: 50ms"


def _default(key: str, note: str = "") -> str:
    """``(default V)`` for a help text, V from :data:`PREDICT_DEFAULTS`, ``note`` after it.

    Example:
        >>> _default("ranks_per_host"), _default("compute_speedup", "; none")
        ('(default 1)', '(default 1; none)')
    """
    value = PREDICT_DEFAULTS[key]
    shown = f"{value:g}" if isinstance(value, float) else str(value)
    return f"(default {shown}{note})"


def add_parsers(commands: argparse._SubParsersAction) -> None:
    """Add ``gradsync profile`` and ``gradsync predict`` to the subcommands."""
    from gradsync.cli import _path, add_model_flags
    from gradsync.cli import _positive_int as _positive

    profile = commands.add_parser(
        "profile",
        help="measure one worker's per-layer compute and gradient sizes for `predict`",
        description="Run forward, backward and the optimizer of one worker's batch and write "
        "per-layer forward starts, per-variable gradient-ready times and bytes, and per-byte "
        "costs of copies, server aggregation and apply (medians after warm-up).",
    )
    add_model_flags(profile)
    profile.add_argument(
        "--batch",
        type=_positive,
        help="samples per worker (default: the preset's global batch / --workers)",
    )
    profile.add_argument(
        "--workers", type=_positive, default=1, help="the run whose shard is profiled"
    )
    profile.add_argument(
        "--steps", type=_positive, default=10, help="steps timed, warm-up included (default 10)"
    )
    profile.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    profile.add_argument("--threads", type=_positive, default=1, help="intra-op threads")
    profile.add_argument(
        "--concurrent",
        type=_positive,
        default=1,
        metavar="K",
        help="K ranks compute at once (K-1 sibling processes), as K ranks share a machine",
    )
    profile.add_argument(
        "--batchnorm",
        choices=BATCHNORM_MODES,
        default=TrainConfig.batchnorm,
        help="the BatchNorm layers to time, as `gradsync train --batchnorm` (global: gradsync's "
        "layer, its own work without peers; predict adds the collectives)",
    )
    profile.add_argument(
        "--deterministic",
        action="store_true",
        help="disable dropout, as `gradsync train --deterministic` does (default: the model "
        "as train runs it, dropout on)",
    )
    profile.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where to time (default cpu)"
    )
    profile.add_argument(
        "--dtype", choices=["float32", "float64"], default="float32", help="(default float32)"
    )
    profile.add_argument(
        "--optimizer", choices=["sgd", "adam"], default="sgd", help="whose update is timed"
    )
    profile.add_argument(
        "--out", type=_path, required=True, metavar="PROFILE.json", help="the profile to write"
    )
    profile.add_argument(
        "--overwrite", action="store_true", help="replace an existing profile file"
    )

    predict = commands.add_parser(
        "predict",
        help="simulate every strategy on a cluster from a profile; recommend one",
        description="Discrete-event simulation of a steady-state step per strategy, following "
        "gradsync's real policies, for each worker count and bandwidth (see docs/predict.md).",
    )
    predict.add_argument("--profile", metavar="PROFILE.json", help="from `gradsync profile`")
    predict.add_argument(
        "--strategies",
        help="comma-separated, options after colons as in verify, e.g. "
        f"allreduce:fusion_threshold_mb=16,ps:servers=2,p3:slice_size=10000 "
        f"{_default('strategies')}",
    )
    predict.add_argument("--workers", help=f"worker counts, e.g. 1,2,4 {_default('workers')}")
    predict.add_argument(
        "--bandwidth",
        help=f"per-host link rates, e.g. 1gbit,25gbit {_default('bandwidth')}",
    )
    predict.add_argument(
        "--latency",
        help=f"one-way latency per message, e.g. 25us, 1ms {_default('latency', '; 0 for none')}",
    )
    predict.add_argument(
        "--queue",
        help="how long a small message waits behind bulk data on a saturated link: the "
        f"link's queue {_default('queue', _QUEUE_NOTE)}",
    )
    predict.add_argument(
        "--ranks-per-host",
        type=_positive,
        help=f"workers sharing one host link {_default('ranks_per_host')}",
    )
    predict.add_argument(
        "--intra-bandwidth", help="rate between ranks of one host (default: the link's)"
    )
    predict.add_argument(
        "--servers",
        type=_positive,
        help="server ranks for ps, hybrid and p3 (default 1; a spec's servers=N wins)",
    )
    predict.add_argument(
        "--colocate",
        action="store_true",
        default=None,
        help="ps, hybrid and p3: every worker serves a shard (a spec's colocate=false wins)",
    )
    predict.add_argument(
        "--calibrate",
        metavar="commbench.json",
        help="fit per-message cost and usable bandwidth share to a `gradsync commbench` run "
        "(and, where it has them, the CPU cost of communication and the slowdown of "
        "point-to-point transfers both ways at once)",
    )
    predict.add_argument(
        "--shared-cores",
        type=_positive,
        metavar="C",
        help="every host's ranks run on the same C cores (hosts emulated on one machine): "
        "communication's and servers' CPU time that overlaps compute lengthens it, and servers "
        "work at their share of the cores meanwhile; its cost comes from --calibrate (a "
        "commbench.json with cpu_s). Default: a real cluster",
    )
    predict.add_argument(
        "--compute-speedup",
        type=float,
        metavar="X",
        help="model workers X times faster than the profiled device (e.g. a GPU from a CPU "
        "profile): compute, optimizer and copies; server work stays as measured "
        f"{_default('compute_speedup')}",
    )
    predict.add_argument(
        "--batchnorm",
        choices=BATCHNORM_MODES,
        default=TrainConfig.batchnorm,
        help="as in train: global (default) syncs the workers at every BatchNorm layer; "
        "local does not",
    )
    predict.add_argument(
        "--no-recommend", dest="recommend", action="store_false", help="skip the knob search"
    )
    predict.add_argument(
        "--validate",
        metavar="FILE.toml",
        help="instead: run the file's configurations on emulated hosts, measured vs predicted",
    )
    predict.add_argument(
        "--experiment",
        metavar="FILE.toml",
        help="read these options from a file (keys named as the flags; a flag given on the "
        "command line wins); a missing profile is measured first from its model, preset and "
        "batch keys",
    )
    predict.add_argument("--out", type=_path, help="results folder (default: runs/predict-<time>)")
    predict.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the results already in --out (only a folder of gradsync's outputs); "
        "--validate without it goes on with the cells an earlier run measured there",
    )


def _fill_defaults(args: argparse.Namespace) -> None:
    """Give every flag of :data:`PREDICT_DEFAULTS` left unset (None) its default."""
    for key, value in PREDICT_DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def _strategy_specs(args: argparse.Namespace) -> list[str]:
    """The ``--strategies`` list, each spec once."""
    from gradsync.strategies import split_specs

    specs = split_specs(args.strategies)
    if not specs:
        raise UserError("--strategies lists no strategy; e.g. --strategies allreduce,ps")
    repeated = sorted({spec for spec in specs if specs.count(spec) > 1})
    if repeated:
        raise UserError(
            f"--strategies lists {', '.join(repeated)} more than once; list each strategy once"
        )
    return specs


def _flag_options(args: argparse.Namespace) -> dict[str, Any]:
    """``--servers`` and ``--colocate`` as strategy options: they apply to every listed
    strategy that takes them, and a spec's own option wins (as in ``gradsync verify``)."""
    given: dict[str, Any] = {}
    if args.servers is not None:
        given["servers"] = args.servers
    if args.colocate:
        given["colocate"] = True
    return given


def _worker_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"--workers {text!r} is not a comma-separated list of integers") from None
    if not counts or min(counts) < 1:
        raise UserError(f"--workers {text!r} needs positive worker counts, e.g. 1,2,4,8")
    return sorted(set(counts))


def cmd_profile(args: argparse.Namespace) -> int:
    """``gradsync profile``: measure one worker's step and write its profile to ``--out``."""
    from gradsync.predict.profile import PROFILE_BEGINS, ProfileRequest, measure_profile
    from gradsync.rundir import claim_output_file

    request = ProfileRequest(
        model=args.model,
        preset=args.preset,
        model_options=dict(args.model_option),
        batch=args.batch,
        workers=args.workers,
        steps=args.steps,
        warmup=args.warmup,
        threads=args.threads,
        device=args.device,
        dtype=args.dtype,
        optimizer=args.optimizer,
        concurrent=args.concurrent,
        batchnorm=args.batchnorm,
        dropout=not args.deterministic,
    )
    claim_output_file(Path(args.out), overwrite=args.overwrite, begins=PROFILE_BEGINS)
    profile = measure_profile(request)
    profile.save(Path(args.out))
    print(
        f"{profile.model} ({profile.preset}), batch {profile.batch}/worker, "
        f"{profile.threads} thread(s), {profile.concurrent} rank(s) at once: forward "
        f"{profile.forward_s * 1e3:.1f} ms, backward "
        f"{profile.backward_s * 1e3:.1f} ms, {len(profile.variables)} variables, "
        f"{profile.num_bytes / 2**20:.1f} MiB; profile in {args.out}"
    )
    return EXIT_OK


def _note_batchnorm_mismatch(profile: Profile, batchnorm: str) -> None:
    """A note when ``profile`` timed other BatchNorm layers than ``--batchnorm`` trains."""
    if profile.batchnorm_channels and profile.batchnorm != batchnorm:
        print(
            f"note: the profile timed {profile.batchnorm} BatchNorm layers and --batchnorm is "
            f"{batchnorm}: the layers' own work is as profiled (take the profile with "
            f"`gradsync profile --batchnorm {batchnorm}` to match)",
            file=sys.stderr,
        )


EXPERIMENT_KEYS = {
    "profiles",
    "compute_speedup",
    "preset",
    "batch",
    "strategies",
    "workers",
    "bandwidth",
    "latency",
    "queue",
    "ranks_per_host",
    "shared_cores",
    "servers",
    "colocate",
    "out",
}
# What `predict --experiment` writes at the top of its results folder, beside a folder per
# model: the experiment it ran (rundir.RUN_MARKERS names it, so --overwrite may clear it).
EXPERIMENT_RECORD = "predict-experiment.json"


def _experiment_options(keys: TomlKeys) -> dict[str, Any]:
    """The experiment file's values of predict's options (those it sets), each typed."""
    from gradsync.predict.network import check_shared_cores
    from gradsync.predict.profile import check_compute_speedup

    options: dict[str, Any] = {}
    for key, item, example in (
        ("strategies", str, '["allreduce", "ps:servers=2"]'),
        ("workers", int, "[1, 2, 4, 8]"),
        ("bandwidth", str, '["1gbit", "25gbit"]'),
    ):
        if key in keys:
            options[key] = keys.comma_list(key, item, example=example)
    for key, example in (("latency", '"25us"'), ("queue", '"0"')):
        if key in keys:
            options[key] = keys.text(key, example=example)
    for key in ("ranks_per_host", "servers"):
        if key in keys:
            options[key] = keys.count(key)
    if "colocate" in keys:
        options["colocate"] = keys.flag("colocate")
    if "compute_speedup" in keys:
        where = f"{keys.path}: compute_speedup"
        options["compute_speedup"] = check_compute_speedup(keys.raw["compute_speedup"], where)
    if "shared_cores" in keys:
        check_shared_cores(keys.raw["shared_cores"], f"{keys.path}: shared_cores")
        options["shared_cores"] = keys.raw["shared_cores"]
    return options


def _missing_profiles(keys: TomlKeys, profiles: dict[str, str], preset: str) -> dict[str, Path]:
    """The experiment's profiles still to measure (of models gradsync has, at ``preset``),
    by model; a model that is no plain name (its results go to a folder of that name), a
    profile that does not load or one of another model, preset or batch than the file
    names is a UserError."""
    from gradsync.models import check_model
    from gradsync.predict.profile import Profile

    path = keys.path

    missing = {}
    for model, profile in profiles.items():
        if model in (".", "..") or Path(model).name != model:
            raise UserError(
                f"{path}: profiles key {model!r} is not a plain name (each model's results go "
                f'to a folder of that name under out); write e.g. vgg16 = "{profile}"'
            )
        if Path(profile).is_file():
            _check_profile_matches(keys, model, profile, Profile.load(profile))
        elif Path(profile).exists():  # refused before out is claimed: nothing left behind
            raise UserError(
                f"{path}: profiles.{model} = {profile!r} is a folder, not a profile file; "
                f'name a file, e.g. {model} = "profiles/{model}.json"'
            )
        else:
            check_model(model, preset)
            missing[model] = Path(profile)
    return missing


def _check_profile_matches(keys: TomlKeys, model: str, file: str, profile: Profile) -> None:
    """UserError when a profile measured another model than its key (a model gradsync
    has), or another preset or batch than the experiment file names: its predictions
    would be filed under the wrong name."""
    from gradsync.models import REGISTRY

    wanted = {"preset": keys.raw.get("preset"), "batch": keys.raw.get("batch")}
    wanted["model"] = model if model in REGISTRY else None
    for field_name, value in wanted.items():
        measured = getattr(profile, field_name)
        if value is not None and measured != value:
            raise UserError(
                f"{keys.path}: profiles.{model} = {file!r} was measured with {field_name} "
                f"{measured}, not {value}; point it at a profile of {model} with that "
                "setting, or remove the file so that it is measured"
            )


def _run_experiment(args: argparse.Namespace) -> int:
    """``--experiment FILE.toml``: its keys fill the options; ``[profiles]`` maps models to
    profile files, each predicted into ``out/<model>`` (a missing profile is measured
    first: the model at ``preset`` and ``batch``, 1 thread). Every key and option is
    checked, and ``out`` claimed, before anything is measured or written."""
    from gradsync.files import atomic_write_text
    from gradsync.predict.profile import Profile, ProfileRequest, measure_profile
    from gradsync.rundir import claim_output_file, claim_run_dir

    path = Path(args.experiment)
    example = "experiments/predict-horovod-scaling.toml"
    keys = TomlKeys(read_toml(path, "--experiment", EXPERIMENT_KEYS, example=example), path)
    profiles = keys.text_table("profiles", example='{ vgg16 = "profiles/vgg16.json" }')
    if not profiles:
        raise UserError(f'{path}: needs a [profiles] table, e.g. vgg16 = "profiles/vgg16.json"')
    # A flag typed on the command line wins over the file's key, even at its default value:
    # an unset flag is None until _fill_defaults.
    given = {key for key, value in vars(args).items() if value is not None}
    vars(args).update({k: v for k, v in _experiment_options(keys).items() if k not in given})
    _fill_defaults(args)
    preset = keys.text("preset", "default", example='"tiny"')
    batch = keys.count("batch", None)
    out = Path(args.out or keys.text("out", f"results/{path.stem}", example='"results/x"'))
    options = _predict_options(args)
    missing = _missing_profiles(keys, profiles, preset)
    # Every model with a profile is predicted before out is claimed, every other one as soon
    # as it is measured, and nothing is written until all are: no half-written experiment.
    predicted = {
        model: _predict_model(path, model, Profile.load(file), options, args)
        for model, file in profiles.items()
        if model not in missing
    }
    inputs = [path, *profiles.values(), *_calibration_of(args)]
    claim_run_dir(out, overwrite=args.overwrite, inputs=inputs)
    for model, profile in missing.items():  # after the claim: it may lie under out
        claim_output_file(profile, overwrite=False, flag=f"{path}: profiles.{model}")
    for model, profile in missing.items():
        request = ProfileRequest(model=model, preset=preset, batch=batch)
        print(f"profiling {model} ({request.preset}) into {profile}")
        measure_profile(request).save(profile)
        predicted[model] = _predict_model(path, model, Profile.load(profile), options, args)
    record = {"experiment": str(path), "profiles": profiles}
    atomic_write_text(out / EXPERIMENT_RECORD, json.dumps(record, indent=1) + "\n")
    for model in profiles:
        claim_run_dir(out / model, overwrite=False)
        _write_predicted(out / model, predicted[model])
    return EXIT_OK


def _predict_model(
    path: Path, model: str, profile: Profile, options: _PredictOptions, args: argparse.Namespace
) -> _Predicted:
    """:func:`_predict` for one model of the experiment ``path``; its error names the model."""
    try:
        return _predict(profile, options, args)
    except UserError as error:
        raise UserError(f"{path}: profiles.{model}: {error}") from None


def _calibration_of(args: argparse.Namespace) -> list[str]:
    """``--calibrate``'s file, if one is given: an input that ``--overwrite`` must keep."""
    return [args.calibrate] if getattr(args, "calibrate", None) else []


@dataclass(frozen=True, kw_only=True)
class _PredictOptions:
    """``predict``'s options, parsed and checked: what to simulate, on which networks."""

    choices: list[StrategyChoice]
    workers: list[int]
    latency_s: float
    queue_s: float
    networks: dict[str, Network]
    shared_cores: int | None
    compute_speedup: float


def _predict_options(args: argparse.Namespace) -> _PredictOptions:
    """Every option of ``predict`` parsed; a bad one is a UserError before any work."""
    from gradsync.predict.network import (
        Network,
        calibrate,
        check_shared_cores,
        parse_bandwidth,
        parse_latency,
    )
    from gradsync.predict.profile import check_compute_speedup
    from gradsync.predict.sweep import parse_choice

    specs = _strategy_specs(args)
    workers = _worker_counts(args.workers)
    latency, queue = parse_latency(args.latency), parse_latency(args.queue, "--queue")
    intra = (
        parse_bandwidth(args.intra_bandwidth, "--intra-bandwidth") if args.intra_bandwidth else None
    )
    networks = {}
    for text in (part.strip() for part in args.bandwidth.split(",") if part.strip()):
        network = Network(
            bandwidth=parse_bandwidth(text), latency=latency, intra_bandwidth=intra, queue_s=queue
        )
        networks[text] = calibrate(network, args.calibrate) if args.calibrate else network
    if not networks:
        raise UserError("--bandwidth lists no rate; e.g. --bandwidth 1gbit,10gbit")
    shared = getattr(args, "shared_cores", None)
    check_shared_cores(shared, "--shared-cores")
    return _PredictOptions(
        choices=[parse_choice(spec, max(workers), _flag_options(args)) for spec in specs],
        workers=workers,
        latency_s=latency,
        queue_s=queue,
        networks=networks,
        shared_cores=shared,
        compute_speedup=check_compute_speedup(args.compute_speedup, "--compute-speedup"),
    )


def cmd_predict(args: argparse.Namespace) -> int:
    """``gradsync predict``: simulate the strategies on the clusters asked for, into a results
    folder claimed (``--overwrite``) once every option has been checked."""
    if args.validate:
        return _validate(args)
    if args.experiment:
        return _run_experiment(args)
    _fill_defaults(args)
    from gradsync.predict.profile import Profile
    from gradsync.rundir import claim_run_dir

    if not args.profile:
        raise UserError(
            "predict needs --profile PROFILE.json (or --experiment FILE.toml, or --validate "
            "FILE.toml)"
        )
    profile = Profile.load(args.profile)
    options = _predict_options(args)
    out = Path(args.out or f"runs/predict-{time.strftime('%Y%m%d-%H%M%S')}")
    predicted = _predict(profile, options, args)  # a profile that cannot be modelled: no out
    claim_run_dir(out, overwrite=args.overwrite, inputs=[args.profile, *_calibration_of(args)])
    _write_predicted(out, predicted)
    return EXIT_OK


@dataclass(frozen=True, kw_only=True)
class _Predicted:
    """One profile's predictions, computed and not yet written."""

    profile: Profile
    points: list[GridPoint]
    recommendations: list[Recommendation]
    settings: dict[str, Any]


def _predict(measured: Profile, options: _PredictOptions, args: argparse.Namespace) -> _Predicted:
    """Simulate ``options`` from the profile ``measured``; nothing is written (a profile no
    configuration can be modelled for is a UserError before any output)."""
    from gradsync.predict.network import Cluster
    from gradsync.predict.sweep import predict_grid, recommend

    profile = measured.with_compute_speedup(options.compute_speedup)
    networks, workers, shared = options.networks, options.workers, options.shared_cores
    if shared and not any(n.cpu_s_per_byte or n.cpu_s_per_message for n in networks.values()):
        print(
            "note: --shared-cores charges only the servers' work here: communication's CPU "
            "cost comes from --calibrate with a commbench.json that has cpu_s",
            file=sys.stderr,
        )
    _note_batchnorm_mismatch(profile, args.batchnorm)
    base = Cluster(
        workers=1,
        network=next(iter(networks.values())),
        ranks_per_host=args.ranks_per_host,
        shared_cores=shared,
    )
    started = time.perf_counter()
    refused: list[str] = []
    points = predict_grid(
        profile,
        options.choices,
        workers=workers,
        networks=networks,
        base=base,
        refused=refused,
        batchnorm=args.batchnorm,
    )
    if not points:
        raise UserError(f"no configuration can be modelled: {refused[0]}")
    recommendations = []
    if args.recommend:
        for label, network in networks.items():
            cluster = Cluster(
                workers=max(workers),
                network=network,
                ranks_per_host=args.ranks_per_host,
                shared_cores=shared,
            )
            recommendations.append(
                recommend(profile, options.choices, cluster, label, batchnorm=args.batchnorm)
            )
    elapsed = time.perf_counter() - started
    settings = {
        "strategies": [choice.label() for choice in options.choices],
        "workers": workers,
        "bandwidths": list(networks),
        "latency_s": options.latency_s,
        "queue_s": options.queue_s,
        "ranks_per_host": args.ranks_per_host,
        "shared_cores": shared,
        "calibrate": args.calibrate,
        "compute_speedup": options.compute_speedup,
        "batchnorm": args.batchnorm,
        "refused": refused,
        "predict_seconds": elapsed,
    }
    return _Predicted(
        profile=profile, points=points, recommendations=recommendations, settings=settings
    )


def _write_predicted(out: Path, predicted: _Predicted) -> None:
    """Write ``predicted`` to the claimed folder ``out`` and print its table."""
    from gradsync.predict.report import HEADERS, recommendation_lines, table_rows, write_outputs
    from gradsync.tables import print_table

    profile, points, settings = predicted.profile, predicted.points, predicted.settings
    write_outputs(out, profile, points, predicted.recommendations, settings)
    print_table(
        f"predicted steady-state steps: {profile.model} ({profile.preset}), batch "
        f"{profile.batch}/worker, profiled with {profile.threads} thread(s) on {profile.device}",
        HEADERS,
        table_rows(points),
    )
    print(
        "efficiency vs compute only: samples/s ÷ (workers × one worker without "
        "communication), as Horovod's figures define it (bench's efficiency divides by the "
        "same strategy at 1 worker instead); exposed: share of the step spent waiting for "
        "communication"
    )
    for line in settings["refused"]:
        print(f"left out (gradsync refuses it): {line}")
    for line in recommendation_lines(predicted.recommendations):
        print(f"recommended: {line}")
    print(f"{len(points)} predictions in {settings['predict_seconds']:.2f} s; results in {out}")


def _validate(args: argparse.Namespace) -> int:
    """``predict --validate FILE.toml``: measure and predict the plan's cells into ``out``."""
    from gradsync.predict.validate import claim_validation_dir, load_plan, run_validation

    plan = load_plan(args.validate)
    out = Path(args.out or f"results/{plan.name}")
    claim_validation_dir(out, Path(args.validate), overwrite=args.overwrite)
    load = os.getloadavg()
    print(f"{plan.name}: load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; results in {out}")
    summary = run_validation(plan, out)
    if summary["median_abs_error"] is not None:
        print(
            f"{summary['num_ok']} cells measured ({summary['num_failed']} failed): median "
            f"|error| {summary['median_abs_error']:.1%}, 90th percentile "
            f"{summary['p90_abs_error']:.1%}; table in {out / 'validation.md'}"
        )
    return EXIT_OK


COMMANDS = {"profile": cmd_profile, "predict": cmd_predict}

__all__ = ["COMMANDS", "add_parsers"]
