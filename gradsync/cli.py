"""The ``gradsync`` command: its argument parser and one ``cmd_*`` function per subcommand.

Besides turning arguments into a config and calling the toolkit, it holds the checks that
need the parsed arguments together (``--resume`` vs ``--out``/``--overwrite``, several
nodes vs ``--master-addr``, momentum with Adam), choosing and claiming a training run's
folder (the default ``--out``, restarts), the table that ``compare`` prints and the
listing of ``netem``."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import re
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from gradsync import __version__
from gradsync.config import BATCHNORM_MODES, TrainConfig
from gradsync.errors import JobFailed, UserError, say
from gradsync.options import add_option_flags

if TYPE_CHECKING:
    from gradsync.topology import RankEnv

EXIT_OK, EXIT_DIFFERS, EXIT_USER_ERROR = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line and exit code 2 (no usage dump)."""

    _argv: Sequence[str] = ()

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        if message.endswith("expected one argument"):
            message += _dash_value_hint(message, self._argv)
        sys.stderr.write(f"gradsync: error: {message} (see {self.prog} --help)\n")
        sys.exit(EXIT_USER_ERROR)


def _dash_value_hint(message: str, argv: Sequence[str]) -> str:
    """argparse reads a value such as ``-1gbit`` as a flag: say how to pass it.

    >>> _dash_value_hint("argument --lr: expected one argument", ["--lr", "-1"])
    '; argparse reads -1 as a flag: write --lr=-1'
    """
    options = message.removeprefix("argument ").split(":")[0].split("/")
    for option, value in itertools.pairwise(argv):
        if option in options and value.startswith("-"):
            return f"; argparse reads {value} as a flag: write {option}={value}"
    return ""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


SEED_LIMIT = 1 << 63  # torch.manual_seed takes a signed 64-bit seed


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"{value} is not a seed from 0 to 2**63 - 1")
    return value


def _path(text: str) -> str:
    """A path argument that names something: an empty one would silently mean the default."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} names no path; give one, or leave the flag out")
    return text


def _int_list(text: str) -> list[int]:
    values = [_positive_int(part) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} lists no worker counts (e.g. 2,4)")
    return values


def _positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{value:g} is not a finite number above 0")
    return value


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def add_model_flags(group: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--model``, ``--preset`` and ``--model-option``: which model a command builds
    (``train``, ``verify``, ``demo``, ``profile``)."""
    group.add_argument(
        "--model",
        default="transformer",
        help="registered model, FILE.py:FUNCTION or package.module:FUNCTION (default transformer)",
    )
    group.add_argument("--preset", default="default", help="tiny | default | paper")
    group.add_argument(
        "--model-option",
        action="append",
        type=_key_value,
        default=[],
        metavar="KEY=VALUE",
        help="model option, e.g. sparse=true (repeatable)",
    )


