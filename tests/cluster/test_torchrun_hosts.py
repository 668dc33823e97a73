"""torchrun on two emulated hosts (network namespaces, 1 Gbit/s links): the c10d rendezvous
and the training both cross the emulated network; the result matches single."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradsync import netem
from tests.cluster.conftest import (
    RUN_TIMEOUT_S,
    TOLERANCE,
    TRAIN,
    distance_to_single,
    report_distance,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="emulated hosts need root (network namespaces)"),
    pytest.mark.skipif(
        netem.shutil.which("ip") is None or netem.shutil.which("tc") is None,
        reason="emulated hosts need iproute2 (ip and tc)",
    ),
]
RDZV_PORT = 29400  # each emulated host is a fresh namespace: every port is free there


def torchrun_argv(hosts: netem.EmulatedHosts, host: int) -> list[str]:
    """torchrun on ``host``, meeting the other node at host 0 over the emulated link."""
    argv = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"),
        *("--rdzv-backend", "c10d", "--rdzv-id", "gradsync-test"),
        *("--rdzv-endpoint", f"{hosts.address(0)}:{RDZV_PORT}"),
        *("--local-addr", hosts.address(host)),  # what the other node connects to
        *("--rdzv-conf", f"is_host={int(host == 0)}"),
        *("-m", "gradsync", *TRAIN, "--strategy", "allreduce", "--out", "run"),
    ]
    return hosts.exec_argv(host, argv)


def test_torchrun_on_two_hosts_matches_single(
    single: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    with netem.EmulatedHosts(2, netem.parse_rate("1gbit")) as hosts:
        nodes = [
            subprocess.Popen(
                torchrun_argv(hosts, host),
                cwd=tmp_path,
                env={**os.environ, **hosts.rank_env(host), "PYTHONUNBUFFERED": "1"},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for host in (0, 1)
        ]
        try:
            outputs = [node.communicate(timeout=RUN_TIMEOUT_S)[0] for node in nodes]
        finally:
            for node in nodes:
                node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["launcher"] == "torchrun" and summary["workers"] == 2
    distance = distance_to_single(single, tmp_path / "run")
    report_distance(request.config, "torchrun --nnodes 2 on 2 emulated hosts (1gbit)", distance)
    assert distance <= TOLERANCE
