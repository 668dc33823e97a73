"""``gradsync profile`` / ``gradsync predict`` end to end in-process: files, errors, cost."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from gradsync.cli import main
from gradsync.predict.network import Cluster
from gradsync.predict.profile import Profile, ProfileRequest, measure_profile
from tests.unit.test_predict import profile_of, variable


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profile") / "mnist.json"
    assert main(["profile", "--model", "mnist-cnn", "--preset", "tiny", "--steps", "4",
                 "--warmup", "1", "--out", str(path)]) == 0  # fmt: skip
    return path


def test_profile_round_trips_and_describes_the_model(tiny_profile: Path) -> None:
    profile = Profile.load(tiny_profile)
    assert Profile.from_json(profile.to_json()) == profile
    assert profile.batch == 8 and profile.threads == 1
    from gradsync.models import build_workload

    model = build_workload("mnist-cnn", preset="tiny").model
    assert [v.name for v in profile.variables] == [n for n, _ in model.named_parameters()]
    starts = [layer.forward_start_s for layer in profile.layers]
    assert starts == sorted(starts)  # layers are numbered in forward order
    assert all(0 <= v.grad_ready_s <= profile.backward_s * 1.5 for v in profile.variables)
    # Each step after the warm-up's forward plus backward: the spread stragglers come from.
    assert len(profile.compute_samples_s) == 3 and min(profile.compute_samples_s) > 0


def test_sparse_rows_are_profiled() -> None:
    profile = measure_profile(
        ProfileRequest(
            model="lstm-lm", preset="tiny", model_options={"sparse": "true"}, steps=3, warmup=1
        )
    )
    sparse = {v.name: v for v in profile.sparse_variables}
    assert "embedding.weight" in sparse
    assert 0 < sparse["embedding.weight"].rows_touched <= sparse["embedding.weight"].num_rows
    assert sparse["embedding.weight"].densify_s > 0  # timed: making the gradient dense
    assert all(v.densify_s == 0 for v in profile.dense_variables)
    # hybrid's server work on those rows, timed with the server's code: sum, update, read,
    # a read's and an update's fixed cost per call. The update and the read are per row
    # less that fixed cost: on a tiny table's few rows they can be below the clock's
    # resolution, and count as measured all the same (test_predict.py prices them).
    for v in sparse.values():
        assert v.merge_s_per_row > 0 and v.apply_call_s > 0 and v.read_call_s > 0
        assert v.apply_s_per_row >= 0 and v.read_s_per_row >= 0
    assert all(v.apply_s_per_row == 0 for v in profile.dense_variables)
    assert profile.dense_optimizer_s > 0  # the LSTM's update alone, as hybrid's worker runs it
    bins = sparse["embedding.weight"].row_bins  # where the rows lie: 16 ranges, shares
    assert len(bins) == 16 and sum(bins) == pytest.approx(1.0)
    assert Profile.from_json(profile.to_json()) == profile


def test_predict_writes_table_json_plots_and_trace(tiny_profile: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = main(["predict", "--profile", str(tiny_profile), "--workers", "1,2,4",
                 "--bandwidth", "100mbit,1gbit", "--out", str(out)])  # fmt: skip
    assert code == 0
    payload = json.loads((out / "predictions.json").read_text())
    assert len(payload["points"]) == 5 * 3 * 2
    assert {r["bandwidth"] for r in payload["recommendations"]} == {"100mbit", "1gbit"}
    for name in ("predictions.md", "scaling.png", "bandwidth.png"):
        assert (out / name).stat().st_size > 0
    trace = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert {e["name"] for e in trace if e["ph"] == "X"} >= {"FORWARD", "BACKWARD"}


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["predict", "--profile", "no/such/profile.json"], "does not exist"),
        (["predict", "--profile", "{profile}", "--strategies", "gossip"], "gossip"),
        (["predict", "--profile", "{profile}", "--bandwidth", "0gbit"], "0gbit"),
        (["predict", "--profile", "{profile}", "--workers", "0"], "positive"),
        (["predict", "--profile", "{profile}", "--queue", "deep"], "--queue"),
        (["predict", "--profile", "{bad}"], "not a gradsync profile"),
        (["predict", "--validate", "no/such.toml"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], words: str, tiny_profile: Path, tmp_path: Path, capsys
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    argv = [a.format(profile=tiny_profile, bad=bad) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err


def test_prediction_work_grows_linearly_with_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    # Counted, not timed: host lookups per prediction stay proportional to the worker count
    # (the link model never loops over worker pairs).
    from gradsync.predict.network import Network
    from gradsync.predict.simulate import StrategyChoice, predict_step

    calls = 0
    original = Cluster.worker_host

    def counting(self: Cluster, worker: int) -> int:
        nonlocal calls
        calls += 1
        return original(self, worker)

    monkeypatch.setattr(Cluster, "worker_host", counting)
    profile = profile_of([variable(f"v{i}", 10_000, 2.0 - i / 10) for i in range(10)])
    counts = {}
    for workers in (64, 256):
        calls = 0
        cluster = Cluster(workers=workers, network=Network(bandwidth=1e9))
        for name in ("allreduce", "ddp", "ps", "hybrid", "p3"):
            predict_step(profile, cluster, StrategyChoice(name))
        counts[workers] = calls
    assert counts[256] <= 4 * counts[64] * 1.1


def model_profile(model: str, **options: str) -> Any:
    """A hand-made profile naming ``model`` (what ``cluster_for`` reads of it)."""
    return dataclasses.replace(profile_of([]), model=model, preset="default", model_options=options)


def test_validation_plan_places_ranks_as_the_launcher_does(tmp_path: Path) -> None:
    from gradsync.errors import UserError
    from gradsync.predict.sweep import parse_choice
    from gradsync.predict.validate import cluster_for, load_plan

    plan_file = tmp_path / "plan.toml"
    plan_file.write_text(
        'strategies = ["ps", "ps:colocate"]\nbandwidths = ["1gbit"]\n[[model]]\nname = "vgg16"\n'
    )
    plan = load_plan(plan_file)
    vgg = model_profile("vgg16")
    # 2 workers + 1 server on 2 hosts: ranks 0 and 1 share host 0, the server has host 1.
    ps = cluster_for(plan, vgg, parse_choice("ps"), "1gbit")
    assert [ps.worker_host(w) for w in range(2)] == [0, 0] and ps.server_host(0) == 1
    colocated = cluster_for(plan, vgg, parse_choice("ps:colocate"), "1gbit")
    assert [colocated.server_host(s) for s in range(2)] == [0, 1]
    # hybrid starts a server only for a model with sparse variables, and the launcher then
    # places its 3 ranks as ps's.
    dense = cluster_for(plan, vgg, parse_choice("hybrid"), "1gbit")
    assert [dense.worker_host(w) for w in range(2)] == [0, 1]
    lstm = model_profile("lstm-lm", sparse="true", vocab="1000")
    sparse = cluster_for(plan, lstm, parse_choice("hybrid"), "1gbit")
    assert [sparse.worker_host(w) for w in range(2)] == [0, 0] and sparse.server_host(0) == 1
    text = plan_file.read_text()
    for bad, words in (('colour = "blue"\n' + text, "unknown key 'colour'"),
                       (text + 'colour = "blue"\n', "'colour' in \\[\\[model\\]\\]")):  # fmt: skip
        plan_file.write_text(bad)
        with pytest.raises(UserError, match=words):
            load_plan(plan_file)


def test_a_calibrated_validation_fits_each_bandwidth_to_its_own_commbench(
    tmp_path: Path,
) -> None:
    from gradsync.predict.sweep import parse_choice
    from gradsync.predict.validate import _calibration, cluster_for, load_plan

    plan_file = tmp_path / "plan.toml"
    plan_file.write_text(
        'strategies = ["ddp"]\nbandwidths = ["100mbit", "1gbit"]\ncalibrate = true\n'
        '[[model]]\nname = "vgg16"\n'
    )
    plan = load_plan(plan_file)
    for bandwidth, share in (("100mbit", 0.5), ("1gbit", 0.8)):
        rate = share * (12.5e6 if bandwidth == "100mbit" else 125e6)
        rows = [  # a 2-rank ring: 2 hops of 1 ms, then S / rate
            {"op": "allreduce", "bytes": size, "time_s": 2e-3 + size / rate}
            for size in (1 << 20, 1 << 24)
        ]
        path = _calibration(plan, bandwidth, tmp_path)
        assert path is not None
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"world_size": 2, "bandwidth": bandwidth, "results": rows}))
        network = cluster_for(plan, model_profile("vgg16"), parse_choice("ddp"), bandwidth, path)
        network = network.network
        assert network.efficiency == pytest.approx(share)
        assert network.message_s == pytest.approx(1e-3)


def test_unshaped_validation_cells_run_at_the_rate_their_calibration_measured(
    tmp_path: Path,
) -> None:
    from gradsync.errors import UserError
    from gradsync.predict.sweep import parse_choice
    from gradsync.predict.validate import _calibration, cluster_for, load_plan, shaped_rate

    plan_file = tmp_path / "plan.toml"
    text = 'strategies = ["ddp"]\nbandwidths = ["unshaped"]\n[[model]]\nname = "vgg16"\n'
    plan_file.write_text(text)
    with pytest.raises(UserError, match="calibrate = true"):
        load_plan(plan_file)  # nothing says how fast links nobody shaped are
    plan_file.write_text("calibrate = true\n" + text)
    plan = load_plan(plan_file)
    rows = [  # a 2-rank ring on veth pairs: 2 hops of 50 us, then S at 600 MB/s
        {"op": "allreduce", "bytes": size, "time_s": 1e-4 + size / 6e8}
        for size in (1 << 20, 1 << 24)
    ]
    path = _calibration(plan, "unshaped", tmp_path)
    assert path is not None and shaped_rate("unshaped") is None
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"world_size": 2, "bandwidth": None, "results": rows}))
    cluster = cluster_for(plan, model_profile("vgg16"), parse_choice("ddp"), "unshaped", path)
    assert cluster.network.rate == pytest.approx(6e8)
    assert cluster.network.message_s == pytest.approx(5e-5)
    assert cluster.network.queue_s == 0.0  # no shaping, no shaper's queue


def test_a_validation_whose_workers_cannot_split_the_batch_stops_before_any_cell(
    tmp_path: Path,
) -> None:
    from gradsync.errors import UserError
    from gradsync.predict.validate import load_plan

    plan_file = tmp_path / "plan.toml"
    text = 'strategies = ["ddp"]\nbandwidths = ["1gbit"]\n[[model]]\nname = "vgg16"\n'
    plan_file.write_text("workers = 3\n" + text)  # vgg16's preset trains 32 samples a step
    with pytest.raises(UserError, match=r"global batch of 32.*global_batch = 30"):
        load_plan(plan_file)
    plan_file.write_text("workers = 3\nglobal_batch = 48\n" + text)
    assert load_plan(plan_file).global_batch == 48
    for bad in ('global_batch = "48"', "global_batch = 0", 'workers = "2"', "hosts = true"):
        plan_file.write_text(f"{bad}\n" + text)
        with pytest.raises(UserError, match="not a whole number of at least 1"):
            load_plan(plan_file)


def test_predict_models_global_batchnorm_unless_told_local(tmp_path: Path) -> None:

    path = tmp_path / "bn.json"
    profile = profile_of([variable("w", 1000, 2.0)])
    dataclasses.replace(profile, batchnorm_channels=(64,) * 20).save(path)
    steps = {}
    for mode in ("global", "local"):
        out = tmp_path / mode
        assert main(["predict", "--profile", str(path), "--strategies", "ddp", "--workers",
                     "4", "--bandwidth", "1gbit", "--batchnorm", mode, "--no-recommend",
                     "--out", str(out)]) == 0  # fmt: skip
        payload = json.loads((out / "predictions.json").read_text())
        assert payload["settings"]["batchnorm"] == mode
        steps[mode] = payload["points"][0]["step_s"]
    # 20 layers × (an all_gather of 3 × 64 float64 moments and a 2-element tag in forward,
    # a float64 allreduce of 2 × 64 sums, the tag and its square in backward)
    hop, rate = 25e-6, 125e6
    gather = 3 * ((3 * 64 + 2) * 8 / rate + hop)
    reduce = 2 * 3 / 4 * (128 + 4) * 8 / rate + 6 * hop
    assert steps["global"] - steps["local"] == pytest.approx(20 * (gather + reduce), rel=1e-3)


def test_the_profile_times_the_batchnorm_layers_a_run_trains_with() -> None:
    """--batchnorm global (train's default) times gradsync's layer, alone in a process group
    of one (so it gathers nothing); local times torch's. Either way the channels are listed,
    the choice recorded, and no process group is left behind."""
    import torch.distributed as dist

    profiles = {
        mode: measure_profile(
            ProfileRequest(model="resnet56", preset="tiny", steps=3, warmup=1, batchnorm=mode)
        )
        for mode in ("global", "local")
    }
    assert not dist.is_initialized()
    assert profiles["global"].batchnorm == "global" and profiles["local"].batchnorm == "local"
    assert profiles["global"].batchnorm_channels == profiles["local"].batchnorm_channels
    assert len(profiles["global"].batchnorm_channels) == 7  # 1 + 3 stages × 1 block × 2
    assert Profile.from_json(profiles["global"].to_json()) == profiles["global"]


def test_the_profile_runs_dropout_as_train_does_and_records_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A profile times the model `gradsync train` runs: dropout on (transformer's forward
    on the validation's machine: 0.11 s without it, 0.15–0.21 s with it), off with
    --deterministic; the choice is recorded, and a profile from before it loads as off."""
    import gradsync.models
    from gradsync.config import TrainConfig

    built = []
    build = gradsync.models.build_workload

    def spy(*args, **kwargs):
        built.append(kwargs["dropout"])
        return build(*args, **kwargs)

    monkeypatch.setattr(gradsync.models, "build_workload", spy)
    assert ProfileRequest(model="transformer").dropout is not TrainConfig().deterministic
    for flags, expected in (([], True), (["--deterministic"], False)):
        built.clear()
        path = tmp_path / f"p{len(flags)}.json"
        argv = ["profile", "--model", "transformer", "--preset", "tiny", "--steps", "3",
                "--warmup", "1", "--out", str(path), *flags]  # fmt: skip
        assert main(argv) == 0
        assert built == [expected] and Profile.load(path).dropout is expected
    old = json.loads(path.read_text())
    del old["dropout"]
    assert Profile.from_json(json.dumps(old)).dropout is False


def test_the_layers_the_profile_converts_compute_torchs_batchnorm() -> None:
    import copy

    import torch
    from torch import nn

    from gradsync.comm.batchnorm import GlobalBatchNorm
    from gradsync.predict.profile import _solo_group, _use_batchnorm

    torch.manual_seed(0)
    reference = nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.BatchNorm2d(3, affine=False)
    )
    model = copy.deepcopy(reference)
    x = torch.randn(4, 2, 5, 5, dtype=torch.float64)
    with _solo_group():
        assert _use_batchnorm(model, "global") == (3, 3)
        assert isinstance(model[1], GlobalBatchNorm) and isinstance(model[2], GlobalBatchNorm)
        got = model.double()(x)
    torch.testing.assert_close(got, reference.double()(x), rtol=1e-12, atol=1e-12)