def _add_model_options(
    parser: argparse.ArgumentParser, *, default_steps: int, precision: bool = False
) -> None:
    group = parser.add_argument_group("model and data")
    if precision:  # verify: the precision every run of the comparison uses
        group.add_argument(
            "--precision",
            choices=["float64", "float32"],
            default="float64",
            help="float64 (default): rounding ~1e-12, so the tolerance is an absolute 1e-9; "
            "float32: the floor measured by rerunning single with other threads",
        )
    else:
        group.add_argument(
            "--dtype",
            choices=["float32", "float64"],
            default="float32",
            help="parameters, data, gradients, communication and optimizer state",
        )
    add_model_flags(group)
    group.add_argument("--data", help="real data file or folder (default: synthetic data)")
    length = group.add_mutually_exclusive_group()
    length.add_argument(
        "--steps",
        type=_positive_int,
        default=default_steps,
        help=f"training steps (default {default_steps})",
    )
    length.add_argument(
        "--epochs",
        type=_positive_number,
        metavar="E",
        help="train E passes over a real training set (--data, or a user model's dataset) "
        "instead of --steps: steps = ceil(E × training samples / global batch)",
    )
    group.add_argument(
        "--global-batch",
        type=_positive_int,
        help="samples per step over all workers (default: the preset's)",
    )
    group.add_argument(
        "--seed", type=_seed, default=0, help="seeds the model, the data and dropout (default 0)"
    )
    group.add_argument(
        "--batchnorm",
        choices=BATCHNORM_MODES,
        default=TrainConfig.batchnorm,
        help="global (default): BatchNorm statistics over the global batch, as single "
        "computes them; local: each worker normalizes its own shard (DDP's and Horovod's "
        "default; verify reports it as an expected difference)",
    )
    optim = parser.add_argument_group("optimization")
    optim.add_argument("--optimizer", default="sgd", help="sgd | adam")
    optim.add_argument("--lr", type=float, help="learning rate (default: 0.05 sgd, 1e-3 adam)")
    optim.add_argument(
        "--momentum", type=float, help="SGD's momentum (default 0.9; adam keeps its own moments)"
    )
    optim.add_argument("--weight-decay", type=float, default=0.0, help="L2 penalty (default 0)")
    optim.add_argument(
        "--lr-warmup-steps", type=int, default=0, help="linear learning-rate warm-up (steps)"
    )
    optim.add_argument(
        "--lr-scaling",
        default="none",
        help="none | linear (Goyal et al. 2017) | sqrt, against --lr-base-batch",
    )
    optim.add_argument(
        "--lr-base-batch",
        type=_positive_int,
        help="batch size --lr was tuned for (default: the preset's)",
    )
    from gradsync.strategies import load_plugins, options_by_strategy

    load_plugins()
    add_option_flags(parser, options_by_strategy())
    run = parser.add_argument_group("launch and measurement")
    run.add_argument(
        "--threads",
        type=_positive_int,
        help="intra-op threads per rank (default: cores / local ranks)",
    )
    run.add_argument(
        "--interop-threads", type=_positive_int, help="inter-op threads per rank (default: torch's)"
    )
    run.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto (default): the GPUs when every rank gets one of its own, else the CPU",
    )
    run.add_argument(
        "--timeout", type=float, default=300.0, help="seconds before a collective gives up"
    )
    run.add_argument(
        "--measure-warmup",
        type=int,
        help="steps left out of throughput (default: 10%%, at least 5, always leaving one "
        "step to measure)",
    )
    run.add_argument("--out", type=_path, help="results folder")
    _add_reliability_options(parser)


REPLACE_RESULTS = "replace the results in --out (of another experiment, or a sweep done)"


def _add_overwrite(parser: argparse.ArgumentParser, help: str) -> None:
    """``--overwrite`` of a command that writes a results folder (default: refuse a used one)."""
    parser.add_argument("--overwrite", action="store_true", help=help)


def _add_reliability_options(parser: argparse.ArgumentParser) -> None:
    """The reliability flags: ``--overwrite`` and ``--hang-timeout`` on every command with
    the model options (``train``, ``verify``, ``demo``), and ``--resume`` and
    ``--max-restarts`` on ``train`` alone."""
    group = parser.add_argument_group("reliability")
    group.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in --out (default: refuse)",
    )
    group.add_argument(
        "--hang-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="name and stop a rank silent this long (default 60; at least 5 of its slowest steps)",
    )
    if parser.prog.endswith(" train"):
        group.add_argument(
            "--resume",
            metavar="RUN_DIR",
            help="continue the run in RUN_DIR from its checkpoint (same flags, larger --steps ok)",
        )
        group.add_argument(
            "--max-restarts",
            type=int,
            default=0,
            metavar="N",
            help="when a rank dies, relaunch every rank from the last checkpoint, up to N times",
        )


def _add_node_options(parser: argparse.ArgumentParser) -> None:
    nodes = parser.add_argument_group("multi-node (gradsync's own launcher)")
    nodes.add_argument(
        "--nnodes", type=_positive_int, default=1, help="nodes of the job, each started alike"
    )
    nodes.add_argument(
        "--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1 (default 0)"
    )
    nodes.add_argument(
        "--master-addr", help="rendezvous host (default 127.0.0.1, or the launcher's MASTER_ADDR)"
    )
    nodes.add_argument(
        "--master-port",
        type=int,
        help="rendezvous port (default: a free one for one node, 29500 for several)",
    )


def _add_netem_options(parser: argparse.ArgumentParser) -> None:
    hosts = parser.add_argument_group(
        "emulated hosts (network namespaces on this machine; needs root, ip and tc)"
    )
    hosts.add_argument(
        "--hosts",
        type=_positive_int,
        default=0,
        metavar="H",
        help="run the ranks on H emulated hosts joined by a bridge (default: loopback)",
    )
    hosts.add_argument(
        "--ranks-per-host",
        type=_positive_int,
        metavar="K",
        help="rank r runs on host r // K (default: the ranks spread evenly)",
    )
    hosts.add_argument(
        "--bandwidth",
        metavar="RATE",
        help="shape each host's link to RATE in and out, e.g. 1gbit, 200mbit (tc tbf); "
        "latency is not emulated (this kernel has no netem qdisc)",
    )


