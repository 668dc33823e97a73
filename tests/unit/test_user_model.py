"""User models (``FILE.py:fn`` / ``pkg.mod:fn``) and map-style datasets as global batches."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from gradsync.config import TrainConfig
from gradsync.data.base import Batch
from gradsync.errors import UserError
from gradsync.models import build_workload, check_model
from gradsync.models.base import BuildRequest, Workload
from gradsync.models.user import (
    DEFAULT_USER_GLOBAL_BATCH,
    MapStyleSamples,
    build_user_workload,
    is_user_model,
)

NUM_ITEMS = 10


def _items(n: int = NUM_ITEMS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.tensor([float(i), -float(i)]), torch.tensor(i)) for i in range(n)]


def _targets(samples: MapStyleSamples, *, step: int, size: int, start: int, stop: int) -> list:
    return samples.batch(step=step, size=size, start=start, stop=stop).targets.tolist()


def _concat(lists) -> list:
    return [item for part in lists for item in part]


# ---------------------------------------------------------------- MapStyleSamples


def test_batch_collates_inputs_and_targets():
    batch = MapStyleSamples(_items(), seed=0).batch(step=0, size=4, start=0, stop=4)
    assert isinstance(batch, Batch) and len(batch) == 4
    assert len(batch.inputs) == 1 and batch.inputs[0].shape == (4, 2)
    assert torch.equal(batch.inputs[0][:, 0].long(), batch.targets)  # items stay paired
    assert torch.equal(batch.inputs[0][:, 1], -batch.inputs[0][:, 0])


def test_shards_concatenate_to_the_global_batch():
    samples = MapStyleSamples(_items(), seed=5)
    whole = _targets(samples, step=3, size=6, start=0, stop=6)
    halves = [_targets(samples, step=3, size=6, start=a, stop=a + 3) for a in (0, 3)]
    thirds = [_targets(samples, step=3, size=6, start=a, stop=a + 2) for a in (0, 2, 4)]
    assert _concat(halves) == _concat(thirds) == whole


def test_each_epoch_is_a_permutation_and_epochs_differ():
    samples = MapStyleSamples(_items(), seed=1)
    epoch0 = _concat(_targets(samples, step=s, size=2, start=0, stop=2) for s in range(5))
    epoch1 = _concat(_targets(samples, step=s, size=2, start=0, stop=2) for s in range(5, 10))
    assert sorted(epoch0) == sorted(epoch1) == list(range(NUM_ITEMS))
    assert epoch0 != epoch1
    assert epoch0 != list(range(NUM_ITEMS))  # shuffled


def test_a_batch_crossing_an_epoch_boundary_continues_in_the_next_permutation():
    samples = MapStyleSamples(_items(), seed=2)
    epoch0 = _targets(samples, step=0, size=10, start=0, stop=10)
    epoch1 = _targets(samples, step=1, size=10, start=0, stop=10)
    # global batch 4, step 2: positions 8..11 → epoch 0 [8, 9], epoch 1 [0, 1]
    assert _targets(samples, step=2, size=4, start=0, stop=4) == epoch0[8:] + epoch1[:2]


def test_same_seed_same_batches_other_seed_other_batches():
    one = _targets(MapStyleSamples(_items(), seed=7), step=4, size=8, start=0, stop=8)
    again = _targets(MapStyleSamples(_items(), seed=7), step=4, size=8, start=0, stop=8)
    other = _targets(MapStyleSamples(_items(), seed=8), step=4, size=8, start=0, stop=8)
    assert one == again
    assert one != other


def test_multi_input_items_become_several_inputs():
    items = [((torch.full((3,), float(i)), torch.tensor(i * 2)), torch.tensor(i)) for i in range(6)]
    batch = MapStyleSamples(items, seed=0).batch(step=0, size=3, start=0, stop=3)
    assert len(batch.inputs) == 2
    assert batch.inputs[0].shape == (3, 3) and batch.inputs[1].shape == (3,)
    assert torch.equal(batch.inputs[1], batch.targets * 2)


@pytest.mark.parametrize(
    ("make_input", "words"),
    [
        (
            lambda i: {"x": torch.full((3,), float(i)), "mask": torch.ones(3)},
            r"a dict \(keys x, mask\)",
        ),
        (lambda i: [[torch.ones(2)], torch.ones(1)], "list"),
    ],
    ids=["dict", "nested"],
)
def test_inputs_the_model_cannot_take_positionally_are_one_line(make_input, words):
    """A dict input was unpacked into its keys: the model was called as model('x', 'mask')
    and failed with "takes 2 positional arguments but 3 were given"."""
    items = [(make_input(i), torch.tensor(i)) for i in range(4)]
    with pytest.raises(UserError, match=f"mine's dataset items have {words}.*model\\(\\*inputs\\)"):
        MapStyleSamples(items, seed=0, owner="mine").batch(step=0, size=2, start=0, stop=2)


def test_torch_tensor_dataset_works():
    dataset = torch.utils.data.TensorDataset(torch.arange(8.0).view(8, 1), torch.arange(8))
    batch = MapStyleSamples(dataset, seed=0).batch(step=0, size=8, start=0, stop=8)
    assert sorted(batch.targets.tolist()) == list(range(8))
    assert torch.equal(batch.inputs[0].view(-1).long(), batch.targets)


@pytest.mark.parametrize("dataset", [object(), (i for i in range(3)), 42])
def test_not_a_map_style_dataset_is_a_user_error(dataset):
    with pytest.raises(UserError, match="map-style dataset with __len__ and __getitem__"):
        MapStyleSamples(dataset, seed=0)


def test_empty_dataset_is_a_user_error():
    """It said "the data file holds no samples; check the --data path" with no --data."""
    with pytest.raises(UserError, match="mine's dataset is empty"):
        MapStyleSamples([], seed=0, owner="mine")


class _Broken:
    def __init__(self, length: int = 4, item: object = None) -> None:
        self.length, self.item = length, item

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> object:
        if self.item is None:
            raise KeyError(index)
        return self.item(index)


BROKEN_WORKLOADS = """
    import torch
    from torch import nn

    from gradsync.models.base import Workload

    def loss(output, targets):
        return nn.functional.cross_entropy(output, targets)

    def no_dataset():
        return Workload(model=nn.Linear(2, 2), dataset=None, loss=loss, global_batch=4,
                        description="x")

    def zero_batch():
        from gradsync.models.user import MapStyleSamples
        items = [(torch.zeros(2), torch.tensor(0))] * 4
        return Workload(model=nn.Linear(2, 2), dataset=MapStyleSamples(items, seed=0),
                        loss=loss, global_batch=0, description="x")