def test_predict_notes_a_profile_timed_with_other_batchnorm_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:

    path = tmp_path / "bn.json"
    profile = profile_of([variable("w", 1000, 2.0)])
    dataclasses.replace(profile, batchnorm_channels=(8,), batchnorm="local").save(path)
    for mode, noted in (("global", True), ("local", False)):
        assert main(["predict", "--profile", str(path), "--strategies", "ddp", "--workers",
                     "2", "--bandwidth", "1gbit", "--batchnorm", mode, "--no-recommend",
                     "--out", str(tmp_path / mode)]) == 0  # fmt: skip
        err = capsys.readouterr().err
        assert ("the profile timed local BatchNorm layers" in err) is noted, err
        if noted:
            assert "gradsync profile --batchnorm global" in err


def test_a_validation_model_may_list_its_own_bandwidths(tmp_path: Path) -> None:
    from gradsync.errors import UserError
    from gradsync.predict.validate import load_plan

    plan_file = tmp_path / "plan.toml"
    plan_file.write_text(
        'strategies = ["ddp"]\nbandwidths = ["100mbit", "1gbit"]\n'
        '[[model]]\nname = "vgg16"\n[[model]]\nname = "lstm-lm"\nbandwidths = ["1gbit"]\n'
    )
    plan = load_plan(plan_file)
    assert [plan.bandwidths_of(m) for m in plan.models] == [("100mbit", "1gbit"), ("1gbit",)]
    text = plan_file.read_text()
    plan_file.write_text(text.replace('["1gbit"]\n', '["1 gigabit"]\n'))
    with pytest.raises(UserError, match="1 gigabit"):
        load_plan(plan_file)
    for bad in ('"true"', "1"):  # a string is a path; a number is neither
        plan_file.write_text(f"calibrate = {bad}\n" + text)
        with pytest.raises(UserError, match="calibrate = "):
            load_plan(plan_file)