def _strategy_names() -> list[str]:
    """The registered strategies, plugins included."""
    from gradsync.strategies import STRATEGIES, load_plugins

    load_plugins()
    return list(STRATEGIES)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gradsync",
        description=(
            "One model, every synchronization architecture: verified against a single-process "
            "reference and measured side by side."
        ),
    )
    parser.add_argument("--version", action="version", version=f"gradsync {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = commands.add_parser("train", help="train with one strategy")
    train.add_argument(
        "--strategy",
        default=TrainConfig.strategy,
        help=f"one of {', '.join(_strategy_names())} (default {TrainConfig.strategy})",
    )
    train.add_argument(
        "--workers",
        type=_positive_int,
        help="worker processes (default 1; under torchrun/srun/mpirun: the launcher's world size)",
    )
    train.add_argument(
        "--checkpoint-every", type=int, default=0, help="also write the checkpoint every N steps"
    )
    train.add_argument(
        "--log-every",
        type=_positive_int,
        metavar="N",
        help="print a progress line every N steps (default: a tenth of --steps)",
    )
    train.add_argument(
        "--deterministic", action="store_true", help="disable dropout, as verify does"
    )
    train.add_argument("--timeline", metavar="PATH", help="write a Chrome-trace timeline")
    train.add_argument(
        "--timeline-steps", metavar="A:B", help="record only steps A <= step < B (default: all)"
    )
    _add_model_options(train, default_steps=50)
    _add_node_options(train)
    _add_netem_options(train)

    verify = commands.add_parser("verify", help="check strategies against single")
    verify.add_argument(
        "--strategies",
        help="comma-separated (default: every registered one); options after colons, "
        "e.g. ps,ps:servers=2,ps:colocate,ps:async,ps:staleness=2,hybrid:partitions=4",
    )
    verify.add_argument("--workers", type=_int_list, default=[2], help="e.g. 2,4")
    _add_model_options(verify, default_steps=20, precision=True)
    _add_netem_options(verify)

    demo = commands.add_parser("demo", help="quick side-by-side comparison of every strategy")
    demo.add_argument("--workers", type=_positive_int, default=2, help="(default 2)")
    _add_model_options(demo, default_steps=30)

    _add_commbench_parser(commands)
    netem = commands.add_parser("netem", help="emulated hosts: clean up after killed runs")
    netem.add_argument(
        "action",
        choices=["cleanup", "list"],
        help="cleanup: delete the namespaces of runs whose launcher is gone; list: show runs",
    )
    bench = commands.add_parser("bench", help="run an experiment file's sweep, then report")
    bench.add_argument("experiment", help="TOML experiment file, e.g. experiments/NAME.toml")
    bench.add_argument(
        "--out",
        type=_path,
        help="results folder (default: results/<experiment name>); "
        "an interrupted sweep resumes there",
    )
    bench.add_argument(
        "--timeline",
        action="store_true",
        help="also write each cell's Chrome trace (cells/<id>/trace.json)",
    )
    _add_overwrite(bench, REPLACE_RESULTS)
    bench.add_argument(
        "--launcher",
        choices=["local", "srun"],
        default="local",
        help="srun: each cell is one step of the current Slurm allocation (see gradsync sbatch)",
    )
    from gradsync.cluster import add_sbatch_parser

    add_sbatch_parser(commands)
    report = commands.add_parser("report", help="write the Markdown report of a sweep")
    report.add_argument("results", help="results folder of gradsync bench")
    timeline = commands.add_parser("timeline", help="analyse a --timeline trace")
    timeline.add_argument(
        "action", choices=["summarize"], help="summarize: where each rank's step time went"
    )
    timeline.add_argument("traces", nargs="+", help="Chrome-trace files from --timeline")
    timeline.add_argument(
        "--step",
        type=int,
        help="step drawn in the Gantt chart (default: rank 0's median-length step)",
    )
    compare = commands.add_parser("compare", help="compare checkpoints tensor by tensor")
    compare.add_argument("checkpoints", nargs="+", help="reference first, then the others")
    compare.add_argument(
        "--tolerance",
        type=float,
        help="max abs difference (default: 1e-9 when every checkpoint is float64, else 1e-5)",
    )
    _add_predict_parsers(commands)
    return parser


def _add_predict_parsers(commands: argparse._SubParsersAction) -> None:
    """``gradsync profile`` and ``gradsync predict`` (gradsync/predict/commands.py)."""
    from gradsync.predict.commands import COMMANDS as PREDICT_COMMANDS
    from gradsync.predict.commands import add_parsers

    add_parsers(commands)
    COMMANDS.update(PREDICT_COMMANDS)


def _config(args: argparse.Namespace, **overrides: object):
    """The TrainConfig of the command line; ``overrides`` set what the command decides."""
    from gradsync.config import LaunchConfig, OptimConfig

    launch = LaunchConfig(
        num_nodes=getattr(args, "nnodes", 1),
        node_rank=getattr(args, "node_rank", 0),
        master_addr=getattr(args, "master_addr", None) or "127.0.0.1",
        master_port=getattr(args, "master_port", None),
        timeout_s=args.timeout,
        threads=args.threads,
        interop_threads=args.interop_threads,
        device=args.device,
        hosts=getattr(args, "hosts", 0),
        ranks_per_host=getattr(args, "ranks_per_host", None),
        bandwidth=getattr(args, "bandwidth", None),
        hang_timeout_s=args.hang_timeout,
        max_restarts=getattr(args, "max_restarts", 0),
    )
    if args.momentum is not None and args.optimizer == "adam":
        raise UserError(
            f"--momentum {args.momentum} is SGD's; adam keeps its own moments (betas 0.9, "
            "0.999) and would ignore it; drop --momentum, or use --optimizer sgd"
        )
    optim = OptimConfig(
        name=args.optimizer,
        lr=args.lr,
        momentum=OptimConfig.momentum if args.momentum is None else args.momentum,
        weight_decay=args.weight_decay,
        lr_warmup_steps=args.lr_warmup_steps,
        lr_scaling=args.lr_scaling,
        lr_base_batch=args.lr_base_batch,
    )
    fields: dict[str, object] = dict(
        model=args.model,
        preset=args.preset,
        model_options=dict(args.model_option),
        steps=args.steps,
        global_batch=args.global_batch,
        seed=args.seed,
        batchnorm=args.batchnorm,
        data=args.data,
        measure_warmup=args.measure_warmup,
        optim=optim,
        launch=launch,
        dtype=args.precision if hasattr(args, "precision") else args.dtype,
    )
    fields.update(overrides)
    config = TrainConfig(**fields)  # type: ignore[arg-type]
    if getattr(args, "epochs", None) is not None:  # --steps and --epochs are exclusive
        from gradsync.models import steps_for_epochs

        config = dataclasses.replace(config, steps=steps_for_epochs(config, args.epochs))
    return config


def _strategy_options(strategy: str, args: argparse.Namespace):
    """``train``'s strategy options from the flags given; a flag of another strategy is an
    error naming the strategies that take it."""
    from gradsync.options import given_options, options_for
    from gradsync.strategies import options_by_strategy, strategy_class

    strategy_class(strategy)  # unknown names: one line listing the choices
    return options_for(strategy, options_by_strategy(), given_options(args))


def _timestamped(prefix: str) -> str:
    return f"runs/{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"


def cmd_train(args: argparse.Namespace) -> int:
    from gradsync.topology import check_slurm_step, detect_environment

    env = detect_environment(master_addr=args.master_addr, master_port=args.master_port)
    if env is None and args.workers is None:
        check_slurm_step()  # a batch script's `gradsync train` without srun
    if args.resume and args.out and Path(args.out) != Path(args.resume):
        raise UserError(f"--resume {args.resume} goes on in that folder; drop --out {args.out}")
    if args.resume and getattr(args, "overwrite", False):
        raise UserError(
            f"--resume {args.resume} keeps that run and goes on from its checkpoint, and "
            "--overwrite would clear it; drop one of them"
        )
    if args.nnodes > 1 and env is None and not args.master_addr:
        raise UserError(
            f"--nnodes {args.nnodes} needs --master-addr: the address of node 0 that every "
            "node can reach (127.0.0.1 would only work with every node on this machine)"
        )
    common = dict(
        strategy=args.strategy,
        strategy_options=_strategy_options(args.strategy, args),
        resume=bool(args.resume),
        deterministic=args.deterministic,
        checkpoint_every=args.checkpoint_every,
        log_every=args.log_every,
        timeline=args.timeline,
        timeline_steps=args.timeline_steps,
    )
    if env is None or env.launcher == "gradsync":
        return _train_here(args, common)
    return _train_as_a_rank(args, env, common)


def _train_here(args: argparse.Namespace, common: dict[str, object]) -> int:
    """gradsync's own launcher: this node's ranks as local processes."""
    from gradsync.jobs import check_every_host_used, run_job

    out = args.resume or args.out or _default_out(args.strategy, None, args.nnodes)
    config = _config(args, workers=args.workers or 1, out=out, **common)
    check_every_host_used(config)
    summary = run_job(config, quiet=False, overwrite=args.overwrite)
    if config.launch.node_rank != 0:
        print(f"node {config.launch.node_rank}: done; node 0 writes the results in its --out")
        return EXIT_OK
    print(
        f"{config.strategy} × {config.workers} worker{'s' if config.workers != 1 else ''}: "
        f"{summary['throughput']['median']:,.1f} samples/s; results in {config.out}"
    )
    return EXIT_OK


def _train_as_a_rank(args: argparse.Namespace, env: RankEnv, common: dict[str, object]) -> int:
    """Under torchrun / srun / mpirun: this process is one rank of the launcher's job."""
    from gradsync.jobs import validate
    from gradsync.rundir import check_writable
    from gradsync.runtime import run_rank
    from gradsync.strategies import strategy_class

    if args.hosts:
        raise UserError(f"--hosts emulates hosts under gradsync's own launcher, not {env.launcher}")
    servers = strategy_class(args.strategy).num_server_ranks
    workers = args.workers or env.world_size
    config = _config(args, workers=workers, **common)
    expected = workers + servers(config)
    if expected != env.world_size:
        raise UserError(
            f"{env.launcher} started {env.world_size} processes but --workers "
            f"{workers} with strategy '{args.strategy}' needs {expected}; "
            "match the launcher's process count"
        )
    config = config.replace(
        out=args.resume or args.out or _default_out(args.strategy, env, args.nnodes)
    )
    validate(config, one_rank=True)
    if env.rank == 0:
        _claim_for_the_ranks(config, env, overwrite=args.overwrite)
    else:
        check_writable(Path(config.out))
    run_rank(config, env)
    return EXIT_OK


def _claim_for_the_ranks(config: TrainConfig, env: RankEnv, *, overwrite: bool) -> None:
    """Rank 0 of a launcher's job claims ``--out`` as gradsync's own launcher does, before
    any rank may write there (they wait for rank 0 at the rendezvous); when the folder
    cannot be had, every rank stops with rank 0's line instead of waiting for it. A
    launcher's restart of the same launch (torchrun ``--max-restarts``, a Slurm requeue)
    takes its own folder back: the folder names the launch that claimed it."""
    from datetime import timedelta

    from gradsync.files import atomic_write_text
    from gradsync.jobs import prepare_out
    from gradsync.rendezvous import rendezvous
    from gradsync.rundir import LAUNCH_FILE

    out = Path(config.out)
    try:
        prepare_out(config, overwrite=overwrite or _restart_of(env, out))
    except UserError as refusal:
        rendezvous(env, timedelta(seconds=config.launch.timeout_s), refusal=str(refusal))
        raise
    if env.job:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / LAUNCH_FILE, json.dumps({"job": env.job}) + "\n")


