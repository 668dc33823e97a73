"""Every synchronous strategy computes single's parameters (DESIGN.md §3), in float64.

float64 rounding stays near 1e-12 over many steps on any CPU, so one absolute tolerance
(1e-9) holds every zoo model and every adversarial model: no per-CPU inflation, and a
real bug (a moved parameter without a gradient, a stale row) shows at 1e-6 or more.
Every cell runs with 1 intra-op thread; ``verify`` reruns single with 2 threads, and the
tolerance it derives from that rerun must stay the plain 1e-9.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gradsync.verify import FLOAT64_TOLERANCE
from tests.e2e.conftest import REPO, gradsync, verify_outcomes

pytestmark = pytest.mark.slow

SYNCHRONOUS = "ddp,allreduce,ps,ps:colocate,hybrid,p3"
# Overlapped pushes, one per variable; the last also splits every variable over 2 servers.
PER_VARIABLE_PUSHES = (
    "ps:push_chunk_mb=0,ps:colocate:push_chunk_mb=0,"
    "ps:servers=2:push_chunk_mb=0:partition_threshold_mb=0.0001"
)
ZOO = ["transformer", "lstm-lm", "resnet56", "vgg16", "mnist-cnn"]  # the P3 models: own file
ADVERSARIAL = REPO / "tests" / "models" / "adversarial.py"


def _verify(
    workdir: Path,
    *args: str,
    strategies: str = SYNCHRONOUS,
    workers: tuple[int, ...] = (2, 4),
    threads: int = 1,
) -> list[dict]:
    out = workdir / "verify"
    result = gradsync(
        "verify",
        *args,
        "--strategies",
        strategies,
        "--workers",
        ",".join(map(str, workers)),
        "--threads",
        str(threads),
        "--out",
        str(out),
        cwd=workdir,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "float64" in result.stdout and "dropout is disabled" in result.stdout
    outcomes = verify_outcomes(out)
    expected = {(s, w) for s in strategies.split(",") for w in workers} | {("single", 1)}
    assert {(o["strategy"], o["workers"]) for o in outcomes} == expected
    for outcome in outcomes:
        assert outcome["tolerance"] == FLOAT64_TOLERANCE, outcome
        assert outcome["verdict"] in ("reference", "match"), outcome
        assert outcome["max_abs"] <= FLOAT64_TOLERANCE, outcome
    return outcomes


@pytest.mark.parametrize("model", ZOO)
def test_zoo_model_matches_single_in_float64(model: str, workdir: Path) -> None:
    _verify(
        workdir,
        "--model",
        model,
        "--preset",
        "tiny",
        "--steps",
        "8",
        "--weight-decay",
        "1e-4",
    )


def test_two_threads_per_rank_match_too(workdir: Path) -> None:
    """Another reduction order inside each rank (single's rerun then uses 1 thread)."""
    _verify(
        workdir, "--model", "resnet56", "--preset", "tiny", "--steps", "8", workers=(2,), threads=2
    )


def test_dense_adversary_matches_single(workdir: Path) -> None:
    """Tied, gated (per worker), never-used, frozen, 0-dim and non-contiguous parameters,
    BatchNorm without affine parameters (under two names) and without running statistics,
    a loss that reads a parameter; momentum 0.9 and weight decay move any parameter wrongly
    given a zero gradient."""
    _verify(
        workdir,
        "--model",
        f"{ADVERSARIAL}:build_dense",
        "--steps",
        "12",
        "--global-batch",
        "16",
        "--weight-decay",
        "0.01",
        strategies=f"{SYNCHRONOUS},{PER_VARIABLE_PUSHES}",
    )
    log = (workdir / "verify" / "ddp-w2" / "stdout.log").read_text()
    assert "find_unused_parameters=True" in log and "never_used" in log


def test_sparse_adversary_matches_single(workdir: Path) -> None:
    """Sparse tables: plain, gated, never read, tied to the output (hybrid: dense path).
    ddp is left out: torch's DDP cannot reduce a sparse gradient a worker lacks (refused
    before launch, see test_ddp_refuses_a_stranded_sparse_gradient)."""
    _verify(
        workdir,
        "--model",
        f"{ADVERSARIAL}:build_sparse",
        "--steps",
        "12",
        "--global-batch",
        "16",
        strategies="allreduce,allreduce:sparse_as_dense=true,ps,ps:colocate,hybrid,"
        f"hybrid:colocate,p3,{PER_VARIABLE_PUSHES}",
    )
    log = (workdir / "verify" / "hybrid-w2" / "stdout.log").read_text()
    assert "tied.weight [12×8]: dense" in log and "lookup.weight [12×8]: sparse" in log


def test_sparse_lstm_allgather_and_sparse_as_dense_match_single(workdir: Path) -> None:
    """lstm-lm with sparse embeddings and sampled softmax: allreduce allgathers the rows
    (Horovod's default) or densifies them (--sparse-as-dense); ddp reduces them sparsely."""
    _verify(
        workdir,
        "--model",
        "lstm-lm",
        "--preset",
        "tiny",
        "--model-option",
        "sparse=true",
        "--model-option",
        "sampled_softmax=5",
        "--steps",
        "6",
        strategies="ddp,allreduce,allreduce:sparse_as_dense=true",
        workers=(2,),
    )


def test_adversarial_data_exercises_every_gating_case() -> None:
    """The runs above are only adversarial if, in the steps they run, the gated branch is
    used by every worker in some step, by some workers only in another, by none in yet
    another (so the branch's parameters get no gradient anywhere)."""
    from gradsync.models import build_workload
    from tests.models.adversarial import GATE

    dataset = build_workload(f"{ADVERSARIAL}:build_dense").dataset
    for workers in (2, 4):
        seen = set()
        size = 16 // workers
        for step in range(12):
            shards = [
                dataset.batch(step=step, size=16, start=size * k, stop=size * (k + 1))
                for k in range(workers)
            ]
            used = [bool((shard.inputs[0][:, 1] > GATE).any()) for shard in shards]
            seen.add("all" if all(used) else "none" if not any(used) else "some")
        assert seen == {"all", "some", "none"}, (workers, seen)


def test_ddp_refuses_a_stranded_sparse_gradient(workdir: Path) -> None:
    result = gradsync(
        "train",
        "--model",
        f"{ADVERSARIAL}:build_sparse",
        "--strategy",
        "ddp",
        "--workers",
        "2",
        "--steps",
        "2",
        "--global-batch",
        "16",
        "--out",
        "run",
        cwd=workdir,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    # Its tied table first: a sparse table tied to the output layer gets a dense gradient,
    # which crashed DDP's reducer at step 0 before session 29 (probe 29c).
    assert "tied.weight is an nn.Embedding(sparse=True)" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (workdir / "run" / "metrics").exists()  # refused before any rank started


def test_float32_verification_keeps_its_measured_floor(workdir: Path) -> None:
    out = workdir / "verify"
    result = gradsync(
        "verify",
        "--model",
        "mnist-cnn",
        "--preset",
        "tiny",
        "--precision",
        "float32",
        "--strategies",
        "ddp,allreduce",
        "--workers",
        "2",
        "--steps",
        "10",
        "--out",
        str(out),
        cwd=workdir,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for outcome in verify_outcomes(out):
        assert outcome["tolerance"] >= 1e-5 and outcome["max_abs"] <= outcome["tolerance"]


def test_adam_matches_in_float64(workdir: Path) -> None:
    """In float32 Adam turns ±1e-10 gradient noise into lr-sized steps (see verify.py); in
    float64 the noise is far below Adam's epsilon, so Adam is held to 1e-9 as well."""
    out = workdir / "verify"
    result = gradsync(
        "verify",
        "--model",
        "transformer",
        "--preset",
        "tiny",
        "--optimizer",
        "adam",
        "--strategies",
        "ddp,allreduce,ps",
        "--workers",
        "2",
        "--steps",
        "20",
        "--out",
        str(out),
        cwd=workdir,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for outcome in verify_outcomes(out):
        assert outcome["max_abs"] <= FLOAT64_TOLERANCE, outcome


def test_a_crashed_strategy_is_a_row_and_the_others_still_run(workdir: Path) -> None:
    model = workdir / "needs_whole_batch.py"
    model.write_text(  # fine in the launcher's check and in single; fails in every other cell
        "import torch\n"
        "from torch import distributed as dist, nn\n"
        "class Whole(nn.Linear):\n"
        "    def forward(self, x):\n"
        "        if dist.is_initialized() and dist.get_world_size() > 1:\n"
        "            raise ValueError('this model needs the whole batch in one process')\n"
        "        return super().forward(x)\n"
        "def build(seed=0):\n"
        "    g = torch.Generator().manual_seed(seed)\n"
        "    data = torch.utils.data.TensorDataset(torch.randn(64, 3, generator=g),\n"
        "                                          torch.randint(0, 2, (64,), generator=g))\n"
        "    return Whole(3, 2), data, nn.functional.cross_entropy\n"
    )
    out = workdir / "verify"
    result = gradsync(
        "verify",
        "--model",
        f"{model}:build",
        "--global-batch",
        "16",
        "--strategies",
        "allreduce,ps",
        "--workers",
        "2",
        "--steps",
        "3",
        "--out",
        str(out),
        cwd=workdir,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    rows = {o["strategy"]: o for o in verify_outcomes(out)}
    assert rows["single"]["verdict"] == "reference"
    for name in ("allreduce", "ps"):
        assert rows[name]["verdict"] == "crashed"
        assert "needs the whole batch in one process" in rows[name]["reason"]
        kept = (Path(rows[name]["out"]) / "failure.txt").read_text()  # the whole error
        assert "its last stderr lines" in kept and "ValueError: this model" in kept
    assert (out / "verify.md").exists()


def test_a_loss_summed_over_samples_gets_the_diagnosis(workdir: Path) -> None:
    """A loss that sums instead of averaging makes every strategy wrong by the same amount
    (each worker's gradient is its shard's sum, then averaged): the model, not them."""
    model = workdir / "summed_loss.py"
    model.write_text(
        "import torch\n"
        "from torch import nn\n"
        "def build(seed=0):\n"
        "    g = torch.Generator().manual_seed(seed)\n"
        "    data = torch.utils.data.TensorDataset(torch.randn(64, 3, generator=g),\n"
        "                                          torch.randint(0, 2, (64,), generator=g))\n"
        "    loss = lambda out, y: nn.functional.cross_entropy(out, y, reduction='sum')\n"
        "    return nn.Linear(3, 2), data, loss\n"
    )
    result = gradsync(
        "verify",
        "--model",
        f"{model}:build",
        "--global-batch",
        "16",
        "--strategies",
        "ddp,allreduce",
        "--workers",
        "2",
        "--steps",
        "3",
        "--out",
        "verify",
        cwd=workdir,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert {o["verdict"] for o in verify_outcomes(workdir / "verify")} == {"reference", "FAIL"}
    assert "diagnosis:" in result.stdout and "not a mean over the samples" in result.stdout


def test_local_batchnorm_is_an_expected_difference(workdir: Path) -> None:
    """--batchnorm local: each worker normalizes its own shard, in every strategy; verify
    names it as the reason and shows the distance, and does not fail."""
    out = workdir / "verify"
    result = gradsync(
        "verify",
        "--model",
        "resnet56",
        "--preset",
        "tiny",
        "--steps",
        "2",
        "--batchnorm",
        "local",
        "--strategies",
        "ddp,allreduce",
        "--workers",
        "2",
        "--out",
        str(out),
        cwd=workdir,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for outcome in verify_outcomes(out):
        if outcome["strategy"] != "single":
            assert outcome["verdict"] == "differs (expected)", outcome
            assert "--batchnorm local" in outcome["reason"]
            assert outcome["max_abs"] > FLOAT64_TOLERANCE


@pytest.mark.parametrize(
    ("strategy", "refused"),
    [("allreduce", True), ("ps", True), ("p3", True), ("ddp", True), ("ps --no-overlap", False)],
)
def test_a_gradient_accumulated_twice_is_refused_where_hooks_send_it(
    strategy: str, refused: bool, workdir: Path
) -> None:
    """Reentrant checkpointing accumulates a shared layer's gradient twice in one backward:
    a strategy that sends from gradient hooks stops with the reason, never drops half.
    torch's DDP reducer took it silently, with wrong parameters (session 25's probe)."""
    result = gradsync(
        "train",
        *("--model", f"{ADVERSARIAL}:build_reentrant", "--strategy", *strategy.split()),
        *("--workers", "2", "--steps", "2", "--global-batch", "16", "--out", "run"),
        cwd=workdir,
    )
    if refused:
        assert result.returncode == 1, result.stdout + result.stderr
        assert re.search(r"'shared\.(weight|bias)' was accumulated twice in one", result.stderr)
    else:
        assert result.returncode == 0, result.stderr
