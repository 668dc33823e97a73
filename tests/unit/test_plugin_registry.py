"""Plugin strategies refused in one line before launch (a module that does not import, a
class that is abstract, not a Strategy or takes a built-in's name), a strategy that saves
no state named as such by train and verify, and user-model and --hosts messages that say
how to fix them."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from gradsync import cli, verify
from gradsync.config import LaunchConfig, TrainConfig
from gradsync.errors import UserError
from gradsync.models.base import BuildRequest
from gradsync.models.user import build_user_workload, check_user_step
from gradsync.runtime import CHECKPOINT_FILE, _write_checkpoint
from gradsync.strategies import STRATEGIES, Context, Strategy, register, strategy_class
from gradsync.strategies.allreduce import HorovodAllreduce


class NoUpdate(Strategy):
    """Runs, but never sets ``self.model`` or ``self.updater``."""

    name = "s30-noupdate"
    summary = "a test strategy that saves no state"

    def setup(self, model: nn.Module, context: Context) -> nn.Module:
        return model

    def step(self) -> None:
        pass


class NoStep(Strategy):  # abstract: step is missing
    name = "s30-nostep"
    summary = "a test strategy without step"

    def setup(self, model: nn.Module, context: Context) -> nn.Module:
        return model


@pytest.fixture(autouse=True)
def registry() -> Iterator[None]:
    """Every test leaves STRATEGIES as it found it."""
    saved = dict(STRATEGIES)
    yield
    STRATEGIES.clear()
    STRATEGIES.update(saved)


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """``plugin(source)``: a module of that source, named in GRADSYNC_STRATEGIES."""
    names: list[str] = []

    def write(source: str) -> str:
        name = f"s30_plugin_{len(names)}_{tmp_path.name}".replace("-", "_")
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        names.append(name)
        monkeypatch.setenv("GRADSYNC_STRATEGIES", name)
        return name

    monkeypatch.syspath_prepend(str(tmp_path))
    yield write
    for name in names:
        sys.modules.pop(name, None)


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("gradsync: error: ")
    return err


# ---------------------------------------------------------------- bug 3: one line, exit 2


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ('raise ImportError("plugin import fails")', "does not import (plugin import fails)"),
        ('raise RuntimeError("boom")', "raised RuntimeError while importing: boom"),
        (
            "from gradsync.strategies import register\n"
            "from gradsync.strategies.base import Strategy\n"
            "@register\nclass NoStep(Strategy):\n"
            '    name = "s30-nostep"\n    def setup(self, model, context): return model\n',
            "NoStep does not define step",
        ),
    ],
)
def test_a_plugin_that_fails_is_one_line_and_exit_2(
    plugin, capsys: pytest.CaptureFixture[str], source: str, says: str
) -> None:
    plugin(source)
    assert cli.main(["train", "--strategy", "allreduce"]) == cli.EXIT_USER_ERROR
    assert says in _one_line_error(capsys)


def test_a_missing_plugin_module_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GRADSYNC_STRATEGIES", "s30_no_such_module")
    assert cli.main(["train"]) == cli.EXIT_USER_ERROR
    assert "'s30_no_such_module', which does not import" in _one_line_error(capsys)


def test_an_abstract_strategy_is_refused_when_registered() -> None:
    with pytest.raises(UserError, match=r"NoStep does not define step.*define step"):
        register(NoStep)
    assert NoStep.name not in STRATEGIES


def test_an_abstract_strategy_put_in_the_registry_is_refused_when_looked_up() -> None:
    STRATEGIES[NoStep.name] = NoStep
    with pytest.raises(UserError, match="NoStep does not define step"):
        strategy_class(NoStep.name)


def test_a_class_that_is_not_a_strategy_is_refused() -> None:
    class Bad:
        name = "s30-bad"

    with pytest.raises(UserError, match=r"Bad is not a subclass of .*Strategy; derive it"):
        register(Bad)  # type: ignore[arg-type]
    assert "s30-bad" not in STRATEGIES


@pytest.mark.parametrize("name", ["", "a,b", "p3:x", 7])
def test_a_strategy_without_a_usable_name_is_refused(name: object) -> None:
    unnamed = type("Unnamed", (NoUpdate,), {"name": name})
    with pytest.raises(UserError, match=r"Unnamed has name .*; set name"):
        register(unnamed)


def test_a_strategy_without_a_name_is_refused() -> None:
    class Nameless(Strategy):
        def setup(self, model: nn.Module, context: Context) -> nn.Module:
            return model

        def step(self) -> None:
            pass

    with pytest.raises(UserError, match="Nameless has name None"):
        register(Nameless)


# ---------------------------------------------------------------- bug 4: names are unique


def test_a_plugin_cannot_take_a_built_in_name() -> None:
    shadow = type("Shadow", (NoUpdate,), {"name": "allreduce"})
    with pytest.raises(UserError) as refusal:
        register(shadow)
    message = str(refusal.value)
    assert "'allreduce' is taken by gradsync.strategies.allreduce.HorovodAllreduce" in message
    assert "Shadow cannot register it too" in message and "\n" not in message
    assert STRATEGIES["allreduce"] is HorovodAllreduce


def test_registering_the_same_class_again_is_harmless() -> None:
    assert register(NoUpdate) is register(NoUpdate) is STRATEGIES[NoUpdate.name]


def test_a_reloaded_plugin_replaces_its_own_class() -> None:
    register(NoUpdate)
    again = type("NoUpdate", (NoUpdate,), {"__module__": __name__, "__qualname__": "NoUpdate"})
    assert register(again) is STRATEGIES[NoUpdate.name]


# ---------------------------------------------------------------- bug 5: no state saved


def _context(steps: int) -> Context:
    return Context(
        config=TrainConfig(model="mnist-cnn", preset="tiny", steps=steps),
        rank=0,
        world_size=1,
        worker_index=0,
        num_workers=1,
        device=torch.device("cpu"),
        worker_group=None,
        make_updater=lambda params: None,  # type: ignore[arg-type,return-value]
    )


def test_train_warns_once_when_a_strategy_saves_no_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    context = _context(steps=4)
    _write_checkpoint(NoUpdate(), tmp_path, {"step": 2}, context)  # --checkpoint-every: silent
    assert capsys.readouterr().err == ""
    _write_checkpoint(NoUpdate(), tmp_path, {"step": 4}, context)
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert "'s30-noupdate' gave no checkpoint tensors" in err
    assert "cannot be verified or resumed" in err and "override checkpoint_tensors" in err
    assert not (tmp_path / CHECKPOINT_FILE).exists()


def test_verify_says_a_strategy_saved_no_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(verify, "load_summary", lambda out: {})  # the job ran; no checkpoint
    config = TrainConfig(model="mnist-cnn", preset="tiny", strategy="ddp", out=str(tmp_path))
    with pytest.raises(UserError) as refusal:
        verify._run_cell(config, "ddp", None, 1e-9, first=True)  # type: ignore[arg-type]
    message = str(refusal.value)
    assert message.startswith("strategy 'ddp' saved no state")
    assert "set self.model and self.updater in setup, or override checkpoint_tensors" in message
    assert "pass a .safetensors file" not in message


# ---------------------------------------------------------------- bug 9: how to fix


def _model_file(tmp_path: Path, body: str) -> str:
    path = tmp_path / "models_s30.py"
    path.write_text(
        "import torch\nfrom torch import nn\nfrom torch.utils.data import TensorDataset\n"
        "DATA = TensorDataset(torch.randn(8, 8), torch.randint(0, 3, (8,)))\n"
        + textwrap.dedent(body)
    )
    return f"{path}:build"


def test_a_user_model_of_the_wrong_type_is_told_what_to_return(tmp_path: Path) -> None:
    name = _model_file(tmp_path, "def build(**kw):\n    return nn.Linear(8, 3)\n")
    with pytest.raises(UserError, match=r"got Linear; return \(model, dataset, loss_fn\)"):
        build_user_workload(name, BuildRequest())


def test_a_user_model_that_fails_the_check_is_told_what_the_check_does(tmp_path: Path) -> None:
    half = "return nn.Linear(8, 3).half(), DATA, nn.functional.cross_entropy"
    name = _model_file(tmp_path, f"def build(**kw):\n    {half}\n")
    with pytest.raises(UserError) as refusal:
        check_user_step(name, build_user_workload(name, BuildRequest()))
    message = str(refusal.value)
    assert "failed the check before launch (forward and loss on the 2 samples" in message
    assert "RuntimeError: mat1 and mat2 must have the same dtype" in message
    assert "parameters in the default dtype" in message and "\n" not in message


def test_too_many_hosts_says_how_to_fix() -> None:
    with pytest.raises(UserError, match=r"got 300; pass at most 250, or leave --hosts out"):
        LaunchConfig(hosts=300)