def test_a_validation_on_shared_cores_reads_cpu_and_duplex_from_the_supplement(
    tmp_path: Path,
) -> None:
    from gradsync.predict.sweep import parse_choice
    from gradsync.predict.validate import SUPPLEMENT, _calibration, cluster_for, load_plan

    plan_file = tmp_path / "plan.toml"
    plan_file.write_text(
        'strategies = ["ps"]\nbandwidths = ["1gbit"]\ncalibrate = true\nshared_cores = 2\n'
        '[[model]]\nname = "vgg16"\n'
    )
    plan = load_plan(plan_file)
    path = _calibration(plan, "1gbit", tmp_path)
    assert path is not None
    path.parent.mkdir(parents=True)
    sizes = (1 << 20, 1 << 24)
    ring = [{"op": "allreduce", "bytes": s, "time_s": 1e-3 + s / 1e8} for s in sizes]
    path.write_text(json.dumps({"world_size": 2, "bandwidth": "1gbit", "results": ring}))
    vgg = model_profile("vgg16")
    before = cluster_for(plan, vgg, parse_choice("ps"), "1gbit", path)
    assert before.shared_cores == 2
    assert before.network.cpu_s_per_byte == 0.0 and before.network.bidirectional_slowdown == 1.0
    rows = [{**r, "cpu_s": 2e-4 + 1e-9 * r["bytes"]} for r in ring] + [
        {"op": op, "bytes": 1 << 24, "time_s": t} for op, t in (("p2p", 0.14), ("exchange", 0.28))
    ]
    (path.parent / SUPPLEMENT).parent.mkdir()
    (path.parent / SUPPLEMENT).write_text(json.dumps({"world_size": 2, "results": rows}))
    network = cluster_for(plan, vgg, parse_choice("ps"), "1gbit", path).network
    assert network.message_s == before.network.message_s  # the ring's time: the calibration's
    assert network.cpu_s_per_byte == pytest.approx(1e-9)
    assert network.cpu_s_per_message == pytest.approx(1e-4)
    assert network.bidirectional_slowdown == pytest.approx(2.0)