"""


@pytest.mark.parametrize(
    ("function", "words"),
    [("no_dataset", "no dataset with a batch method"), ("zero_batch", "global_batch 0")],
)
def test_a_returned_workload_is_checked_like_a_tuple(tmp_path, function, words):
    path = _write(tmp_path, "broken.py", BROKEN_WORKLOADS)
    with pytest.raises(UserError, match=words):
        build_user_workload(f"{path}:{function}", BuildRequest())


@pytest.mark.parametrize(
    ("dataset", "words"),
    [
        (_Broken(), "failed to give a batch of 2 samples: KeyError"),
        (_Broken(item=lambda i: (torch.zeros(i + 1), torch.tensor(0))), "stack expects"),
        (_Broken(length=-1), "has no length: ValueError"),
    ],
)
def test_a_dataset_that_fails_is_one_line_before_launch(dataset, words):
    """Each was a traceback from the launcher (session 24's probe)."""
    from gradsync.models.user import check_user_step

    with pytest.raises(UserError, match=words):
        samples = MapStyleSamples(dataset, seed=0, owner="mine")
        workload = Workload(
            model=nn.Linear(2, 2), dataset=samples, loss=nn.functional.cross_entropy,
            global_batch=4, description="mine",
        )  # fmt: skip
        check_user_step("mine", workload)


# ---------------------------------------------------------------- loading user models


def _write(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(body))
    return path


MODEL_FILE = """
    import torch
    from torch import nn

    CALLS = []

    def loss(output, targets):
        return nn.functional.cross_entropy(output, targets)

    def build(preset, seed, width="1"):
        CALLS.append((preset, seed, width))
        items = [(torch.randn(4), torch.tensor(i % 3)) for i in range(12)]
        return nn.Linear(4, 3 * int(width)), items, loss

    def build_any(**kwargs):
        raise RuntimeError(f"got {sorted(kwargs.items())}")

    def build_workload(seed):
        from gradsync.models.base import Workload
        from gradsync.models.user import MapStyleSamples
        items = [(torch.zeros(2), torch.tensor(0))] * 4
        return Workload(model=nn.Linear(2, 2), dataset=MapStyleSamples(items, seed=seed),
                        loss=loss, global_batch=4, description="mine")

    def build_list():
        return [1, 2, 3]

    def build_pair():
        return nn.Linear(1, 1), []

    class Synthetic:
        def batch(self, *, step, size, start, stop):
            raise AssertionError("not called here")

    def build_native():
        return nn.Linear(1, 1), Synthetic(), loss

    def explode():
        raise AssertionError("load_only must not call build")

    NOT_A_FUNCTION = 3
"""


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    return _write(tmp_path, "mymodel.py", MODEL_FILE)


def test_is_user_model():
    assert is_user_model("examples/user_model.py:build")
    assert is_user_model("pkg.mod:build")
    assert not is_user_model("resnet56")


def test_file_model_with_a_tuple_becomes_a_workload(model_file):
    name = f"{model_file}:build"
    workload = build_user_workload(
        name, BuildRequest(preset="tiny", seed=4, options={"width": "2"})
    )
    assert isinstance(workload, Workload)
    assert isinstance(workload.model, nn.Linear) and workload.model.out_features == 6
    assert isinstance(workload.dataset, MapStyleSamples) and workload.dataset.seed == 4
    assert workload.global_batch == DEFAULT_USER_GLOBAL_BATCH == 32
    assert workload.description == name
    batch = workload.dataset.batch(step=0, size=4, start=0, stop=4)
    assert workload.loss(workload.model(*batch.inputs)[:, :3], batch.targets).dim() == 0


def test_only_declared_keywords_are_passed_and_options_stay_strings(model_file):
    import sys

    build_user_workload(
        f"{model_file}:build", BuildRequest(preset="paper", seed=9, options={"width": "3"})
    )
    module = sys.modules["gradsync_user_mymodel"]
    assert module.CALLS == [("paper", 9, "3")]


def test_var_keyword_build_gets_everything(model_file):
    request = BuildRequest(
        preset="tiny", seed=1, data=None, dropout=False, options={"sparse": "true"}
    )
    with pytest.raises(UserError) as raised:  # its RuntimeError, as one line
        build_user_workload(f"{model_file}:build_any", request)
    assert (
        "RuntimeError while building: got [('data', None), ('dropout', False), "
        "('preset', 'tiny'), ('seed', 1), ('sparse', 'true')]"
    ) in str(raised.value)


def test_unknown_option_is_a_user_error_listing_the_parameters(model_file):
    with pytest.raises(
        UserError, match="takes no option depth; its parameters: preset, seed, width"
    ):
        build_user_workload(f"{model_file}:build", BuildRequest(options={"depth": "4"}))


def test_a_workload_is_returned_as_is(model_file):
    workload = build_user_workload(f"{model_file}:build_workload", BuildRequest(seed=3))
    assert (workload.global_batch, workload.description) == (4, "mine")


def test_a_gradsync_dataset_is_not_wrapped(model_file):
    workload = build_user_workload(f"{model_file}:build_native", BuildRequest())
    assert type(workload.dataset).__name__ == "Synthetic"


@pytest.mark.parametrize(
    ("function", "got"), [("build_list", "got list"), ("build_pair", "got tuple")]
)
def test_wrong_return_value_is_a_user_error(model_file, function, got):
    with pytest.raises(
        UserError, match=f"must return a Workload or \\(model, dataset, loss\\), {got}"
    ):
        build_user_workload(f"{model_file}:{function}", BuildRequest())


def test_load_only_imports_without_building(model_file):
    assert build_user_workload(f"{model_file}:explode", BuildRequest(), load_only=True) is None


def test_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(
        UserError,
        match=r"user model file .*absent\.py does not exist; pass "
        r"--model FILE\.py:FUNCTION",
    ):
        build_user_workload(f"{tmp_path / 'absent.py'}:build", BuildRequest())


@pytest.mark.parametrize(
    ("body", "shown"),
    [
        ("raise RuntimeError('no GPU here')\n", "RuntimeError at {path}:1: no GPU here"),
        ("def build(:\n", "SyntaxError at {path}:1 (column 11): invalid syntax"),
        ("import a_module_that_does_not_exist_4711\n", "a_module_that_does_not_exist_4711"),
    ],
)
def test_file_that_fails_to_import_is_a_user_error(tmp_path, body, shown):
    path = _write(tmp_path, "broken.py", body)
    with pytest.raises(UserError, match="failed to import") as raised:
        build_user_workload(f"{path}:build", BuildRequest())
    assert shown.format(path=path) in str(raised.value)
    assert str(raised.value).endswith("; fix it and rerun")


@pytest.mark.parametrize("function", ["nope", "NOT_A_FUNCTION", ""])
def test_missing_or_non_callable_function_is_a_user_error(model_file, function):
    with pytest.raises(UserError, match=f"'{function}' is not a function in .*mymodel.py"):
        build_user_workload(f"{model_file}:{function}", BuildRequest())


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"usermodels_{tmp_path.name.replace('-', '_')}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    _write(tmp_path / name, "good.py", MODEL_FILE)
    _write(tmp_path / name, "raising.py", "raise RuntimeError('no GPU here')\n")
    _write(tmp_path / name, "syntax.py", "def build(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_module_path_model(package):
    workload = build_user_workload(f"{package}.good:build", BuildRequest(seed=2))
    assert isinstance(workload.dataset, MapStyleSamples)


def test_missing_module_is_a_user_error(package):
    with pytest.raises(UserError, match=f"cannot import user model module '{package}.absent'"):
        build_user_workload(f"{package}.absent:build", BuildRequest())


@pytest.mark.parametrize("module", ["raising", "syntax"])
def test_module_that_fails_to_import_is_a_user_error(package, module):
    with pytest.raises(UserError, match=f"{package}.{module}"):
        build_user_workload(f"{package}.{module}:build", BuildRequest())


def test_registry_front_door_handles_user_models(model_file, tmp_path):
    workload = build_workload(f"{model_file}:build", preset="tiny", seed=1, options={"width": "1"})
    assert workload.model.out_features == 3
    check_model(f"{model_file}:build")  # loads fine
    with pytest.raises(UserError, match="does not exist"):
        check_model(f"{tmp_path / 'gone.py'}:build")


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ('def build():\n    raise RuntimeError("boom")\n', "RuntimeError while building: boom"),
        ("def build(width):\n    return None\n", "requires 'width'"),
        ("def build(*, depth):\n    return None\n", "requires 'depth'"),
    ],
)
def test_a_user_build_function_that_fails_is_one_line(
    tmp_path: Path, body: str, words: str
) -> None:
    """The user's exception, or a parameter gradsync cannot fill, becomes a UserError (one
    line, exit 2) instead of a traceback from inside the launcher."""
    (tmp_path / "net.py").write_text(body)
    with pytest.raises(UserError, match=words) as refused:
        build_workload(f"{tmp_path}/net.py:build")
    assert len(str(refused.value).splitlines()) == 1


