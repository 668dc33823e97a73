"""Slurm: a job script for a bench experiment, and the cells of a sweep run by ``srun``.

``gradsync sbatch EXPERIMENT.toml`` writes ``results/<name>/job.sbatch``: a batch script
asking for the nodes, tasks per node and CPUs per task the experiment needs and a time
limit estimated from its cells, whose one command is ``gradsync bench EXPERIMENT --launcher
srun``. Inside the job, every cell is one ``srun`` step of ``workers + servers`` tasks over
as many nodes as that takes (``--tasks-per-node`` ranks per node), so a scaling study of
1, 2, 4 and 8 workers really spreads over the nodes; the results folder is the one
``gradsync report`` reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradsync.errors import JobFailed, UserError
from gradsync.files import atomic_write_text

if TYPE_CHECKING:
    from gradsync.bench.experiment import Experiment
    from gradsync.config import TrainConfig

SCRIPT_NAME = "job.sbatch"
STARTUP_S = 30.0  # per cell: srun step, interpreter, torch import, rendezvous
STEP_S = {"tiny": 0.2, "default": 2.0, "paper": 10.0}  # seconds per step, generous
SAFETY = 2.0  # the time limit is twice the estimate …
MIN_LIMIT_S = 10 * 60  # … and at least ten minutes
STDERR_TAIL_LINES = 15


@dataclass(frozen=True, kw_only=True)
class JobShape:
    """What the batch job asks Slurm for.

    Example:
        >>> JobShape(nodes=2, tasks_per_node=4, cpus_per_task=1, time_limit_s=3600).header()[:2]
        ['#SBATCH --nodes=2', '#SBATCH --ntasks-per-node=4']
    """

    nodes: int
    tasks_per_node: int
    cpus_per_task: int
    time_limit_s: int

    def header(self) -> list[str]:
        return [
            f"#SBATCH --nodes={self.nodes}",
            f"#SBATCH --ntasks-per-node={self.tasks_per_node}",
            f"#SBATCH --cpus-per-task={self.cpus_per_task}",
            f"#SBATCH --time={format_time_limit(self.time_limit_s)}",
        ]


def format_time_limit(seconds: float) -> str:
    """Slurm's ``[D-]HH:MM:SS``, rounded up to the minute.

    Example:
        >>> format_time_limit(59), format_time_limit(3 * 3600 + 1), format_time_limit(90000)
        ('00:01:00', '03:01:00', '1-01:00:00')
    """
    minutes = math.ceil(seconds / 60)
    days, minutes = divmod(minutes, 24 * 60)
    text = f"{minutes // 60:02d}:{minutes % 60:02d}:00"
    return f"{days}-{text}" if days else text


def estimate_seconds(experiment: Experiment) -> float:
    """A generous guess of the sweep's wall time: start-up plus steps, cell by cell.

    Example:
        >>> # estimate_seconds(load_experiment("experiments/tiny.toml"))  # 6 cells → 192.0
    """
    per_step = STEP_S.get(experiment.preset, STEP_S["default"])
    if experiment.epochs is None:
        return len(experiment.cells()) * (STARTUP_S + experiment.steps * per_step)
    from gradsync.bench.sweep import cell_config

    steps = [cell_config(experiment, c, Path(".")).steps for c in experiment.cells()]
    return sum(STARTUP_S + n * per_step for n in steps)


def job_shape(
    experiment: Experiment,
    *,
    tasks_per_node: int,
    cpus_per_task: int | None = None,
    time_limit_s: int | None = None,
) -> JobShape:
    """Nodes for the largest cell at ``tasks_per_node`` ranks per node; CPUs from ``threads``.

    Example:
        >>> # job_shape(load_experiment("experiments/tiny.toml"), tasks_per_node=1).nodes  # 2
    """
    from gradsync.bench.sweep import cell_config
    from gradsync.strategies import world_size_of

    if any(cell.bandwidth for cell in experiment.cells()):
        raise UserError(
            f"experiment {experiment.path} sets bandwidths, which emulate hosts on one machine; "
            "a cluster has real links: remove bandwidths to run it with gradsync sbatch"
        )
    largest = max(
        world_size_of(cell_config(experiment, cell, Path("."))) for cell in experiment.cells()
    )
    threads = [t for t in experiment.threads if t is not None]
    estimate = SAFETY * estimate_seconds(experiment)
    return JobShape(
        nodes=math.ceil(largest / tasks_per_node),
        tasks_per_node=min(tasks_per_node, largest),
        cpus_per_task=cpus_per_task or max(threads, default=1),
        time_limit_s=time_limit_s or max(MIN_LIMIT_S, math.ceil(estimate)),
    )


def sbatch_script(
    experiment: Experiment,
    shape: JobShape,
    *,
    results: Path,
    workdir: Path,
    extra: list[str] | None = None,
) -> str:
    """The batch script: Slurm's header, then ``gradsync bench … --launcher srun``.

    ``extra`` are more ``#SBATCH`` options, e.g. ``["--partition=cpu"]``.

    Example:
        >>> # print(sbatch_script(experiment, shape, results=Path("results/tiny"), workdir=cwd))
    """
    command = [
        sys.executable, "-m", "gradsync", "bench", str(Path(experiment.path).resolve()),
        "--out", str(results.resolve()), "--launcher", "srun",
    ]  # fmt: skip
    lines = [
        "#!/bin/bash",
        f"# gradsync bench {experiment.name} on Slurm, written by gradsync sbatch.",
        f"# Results in {results}; the sweep writes its report there (gradsync report rewrites it).",
        f"#SBATCH --job-name=gradsync-{experiment.name}",
        *shape.header(),
        f"#SBATCH --chdir={sbatch_value(str(workdir.resolve()))}",
        f"#SBATCH --output=slurm-gradsync-{experiment.name}-%j.out",
        *(f"#SBATCH {option}" for option in extra or []),
        "set -euo pipefail",
        "# One srun step per cell, over as many of the job's nodes as the cell needs.",
        shlex.join(command),
    ]
    return "\n".join(lines) + "\n"


def sbatch_value(text: str) -> str:
    """``text`` as the value of an ``#SBATCH`` option: sbatch splits its lines at blanks
    outside double quotes, so a value with a blank is quoted; a double quote or a line
    break cannot be written there (UserError).

    Example:
        >>> sbatch_value("/home/me/runs"), sbatch_value("/home/me/my runs")
        ('/home/me/runs', '"/home/me/my runs"')
    """
    if '"' in text or "\n" in text:
        raise UserError(
            f"{text!r} holds a double quote or a line break, which an #SBATCH line cannot "
            "carry; run gradsync sbatch from a folder without one"
        )
    return f'"{text}"' if any(c.isspace() for c in text) else text


def add_sbatch_parser(commands: argparse._SubParsersAction) -> None:
    """The ``gradsync sbatch`` subcommand's options."""
    # The CLI's own flags and checks: one line on bad input, the same help as bench's.
    from gradsync.cli import REPLACE_RESULTS, _add_overwrite, _path, _positive_int

    sbatch = commands.add_parser(
        "sbatch",
        help="write a Slurm job script running an experiment file's sweep on a cluster",
        description="Write results/<name>/job.sbatch for `gradsync bench EXPERIMENT` on a "
        "Slurm cluster: one srun step per cell, then `gradsync report` reads the results.",
    )
    sbatch.add_argument("experiment", help="TOML experiment file, e.g. experiments/NAME.toml")
    sbatch.add_argument(
        "--out", type=_path, help="results folder (default: results/<experiment name>)"
    )
    sbatch.add_argument(
        "--tasks-per-node", type=_positive_int, default=1, help="ranks per node (default 1)"
    )
    sbatch.add_argument(
        "--cpus-per-task",
        type=_positive_int,
        help="CPUs per rank (default: the experiment's largest threads, or 1)",
    )
    sbatch.add_argument("--time", help="time limit [D-]HH:MM:SS (default: an estimate)")
    sbatch.add_argument(
        "--sbatch-option",
        action="append",
        default=[],
        metavar="OPTION",
        help="another #SBATCH line, e.g. --sbatch-option=--partition=cpu (the = keeps the "
        "option's own dashes from being read as a flag; repeatable)",
    )
    sbatch.add_argument(
        "--print-sbatch", action="store_true", help="print the script instead of writing it"
    )
    sbatch.add_argument("--submit", action="store_true", help="also submit it with sbatch")
    _add_overwrite(sbatch, REPLACE_RESULTS)