def _restart_of(env: RankEnv, out: Path) -> bool:
    """Whether this is the launcher restarting the launch that claimed ``out``."""
    from gradsync.rundir import LAUNCH_FILE

    if env.attempt == 0 or not env.job:
        return False
    try:
        return json.loads((out / LAUNCH_FILE).read_text()).get("job") == env.job
    except (OSError, ValueError, AttributeError):
        return False


def _default_out(strategy: str, env: RankEnv | None, nnodes: int) -> str:
    """``--out`` when none is given: a time stamp for one launch on this machine; under a
    launcher that names the job, the job's name, so every rank derives the same folder.

    Example:
        >>> from gradsync.topology import detect_environment
        >>> slurm = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "41"}
        >>> _default_out("ddp", detect_environment(slurm), 1)
        'runs/train-ddp-slurm-step-41.0'
    """
    if env is None or env.launcher == "gradsync":
        if nnodes == 1:
            return _timestamped(f"train-{strategy}")
        launcher = f"--nnodes {nnodes}"
    elif env.job:
        return f"runs/train-{strategy}-{re.sub(r'[^A-Za-z0-9_.-]+', '-', env.job).lower()}"
    else:
        launcher = env.launcher
    raise UserError(
        f"under {launcher} each process would name its own --out from its clock; pass "
        "--out DIR, the same on every node (a shared file system holds the whole run)"
    )


