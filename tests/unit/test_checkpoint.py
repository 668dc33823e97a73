"""Checkpoints (safetensors + JSON sidecar, atomic) and tensor-by-tensor comparison."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

import gradsync.checkpoint as checkpoint_module
from gradsync.checkpoint import (
    Checkpoint,
    atomic_write_text,
    load_checkpoint,
    model_state,
    save_checkpoint,
    sidecar_path,
)
from gradsync.compare import RELATIVE_FLOOR, TensorDiff, diff_checkpoints, tensor_diff, worst
from gradsync.errors import UserError

META = {
    "model": "mnist-cnn",
    "preset": "tiny",
    "strategy": "ddp",
    "workers": 2,
    "step": 3,
    "seed": 7,
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.bn = nn.BatchNorm2d(2)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.conv(x)).flatten(1))


def _trained(optimizer_name: str, steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    if optimizer_name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(4, 1, 4, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ---------------------------------------------------------------- model_state


def test_model_state_names_params_buffers_and_sgd_momentum():
    model, optimizer = _trained("sgd")
    state = model_state(model, optimizer)
    params = {f"param/{n}" for n, _ in model.named_parameters()}
    buffers = {"buffer/bn.running_mean", "buffer/bn.running_var", "buffer/bn.num_batches_tracked"}
    momenta = {f"optim/{n}/momentum_buffer" for n, _ in model.named_parameters()}
    assert set(state) == params | buffers | momenta
    assert torch.equal(state["param/head.weight"], model.head.weight)
    assert state["buffer/bn.num_batches_tracked"].item() == 2
    assert state["buffer/bn.num_batches_tracked"].dtype == torch.int64
    momentum = optimizer.state[model.head.weight]["momentum_buffer"]
    assert torch.equal(state["optim/head.weight/momentum_buffer"], momentum)
    assert not any(t.requires_grad for t in state.values())


def test_model_state_with_adam_has_moments_and_step():
    model, optimizer = _trained("adam", steps=3)
    state = model_state(model, optimizer)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert f"optim/conv.weight/{key}" in state
    assert state["optim/conv.weight/step"].item() == 3.0


def test_model_state_without_optimizer_and_with_tied_or_sparse_tensors():
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight  # tied: one tensor, one name
    model.register_buffer("mask", torch.eye(3).to_sparse())
    state = model_state(model, None)
    assert set(state) == {"param/0.weight", "buffer/mask"}
    assert not state["buffer/mask"].is_sparse
    assert torch.equal(state["buffer/mask"], torch.eye(3))


# ---------------------------------------------------------------- save / load


@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_round_trip_keeps_every_tensor_bit_for_bit(tmp_path, optimizer_name):
    model, optimizer = _trained(optimizer_name)
    tensors = model_state(model, optimizer)
    path = tmp_path / "run" / "checkpoint.safetensors"
    save_checkpoint(path, tensors, META)
    loaded = load_checkpoint(path)
    assert set(loaded.tensors) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded.tensors[name].dtype == tensor.dtype, name
        assert torch.equal(loaded.tensors[name], tensor), name
    assert set(loaded.parameters()) == {k for k in tensors if not k.startswith("optim/")}
    assert loaded.meta["model"] == "mnist-cnn" and loaded.meta["step"] == 3
    assert set(loaded.meta["versions"]) == {"gradsync", "torch", "python"}
    assert loaded.path == path

    # ... and the parameters restore a fresh model exactly
    fresh = Net()
    fresh.load_state_dict({k.split("/", 1)[1]: v for k, v in loaded.parameters().items()})
    x = torch.randn(2, 1, 4, 4)
    assert torch.equal(fresh.eval()(x), model.eval()(x))


def test_sidecar_equals_header_metadata(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, {"param/w": torch.arange(3.0)}, META)
    sidecar = json.loads(sidecar_path(path).read_text())
    assert sidecar_path(path).name == "ckpt.safetensors.json"
    with safe_open(str(path), framework="pt") as handle:
        header = json.loads(handle.metadata()["gradsync"])
    assert sidecar == header
    assert {k: sidecar[k] for k in META} == META


def test_missing_sidecar_falls_back_on_the_header(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, {"param/w": torch.ones(2)}, META)
    expected = load_checkpoint(path).meta
    sidecar_path(path).unlink()
    assert load_checkpoint(path).meta == expected
    assert expected["preset"] == "tiny"


def test_run_folder_loads_its_checkpoint(tmp_path):
    save_checkpoint(tmp_path / "checkpoint.safetensors", {"param/w": torch.ones(2)}, META)
    assert load_checkpoint(str(tmp_path)).path == tmp_path / "checkpoint.safetensors"


def test_missing_file_and_empty_folder_are_user_errors(tmp_path):
    with pytest.raises(UserError, match=r"no checkpoint at .*nope\.safetensors"):
        load_checkpoint(tmp_path / "nope.safetensors")
    with pytest.raises(UserError, match=r"no checkpoint at .*checkpoint\.safetensors"):
        load_checkpoint(tmp_path)


def _valid_bytes(tmp_path: Path) -> bytes:
    path = tmp_path / "good.safetensors"
    save_checkpoint(path, {"param/w": torch.arange(64.0), "buffer/b": torch.ones(3)}, META)
    return path.read_bytes()


@pytest.mark.parametrize("cut", [0, 4, 8, 20, 0.5, -1])
def test_truncated_file_is_a_user_error(tmp_path, cut):
    data = _valid_bytes(tmp_path)
    size = int(len(data) * cut) if isinstance(cut, float) else cut % len(data)
    path = tmp_path / "cut.safetensors"
    path.write_bytes(data[:size])
    with pytest.raises(UserError, match="is corrupt or not a safetensors file") as raised:
        load_checkpoint(path)
    assert str(path) in str(raised.value) and "rerun the job" in str(raised.value)


@pytest.mark.parametrize(
    "content",
    [b"garbage" * 50, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......", b"{}"],
)
def test_garbage_file_is_a_user_error(tmp_path, content):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(UserError, match="is corrupt"):
        load_checkpoint(path)


def test_corrupt_header_json_is_a_user_error(tmp_path):
    data = bytearray(_valid_bytes(tmp_path))
    data[8] = ord("[")  # the header JSON starts at byte 8
    path = tmp_path / "header.safetensors"
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match="is corrupt"):
        load_checkpoint(path)


def test_metadata_comes_from_the_header_not_a_corrupt_or_stale_sidecar(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, {"param/w": torch.ones(2)}, {**META, "step": 7})
    sidecar_path(path).write_text("{truncated")
    assert load_checkpoint(path).meta["step"] == 7


def test_failed_write_leaves_previous_checkpoint_and_no_temp_files(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.safetensors"
    save_checkpoint(path, {"param/w": torch.zeros(4)}, {**META, "step": 1})
    before = path.read_bytes(), sidecar_path(path).read_text()

    def half_write(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\x00" * 100)  # partial bytes, then the disk fills up
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_module, "save_file", half_write)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(path, {"param/w": torch.ones(4)}, {**META, "step": 2})
    assert (path.read_bytes(), sidecar_path(path).read_text()) == before
    assert _files(tmp_path) == ["checkpoint.safetensors", "checkpoint.safetensors.json"]
    loaded = load_checkpoint(path)
    assert loaded.meta["step"] == 1 and torch.equal(loaded.tensors["param/w"], torch.zeros(4))


def test_interrupted_text_write_cleans_up(tmp_path):
    target = tmp_path / "summary.json"
    atomic_write_text(target, "old\n")

    def interrupted(tmp: Path) -> None:
        tmp.write_text("new but incomplete")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        checkpoint_module.atomic_write_bytes(target, interrupted)
    assert target.read_text() == "old\n"
    assert _files(tmp_path) == ["summary.json"]


def test_atomic_write_replaces_and_creates_parents(tmp_path):
    target = tmp_path / "a" / "b" / "summary.json"
    atomic_write_text(target, "one")
    atomic_write_text(target, "two")
    assert target.read_text() == "two"
    assert _files(target.parent) == ["summary.json"]


def test_atomic_write_respects_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "summary.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "summary.json").stat().st_mode & 0o777 == 0o644


# ---------------------------------------------------------------- compare


def _ckpt(tensors: dict[str, torch.Tensor], name: str = "a", **meta: object) -> Checkpoint:
    return Checkpoint(
        path=Path(name), tensors=tensors, meta={"model": "mnist-cnn", "preset": "tiny", **meta}
    )


def test_tensor_diff_values():
    diff = tensor_diff("w", torch.tensor([1.0, -2.0, 4.0]), torch.tensor([1.5, -2.0, 3.0]))
    assert diff == TensorDiff("w", 1.0, 0.5)  # max abs from 4→3, max rel from 1→1.5


def test_tensor_diff_relative_floor_leaves_tiny_references_out():
    assert RELATIVE_FLOOR == 1e-6
    reference = torch.tensor([0.0, 5e-7, 2.0], dtype=torch.float64)
    other = torch.tensor([0.1, 0.2, 2.2], dtype=torch.float64)
    diff = tensor_diff("w", reference, other)
    assert diff.max_abs == pytest.approx(0.2)
    assert diff.max_rel == pytest.approx(0.1)  # only 2.0 → 2.2 counts
    at_floor = tensor_diff(
        "w", torch.tensor([1e-6], dtype=torch.float64), torch.tensor([3e-6], dtype=torch.float64)
    )
    assert at_floor.max_rel == pytest.approx(2.0)


def test_tensor_diff_edge_cases():
    assert tensor_diff("e", torch.empty(0), torch.empty(0)) == TensorDiff("e", 0.0, 0.0)
    below = tensor_diff("z", torch.zeros(3), torch.full((3,), 1e-3))
    assert below.max_rel == 0.0 and below.max_abs == pytest.approx(1e-3)
    ints = tensor_diff("n", torch.tensor([3]), torch.tensor([5]))
    assert (ints.max_abs, ints.max_rel) == (2.0, pytest.approx(2 / 3))
    vs_zero = tensor_diff("s", torch.tensor([-3.0, 0.5]), torch.zeros(2))
    assert (vs_zero.max_abs, vs_zero.max_rel) == (3.0, 1.0)


def test_tensor_diff_is_computed_in_float64():
    a = torch.tensor([1.0], dtype=torch.float32)
    b = torch.tensor([1.0 + 2**-23], dtype=torch.float32)  # one float32 ulp
    assert tensor_diff("u", a, b).max_abs == 2**-23


def test_within_tolerance_is_inclusive_and_nan_is_never_within():
    assert TensorDiff("t", 1e-5, 0.0).within(1e-5)
    assert not TensorDiff("t", 1.1e-5, 0.0).within(1e-5)
    nan = tensor_diff("t", torch.tensor([1.0]), torch.tensor([float("nan")]))
    assert not nan.within(1e9)


def test_diff_checkpoints_per_tensor_sorted():
    ref = _ckpt(
        {
            "param/b": torch.ones(2),
            "param/a": torch.zeros(2),
            "optim/a/momentum_buffer": torch.ones(2),
        }
    )
    other = _ckpt(
        {
            "param/b": torch.tensor([1.0, 1.5]),
            "param/a": torch.zeros(2),
            "optim/a/momentum_buffer": torch.tensor([1.0, 3.0]),
        },
        "b",
    )
    diffs = diff_checkpoints(ref, other)
    assert [d.name for d in diffs] == ["optim/a/momentum_buffer", "param/a", "param/b"]
    assert [(d.max_abs, d.max_rel) for d in diffs] == [(2.0, 2.0), (0.0, 0.0), (0.5, 0.5)]
    without = diff_checkpoints(ref, other, include_optimizer=False)
    assert [d.name for d in without] == ["param/a", "param/b"]
    assert worst(diffs) == TensorDiff("all", 2.0, 2.0)
    assert worst(without) == TensorDiff("all", 0.5, 0.5)
    assert worst([]) == TensorDiff("all", 0.0, 0.0)


def test_worst_takes_abs_and_rel_from_different_tensors():
    diffs = [TensorDiff("a", 3.0, 0.1), TensorDiff("b", 0.5, 0.9)]
    assert worst(diffs) == TensorDiff("all", 3.0, 0.9)


def test_optimizer_state_of_only_one_side_is_not_an_error():
    ref = _ckpt({"param/w": torch.ones(2), "optim/w/exp_avg": torch.ones(2)})
    other = _ckpt({"param/w": torch.ones(2)}, "b")
    assert [d.name for d in diff_checkpoints(ref, other)] == ["param/w"]


@pytest.mark.parametrize("field", ["model", "preset"])
def test_different_models_are_a_user_error(field):
    ref = _ckpt({"param/w": torch.ones(2)}, "ref.safetensors")
    other = _ckpt({"param/w": torch.ones(2)}, "other.safetensors", **{field: "resnet56"})
    with pytest.raises(UserError, match="different models") as raised:
        diff_checkpoints(ref, other)
    assert "ref.safetensors" in str(raised.value) and "other.safetensors" in str(raised.value)
    assert "resnet56" in str(raised.value)


def test_different_tensor_sets_are_a_user_error_naming_them():
    ref = _ckpt({"param/w": torch.ones(2), "buffer/bn.running_mean": torch.zeros(2)})
    other = _ckpt({"param/w": torch.ones(2), "param/extra": torch.zeros(1)}, "b")
    with pytest.raises(UserError, match="hold different tensors") as raised:
        diff_checkpoints(ref, other)
    assert "buffer/bn.running_mean" in str(raised.value)
    assert "param/extra" in str(raised.value)


def test_different_shapes_are_a_user_error():
    ref = _ckpt({"param/w": torch.ones(2, 3)})
    other = _ckpt({"param/w": torch.ones(3, 2)}, "b")
    with pytest.raises(UserError, match=r"param/w has shape \(3, 2\) .* but \(2, 3\)"):
        diff_checkpoints(ref, other)


def test_files_without_model_parameters_are_not_within_tolerance(tmp_path):
    """Two foreign safetensors files ({'w': zeros} and {'w': ones}) compared "within
    tolerance" on no tensors at all (session 24's probe)."""
    from safetensors.torch import save_file

    ref = _ckpt({"param/w": torch.ones(2)})
    foreign = _ckpt({"w": torch.zeros(2)}, "foreign.safetensors")
    with pytest.raises(UserError, match=r"foreign\.safetensors holds no model parameters"):
        diff_checkpoints(ref, foreign)
    with pytest.raises(UserError, match="holds no model parameters"):
        diff_checkpoints(foreign, ref)
    # metadata that is JSON but not an object: one line, not an AttributeError
    save_file({"w": torch.zeros(1)}, str(tmp_path / "list.safetensors"), {"gradsync": "[1, 2]"})
    with pytest.raises(UserError, match="JSON but not an object"):
        load_checkpoint(tmp_path / "list.safetensors")


