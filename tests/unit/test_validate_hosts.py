"""A validation plan whose jobs would leave an emulated host empty is refused when loaded,
as ``gradsync train`` and ``gradsync commbench`` refuse it (one check_hosts_filled)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradsync.errors import UserError
from gradsync.predict.validate import load_plan

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def _plan(tmp_path: Path, **keys: str) -> Path:
    lines = {"strategies": '["ps:colocate"]', "bandwidths": '["1gbit"]', **keys}
    plan = tmp_path / "plan.toml"
    plan.write_text(
        "".join(f"{key} = {value}\n" for key, value in lines.items())
        + '[[model]]\nname = "mnist-cnn"\n'
    )
    return plan


def test_the_calibrations_commbench_must_fill_every_host(tmp_path: Path) -> None:
    """Was accepted (5 ranks ≥ 4 hosts): the commbench then failed at run time naming
    --hosts and --workers, flags the user never typed."""
    plan = _plan(tmp_path, workers="5", hosts="4", global_batch="50", calibrate="true")
    with pytest.raises(UserError) as refused:
        load_plan(plan)
    message = str(refused.value)
    assert message.startswith(f"{plan}: calibrate = true runs commbench on 5 ranks")
    assert "fill only 3 of hosts = 4; write hosts = 3" in message
    assert "--hosts" not in message and "\n" not in message


@pytest.mark.parametrize(("spec", "ranks"), [("ps", 5), ("p3", 5), ("ps:servers=2", 6)])
def test_a_server_strategy_must_fill_every_host(spec: str, ranks: int, tmp_path: Path) -> None:
    """Was accepted: 4 workers and 1 or 2 servers on 4 hosts fill 3, which train refuses."""
    plan = _plan(tmp_path, strategies=f'["{spec}"]', workers="4", hosts="4")
    with pytest.raises(UserError, match=f"strategies: {spec} on mnist-cnn .* runs {ranks} ranks"):
        load_plan(plan)


def test_servers_that_fill_the_hosts_and_hybrid_without_sparse_variables_load(
    tmp_path: Path,
) -> None:
    """hybrid starts no server for a dense model: its 4 workers fill the 4 hosts."""
    specs = '["ps:servers=3", "p3:servers=4", "hybrid"]'
    plan = _plan(tmp_path, strategies=specs, workers="4", hosts="4")
    assert load_plan(plan).strategies == ("ps:servers=3", "p3:servers=4", "hybrid")


@pytest.mark.parametrize("path", sorted(EXPERIMENTS.glob("predict-validation*.toml")), ids=str)
def test_every_shipped_validation_plan_loads(path: Path) -> None:
    """The 3- and 4-host plans ran ps and p3 with one server, leaving a host empty."""
    load_plan(path)
