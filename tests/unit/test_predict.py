"""The step simulator on hand-made profiles whose answers are known in closed form."""

from __future__ import annotations

import dataclasses

import pytest

from gradsync.predict.network import Cluster, Network, calibrate
from gradsync.predict.profile import LayerProfile, Profile, VariableProfile
from gradsync.predict.simulate import (
    StrategyChoice,
    ddp_bucket_caps,
    plan_ddp_buckets,
    predict_step,
)
from gradsync.strategies.allreduce import AllreduceOptions
from gradsync.strategies.hybrid import HybridOptions
from gradsync.strategies.p3 import P3Options
from gradsync.strategies.ps import PSOptions


def variable(name: str, numel: int, ready: float, layer: int = 0) -> VariableProfile:
    return VariableProfile(name=name, numel=numel, element_size=4, layer=layer, grad_ready_s=ready)


def profile_of(
    variables: list[VariableProfile],
    *,
    forward: float = 1.0,
    backward: float = 2.0,
    layers: list[LayerProfile] | None = None,
) -> Profile:
    """A profile with free copies, optimizer and server work: only compute and wire."""
    return Profile(
        model="hand-made",
        preset="none",
        batch=10,
        threads=1,
        device="cpu",
        steps=1,
        warmup=0,
        forward_s=forward,
        backward_s=backward,
        optimizer_s_per_byte=0.0,
        copy_s_per_byte=0.0,
        aggregate_s_per_byte=0.0,
        apply_s_per_byte=0.0,
        layers=tuple(layers or [LayerProfile(name="only", forward_start_s=0.0)]),
        variables=tuple(variables),
    )


def ring(n: int, num_bytes: float, rate: float, hop: float) -> float:
    return 2 * (n - 1) / n * num_bytes / rate + 2 * (n - 1) * hop


# Horovod's one 64 MB buffer, no first-bucket cap: these small models fit in one bucket.
ALLREDUCE = StrategyChoice("allreduce", AllreduceOptions(fusion_threshold_mb=64, first_bucket_mb=0))


def test_one_bucket_after_backward_is_compute_plus_ring() -> None:
    # Both gradients are ready only when backward ends: nothing overlaps.
    profile = profile_of([variable("a", 250_000, 2.0), variable("b", 250_000, 2.0)])
    network = Network(bandwidth=1e6, latency=1e-3)
    bucket_bytes = (500_000 + 2) * 4  # values + one had-a-gradient flag per variable
    for workers in (2, 4, 8):
        step = predict_step(profile, Cluster(workers=workers, network=network), ALLREDUCE)
        assert step.step_s == pytest.approx(3.0 + ring(workers, bucket_bytes, 1e6, 1e-3))


def test_one_worker_pays_no_communication() -> None:
    profile = profile_of([variable("a", 1000, 2.0)])
    step = predict_step(profile, Cluster(workers=1, network=Network(bandwidth=1.0)), ALLREDUCE)
    assert step.step_s == pytest.approx(3.0)


def test_a_bucket_ready_early_overlaps_backward_completely() -> None:
    # 8 KB at 1 MB/s with 4 workers: 12 ms of ring launched 1 s before backward ends.
    profile = profile_of([variable("a", 1000, 0.5), variable("b", 1000, 1.0)])
    step = predict_step(profile, Cluster(workers=4, network=Network(bandwidth=1e6)), ALLREDUCE)
    assert step.step_s == pytest.approx(3.0)
    assert step.exposed_comm_s == pytest.approx(0.0)


def test_buckets_launch_in_order_even_if_a_later_one_is_ready_first() -> None:
    # Fusion off: one bucket per variable, last parameter first. "a" (bucket 1) is ready at
    # 0.1 s but waits for "b" (bucket 0), ready only at the end of backward (2.0 s).
    profile = profile_of([variable("a", 250_000, 0.1), variable("b", 250_000, 2.0)])
    network = Network(bandwidth=1e6)
    no_fusion = StrategyChoice("allreduce", AllreduceOptions(fusion_threshold_mb=0))
    step = predict_step(profile, Cluster(workers=2, network=network), no_fusion)
    one = ring(2, (250_000 + 1) * 4, 1e6, 0.0)
    assert step.step_s == pytest.approx(3.0 + 2 * one)