def test_predict_shared_cores_charges_communication_cpu(tmp_path: Path) -> None:
    profile = tmp_path / "p.json"
    profile_of([variable("a", 250_000, 0.0)]).save(profile)
    calibration = tmp_path / "commbench.json"
    rows = [
        {"op": "allreduce", "bytes": s, "time_s": s / 1e6, "cpu_s": 1e-7 * s}
        for s in (1 << 16, 1 << 20)
    ]
    calibration.write_text(json.dumps({"world_size": 2, "results": rows}))
    steps = {}
    for flags in ([], ["--shared-cores", "2"]):
        out = tmp_path / f"out{len(flags)}"
        argv = ["predict", "--profile", str(profile), "--workers", "2", "--bandwidth", "8mbit",
                "--latency", "0", "--strategies", "allreduce", "--no-recommend",
                "--calibrate", str(calibration), "--out", str(out), *flags]  # fmt: skip
        assert main(argv) == 0
        steps[len(flags)] = json.loads((out / "predictions.json").read_text())
    assert steps[2]["settings"]["shared_cores"] == 2
    plain = steps[0]["points"][0]["step_s"]
    shared = steps[2]["points"][0]["step_s"]
    assert shared == pytest.approx(plain + (250_000 + 1) * 4 * 1e-7)  # 2·S bytes, 2 cores