def cmd_verify(args: argparse.Namespace) -> int:
    from gradsync.jobs import inputs_of
    from gradsync.options import given_options
    from gradsync.rundir import claim_run_dir
    from gradsync.strategies import STRATEGIES, split_specs
    from gradsync.verify import check_cells, deterministic_notice, report_verify, run_matrix

    strategies = list(STRATEGIES) if args.strategies is None else split_specs(args.strategies)
    given = given_options(args)
    config = _config(args, deterministic=True, workers=1, strategy="single")
    out = Path(args.out or _timestamped("verify"))
    check_cells(config, strategies, args.workers, given, out)
    claim_run_dir(out, overwrite=args.overwrite, inputs=inputs_of(config))
    print(deterministic_notice(config))
    outcomes = run_matrix(config, strategies, args.workers, out, given=given)
    report_verify(outcomes, out)
    return EXIT_DIFFERS if any(o.failed for o in outcomes) else EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from gradsync.jobs import inputs_of
    from gradsync.options import given_options
    from gradsync.rundir import claim_run_dir
    from gradsync.strategies import STRATEGIES
    from gradsync.verify import check_cells, deterministic_notice, report_demo, run_matrix

    given = given_options(args)
    config = _config(args, deterministic=True, workers=1, strategy="single")
    out = Path(args.out or _timestamped("demo"))
    check_cells(config, list(STRATEGIES), [args.workers], given, out)
    claim_run_dir(out, overwrite=args.overwrite, inputs=inputs_of(config))
    print(deterministic_notice(config))
    outcomes = run_matrix(config, list(STRATEGIES), [args.workers], out, given=given)
    title = (
        f"gradsync demo: {config.model} ({config.preset}), {args.workers} workers, "
        f"{config.steps} steps, synthetic data"
    )
    report_demo(outcomes, out, title)
    return EXIT_DIFFERS if any(o.failed for o in outcomes) else EXIT_OK


