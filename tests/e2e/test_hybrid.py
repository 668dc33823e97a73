"""Strategy ``hybrid`` end to end: the verify matrix on lstm-lm, the degenerate case, flags."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.conftest import gradsync, verify_outcomes

LSTM_SPARSE = ["--model-option", "sparse=true", "--model-option", "sampled_softmax=8"]


def test_hybrid_matches_single_on_sparse_lstm(workdir: Path) -> None:
    """1 and 2 dedicated servers and colocated servers, at 2 and 4 workers, in one verify."""
    out = workdir / "verify"
    strategies = "hybrid,hybrid:servers=2,hybrid:colocate"
    result = gradsync(
        "verify",
        "--model",
        "lstm-lm",
        "--preset",
        "tiny",
        *LSTM_SPARSE,
        "--strategies",
        strategies,
        "--workers",
        "2,4",
        "--steps",
        "10",
        "--out",
        str(out),
        cwd=workdir,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    outcomes = verify_outcomes(out)
    expected = {(s, w) for s in strategies.split(",") for w in (2, 4)} | {("single", 1)}
    assert {(o["strategy"], o["workers"]) for o in outcomes} == expected
    for outcome in outcomes:
        assert outcome["verdict"] in ("reference", "match"), outcome
    log = (out / "hybrid-servers2-w4" / "stdout.log").read_text()
    assert "embedding.weight [32×16]: sparse" in log
    assert "softmax_weight.weight [32×16]: sparse" in log
    assert "lstm.weight_ih_l0 [64×16]: dense" in log
    assert "row partition(s) each (cost model: P=" in log


def test_without_sparse_variables_hybrid_is_allreduce_and_densifying_says_so(workdir: Path) -> None:
    out = workdir / "verify"
    result = gradsync(
        "verify",
        "--model",
        "resnet56",
        "--preset",
        "tiny",
        "--strategies",
        "hybrid,allreduce:sparse_as_dense=true",
        "--workers",
        "2",
        "--steps",
        "5",
        "--out",
        str(out),
        cwd=workdir,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert all(o["verdict"] == "match" for o in verify_outcomes(out)[1:])
    log = (out / "hybrid-w2" / "stdout.log").read_text()
    assert "no sparse variables, so it degenerates to allreduce" in log
    logs = [p.read_text() for p in out.glob("allreduce*/stdout.log")]
    assert logs and "--sparse-as-dense has nothing to densify" in logs[0]


def test_hybrid_flags_are_checked_up_front(workdir: Path) -> None:
    cases = {
        ("--strategy", "hybrid", "--optimizer", "adam"): "torch's Adam refuses sparse",
        ("--strategy", "allreduce", "--partitions", "4"): "applies to --strategy hybrid",
        ("--strategy", "hybrid", "--sparse-pattern", "lstm.*"): "not the weight of an",
    }
    for args, message in cases.items():
        result = gradsync(
            "train",
            "--model",
            "lstm-lm",
            "--preset",
            "tiny",
            *LSTM_SPARSE,
            *args,
            "--out",
            "run",
            cwd=workdir,
        )
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, lines)