def cmd_sbatch(args: argparse.Namespace) -> int:
    """``gradsync sbatch``: write (or print, or submit) the job script of an experiment."""
    from gradsync.bench.experiment import load_experiment
    from gradsync.bench.sweep import claim_results_dir

    experiment = load_experiment(args.experiment)
    for option in args.sbatch_option:
        check_sbatch_option(option)
    if args.print_sbatch and args.submit:
        raise UserError("--print-sbatch prints the script and --submit submits it; pick one")
    if args.submit and shutil.which("sbatch") is None:  # before the script is written
        raise UserError("sbatch is not on PATH; run gradsync sbatch --submit on a Slurm login node")
    shape = job_shape(
        experiment,
        tasks_per_node=args.tasks_per_node,
        cpus_per_task=args.cpus_per_task,
        time_limit_s=parse_time_limit(args.time) if args.time else None,
    )
    results = Path(args.out or f"results/{experiment.name}")
    script = sbatch_script(
        experiment, shape, results=results, workdir=Path.cwd(), extra=args.sbatch_option
    )
    if args.print_sbatch:
        print(script, end="")
        return 0
    # The folder the job's sweep will fill: new, or this experiment's own (it resumes there).
    claim_results_dir(results, experiment, overwrite=args.overwrite)
    path = results / SCRIPT_NAME
    atomic_write_text(path, script)
    print(
        f"{path}: {len(experiment.cells())} cells on {shape.nodes} node(s) × "
        f"{shape.tasks_per_node} task(s), {shape.cpus_per_task} CPU(s) per task, time limit "
        f"{format_time_limit(shape.time_limit_s)}; submit with: sbatch {path}"
    )
    if args.submit:
        print(submit(path))
    return 0