def cmd_compare(args: argparse.Namespace) -> int:
    from gradsync.checkpoint import load_checkpoint
    from gradsync.compare import default_tolerance, diff_checkpoints, setting_differences
    from gradsync.tables import print_table

    if len(args.checkpoints) < 2:
        raise UserError("compare needs at least two checkpoints: REFERENCE OTHER [OTHER ...]")
    if args.tolerance is not None and not 0 <= args.tolerance < math.inf:
        raise UserError(f"--tolerance must be a finite number >= 0, got {args.tolerance}")
    checkpoints = [load_checkpoint(path) for path in args.checkpoints]
    reference, *others = checkpoints
    beyond = 0
    for other in others:
        # Per pair: a float64 pair is judged at float64's tolerance beside a float32 one.
        tolerance = args.tolerance
        if tolerance is None:
            tolerance = default_tolerance([reference, other])
        diffs = diff_checkpoints(reference, other)
        rows = [
            [
                d.name,
                f"{d.max_abs:.3e}",
                f"{d.max_rel:.3e}",
                "ok" if d.within(tolerance) else "BEYOND",
            ]
            for d in diffs
        ]
        beyond += sum(not d.within(tolerance) for d in diffs)
        print_table(
            f"reference {reference.path}, compared {other.path} "
            f"(tolerance: max abs ≤ {tolerance:g}"
            f"{'' if args.tolerance is not None else ', the default for this pair'})",
            ["tensor", "max abs diff", "max rel diff", "verdict"],
            rows,
        )
        for note in setting_differences(reference, other):
            print(f"note: the runs differ in {note}")
    print(f"{beyond} tensor(s) beyond tolerance" if beyond else "all tensors within tolerance")
    return EXIT_DIFFERS if beyond else EXIT_OK