def test_averaging_two_profiles_halves_every_time_between_them() -> None:
    from gradsync.errors import UserError

    slow = profile_of([variable("w", 1000, 2.0)], forward=1.0, backward=2.0)
    fast = profile_of([variable("w", 1000, 1.0)], forward=3.0, backward=4.0)
    mean = slow.averaged_with(fast)
    assert (mean.forward_s, mean.backward_s, mean.variables[0].grad_ready_s) == (2.0, 3.0, 1.5)
    with pytest.raises(UserError, match="different models"):
        slow.averaged_with(profile_of([variable("v", 1000, 1.0)]))


def _fake_validation(
    monkeypatch: pytest.MonkeyPatch, plan_file: Path, forwards: Any, measured: Any
) -> list[tuple[str, int]]:
    """Validation without training or profiling: each profile's forward_s is the next of
    ``forwards``, each run measures the next of ``measured``; returns the (strategy,
    round) of every run, in order, as they happen."""
    from gradsync.predict import validate

    order: list[tuple[str, int]] = []

    def fake_profile(plan: Any, model: Any, where: Path) -> Profile:
        profile = dataclasses.replace(
            profile_of([variable("w", 1000, 0.5)], forward=next(forwards)), model="vgg16"
        )
        profile.save(where)
        return profile

    def fake_cell(
        plan: Any, model: Any, profile: Profile, spec: str, bandwidth: str, out: Path,
        *, round_: int = 0,
    ) -> dict[str, Any]:  # fmt: skip
        order.append((spec, round_))
        return {"model": model.label, "strategy": spec, "bandwidth": bandwidth, "workers": 2,
                "status": "ok", "measured": next(measured), "predicted": 1.0, "error": 0.0,
                "load_before": 0.0}  # fmt: skip

    monkeypatch.setattr(validate, "_profile", fake_profile)
    monkeypatch.setattr(validate, "_run_cell", fake_cell)
    return order