def test_ddp_buckets_follow_ready_order_with_a_small_first_bucket() -> None:
    first_cap, cap = ddp_bucket_caps()
    assert (first_cap, cap) == (1 << 20, 25 << 20)  # torch's defaults, read from torch
    quarter_mb = (1 << 20) // 16  # 256 KiB of float32 values
    variables = tuple(variable(f"v{i}", quarter_mb, ready=10.0 - i) for i in range(10))
    buckets = plan_ddp_buckets(variables)
    assert buckets[0] == [9, 8, 7, 6]  # ready first; 1 MiB fits four
    assert buckets[1] == [5, 4, 3, 2, 1, 0]


def test_synchronous_ps_is_push_apply_pull_through_the_server_link() -> None:
    # One dedicated server: its inbound link carries every worker's S bytes, then its
    # outbound link every worker's pull.
    size = 1_000_000
    profile = profile_of([variable("a", size // 4, 2.0)])
    network = Network(bandwidth=1e6, latency=1e-3)
    for workers in (1, 3):
        step = predict_step(
            profile, Cluster(workers=workers, network=network), StrategyChoice("ps", PSOptions())
        )
        assert step.step_s == pytest.approx(3.0 + 2 * (workers * size / 1e6 + 1e-3))


def test_colocated_ps_keeps_the_local_shard_off_the_wire() -> None:
    # Two variables on two colocated servers: each worker sends only the other's shard.
    profile = profile_of([variable("a", 250_000, 2.0), variable("b", 250_000, 2.0)])
    cluster = Cluster(workers=2, network=Network(bandwidth=1e6))
    step = predict_step(profile, cluster, StrategyChoice("ps", PSOptions(colocate=True)))
    assert step.step_s == pytest.approx(3.0 + 2 * 1.0)


def test_ps_pushes_a_chunk_as_soon_as_backward_completes_it() -> None:
    # One worker, one dedicated server, 1 MB/s each way. "b" (1 MB, the last layer) is
    # ready 0.5 s into backward: pushed 1.5–2.5 s, answered 2.5–3.5 s. "a" (4 KB) is ready
    # at the end of backward (3.0 s): pushed by 3.004 s, answered after b's pull, by 3.504.
    profile = profile_of([variable("a", 1000, 2.0), variable("b", 250_000, 0.5)])
    cluster = Cluster(workers=1, network=Network(bandwidth=1e6))
    per_variable = StrategyChoice("ps", PSOptions(push_chunk_mb=0))
    assert predict_step(profile, cluster, per_variable).step_s == pytest.approx(3.504)
    after_backward = StrategyChoice("ps", PSOptions(overlap=False))
    assert predict_step(profile, cluster, after_backward).step_s == pytest.approx(3.0 + 2 * 1.004)
    # A server round's fixed cost (0.1 s) delays each answer: b's to 2.6–3.6 s, a's after it.
    costly = dataclasses.replace(profile, server_round_s=0.1)
    assert predict_step(costly, cluster, per_variable).step_s == pytest.approx(3.604)


def two_servers_behind_one_link(workers: int) -> Cluster:
    """``workers`` on host 0 and two servers on host 1, 1 MB/s each way."""
    return Cluster(
        workers=workers,
        network=Network(bandwidth=1e6),
        servers=2,
        host_of_worker=(0,) * workers,
        host_of_server=(1, 1),
    )


def test_pushes_that_leave_together_arrive_together() -> None:
    # Without overlap every chunk leaves after backward: two servers on host 1, two workers
    # on host 0. Host 0's link carries 2 × 2 MB each way at 1 MB/s: 4 s, then 4 s back; the
    # first server's answers cannot start before the second server's pushes are through.
    profile = profile_of([variable("a", 250_000, 2.0), variable("b", 250_000, 2.0)])
    cluster = two_servers_behind_one_link(workers=2)
    choice = StrategyChoice("ps", PSOptions(servers=2, overlap=False))
    assert predict_step(profile, cluster, choice).step_s == pytest.approx(3.0 + 4.0 + 4.0)


def test_pushes_to_two_servers_share_the_link_instead_of_queueing() -> None:
    # One worker, two servers on host 1, 1 MB/s each way, 1 MB a variable. "b" is ready at
    # 2.5 s and goes alone for 0.5 s; from 3.0 s "a" (to the other server, so on another
    # connection) shares the link: b is in at 4.0, a at 4.5. The answers share the same
    # way: b's 4.0–5.5, a's 4.5–6.0. One queue (first come, first served) would say 5.5.
    profile = profile_of([variable("a", 250_000, 2.0), variable("b", 250_000, 1.5)])
    cluster = two_servers_behind_one_link(workers=1)
    choice = StrategyChoice("ps", PSOptions(servers=2, push_chunk_mb=0))
    step = predict_step(profile, cluster, choice)
    assert step.step_s == pytest.approx(6.0)
    ends = {s.name: s.start + s.duration for s in step.spans if s.name.startswith("P")}
    assert ends == pytest.approx(
        {
            "PUSH server 1 chunk 0": 4.0,
            "PUSH server 0 chunk 0": 4.5,
            "PULL server 1 chunk 0": 5.5,
            "PULL server 0 chunk 0": 6.0,
        }
    )


def p3_case(priority: bool, slices_per_message: int = 1) -> float:
    """Layer 0 (1 slice) becomes ready 1 s after layer 1's 6 slices; every slice takes 1 s
    on each link. Derivation in docs/predict.md ("a priority case"): the next forward waits
    for layer 0 until backward end + 6 s with priority, + 8 s without (FIFO)."""
    profile = profile_of(
        [variable("w0", 1000, 1.0, layer=0), variable("w1", 6000, 0.0, layer=1)],
        forward=2.0,
        backward=1.0,
        layers=[
            LayerProfile(name="l0", forward_start_s=0.0),
            LayerProfile(name="l1", forward_start_s=1.0),
        ],
    )
    cluster = Cluster(workers=1, network=Network(bandwidth=4000.0))
    options = P3Options(slice_size=1000, priority=priority, slices_per_message=slices_per_message)
    return predict_step(profile, cluster, StrategyChoice("p3", options)).step_s


def test_p3_priority_lets_the_first_layer_overtake() -> None:
    assert p3_case(priority=True) == pytest.approx(9.0)
    assert p3_case(priority=False) == pytest.approx(10.0)


@pytest.mark.parametrize("workers", [2, 3])
def test_p3_answers_the_workers_in_turn_so_the_first_computes_while_the_others_wait(
    workers: int,
) -> None:
    # n workers share one host link, the server has its own host; one slice, 1 s a copy
    # on each link, ready as backward (1 s) ends; forward 1 s. The n copies go out one
    # after the other (+n s); the server answers worker 0 first (+n+1 s): worker 0 runs
    # forward and backward (2 s) while the other answers cross, and sends its next copy
    # first. Its period is n + 3 s, where one shared order of all workers (pushes and
    # answers as one n-second transfer each) would give 2n + 2.
    profile = profile_of(
        [variable("w", 1000, 1.0)], forward=1.0, backward=1.0,
        layers=[LayerProfile(name="l0", forward_start_s=0.0)],
    )  # fmt: skip
    cluster = Cluster(workers=workers, network=Network(bandwidth=4000.0), ranks_per_host=workers)
    step = predict_step(profile, cluster, StrategyChoice("p3", P3Options(slice_size=1000)))
    assert step.step_s == pytest.approx(workers + 3.0)
    wait = [s for s in step.spans if s.name == "WAIT layer0"]
    assert [w.duration for w in wait] == pytest.approx([workers + 1.0])  # worker 0's


def test_p3_bundles_cost_pipelining_where_the_link_is_the_bottleneck() -> None:
    """Four slices a message (docs/predict.md): layer 1's first four leave as one 4 s
    message, layer 0's slice shares the next with the last two (3 s, pushed at +7 s); each
    answer leaves once its whole message is applied, so layer 0 is back at backward start
    + 11 s and the period is 13 s, priority or not."""
    assert p3_case(priority=True, slices_per_message=4) == pytest.approx(13.0)
    assert p3_case(priority=False, slices_per_message=4) == pytest.approx(13.0)


def test_calibration_recovers_latency_and_efficiency(tmp_path) -> None:
    import json

    n, rate, hop = 2, 0.9 * 125e6, 2e-4  # 90% of 1 Gbit/s, 200 us per message
    rows = [
        {"op": "allreduce", "bytes": size, "time_s": ring(n, size, rate, hop)}
        for size in (1 << 16, 1 << 20, 1 << 24)
    ]
    path = tmp_path / "commbench.json"
    path.write_text(json.dumps({"world_size": n, "bandwidth": "1gbit", "results": rows}))
    fitted = calibrate(Network(bandwidth=125e6), path)
    assert fitted.message_s == pytest.approx(hop)
    assert fitted.efficiency == pytest.approx(0.9)


def test_global_batchnorm_adds_its_blocking_collectives_to_forward_and_backward() -> None:
    import dataclasses

    from gradsync.predict.simulate import with_batchnorm_sync

    rate, hop, channels = 1e6, 1e-3, (10, 20)
    base = profile_of([variable("w", 1000, 2.0)], forward=1.0, backward=2.0)
    profile = dataclasses.replace(base, batchnorm_channels=channels)
    for n in (2, 4):
        cluster = Cluster(workers=n, network=Network(bandwidth=rate, latency=hop))
        synced = with_batchnorm_sync(profile, cluster)
        # forward: an all_gather of (count, mean, M2) per channel and a 2-element tag in
        # float64, as comm/batchnorm.py stacks them; backward: a float64 allreduce of 2 sums
        # per channel, the tag and its square
        gather = sum((n - 1) * ((3 * c + 2) * 8 / rate + hop) for c in channels)
        reduce = sum(ring(n, (2 * c + 4) * 8, rate, hop) for c in channels)
        assert synced.forward_s == pytest.approx(1.0 + gather)
        assert synced.backward_s == pytest.approx(2.0 + reduce)
        assert synced.variables[0].grad_ready_s == pytest.approx(2.0 + reduce)  # at the end
        # No bytes to send: ddp's step is exactly the stretched compute plus its ring.
        step = predict_step(profile, cluster, StrategyChoice("ddp")).step_s
        assert step == pytest.approx(3.0 + gather + reduce + ring(n, 1001 * 4, rate, hop))
        local = predict_step(profile, cluster, StrategyChoice("ddp"), batchnorm="local")
        assert local.step_s == pytest.approx(3.0 + ring(n, 1001 * 4, rate, hop))
    one = Cluster(workers=1, network=Network(bandwidth=rate, latency=hop))
    assert with_batchnorm_sync(profile, one) == profile


def test_batchnorm_syncs_wait_behind_a_bucket_in_a_deep_link_queue() -> None:
    # Bucket 0 ("b") is ready half-way through backward and takes D on the wire. Global
    # BatchNorm syncs every `gap` of compute; behind a queue at least D deep each waits
    # until the bucket is across, so backward runs at gap / (gap + D) meanwhile and the
    # step grows by D·D / (gap + D). Without a queue, or on one host, nothing waits.
    base = profile_of([variable("a", 250_000, 2.0), variable("b", 250_000, 0.5)])
    profile = dataclasses.replace(base, batchnorm_channels=(1,) * 100)
    no_fusion = StrategyChoice("allreduce", AllreduceOptions(fusion_threshold_mb=0))

    def step(queue_s: float, ranks_per_host: int = 1, batchnorm: str = "global") -> float:
        network = Network(bandwidth=1e6, queue_s=queue_s)
        cluster = Cluster(workers=2, network=network, ranks_per_host=ranks_per_host)
        return predict_step(profile, cluster, no_fusion, batchnorm=batchnorm).step_s

    transfer = ring(2, (250_000 + 1) * 4, 1e6, 0.0)
    shallow = step(0.0)
    gap = (shallow - transfer) / 200  # the synced compute (bucket "a" follows it), 2 syncs a layer
    assert step(10.0) - shallow == pytest.approx(transfer * transfer / (gap + transfer))
    assert step(10.0, ranks_per_host=2) == pytest.approx(step(0.0, ranks_per_host=2))
    assert step(10.0, batchnorm="local") == pytest.approx(step(0.0, batchnorm="local"))


def test_sparse_rows_are_allgathered_after_the_dense_buckets_not_reduced_densely() -> None:
    import dataclasses

    rate, hop, n = 1e6, 1e-3, 4
    table = dataclasses.replace(  # 1000 rows of 10 floats; a step touches 50 of them
        variable("emb", 10_000, 2.0), sparse=True, num_rows=1000, rows_touched=50.0
    )
    profile = profile_of([table, variable("w", 1000, 1.0)])
    cluster = Cluster(workers=n, network=Network(bandwidth=rate, latency=hop))

    def gather(num_bytes: float) -> float:
        return (n - 1) * (num_bytes / rate + hop)

    # The rows wait for backward's end; "w" (ready at 1 s) is reduced inside backward.
    # allreduce: the (count, flag) table, then one buffer of indices and rows.
    rows = gather(2 * 8) + gather(50 * (8 + 40))
    step = predict_step(profile, cluster, StrategyChoice("allreduce")).step_s
    assert step == pytest.approx(3.0 + rows)
    # DDP on Gloo: the row count, the indices and the rows of each sparse tensor.
    rows = gather(8) + gather(50 * 8) + gather(50 * 40)
    assert predict_step(profile, cluster, StrategyChoice("ddp")).step_s == pytest.approx(3.0 + rows)
    as_dense = StrategyChoice("allreduce", AllreduceOptions(sparse_as_dense=True))
    step = predict_step(profile, cluster, as_dense).step_s
    assert step == pytest.approx(3.0 + ring(n, (11_000 + 2) * 4, rate, hop))


def test_strategies_that_push_sparse_gradients_dense_pay_for_densifying_them() -> None:
    # A 1 MB sparse table, its gradient complete at the end of backward (3.0 s) and 0.5 s
    # to make dense. ps pushes it dense over a 1 MB/s link and pulls it back: 3.0 + 0.5 +
    # 2 × 1.0 s. hybrid sends its rows as they are: no densifying.
    table = dataclasses.replace(
        variable("table", 250_000, 2.0), sparse=True, num_rows=1000, rows_touched=10.0
    )
    cluster = Cluster(workers=1, network=Network(bandwidth=1e6))
    for densify_s, step_s in ((0.0, 5.0), (0.5, 5.5)):
        profile = profile_of([dataclasses.replace(table, densify_s=densify_s)])
        ps = predict_step(profile, cluster, StrategyChoice("ps", PSOptions()))
        assert ps.step_s == pytest.approx(step_s)
    hybrid = StrategyChoice("hybrid", HybridOptions())
    plain, costly = (
        predict_step(profile_of([dataclasses.replace(table, densify_s=d)]), cluster, hybrid)
        for d in (0.0, 0.5)
    )
    assert costly.step_s == plain.step_s


def test_hybrid_gathers_rows_on_the_host_then_pushes_updates_and_answers_each_pull() -> None:
    # 2 workers on host 0, hybrid's one server on host 1, no dense variables: a step is
    # compute (3.0 s), then the sparse round, priced from the profile's per-row times.
    table = dataclasses.replace(
        variable("table", 250_000, 2.0),  # 1000 rows of 1000 bytes, 10 touched a step
        sparse=True, num_rows=1000, rows_touched=10.0,
        merge_s_per_row=1e-3, apply_s_per_row=2e-3, read_s_per_row=3e-3,
        apply_call_s=0.1, read_call_s=0.2,  # a call's fixed cost, once per partition
    )  # fmt: skip
    hop, rate = 0.01, 1e6
    cluster = Cluster(workers=2, network=Network(bandwidth=rate, message_s=hop), ranks_per_host=2)
    rows = 10 * (1000 + 8)  # one worker's rows with their int64 indices
    # two all-gathers between the 2 workers, the other's rows in, each sums 2 lists
    gather = 2 * hop + rows / rate + 2 * 10 * 1e-3
    push = 2 * rows / rate + hop  # the host's one pusher sends both workers' rows (summed)
    update = 0.1 + 20 * 2e-3  # the union of 20 rows (one pusher: nothing to add)
    answers = 2 * (0.2 + 10 * 3e-3)  # each worker's 10 rows read, caught up
    pull = 2 * rows / rate + hop  # both workers' pulls cross the server's link
    step = predict_step(profile_of([table]), cluster, StrategyChoice("hybrid", HybridOptions()))
    assert step.step_s == pytest.approx(3.0 + gather + push + update + answers + pull)
    without = HybridOptions(local_aggregation=False)  # each worker pushes its own rows
    alone = predict_step(profile_of([table]), cluster, StrategyChoice("hybrid", without))
    summed = 2 * 10 * 1e-3  # the server now adds two pushers' lists
    assert alone.step_s == pytest.approx(3.0 + push + summed + update + answers + pull)
    # An update per row below the clock's resolution (zero once a call's cost is taken
    # off) is still a measured profile: priced per row and per partition.
    fast = dataclasses.replace(table, apply_s_per_row=0.0)
    step = predict_step(profile_of([fast]), cluster, StrategyChoice("hybrid", HybridOptions()))
    assert step.step_s == pytest.approx(3.0 + gather + push + 0.1 + answers + pull)


def test_hybrids_worker_updates_its_dense_variables_at_their_measured_cost() -> None:
    # A 1 MB dense variable and a 1 MB sparse table, the optimizer at 1 µs a byte over both
    # (2 s: what allreduce's worker pays, tables included). hybrid's worker updates the
    # dense one only: 1 s by the byte, or the 1.5 s the profile measured for it alone.
    table = dataclasses.replace(
        variable("table", 250_000, 2.0), sparse=True, num_rows=1000, rows_touched=10.0
    )
    by_byte = dataclasses.replace(
        profile_of([variable("dense", 250_000, 2.0), table]), optimizer_s_per_byte=1e-6
    )
    cluster = Cluster(workers=1, network=Network(bandwidth=1e9))

    def optimizer_s(profile: Profile, strategy: str) -> float:
        spans = predict_step(profile, cluster, StrategyChoice(strategy)).spans
        return next(s.duration for s in spans if s.name == "OPTIMIZER_STEP")

    measured = dataclasses.replace(by_byte, dense_optimizer_s=1.5)
    assert optimizer_s(by_byte, "hybrid") == pytest.approx(1.0)
    assert optimizer_s(measured, "hybrid") == pytest.approx(1.5)
    assert optimizer_s(measured, "allreduce") == pytest.approx(2.0)


def test_hybrid_is_paced_by_the_server_that_holds_most_of_the_rows() -> None:
    # 2 workers on 2 hosts, 2 dedicated servers, one partition each (rows 0–499, 500–999).
    # Rows spread evenly, each server takes half of every cost; all rows in the first half
    # of the table, server 0 takes all of it.
    table = dataclasses.replace(
        variable("table", 250_000, 2.0),
        sparse=True, num_rows=1000, rows_touched=10.0,
        merge_s_per_row=1e-3, apply_s_per_row=2e-3, read_s_per_row=3e-3,
    )  # fmt: skip
    rate = 1e6
    cluster = Cluster(workers=2, network=Network(bandwidth=rate, message_s=0.01))
    hybrid = StrategyChoice("hybrid", HybridOptions(servers=2))
    even, skewed = (
        predict_step(profile_of([dataclasses.replace(table, row_bins=bins)]), cluster, hybrid)
        for bins in ((0.5, 0.5), (1.0, 0.0))
    )
    rows = 10 * (1000 + 8)
    links = 2 * rows / rate  # server 0's link takes both workers' whole push, then pull
    update = 0.5 * (2 * 10 * 1e-3 + 20 * 2e-3)  # the other half of: sum 2 lists, update 20
    answers = 0.5 * 2 * 10 * 3e-3  # the other half of reading each worker's 10 rows
    assert skewed.step_s - even.step_s == pytest.approx(links + update + answers)


def test_p3_never_runs_a_step_faster_than_its_compute() -> None:
    # A layer's parameters that come back while the worker is still computing an earlier
    # layer resume it where it is, not at the answer's time (a step once took 0.03 s of
    # resnet56's 0.045 s of compute at 2 Gbit/s).
    layers = [LayerProfile(name=f"l{i}", forward_start_s=0.1 * i) for i in range(10)]
    profile = profile_of(
        [variable(f"w{i}", 1000, 1.0 - 0.1 * i, layer=i) for i in range(10)],
        forward=1.0, backward=1.0, layers=layers,
    )  # fmt: skip
    for rate in (4e3, 4e4, 4e5):
        cluster = Cluster(workers=4, network=Network(bandwidth=rate))
        step = predict_step(profile, cluster, StrategyChoice("p3", P3Options(servers=4)))
        assert step.step_s >= 2.0 - 1e-9
        assert all(s.duration >= 0 for s in step.spans)


def test_a_synchronous_step_computes_as_long_as_its_slowest_worker() -> None:
    # One worker's forward + backward took 2, 3 or 4 s (median 3); the median step's
    # slowest of 2 is the 0.5 ** (1/2) quantile: 2 + 2 * 0.7071 = 3.414 s. The bucket
    # leaves when the slowest worker's backward ends, so the ring follows it.
    spread = dataclasses.replace(
        profile_of([variable("a", 250_000, 2.0)]), compute_samples_s=(2.0, 4.0, 3.0)
    )
    network = Network(bandwidth=1e6, latency=1e-3)
    slowest = 2.0 + 2.0 * 0.5**0.5
    assert spread.straggler_stretch(2) == pytest.approx(slowest / 3.0)
    step = predict_step(spread, Cluster(workers=2, network=network), ALLREDUCE)
    ring_s = ring(2, (250_000 + 1) * 4, 1e6, 1e-3)
    assert step.step_s == pytest.approx(slowest + ring_s)
    # One worker waits for nobody; without samples nothing is stretched.
    alone = predict_step(spread, Cluster(workers=1, network=network), ALLREDUCE)
    assert alone.step_s == pytest.approx(3.0)
    plain = dataclasses.replace(spread, compute_samples_s=())
    assert predict_step(plain, Cluster(workers=2, network=network), ALLREDUCE).step_s == (
        pytest.approx(3.0 + ring_s)
    )


def test_asynchronous_ps_does_not_wait_for_the_slowest_worker() -> None:
    profile = profile_of([variable("a", 1000, 2.0)])
    spread = dataclasses.replace(profile, compute_samples_s=(1.0, 3.0, 9.0))
    cluster = Cluster(workers=4, network=Network(bandwidth=1e6), servers=1)
    for options, stretched in ((PSOptions(async_updates=True), False), (PSOptions(), True)):
        choice = StrategyChoice("ps", options)
        before = predict_step(profile, cluster, choice).step_s
        after = predict_step(spread, cluster, choice).step_s
        assert (after > before) is stretched


def test_averaged_profiles_pool_their_spread_without_the_drift_between_them() -> None:
    # Taken at two moments, one twice as fast: each one's samples are scaled to the
    # averaged median before pooling, so the drift does not count as spread.
    slow = dataclasses.replace(
        profile_of([variable("a", 10, 1.0)], forward=2.0, backward=4.0),
        compute_samples_s=(5.0, 6.0, 7.0),
    )
    fast = dataclasses.replace(
        profile_of([variable("a", 10, 1.0)], forward=1.0, backward=2.0),
        compute_samples_s=(2.5, 3.0, 3.5),
    )
    mean = Profile.mean([slow, fast])
    assert mean.compute_s == pytest.approx(4.5)
    assert sorted(mean.compute_samples_s) == pytest.approx([3.75, 3.75, 4.5, 4.5, 5.25, 5.25])
    assert Profile.from_json(mean.to_json()) == mean