COUNTED_MODEL = """
    from pathlib import Path

    import torch
    from torch import nn

    def loss(output, targets):
        return nn.functional.cross_entropy(output, targets)

    def build(seed):
        with open(Path(__file__).with_suffix(".builds"), "a") as builds:
            builds.write("built\\n")
        items = [(torch.randn(4), torch.tensor(i % 3)) for i in range(16)]
        return nn.Linear(4, 3), items, loss
"""


@pytest.mark.parametrize("strategy", ["ddp", "ps", "p3", "hybrid"])
def test_the_checks_before_launch_build_a_user_model_once(tmp_path, strategy):
    """validate, the strategy's check_config and a resume's settings each built the model
    (up to three builds of a user's file before session 24; a verify sweep, more)."""
    from gradsync.jobs import validate
    from gradsync.models import shared_workloads
    from gradsync.resume import meta_differences

    path = _write(tmp_path, "counted.py", COUNTED_MODEL)
    config = TrainConfig(model=f"{path}:build", strategy=strategy, workers=2, global_batch=8)
    with shared_workloads():
        validate(config)
        validate(config.replace(workers=4))  # verify's cells: the same model
        assert meta_differences({"workers": 2}, config) == []
    assert path.with_suffix(".builds").read_text().count("built") == 1


ODD_PARAMETERS = """
    import torch
    from torch import nn

    def items():
        return [(torch.randn(3), torch.tensor(i % 2)) for i in range(16)]

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(3, 4)
            self.last = nn.Linear(4, 2).double()

        def forward(self, x):
            return self.last(torch.tanh(self.first(x)).double()).float()

    def mixed():
        return Mixed(), items(), nn.functional.cross_entropy

    class Complex(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(3, 2)
            self.phase = nn.Parameter(torch.ones(2, dtype=torch.complex64))

        def forward(self, x):
            return self.layer(x) * self.phase.abs()

    def complex_():
        return Complex(), items(), nn.functional.cross_entropy
"""


