"""Emulated hosts (network namespaces, shaped links): bandwidth, correctness, teardown, refusals.

Needs root and iproute2 (``ip``, ``tc``); CI runs as root. Every test lists the machine's
namespaces, links and root qdiscs before and after and requires them unchanged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradsync import cli, netem
from tests.e2e.conftest import FAULTY, gradsync, verify_outcomes


def _gradsync(workdir: Path, command: str):
    """``gradsync COMMAND`` (split on spaces) in ``workdir``."""
    return gradsync(*command.split(), cwd=workdir)


pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="emulated hosts need root (network namespaces)"),
    pytest.mark.skipif(
        netem.shutil.which("ip") is None or netem.shutil.which("tc") is None,
        reason="emulated hosts need iproute2 (ip and tc)",
    ),
]


def _network() -> dict[str, list[str]]:
    """What a run must not leave behind: namespaces, links and qdiscs of this namespace."""

    def lines(*argv: str) -> list[str]:
        return sorted(subprocess.run(argv, capture_output=True, text=True).stdout.splitlines())

    return {
        "netns": lines("ip", "netns", "list"),
        "links": [line.split()[0] for line in lines("ip", "-br", "link")],
        "qdiscs": lines("tc", "qdisc", "show"),
        "etc": sorted(p.name for p in netem.NETNS_ETC.iterdir())
        if netem.NETNS_ETC.is_dir()
        else [],
    }


@pytest.fixture(scope="module", autouse=True)
def _no_runs_left_by_killed_launchers() -> None:
    # A launcher killed by SIGKILL (a CI job cancelled mid-test, say) leaves its namespaces
    # behind; its pid is gone, so nothing can use them. Remove them, as `gradsync netem
    # cleanup` would, so that every test starts from a machine with only live runs on it.
    if os.geteuid() == 0 and netem.shutil.which("ip") and netem.shutil.which("tc"):
        netem.cleanup()


@pytest.fixture
def unchanged_network():
    before = _network()
    yield before
    assert _network() == before


def _new_namespaces(before: dict[str, list[str]]) -> list[str]:
    """This test's namespaces: gradsync's, and not on the machine when it began."""
    return [
        n
        for n in netem.list_namespaces()
        if netem.NAMESPACE_PATTERN.match(n) and n not in before["netns"]
    ]


def _stop(job: subprocess.Popen[str]) -> None:
    """End a launcher the way Ctrl-C does (it tears its hosts down), then for good."""
    if job.poll() is None:
        job.send_signal(signal.SIGTERM)
        try:
            job.wait(timeout=30)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()


def _wait_for(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("condition not reached in time")


def _long_training(workdir: Path) -> subprocess.Popen[str]:
    argv = "train --model lstm-lm --preset tiny --strategy allreduce --workers 2 --steps 100000"
    return subprocess.Popen(
        [sys.executable, "-m", "gradsync", *argv.split(), "--hosts", "2", "--out", "run"],
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_training(workdir: Path) -> None:
    metrics = workdir / "run" / "metrics" / "rank1.jsonl"
    _wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, timeout=60)


def test_p2p_reaches_the_shaped_rate(workdir: Path, unchanged_network) -> None:
    result = _gradsync(
        workdir,
        "commbench --workers 2 --hosts 2 --bandwidth 100mbit --ops p2p --sizes 16M "
        "--warmup 1 --iters 3 --time-budget 10 --out bench",
    )
    assert result.returncode == 0, result.stderr
    assert "latency is not emulated" in result.stderr
    payload = json.loads((workdir / "bench" / "commbench.json").read_text())
    assert [p["host"] for p in payload["placement"]] == [f"{h}" for h in _hosts(payload)]
    (row,) = payload["results"]
    assert row["bytes"] == 16 * 2**20 and row["iters"] == 3
    share = row["busbw_Bps"] * 8 / 100e6
    assert 0.85 <= share <= 1.05, f"p2p reached {share:.1%} of 100 Mbit/s"


def _hosts(payload: dict) -> list[str]:
    # Two ranks on two hosts: each its own namespace of one run.
    hosts = [p["host"] for p in payload["placement"]]
    assert len(set(hosts)) == 2 and all(netem.NAMESPACE_PATTERN.match(h) for h in hosts)
    assert [p["node_group"] for p in payload["placement"]] == [[0], [1]]
    return hosts


def test_node_local_groups_follow_hosts(workdir: Path, unchanged_network) -> None:
    result = _gradsync(
        workdir,
        "commbench --workers 3 --hosts 2 --ranks-per-host 2 --ops allreduce "
        "--sizes 4K --warmup 1 --iters 1 --out bench",
    )
    assert result.returncode == 0, result.stderr
    placement = json.loads((workdir / "bench" / "commbench.json").read_text())["placement"]
    assert [(p["node"], p["local_rank"], p["local_world_size"]) for p in placement] == [
        (0, 0, 2),
        (0, 1, 2),
        (1, 0, 1),
    ]
    assert [p["node_group"] for p in placement] == [[0, 1], [0, 1], [2]]


def test_training_across_two_hosts_matches_single(workdir: Path, unchanged_network) -> None:
    result = _gradsync(
        workdir,
        "verify --model mnist-cnn --preset tiny --strategies allreduce --workers 2 "
        "--hosts 2 --bandwidth 1gbit --out verify",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    verdicts = {o["strategy"]: o["verdict"] for o in verify_outcomes(workdir / "verify")}
    assert verdicts == {"single": "reference", "allreduce": "match"}


def test_failed_run_leaves_nothing(workdir: Path, unchanged_network) -> None:
    result = _gradsync(
        workdir,
        f"train --model {FAULTY} --model-option raise_in_ranks=1 --workers 2 "
        "--steps 2 --hosts 2 --bandwidth 1gbit",
    )
    assert result.returncode == 1
    assert "fails on purpose" in result.stderr


def test_sigkilled_rank_leaves_nothing(workdir: Path, unchanged_network) -> None:
    job = _long_training(workdir)
    try:
        _wait_training(workdir)
        assert len(_new_namespaces(unchanged_network)) == 3
        pids = json.loads((workdir / "run" / "ranks-node0.json").read_text())
        assert "gradsync.runtime" in Path(f"/proc/{pids['1']}/cmdline").read_text()
        os.kill(pids["1"], signal.SIGKILL)
        _, stderr = job.communicate(timeout=30)
    finally:
        _stop(job)
    assert job.returncode == 1
    assert "rank 1" in stderr and "SIGKILL" in stderr


def test_interrupted_launcher_leaves_nothing(workdir: Path, unchanged_network) -> None:
    job = _long_training(workdir)
    try:
        _wait_training(workdir)
        job.send_signal(signal.SIGTERM)  # SIGINT (Ctrl-C) takes the same path
        _, stderr = job.communicate(timeout=30)
    finally:
        _stop(job)
    # gradsync's own SIGTERM handler, as without emulated hosts (it was 130, "interrupted")
    assert job.returncode == 143
    assert "stopped by SIGTERM" in stderr


def test_killed_launcher_is_cleaned_up_by_netem_cleanup(workdir: Path, unchanged_network) -> None:
    job = _long_training(workdir)
    try:
        _wait_training(workdir)
        job.kill()  # the launcher itself: nothing can tear down
        job.wait(timeout=10)
        assert len(_new_namespaces(unchanged_network)) == 3
        listed = gradsync("netem", "list", cwd=workdir)
        assert "left over" in listed.stdout
    finally:
        job.kill()
        job.wait(timeout=10)
        result = gradsync("netem", "cleanup", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "1 left-over run(s) cleaned up" in result.stdout
    assert _new_namespaces(unchanged_network) == []


def test_refuses_without_root(workdir: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(netem, "_euid", lambda: 65534)
    code = cli.main(["commbench", "--hosts", "2", "--sizes", "4K", "--out", str(workdir / "b")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "needs root" in err


def test_refuses_without_iproute2(workdir: Path) -> None:
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}
    result = subprocess.run(
        [sys.executable, "-m", "gradsync", "commbench", "--hosts", "2", "--sizes", "4K"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "iproute2" in result.stderr


def test_refuses_without_the_qdisc(workdir: Path, monkeypatch, capsys, unchanged_network) -> None:
    monkeypatch.setattr(netem, "SHAPING_QDISC", "gsnosuchqdisc")
    code = cli.main(
        ["commbench", "--hosts", "2", "--bandwidth", "1gbit", "--out", str(workdir / "b")]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "'gsnosuchqdisc' qdisc" in err, err


def test_each_host_resolves_the_machines_name_to_its_own_address(
    tmp_path: Path, unchanged_network
) -> None:
    """As on a real host, where a library binds to the address of gethostname() (Horovod's
    Gloo process sets did, and aborted: the name resolved to a loopback address)."""
    lookup = "import socket; print(socket.gethostbyname(socket.gethostname()))"
    with netem.EmulatedHosts(2, None, state_dir=tmp_path) as hosts:
        for host in range(2):
            argv = hosts.exec_argv(host, [sys.executable, "-c", lookup])
            found = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
            assert found.strip() == hosts.address(host)