def test_compare_two_saved_checkpoints(tmp_path):
    model, optimizer = _trained("sgd")
    save_checkpoint(tmp_path / "a.safetensors", model_state(model, optimizer), META)
    with torch.no_grad():
        model.head.bias[1] += 0.25
    save_checkpoint(tmp_path / "b.safetensors", model_state(model, optimizer), META)
    diffs = diff_checkpoints(
        load_checkpoint(tmp_path / "a.safetensors"), load_checkpoint(tmp_path / "b.safetensors")
    )
    beyond = {d.name: d.max_abs for d in diffs if not d.within(1e-5)}
    assert list(beyond) == ["param/head.bias"]
    assert beyond["param/head.bias"] == pytest.approx(0.25)


def test_optimizer_state_is_restored_beside_its_parameter() -> None:
    """On a GPU the moments must land on the GPU: session 24's resume on an H200 died in
    SGD's first step ("cuda:0 and cpu"). The meta device stands in for the GPU; Adam's step
    count stays on the CPU, where torch keeps it."""
    from gradsync.checkpoint import load_model_state

    source = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(source.parameters())
    source(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    target = nn.Linear(3, 2, device="meta")
    target_optimizer = torch.optim.Adam(target.parameters())
    load_model_state(target, target_optimizer, model_state(source, optimizer))
    states = list(target_optimizer.state.values())
    assert len(states) == 2
    for state in states:
        assert state["exp_avg"].device.type == "meta" and state["exp_avg_sq"].device.type == "meta"
        assert state["step"].device.type == "cpu"


def test_tensors_that_share_memory_are_written(tmp_path: Path) -> None:
    """A buffer aliasing a parameter, and two parameters over overlapping windows of one
    storage: safetensors refused them after every step had run (session 31's probe)."""

    model = nn.Linear(3, 2)
    model.register_buffer("weight_ref", model.weight.data)
    storage = torch.arange(6.0)
    model.register_parameter("low", nn.Parameter(storage[:4]))
    model.register_parameter("high", nn.Parameter(storage[2:]))
    path = tmp_path / "checkpoint.safetensors"
    save_checkpoint(path, model_state(model, None), {"step": 1})
    tensors = load_checkpoint(path).tensors
    assert torch.equal(tensors["buffer/weight_ref"], model.weight.detach())
    assert torch.equal(tensors["param/high"], torch.arange(2.0, 6.0))


def test_a_servers_state_with_one_tensor_under_several_keys_is_sent() -> None:
    """hybrid --partitions 3 on one server: every partition's lag/sums is one tensor, and
    the LOAD of a resume crashed in safetensors (session 31's probe)."""
    from gradsync.comm.wire import decode_state, encode_state

    sums = torch.arange(3.0)
    state = decode_state(encode_state({"0/lag/sums": sums, "1/lag/sums": sums}))
    assert torch.equal(state["0/lag/sums"], sums) and torch.equal(state["1/lag/sums"], sums)