def test_each_validation_cell_is_predicted_from_profiles_either_side_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Profile, cell, profile, cell, profile: the profile after a cell is the next one's
    before, so a machine that slows down during the run is bracketed, not sampled once."""
    from gradsync.predict import validate
    from gradsync.predict.simulate import StrategyChoice, predict_step

    plan_file = tmp_path / "plan.toml"
    plan_file.write_text('strategies = ["ddp", "allreduce"]\nbandwidths = ["1gbit"]\n'
                         '[[model]]\nname = "vgg16"\n')  # fmt: skip
    _fake_validation(monkeypatch, plan_file, iter([1.0, 3.0, 5.0, 7.0, 9.0]), iter([1.0] * 9))
    plan = validate.load_plan(plan_file)
    summary = validate.run_validation(plan, tmp_path / "run")
    cells = {c["strategy"]: c for c in summary["cells"]}
    assert Profile.load(cells["allreduce"]["profile"]).forward_s == 3.0  # ddp's after
    assert Profile.load(cells["allreduce"]["profile_after"]).forward_s == 5.0
    cluster = validate.cluster_for(plan, Profile.load(cells["ddp"]["profile"]),
                                   StrategyChoice("ddp"), "1gbit")  # fmt: skip
    bracketed = dataclasses.replace(
        profile_of([variable("w", 1000, 0.5)], forward=2.0), model="vgg16"
    )
    expected = predict_step(bracketed, cluster, StrategyChoice("ddp")).throughput
    assert cells["ddp"]["predicted"] == pytest.approx(expected)
    # A resumed run keeps the measured cells' profiles and profiles afresh before the next.
    log = tmp_path / "run" / "cells.jsonl"
    log.write_text(log.read_text().splitlines()[0] + "\n")
    summary = validate.run_validation(plan, tmp_path / "run")
    resumed = {c["strategy"]: c for c in summary["cells"]}["allreduce"]
    assert resumed["profile"].endswith("vgg16-1gbit-allreduce-before.json")
    assert Profile.load(cells["ddp"]["profile"]).forward_s == 1.0


def test_a_validation_with_repeats_measures_each_cell_in_interleaved_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """repeats = 3: every strategy once, then every strategy again (A, B, A, B, A, B), each
    run in a directory of its own; a cell is the median of its rounds, its spread their
    min–max, predicted from the mean of all six profiles around its runs. A resumed run
    measures only the rounds missing."""
    from gradsync.predict import validate
    from gradsync.predict.simulate import StrategyChoice, predict_step

    plan_file = tmp_path / "plan.toml"
    plan_file.write_text('strategies = ["ddp", "allreduce"]\nbandwidths = ["1gbit"]\n'
                         'repeats = 3\n[[model]]\nname = "vgg16"\n')  # fmt: skip
    measured = iter([10.0, 20.0, 30.0, 21.0, 12.0, 19.0, 99.0, 99.0])
    forwards = iter(float(n) for n in range(1, 100))
    order = _fake_validation(monkeypatch, plan_file, forwards, measured)
    plan = validate.load_plan(plan_file)
    summary = validate.run_validation(plan, tmp_path / "run")
    assert order == [(s, r) for r in range(3) for s in ("ddp", "allreduce")]
    cells = {c["strategy"]: c for c in summary["cells"]}
    assert cells["ddp"]["rounds"] == [10.0, 30.0, 12.0] and cells["ddp"]["measured"] == 12.0
    assert cells["allreduce"]["measured"] == 20.0 and cells["allreduce"]["spread"] == "19.00–21.00"
    # ddp's runs sat between profiles 1|2, 3|4 and 5|6 (forward_s): their mean is 3.5.
    assert [Profile.load(p).forward_s for p in cells["ddp"]["profiles"]] == [1, 2, 3, 4, 5, 6]
    cluster = validate.cluster_for(plan, Profile.load(cells["ddp"]["profiles"][0]),
                                   StrategyChoice("ddp"), "1gbit")  # fmt: skip
    mean = dataclasses.replace(profile_of([variable("w", 1000, 0.5)], forward=3.5), model="vgg16")
    expected = predict_step(mean, cluster, StrategyChoice("ddp")).throughput
    assert cells["ddp"]["predicted"] == pytest.approx(expected)
    assert cells["ddp"]["error"] == pytest.approx(expected / 12.0 - 1)
    # Resumed with the last round lost: only that round runs again.
    log = tmp_path / "run" / "cells.jsonl"
    log.write_text("\n".join(log.read_text().splitlines()[:4]) + "\n")
    order.clear()
    validate.run_validation(plan, tmp_path / "run")
    assert order == [("ddp", 2), ("allreduce", 2)]


def test_a_validation_plan_with_zero_repeats_is_refused(tmp_path: Path) -> None:
    from gradsync.errors import UserError
    from gradsync.predict import validate

    plan_file = tmp_path / "plan.toml"
    plan_file.write_text('strategies = ["ddp"]\nbandwidths = ["1gbit"]\nrepeats = 0\n'
                         '[[model]]\nname = "vgg16"\n')  # fmt: skip
    with pytest.raises(UserError, match="repeats = 0 is not a whole number of at least 1"):
        validate.load_plan(plan_file)


SIBLING_MODEL = """
import multiprocessing

