"""The cluster tests install their Debian packages only when missing, or say why they cannot."""

from __future__ import annotations

import subprocess

import pytest

from tests.cluster import slurm


def _apt_must_not_run(args: list[str]) -> subprocess.CompletedProcess[str]:
    raise AssertionError(f"apt-get {' '.join(args)} ran although nothing was missing")


def test_present_packages_need_no_apt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(slurm, "_apt", _apt_must_not_run)
    assert slurm.ensure_packages() is None


@pytest.fixture
def no_mpirun(monkeypatch: pytest.MonkeyPatch) -> None:
    def which(tool: str) -> str | None:
        return None if tool == "mpirun" else f"/usr/bin/{tool}"

    monkeypatch.setattr(slurm.shutil, "which", which)


def test_without_root_the_reason_is_given(no_mpirun: None, monkeypatch) -> None:
    monkeypatch.setattr(slurm.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(slurm, "_apt", _apt_must_not_run)
    assert slurm.ensure_packages() == (
        "Debian packages openmpi-bin are missing and installing needs root"
    )


def test_a_failed_install_updates_the_lists_once_then_gives_the_reason(
    no_mpirun: None, monkeypatch
) -> None:
    calls: list[list[str]] = []

    def apt(args: list[str]) -> subprocess.CompletedProcess[str]:
        calls.append(args)
        return subprocess.CompletedProcess(args, 100, "", "E: Unable to locate package x\n")

    monkeypatch.setattr(slurm.os, "geteuid", lambda: 0)
    monkeypatch.setattr(slurm, "_apt", apt)
    reason = slurm.ensure_packages()
    assert reason == "apt-get install openmpi-bin failed: E: Unable to locate package x"
    assert [c[0] for c in calls] == ["install", "update", "install"]