def check_sbatch_option(option: str) -> None:
    """UserError unless ``option`` is one #SBATCH option: it starts with a dash and holds
    no line break.

    Example:
        >>> check_sbatch_option("--partition=cpu")
        >>> check_sbatch_option("partition=cpu")
        Traceback (most recent call last):
        gradsync.errors.UserError: --sbatch-option 'partition=cpu' is not an sbatch option ...
    """
    if "\n" in option or "\r" in option:
        raise UserError(
            f"--sbatch-option {option!r} holds a line break; give one #SBATCH option each"
        )
    if not option.strip().startswith("-"):
        raise UserError(
            f"--sbatch-option {option!r} is not an sbatch option (they start with - or --); "
            "write e.g. --sbatch-option=--partition=cpu"
        )


def parse_time_limit(text: str) -> int:
    """Seconds of a Slurm time limit: ``[D-]HH:MM:SS`` or minutes.

    Example:
        >>> parse_time_limit("1-02:00:00"), parse_time_limit("00:30:00"), parse_time_limit("45")
        (93600, 1800, 2700)
    """
    match = re.fullmatch(r"(?:(\d+)-)?(\d+):(\d\d):(\d\d)|(\d+)", text.strip())
    if match is None:
        raise UserError(f"--time {text!r} is not a time limit; write [D-]HH:MM:SS or minutes")
    days, hours, minutes, seconds, only_minutes = match.groups()
    if only_minutes is not None:
        limit = int(only_minutes) * 60
    else:
        limit = int(days or 0) * 86400 + int(hours) * 3600 + int(minutes) * 60 + int(seconds)
    if limit == 0:
        raise UserError(f"--time {text!r} is zero, which Slurm reads as no limit; give a time")
    return limit