import torch
from torch import nn


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x):
        if multiprocessing.parent_process() is not None and {where!r} == "forward":
            raise RuntimeError("this sibling dies in its first forward")
        return self.linear(x)


def build():
    if multiprocessing.parent_process() is not None and {where!r} == "build":
        raise RuntimeError("this sibling dies building its model")
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    return Model(), data, nn.functional.cross_entropy
"""


@pytest.mark.parametrize("where", ["nowhere", "build", "forward"])
def test_concurrent_siblings_compute_or_the_profile_fails(where: str, tmp_path: Path) -> None:
    """--concurrent 2 runs a sibling process computing the same steps (started clean by
    spawn: on a CUDA build of torch, a process forked after any backward cannot run
    backward). A sibling that dies, before it computed or while it computes, fails the
    profile: one taken with fewer ranks computing than it says would be silently wrong."""
    from gradsync.errors import JobFailed

    model = tmp_path / "model.py"
    model.write_text(SIBLING_MODEL.format(where=where))
    request = ProfileRequest(model=f"{model}:build", steps=4, warmup=1, concurrent=2)
    if where == "nowhere":
        assert measure_profile(request).batch == 32
        return
    with pytest.raises(JobFailed, match=r"--concurrent 2: a sibling process ended .*exit code 1"):
        measure_profile(request)