@pytest.mark.parametrize("strategy", ["ps", "p3"])
def test_servers_refuse_parameters_of_several_dtypes(tmp_path, strategy):
    """ps rounded a float32 parameter through a float64 shard; p3 crashed on it (session 24)."""
    from gradsync.jobs import validate

    path = _write(tmp_path, "odd.py", ODD_PARAMETERS)
    config = TrainConfig(model=f"{path}:mixed", strategy=strategy, workers=2, global_batch=8)
    with pytest.raises(UserError, match=f"{strategy} keeps each server's shard in one buffer"):
        validate(config)
    with pytest.raises(UserError, match=r"parameter first\.weight is float32 while other"):
        validate(config)  # names a parameter of the odd dtype
    validate(config.replace(strategy="allreduce", strategy_options=None))  # a bucket per dtype


def test_complex_parameters_are_refused_before_launch(tmp_path):
    """allreduce dropped their imaginary part; single could not save its checkpoint."""
    from gradsync.jobs import validate

    path = _write(tmp_path, "odd.py", ODD_PARAMETERS)
    with pytest.raises(UserError, match="parameter phase is complex64: gradsync trains real"):
        validate(TrainConfig(model=f"{path}:complex_", strategy="single"))


def test_the_probe_leaves_no_gradient_on_the_model_a_loss_reads():
    """A loss that reads a parameter itself reached the real model from the probe's copy:
    ddp added one extra gradient at step 0 (session 24's probe)."""
    from gradsync.probe import params_without_gradient

    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    loose = nn.Parameter(torch.ones(2))  # read by the loss alone
    model.loose = loose

    def loss(output, targets):
        return nn.functional.cross_entropy(output, targets) + (model[0].weight.sum() + loose.sum())

    samples = MapStyleSamples([(torch.randn(3), torch.tensor(i % 2)) for i in range(8)], seed=0)
    workload = Workload(model=model, dataset=samples, loss=loss, global_batch=8, description="m")
    missing = params_without_gradient(
        workload, model, global_batch=8, start=0, stop=4, device=torch.device("cpu")
    )
    assert missing == set()  # the loss reads loose: it gets a gradient, in the real model
    assert all(param.grad is None for param in model.parameters())