def _add_commbench_parser(commands: argparse._SubParsersAction) -> None:
    from gradsync.commbench import DEFAULT_MAX_BYTES, DEFAULT_MIN_BYTES, DEFAULT_OPS, OPS

    def warmup_iterations(text: str) -> int:
        """--warmup: at least 1, unlike profile's: commbench always runs each size once,
        untimed, to fit the timed iterations into its time budget."""
        try:
            return _positive_int(text)
        except argparse.ArgumentTypeError:
            if text.strip().lstrip("-").isdigit():  # a whole number below 1
                raise argparse.ArgumentTypeError(
                    f"{text} warm-up iterations: commbench always runs at least 1 (its first "
                    "run of each size sets how many timed iterations fit the time budget); "
                    "give --warmup 1 or more"
                ) from None
            raise

    bench = commands.add_parser(
        "commbench",
        help="collective bandwidth vs message size (nccl-tests style)",
        description="Time allreduce, reduce, broadcast, allgather, p2p (rank 0 → 1) and "
        "exchange (ranks r and r + n/2 send to each other at once) over message sizes; report "
        "time, algorithm and bus bandwidth (nccl-tests definitions) and the ranks' mean CPU time.",
    )
    bench.add_argument("--workers", type=_positive_int, default=2, help="ranks (default 2)")
    bench.add_argument(
        "--ops",
        default=",".join(DEFAULT_OPS),
        help=f"comma-separated subset of {','.join(OPS)} (default: all but exchange and wire)",
    )
    bench.add_argument("--min-bytes", default=str(DEFAULT_MIN_BYTES), help="e.g. 4K (default)")
    bench.add_argument("--max-bytes", default=str(DEFAULT_MAX_BYTES), help="e.g. 256M (default)")
    bench.add_argument("--factor", type=int, default=2, choices=[2, 4], help="size step")
    bench.add_argument("--sizes", help="explicit sizes instead of the sweep, e.g. 1M,16M")
    bench.add_argument(
        "--warmup",
        type=warmup_iterations,
        default=5,
        help="warm-up iterations (at least 1: the first also sizes the timed ones; default 5)",
    )
    bench.add_argument("--iters", type=_positive_int, default=20, help="timed iterations")
    bench.add_argument(
        "--time-budget",
        type=float,
        default=1.0,
        help="seconds of timed iterations per size at most (fewer iterations on slow links)",
    )
    bench.add_argument(
        "--busy-ms",
        default="0",
        help="comma-separated: compute this long on every rank before each timed operation "
        "(not counted), as training ranks do between blocking collectives; every operation "
        "and size is measured at each (default 0: idle ranks)",
    )
    bench.add_argument("--threads", type=_positive_int, help="intra-op threads per rank")
    bench.add_argument(
        "--timeout", type=float, default=300.0, help="seconds before a collective gives up"
    )
    bench.add_argument("--master-port", type=int, help="rendezvous port (default: a free one)")
    bench.add_argument("--out", type=_path, help="results folder")
    _add_overwrite(bench, "replace the results in --out")
    _add_netem_options(bench)


def _milliseconds_list(text: str, flag: str) -> tuple[float, ...]:
    """``0,1,2.5`` → (0.0, 1.0, 2.5); anything else is a one-line UserError."""
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UserError(f"{flag} {text!r} is not a comma-separated list of milliseconds") from None


def cmd_commbench(args: argparse.Namespace) -> int:
    from gradsync.commbench import (
        CommbenchConfig,
        check_memory,
        parse_size,
        report,
        run_commbench,
        sizes_from,
    )
    from gradsync.config import LaunchConfig
    from gradsync.rundir import claim_run_dir

    sizes = [parse_size(part) for part in args.sizes.split(",")] if args.sizes else None
    config = CommbenchConfig(
        workers=args.workers,
        ops=tuple(op.strip() for op in args.ops.split(",") if op.strip()),
        sizes=sizes_from(
            sizes, parse_size(args.min_bytes), parse_size(args.max_bytes), args.factor
        ),
        warmup_iters=args.warmup,
        iters=args.iters,
        time_budget_s=args.time_budget,
        busy_ms=_milliseconds_list(args.busy_ms, "--busy-ms"),
        out=args.out or _timestamped("commbench"),
        launch=LaunchConfig(
            master_port=args.master_port,
            timeout_s=args.timeout,
            threads=args.threads,
            device="cpu",
            hosts=args.hosts,
            ranks_per_host=args.ranks_per_host,
            bandwidth=args.bandwidth,
        ),
    )
    check_memory(config)  # before the folder: --overwrite must not clear it for nothing
    claim_run_dir(Path(config.out), overwrite=args.overwrite)
    payload = run_commbench(config)
    report(payload, Path(config.out))
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    from gradsync.bench.experiment import load_experiment
    from gradsync.bench.report import write_report
    from gradsync.bench.sweep import run_sweep

    experiment = load_experiment(args.experiment)
    out = Path(args.out or f"results/{experiment.name}")
    cells = experiment.cells()
    print(f"{experiment.name}: {len(cells)} cells, {experiment.length} each; results in {out}")
    records = run_sweep(
        experiment,
        out,
        show_progress=sys.stdout.isatty(),
        timeline=args.timeline,
        launcher=args.launcher,
        overwrite=args.overwrite,
    )
    failed = sum(r["status"] == "failed" for r in records)
    report = write_report(out)
    print(f"{len(records) - failed} cell(s) ok, {failed} failed; report in {report}")
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from gradsync.bench.report import write_report

    print(f"report in {write_report(Path(args.results))}")
    return EXIT_OK