def submit(script: Path) -> str:
    """``sbatch SCRIPT``; its answer (``Submitted batch job N``)."""
    if shutil.which("sbatch") is None:
        raise UserError("sbatch is not on PATH; run gradsync sbatch --submit on a Slurm login node")
    result = subprocess.run(["sbatch", str(script)], capture_output=True, text=True, check=False)
    if result.returncode:
        message = (result.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise UserError(f"sbatch {script} was refused: {message}")
    return result.stdout.strip()


def check_allocation() -> None:
    """UserError unless this process runs inside a Slurm allocation with ``srun`` at hand."""
    if "SLURM_JOB_ID" not in os.environ or shutil.which("srun") is None:
        raise UserError(
            "--launcher srun runs inside a Slurm allocation (sbatch or salloc); "
            "use gradsync sbatch EXPERIMENT to write the job script"
        )


def srun_job(config: TrainConfig) -> dict[str, Any]:
    """Run one job as an ``srun`` step inside the current allocation; its summary.

    The step has ``workers + servers`` tasks on as many of the allocation's nodes as
    ``SLURM_NTASKS_PER_NODE`` allows; ranks without a ``threads`` setting get the
    allocation's CPUs per task.

    Example:
        >>> # summary = srun_job(cell_config(experiment, cell, out))  # inside sbatch
    """
    from gradsync.jobs import validate
    from gradsync.launch import free_port
    from gradsync.metrics import load_summary
    from gradsync.strategies import world_size_of

    check_allocation()
    if config.launch.hosts:
        raise UserError("emulated hosts (bandwidths) cannot run under srun; remove bandwidths")
    validate(config, local=False)
    cpus = int(os.environ.get("SLURM_CPUS_PER_TASK", "1"))
    if config.launch.threads is None:
        config = config.replace(launch=dataclasses.replace(config.launch, threads=cpus))
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "srun-config.json"
    config_path.write_text(config.to_json())
    argv = srun_argv(world_size_of(config), cpus_per_task=cpus, env=os.environ)
    argv += [sys.executable, "-m", "gradsync.runtime", str(config_path)]
    env = {**os.environ, "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}
    with open(out / "stdout.log", "wb") as stdout, open(out / "stderr.log", "wb") as stderr:
        code = subprocess.run(argv, env=env, stdout=stdout, stderr=stderr, check=False).returncode
    if code:
        tail = (out / "stderr.log").read_text(errors="replace").splitlines()[-STDERR_TAIL_LINES:]
        errors = [line for line in tail if line.startswith("gradsync: error: ")]
        raise JobFailed(errors[-1] if errors else f"srun exited with {code}: " + " | ".join(tail))
    return load_summary(out)


def srun_argv(world_size: int, *, cpus_per_task: int, env: dict[str, str] | Any) -> list[str]:
    """``srun`` options for a step of ``world_size`` tasks in the current allocation.

    Example:
        >>> srun_argv(5, cpus_per_task=2, env={"SLURM_NTASKS_PER_NODE": "4",
        ...     "SLURM_JOB_NUM_NODES": "2"})  # doctest: +NORMALIZE_WHITESPACE
        ['srun', '--nodes=2', '--ntasks=5', '--ntasks-per-node=4', '--cpus-per-task=2',
         '--kill-on-bad-exit=1']
    """
    nodes = int(env.get("SLURM_JOB_NUM_NODES", "1"))
    per_node = int(env.get("SLURM_NTASKS_PER_NODE", "0")) or math.ceil(world_size / nodes)
    needed = math.ceil(world_size / per_node)
    if needed > nodes:
        raise UserError(
            f"a cell needs {world_size} ranks, {needed} node(s) at {per_node} per node, but the "
            f"job has {nodes}; write the script again with gradsync sbatch"
        )
    return [
        "srun",
        f"--nodes={needed}",
        f"--ntasks={world_size}",
        f"--ntasks-per-node={min(per_node, world_size)}",
        f"--cpus-per-task={cpus_per_task}",
        "--kill-on-bad-exit=1",
    ]


__all__ = [
    "JobShape",
    "add_sbatch_parser",
    "check_allocation",
    "cmd_sbatch",
    "estimate_seconds",
    "format_time_limit",
    "job_shape",
    "parse_time_limit",
    "sbatch_script",
    "srun_argv",
    "srun_job",
]