EDITS_IN_FORWARD = """
    import torch
    from torch import nn

    def items():
        return [(torch.randint(0, 6, (2,)), torch.tensor(i % 2)) for i in range(16)]

    class Clamped(nn.Module):
        def __init__(self, max_norm=None):
            super().__init__()
            self.table = nn.Embedding(6, 4, max_norm=max_norm, sparse=True)
            self.head = nn.Linear(4, 2)

        def forward(self, ids):
            with torch.no_grad():
                self.head.weight.clamp_(-0.2, 0.2)  # a projection inside forward
            return self.head(self.table(ids).mean(1))

    def clamped():
        return Clamped(), items(), nn.functional.cross_entropy

    def renormalized():
        return Clamped(max_norm=1.0), items(), nn.functional.cross_entropy

    class Lazy(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.LazyLinear(2)

        def forward(self, ids):
            return self.layer(ids.double().to(torch.get_default_dtype()))

    def lazy():
        return Lazy(), items(), nn.functional.cross_entropy

    class ReadsWhole(nn.Module):  # a sparse table whose mean row is also a feature

        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(6, 4, sparse=True)
            self.head = nn.Linear(4, 2)

        def forward(self, ids):
            return self.head(self.table(ids).mean(1) + self.table.weight.detach().mean(0))

    def reads_whole():
        return ReadsWhole(), items(), nn.functional.cross_entropy

    class Positions(nn.Embedding):  # learned positions: looks up rows other than its input

        def forward(self, ids):
            return nn.functional.embedding(torch.arange(ids.shape[-1]), self.weight, sparse=True)

    class Positioned(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(6, 4, sparse=True)
            self.positions = Positions(6, 4, sparse=True)
            self.head = nn.Linear(4, 2)

        def forward(self, ids):
            return self.head((self.table(input=ids) + self.positions(ids)).mean(1))

    def positioned():
        return Positioned(), items(), nn.functional.cross_entropy

    class Overlapping(nn.Module):
        def __init__(self, how):
            super().__init__()
            if how == "expand":
                self.weight = nn.Parameter(torch.randn(1, 4).expand(2, 4))
            else:
                self.weight = nn.Parameter(torch.randn(64).as_strided((2, 4), (1, 1)))
            self.table = nn.Embedding(6, 4)

        def forward(self, ids):
            return nn.functional.linear(self.table(ids).mean(1), self.weight)

    def expanded():
        return Overlapping("expand"), items(), nn.functional.cross_entropy

    def as_strided():
        return Overlapping("strided"), items(), nn.functional.cross_entropy
"""