def cmd_timeline(args: argparse.Namespace) -> int:
    from gradsync.timeline_summary import gantt, print_summary, summarize_trace, write_summary
    from gradsync.trace_check import check_trace

    for trace in map(Path, args.traces):
        check_trace(trace, args.step)  # every trace is sound before anything is written
    for trace in map(Path, args.traces):
        summary = summarize_trace(trace)
        print_summary(summary)
        out_json = trace.with_name(trace.stem + ".summary.json")
        out_png = trace.with_name(trace.stem + ".gantt.png")
        write_summary(summary, out_json)
        step = gantt(trace, out_png, step=args.step)
        print(f"summary in {out_json}; Gantt chart of step {step} in {out_png}")
    return EXIT_OK


def cmd_sbatch(args: argparse.Namespace) -> int:
    from gradsync.cluster import cmd_sbatch as write_sbatch

    return write_sbatch(args)


def cmd_netem(args: argparse.Namespace) -> int:
    from gradsync import netem

    if args.action == "list":
        runs = netem.find_runs()
        for run in runs:
            owner = f"launcher pid {run.owner_pid}" if run.owner_pid else "no state file"
            state = "live" if run.alive else "left over"
            print(f"gs{run.run_id}: {state} ({owner}): {' '.join(run.namespaces) or '-'}")
        print(f"{len(runs)} emulated-network run(s)")
        return EXIT_OK
    removed = netem.cleanup()
    for run in removed:
        print(f"removed gs{run.run_id}: {' '.join(run.namespaces) or '(state file only)'}")
    print(f"{len(removed)} left-over run(s) cleaned up")
    return EXIT_OK


COMMANDS = {"train": cmd_train, "verify": cmd_verify, "demo": cmd_demo, "compare": cmd_compare}
COMMANDS.update(
    commbench=cmd_commbench,
    netem=cmd_netem,
    timeline=cmd_timeline,
    bench=cmd_bench,
    report=cmd_report,
    sbatch=cmd_sbatch,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gradsync`` command; returns the exit code."""
    from gradsync.signals import Stopped, stop_on_signals

    stop_on_signals()  # SIGTERM/SIGHUP end the job like Ctrl-C (exit 143/129), from here on
    try:
        parser = build_parser()  # imports torch, and the GRADSYNC_STRATEGIES plugins: seconds
    except UserError as error:
        say(f"gradsync: error: {error}")
        return EXIT_USER_ERROR
    except Stopped as stop:
        say(f"gradsync: stopped by {stop.name} before anything started")
        return stop.exit_code
    args = parser.parse_args(argv)
    from gradsync.rendezvous import finish_process

    # A rank under torchrun, srun or mpirun exits at once (see finish_process).
    return finish_process(_run_command(args))


def _run_command(args: argparse.Namespace) -> int:
    from gradsync.signals import Stopped

    try:
        return COMMANDS[args.command](args)
    except UserError as error:
        say(f"gradsync: error: {error}")
        return EXIT_USER_ERROR
    except JobFailed as failure:
        say(f"gradsync: job failed: {failure}")
        return failure.exit_code
    except KeyboardInterrupt:
        say("gradsync: interrupted")
        return 130
    except Stopped as stop:
        say(f"gradsync: stopped by {stop.name}; every rank was stopped")
        return stop.exit_code
    except Exception:  # a bug: its traceback, exit 1 (and a rank still exits at once)
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