@pytest.mark.parametrize(
    ("build", "strategy", "words"),
    [
        # The servers hold the parameters and overwrite each worker's copy every step.
        ("clamped", "ps", "changes parameter head.weight in place during forward"),
        ("clamped", "p3", "changes parameter head.weight in place during forward"),
        # Each worker would renormalize only the rows of its own shard.
        ("renormalized", "allreduce", "lookup table table.weight has max_norm"),
        ("renormalized", "ddp", "lookup table table.weight has max_norm"),
        # Buffers are sized and initial values shared before the first forward.
        ("lazy", "allreduce", "parameter layer.weight is not made yet"),
        # ps and p3 size the parameters in their own checks: those must not run first.
        ("lazy", "ps", "parameter layer.weight is not made yet"),
        ("lazy", "p3", "parameter layer.weight is not made yet"),
        # hybrid brings a worker only the rows its lookups read: other reads were stale.
        ("reads_whole", "hybrid", "reads lookup table table.weight other than by"),
        ("positioned", "hybrid", "reads lookup table positions.weight other than by"),
        # An update writes several elements to one place: single itself is ill-defined.
        ("expanded", "allreduce", "parameter weight overlaps itself in memory"),
        ("as_strided", "ps", "parameter weight overlaps itself in memory"),
    ],
)
def test_models_whose_parameters_change_outside_training_are_refused(
    tmp_path, build, strategy, words
):
    """Silently wrong before session 25: an in-place change in forward was lost under the
    server strategies, max_norm drifted the workers' tables apart under every strategy,
    and a lazy module crashed the strategies with a traceback."""
    from gradsync.jobs import validate

    path = _write(tmp_path, "edits.py", EDITS_IN_FORWARD)
    config = TrainConfig(model=f"{path}:{build}", strategy=strategy, workers=2, global_batch=8)
    with pytest.raises(UserError, match=words):
        validate(config)


def test_an_edit_in_forward_that_the_workers_keep_is_allowed(tmp_path):
    """Under allreduce every worker makes the same data-independent change to its own copy,
    as single does (verify matches); hybrid keeps only sparse tables on its servers."""
    from gradsync.jobs import validate

    path = _write(tmp_path, "edits.py", EDITS_IN_FORWARD)
    for strategy in ("allreduce", "hybrid"):
        validate(TrainConfig(model=f"{path}:clamped", strategy=strategy, workers=2, global_batch=8))
    validate(TrainConfig(model=f"{path}:lazy", strategy="single", global_batch=8))


def test_a_table_read_other_than_by_lookups_trains_when_hybrid_allreduces_it(tmp_path):
    """The refusal's advice works: with the table allreduced (--dense-pattern) nothing is
    read stale; allreduce never brings rows, so it reads the table any way it likes."""
    from gradsync.jobs import validate
    from gradsync.strategies.hybrid import HybridOptions

    path = _write(tmp_path, "edits.py", EDITS_IN_FORWARD)
    for build in ("reads_whole", "positioned"):
        model = f"{path}:{build}"
        validate(TrainConfig(model=model, strategy="allreduce", workers=2, global_batch=8))
    dense = HybridOptions(dense_patterns=("table.weight", "positions.weight"))
    validate(
        TrainConfig(
            model=f"{path}:positioned", strategy="hybrid", workers=2, global_batch=8,
            strategy_options=dense,
        )
    )  # fmt: skip


def test_a_resume_names_the_model_file_by_any_path_to_it(tmp_path: Path, monkeypatch) -> None:
    """`--resume` refused `--model m.py:build` for a run started with `/abs/m.py:build`."""
    from gradsync.resume import meta_differences

    path = _write(tmp_path, "counted.py", COUNTED_MODEL)
    monkeypatch.chdir(tmp_path)
    config = TrainConfig(model="counted.py:build", global_batch=8)
    assert meta_differences({"model": f"{path.resolve()}:build"}, config) == []
    other = _write(tmp_path, "other.py", COUNTED_MODEL)
    assert meta_differences({"model": f"{other}:build"}, config) == [
        f"model {other}:build, not counted.py:build"
    ]


STRANDED_SPARSE = """
    import torch
    from torch import nn

    def items():
        return [(torch.tensor([i % 4, i]), torch.tensor(i % 2)) for i in range(8)]

    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.rare = nn.Embedding(8, 3, sparse=True)  # read by sample 0 alone
            self.out = nn.Linear(3, 2)

        def forward(self, x):
            h = torch.zeros(len(x), 3)
            if bool((x[:, 1] == 0).any()):
                h = h + self.rare(x[:, 0])
            return self.out(h + x[:, :1].float())

    def build():
        return Gated(), items(), nn.functional.cross_entropy
"""


def test_ddp_refuses_a_sparse_gradient_some_worker_lacks(tmp_path: Path) -> None:
    from gradsync.strategies.ddp import NativeDDP

    path = _write(tmp_path, "stranded.py", STRANDED_SPARSE)
    config = TrainConfig(model=f"{path}:build", strategy="ddp", workers=2, global_batch=8)
    with pytest.raises(UserError, match=r"rare\.weight get none on some worker in step 0"):
        NativeDDP.check_config(config)


MIXED_DTYPE_MODEL = """
import torch
from torch import nn
from torch.utils.data import TensorDataset


class Model(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.inp = nn.Linear(3, 2)
        self.other = nn.Parameter(torch.zeros(2, dtype=dtype))

    def forward(self, x):
        return self.inp(x) + self.other.to(x.dtype)


def build(seed: int = 0, dt: str = "float32"):
    data = TensorDataset(torch.randn(8, 3), torch.randint(0, 2, (8,)))
    return Model(getattr(torch, dt)), data, nn.functional.cross_entropy
"""


@pytest.mark.parametrize(
    ("dtype", "option", "refused"),
    [("float64", "float32", True), ("float64", "float64", False), ("float32", "float32", False)],
)
def test_servers_check_the_dtypes_the_run_builds(
    tmp_path: Path, dtype: str, option: str, refused: bool
) -> None:
    """The pre-launch model was built in float32 whatever --dtype said: a float32 parameter
    beside float64 ones passed (ps then rounded it), and an all-float64 model was refused
    (session 31's probe)."""
    from gradsync.config import TrainConfig
    from gradsync.errors import UserError
    from gradsync.strategies.ps import ParameterServer

    path = _write(tmp_path, "mixed.py", MIXED_DTYPE_MODEL)
    config = TrainConfig(
        model=f"{path}:build", strategy="ps", workers=2, dtype=dtype, model_options={"dt": option}
    )
    if refused:
        with pytest.raises(UserError, match="parameter other is float32 while other"):
            ParameterServer.check_config(config)
    else:
        ParameterServer.check_config(config)


GROUPED_MODEL = """
import torch
from torch import nn
from torch.utils.data import TensorDataset


class Grouped(nn.Module):
    '''Samples in groups of 4 (a set of 4 instances): a batch is a multiple of 4.'''

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 2)

    def forward(self, x):
        h = self.inp(x)
        return h + h.view(-1, 4, 2).mean(1, keepdim=True).expand(-1, 4, -1).reshape(-1, 2)


def build(seed: int = 0):
    data = TensorDataset(torch.randn(64, 3), torch.randint(0, 2, (64,)))
    return Grouped(), data, nn.functional.cross_entropy
"""


def test_the_check_before_launch_runs_a_workers_shard(tmp_path: Path) -> None:
    """It ran exactly 2 samples, so a model that needs a batch of 4k was refused whatever
    --global-batch said (session 31's probe); an odd shard is still refused."""
    from gradsync.config import TrainConfig
    from gradsync.jobs import validate

    name = f"{_write(tmp_path, 'grouped.py', GROUPED_MODEL)}:build"
    validate(TrainConfig(model=name, strategy="single", global_batch=16, out=str(tmp_path / "a")))
    validate(TrainConfig(model=name, strategy="allreduce", workers=2, global_batch=16))
    with pytest.raises(UserError, match="forward and loss on the 6 samples a worker takes"):
        validate(TrainConfig(model=name, strategy="allreduce", workers=2, global_batch=12))


@pytest.mark.parametrize(
    ("read", "elsewhere"),
    [
        (lambda w, ids: torch.arange(ids.shape[0], device=w.device).to(w.dtype), False),
        (lambda w, ids: torch.zeros(w.shape[1], w.size(1) * w.dim()), False),
        (lambda w, ids: w.data[ids], True),  # .data is the values under another name
        (lambda w, ids: w.T[:, ids], True),
        (lambda w, ids: w.detach().mean(0), True),
    ],
)
def test_reading_a_tables_metadata_is_not_reading_its_rows(read, elsewhere) -> None:
    """`torch.arange(n, device=table.weight.device)` made hybrid refuse the model as one that
    reads the table other than by its lookups (session 31's probe)."""
    from gradsync.models.lookup_reads import LookupReads

    table = nn.Embedding(5, 2, sparse=True)
    ids = torch.tensor([1, 3])
    with LookupReads({"a": table}) as reads:
        _ = table(ids).sum() + read(table.weight, ids).sum()
    assert reads.elsewhere == ({"a"} if elsewhere else set())


FREQUENCY_SCALED_MODEL = """
import torch
from torch import nn
from torch.utils.data import TensorDataset


def build(seed: int = 0):
    model = nn.Sequential(nn.Embedding(9, 2, scale_grad_by_freq=True), nn.Flatten())
    data = TensorDataset(torch.randint(0, 9, (8, 1)), torch.randint(0, 2, (8,)))
    return model, data, nn.functional.cross_entropy
"""


def test_a_table_scaled_by_row_counts_is_an_expected_difference(tmp_path: Path) -> None:
    """Every strategy FAILed with the diagnosis "the model or its loss" (session 31's probe):
    each worker scales by its own shard's counts, as DDP does."""
    from gradsync.config import TrainConfig
    from gradsync.verify import verdict_for

    name = f"{_write(tmp_path, 'freq.py', FREQUENCY_SCALED_MODEL)}:build"
    config = TrainConfig(model=name, strategy="allreduce", workers=2)
    verdict, reason = verdict_for(config, 5e-4, 1e-9)
    assert verdict == "differs (expected)"
    assert reason.startswith("lookup table 0.weight has scale_grad_by_freq")
    assert verdict_for(config.replace(workers=1), 5e-4, 1e-9)[0] == "FAIL"


SHARED_SPARSE_MODEL = """
import torch
from torch import nn
from torch.utils.data import TensorDataset


class Shared(nn.Module):
    def __init__(self, tied_output: bool):
        super().__init__()
        self.src = nn.Embedding(9, 4, sparse=True)
        self.tgt = nn.Embedding(9, 4, sparse=True)
        self.tgt.weight = self.src.weight
        self.out = nn.Linear(4, 9, bias=False)
        if tied_output:
            self.out.weight = self.src.weight

    def forward(self, x):
        return self.out(self.src(x[:, 0]) + self.tgt(x[:, 1]))


def build(seed: int = 0, tied_output: str = "no"):
    data = TensorDataset(torch.randint(0, 9, (8, 2)), torch.randint(0, 9, (8,)))
    return Shared(tied_output == "yes"), data, nn.functional.cross_entropy
"""


def test_ddp_trains_a_sparse_table_shared_by_sparse_lookups_only(tmp_path: Path) -> None:
    """Tied source and target embeddings were refused as "tied to a layer that reads it
    whole" (session 31's probe); ddp matches single on them. A tied output layer, which
    makes the gradient dense, is still refused."""
    from gradsync.config import TrainConfig
    from gradsync.errors import UserError
    from gradsync.strategies.ddp import NativeDDP

    name = f"{_write(tmp_path, 'shared.py', SHARED_SPARSE_MODEL)}:build"
    NativeDDP.check_config(TrainConfig(model=name, strategy="ddp", workers=2))
    tied = TrainConfig(model=name, strategy="ddp", workers=2, model_options={"tied_output": "yes"})
    with pytest.raises(UserError, match=r"src\.weight is an nn\.Embedding\(sparse=True\) weight"):
        NativeDDP.check_config(tied)
