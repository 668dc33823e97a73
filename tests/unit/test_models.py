"""The published models on their tiny presets: build, train, shard, sparsity, dropout, presets."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from torch import Tensor, nn

from gradsync.data.base import Batch
from gradsync.errors import UserError
from gradsync.models import (
    REGISTRY,
    inception_v3,
    lstm_lm,
    mnist_cnn,
    resnet,
    resnet50,
    sockeye,
    transformer,
    vgg,
    vgg19,
)
from gradsync.models.base import PRESETS, BuildRequest, ModelSpec, Workload

SPECS: dict[str, ModelSpec] = dict(REGISTRY)
PRESET_TABLES = {
    "transformer": transformer.PRESETS,
    "lstm-lm": lstm_lm.PRESETS,
    "resnet56": resnet.PRESETS,
    "vgg16": vgg.PRESETS,
    "mnist-cnn": mnist_cnn.PRESETS,
    "resnet50": resnet50.PRESETS,
    "inception-v3": inception_v3.PRESETS,
    "vgg19": vgg19.PRESETS,
    "sockeye": sockeye.PRESETS,
}
WITH_BATCHNORM = {"resnet56", "resnet50", "inception-v3"}
WITHOUT_DROPOUT = {"resnet56", "resnet50"}  # the papers' ResNets have none
SAMPLED = {"sampled_softmax": "6", "sparse": "true"}
# (model, options): every registered model, plus its output/embedding/head variants.
VARIANTS = [
    *((name, {}) for name in REGISTRY),
    ("lstm-lm", {"sparse": "true"}),
    ("lstm-lm", SAMPLED),
    ("inception-v3", {"aux": "true"}),
    ("sockeye", {"sparse": "true"}),
    ("sockeye", {"tied": "true"}),
]
VARIANT_IDS = [name + "".join(f"-{key}" for key in options) for name, options in VARIANTS]


def build_tiny(
    name: str, options: Mapping[str, str] | None = None, *, seed: int = 0, dropout: bool = True
) -> Workload:
    torch.manual_seed(seed)
    request = BuildRequest(preset="tiny", seed=seed, dropout=dropout, options=dict(options or {}))
    return SPECS[name].build(request)


def full_batch(workload: Workload, step: int = 0) -> Batch:
    size = workload.global_batch
    return workload.dataset.batch(step=step, size=size, start=0, stop=size)


def loss_of(workload: Workload, batch: Batch) -> Tensor:
    return workload.loss(workload.model(*batch.inputs, **batch.shared), batch.targets)


def dense_gradients(model: nn.Module) -> dict[str, Tensor]:
    return {
        name: parameter.grad.to_dense().clone()
        for name, parameter in model.named_parameters()
        if parameter.grad is not None
    }


def dropout_probabilities(model: nn.Module) -> list[float]:
    """Every dropout rate in ``model``: nn.Dropout, LSTM between layers, attention weights."""
    return [
        float(module.p if isinstance(module, nn.Dropout) else module.dropout)
        for module in model.modules()
        if isinstance(module, nn.Dropout | nn.LSTM | nn.MultiheadAttention)
    ]


@pytest.mark.parametrize(("name", "options"), VARIANTS, ids=VARIANT_IDS)
def test_tiny_model_trains_one_step_with_finite_loss(name: str, options: dict[str, str]) -> None:
    workload = build_tiny(name, options)
    assert workload.global_batch == 8
    num_parameters = sum(parameter.numel() for parameter in workload.model.parameters())
    assert num_parameters < 20_000, "tiny presets stay a few thousand parameters"
    loss = loss_of(workload, full_batch(workload))
    assert loss.dim() == 0
    assert torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in workload.model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"


# Plain SGD except for VGG: the narrow tiny VGG-16 without batch norm is too badly
# conditioned for plain SGD to move in 100 steps (Adam does, showing the data is learnable).
TRAINING = {
    "transformer": (lambda params: torch.optim.SGD(params, lr=1.0), 100),
    "lstm-lm": (lambda params: torch.optim.SGD(params, lr=2.0), 100),
    "resnet56": (lambda params: torch.optim.SGD(params, lr=0.3), 60),
    "vgg16": (lambda params: torch.optim.Adam(params, lr=0.003), 100),
    "mnist-cnn": (lambda params: torch.optim.SGD(params, lr=0.1), 60),
    "resnet50": (lambda params: torch.optim.SGD(params, lr=0.1), 30),
    "inception-v3": (lambda params: torch.optim.SGD(params, lr=0.1), 30),
    # Adagrad takes sparse gradients (sparse=true) and moves the small RNN faster than SGD.
    "sockeye": (lambda params: torch.optim.Adagrad(params, lr=0.1), 40),
}


# Training is the slowest test here: variants that add no new network to train are left out
# (vgg19 is vgg16's VGG class with more layers; the auxiliary head and tied output change
# the loss, which the other tests cover, not whether the data is learnable).
SAME_NETWORK = {"vgg19", "inception-v3-aux", "sockeye-tied"}
TRAINED = [
    (variant, variant_id)
    for variant, variant_id in zip(VARIANTS, VARIANT_IDS, strict=True)
    if variant_id not in SAME_NETWORK
]


@pytest.mark.parametrize(("name", "options"), [v for v, _ in TRAINED], ids=[i for _, i in TRAINED])
def test_tiny_model_loss_decreases_on_synthetic_data(name: str, options: dict[str, str]) -> None:
    workload = build_tiny(name, options, dropout=False)
    make_optimizer, num_steps = TRAINING[name]
    optimizer: torch.optim.Optimizer = make_optimizer(workload.model.parameters())
    losses = []
    for step in range(num_steps):
        optimizer.zero_grad()
        loss = loss_of(workload, full_batch(workload, step))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.9 * first, f"loss went from {first:.3f} to {last:.3f} in {num_steps} steps"


@pytest.mark.parametrize(("name", "options"), VARIANTS, ids=VARIANT_IDS)
def test_halves_of_a_global_batch_concatenate_to_the_whole(
    name: str, options: dict[str, str]
) -> None:
    dataset = build_tiny(name, options).dataset
    whole = dataset.batch(step=5, size=8, start=0, stop=8)
    halves = [dataset.batch(step=5, size=8, start=a, stop=a + 4) for a in (0, 4)]
    for index, inputs in enumerate(whole.inputs):
        assert torch.equal(inputs, torch.cat([half.inputs[index] for half in halves]))
    assert torch.equal(whole.targets, torch.cat([half.targets for half in halves]))
    for key, value in whole.shared.items():
        assert all(torch.equal(value, half.shared[key]) for half in halves)


@pytest.mark.parametrize(("name", "options"), VARIANTS, ids=VARIANT_IDS)
def test_batches_are_fixed_by_seed_and_step(name: str, options: dict[str, str]) -> None:
    dataset = build_tiny(name, options, seed=3).dataset
    again = build_tiny(name, options, seed=3).dataset
    other_seed = build_tiny(name, options, seed=4).dataset
    step_2 = dataset.batch(step=2, size=8, start=0, stop=8)
    assert torch.equal(step_2.targets, again.batch(step=2, size=8, start=0, stop=8).targets)
    assert torch.equal(step_2.inputs[0], again.batch(step=2, size=8, start=0, stop=8).inputs[0])
    assert not torch.equal(
        step_2.inputs[0], dataset.batch(step=3, size=8, start=0, stop=8).inputs[0]
    )
    assert not torch.equal(
        step_2.inputs[0], other_seed.batch(step=2, size=8, start=0, stop=8).inputs[0]
    )


@pytest.mark.parametrize(("name", "options"), VARIANTS, ids=VARIANT_IDS)
def test_mean_of_equal_shard_gradients_is_the_global_batch_gradient(
    name: str, options: dict[str, str]
) -> None:
    workload = build_tiny(name, options, dropout=False)
    model = workload.model
    if name in WITH_BATCHNORM:
        # Training-mode BatchNorm normalizes with each shard's own statistics (the strategies
        # make them global across ranks); with running statistics the property must hold.
        model.eval()
    loss_of(workload, full_batch(workload, step=1)).backward()
    expected = dense_gradients(model)
    shard_gradients = []
    for start in (0, 4):
        model.zero_grad(set_to_none=True)
        shard = workload.dataset.batch(step=1, size=8, start=start, stop=start + 4)
        loss_of(workload, shard).backward()
        shard_gradients.append(dense_gradients(model))
    assert expected.keys() == shard_gradients[0].keys()
    for key, gradient in expected.items():
        mean = (shard_gradients[0][key] + shard_gradients[1][key]) / 2
        torch.testing.assert_close(mean, gradient, rtol=1e-5, atol=1e-5, msg=key)


def test_same_seed_gives_identical_initial_parameters() -> None:
    for name in SPECS:
        first, second = build_tiny(name, seed=7).model, build_tiny(name, seed=7).model
        for (key, a), b in zip(
            first.state_dict().items(), second.state_dict().values(), strict=True
        ):
            assert torch.equal(a, b), f"{name}: {key} differs between two builds with one seed"


@pytest.mark.parametrize(("name", "options"), VARIANTS, ids=VARIANT_IDS)
def test_dropout_false_sets_every_dropout_rate_to_zero(name: str, options: dict[str, str]) -> None:
    assert all(
        rate == 0.0
        for rate in dropout_probabilities(build_tiny(name, options, dropout=False).model)
    )
    with_dropout = dropout_probabilities(build_tiny(name, options, dropout=True).model)
    if name not in WITHOUT_DROPOUT:
        assert max(with_dropout) > 0.0


def test_dropout_rates_are_the_papers() -> None:
    assert transformer.PRESETS["paper"].dropout == 0.1
    assert lstm_lm.PRESETS["paper"].dropout == 0.65
    assert vgg.PRESETS["paper"].dropout == 0.5
    assert mnist_cnn.PRESETS["paper"].dropout == 0.4


def test_lstm_sparse_options_give_sparse_gradients() -> None:
    dense = build_tiny("lstm-lm")
    loss_of(dense, full_batch(dense)).backward()
    assert not dense.model.embedding.weight.grad.is_sparse

    sparse = build_tiny("lstm-lm", {"sparse": "true"})
    loss_of(sparse, full_batch(sparse)).backward()
    assert sparse.model.embedding.weight.grad.is_sparse
    assert not sparse.model.decoder.weight.grad.is_sparse

    sampled = build_tiny("lstm-lm", {"sampled_softmax": "6"})
    loss_of(sampled, full_batch(sampled)).backward()
    assert not sampled.model.embedding.weight.grad.is_sparse
    assert sampled.model.softmax_weight.weight.grad.is_sparse
    assert sampled.model.softmax_bias.weight.grad.is_sparse


def test_lstm_sampled_candidates_are_shared_by_every_shard_of_a_step() -> None:
    dataset = build_tiny("lstm-lm", SAMPLED).dataset
    shards = [dataset.batch(step=4, size=8, start=a, stop=a + 2) for a in (0, 2, 4, 6)]
    candidates = shards[0].shared["sampled"]
    assert candidates.shape == (6,)
    assert len(set(candidates.tolist())) == 6
    assert all(torch.equal(shard.shared["sampled"], candidates) for shard in shards)
    assert all(
        torch.equal(shard.shared["sampled_tries"], shards[0].shared["sampled_tries"])
        for shard in shards
    )
    later = dataset.batch(step=5, size=8, start=0, stop=2).shared["sampled"]
    assert not torch.equal(later, candidates)
    tokens, targets = shards[1].inputs
    assert torch.equal(targets, shards[1].targets)
    assert tokens.shape == targets.shape


def test_lstm_sampled_logits_put_the_true_class_first_and_mask_accidental_hits() -> None:
    workload = build_tiny("lstm-lm", {"sampled_softmax": "6"}, dropout=False)
    model = workload.model
    tokens = torch.randint(32, (2, 8))
    targets = torch.randint(32, (2, 8))
    sampled = torch.tensor([targets[0, 0].item(), *[i for i in range(32) if i not in targets][:5]])
    tries = torch.tensor(9)
    logits = model(tokens, targets, sampled=sampled, sampled_tries=tries)
    assert logits.shape == (16, 7)
    hits = targets.reshape(-1)[:, None] == sampled[None, :]
    assert hits.any()
    assert (logits[:, 1:][hits] < -1e30).all()
    # Column 0 is h·w[target] + b[target] - log(expected count of target).
    hidden, _ = model.lstm(model.embedding(tokens))
    flat_hidden, flat_targets = hidden.reshape(16, -1), targets.reshape(-1)
    weight = model.softmax_weight.weight[flat_targets]
    bias = model.softmax_bias.weight[flat_targets, 0]
    probability = (
        torch.log1p(1 / (flat_targets.double() + 1)) / torch.log(torch.tensor(33.0)).double()
    )
    expected_count = 1 - (1 - probability) ** 9
    true_logit = (flat_hidden * weight).sum(-1) + bias - expected_count.log().float()
    torch.testing.assert_close(logits[:, 0], true_logit)


def test_log_uniform_sampler_is_zipfian_and_distinct() -> None:
    sampler = lstm_lm.LogUniformSampler(10_000)
    ids, tries = sampler.sample(500, torch.Generator().manual_seed(0))
    assert len(set(ids.tolist())) == 500
    assert tries >= 500
    assert int(ids.min()) >= 0
    assert int(ids.max()) < 10_000
    assert (ids < 100).sum() > (ids >= 9900).sum()  # frequent (low) ids are drawn far more
    again, tries_again = sampler.sample(500, torch.Generator().manual_seed(0))
    assert torch.equal(ids, again)
    assert tries == tries_again


def test_lstm_vocab_option_overrides_the_preset_vocabulary() -> None:
    workload = build_tiny("lstm-lm", {"vocab": "100", "sampled_softmax": "10"})
    assert workload.model.softmax_weight.num_embeddings == 100
    assert workload.model.embedding.num_embeddings == 100
    loss_of(workload, full_batch(workload)).backward()


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("lstm-lm", {"sparse": "maybe"}, "not a valid bool"),
        ("lstm-lm", {"colour": "red"}, "unknown --model-option 'colour'"),
        ("lstm-lm", {"sampled_softmax": "32"}, "smaller than the vocabulary"),
        ("lstm-lm", {"vocab": "-1"}, "must be >= 0"),
        ("resnet56", {"sparse": "true"}, "takes no --model-option"),
    ],
)
def test_bad_model_options_are_user_errors(
    name: str, options: dict[str, str], message: str
) -> None:
    with pytest.raises(UserError, match=message):
        build_tiny(name, options)


def test_unknown_preset_is_a_user_error() -> None:
    with pytest.raises(UserError, match="unknown preset 'huge'"):
        SPECS["mnist-cnn"].build(BuildRequest(preset="huge"))


def test_transformer_loss_averages_tokens_per_sentence_and_ignores_padding() -> None:
    loss = transformer.SmoothedSentenceLoss(label_smoothing=0.0)
    logits = torch.randn(2, 4, 9)
    targets = torch.tensor([[4, 5, 3, 0], [6, 3, 0, 0]])
    changed = logits.clone()
    changed[0, 3] += 100.0  # a padded position's logits do not matter
    torch.testing.assert_close(loss(logits, targets), loss(changed, targets))
    by_token = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), reduction="none"
    )
    by_token = by_token.view(2, 4)
    expected = (by_token[0, :3].mean() + by_token[1, :2].mean()) / 2
    torch.testing.assert_close(loss(logits, targets), expected)


def test_transformer_padding_does_not_change_real_positions() -> None:
    model = build_tiny("transformer", dropout=False).model.eval()
    source = torch.tensor([[5, 6, 7, 3, 0, 0, 0, 0]])
    target_in = torch.tensor([[2, 9, 8, 7, 0, 0, 0, 0]])
    shorter = model(source[:, :4], target_in[:, :4])
    padded = model(source, target_in)[:, :4]
    torch.testing.assert_close(padded, shorter, rtol=1e-5, atol=1e-5)


def test_transformer_embedding_is_shared_with_the_output_projection() -> None:
    model = build_tiny("transformer").model
    embeddings = [module for module in model.modules() if isinstance(module, nn.Embedding)]
    assert len(embeddings) == 1
    assert not any(
        isinstance(module, nn.Linear) and module.out_features == 24 for module in model.modules()
    )


def test_resnet_uses_plain_batchnorm_and_option_a_shortcuts() -> None:
    model = build_tiny("resnet56").model
    assert any(isinstance(module, nn.BatchNorm2d) for module in model.modules())
    block = resnet.BasicBlock(4, 8, stride=2)
    x = torch.randn(1, 4, 6, 6)
    shortcut = block.shortcut(x)
    assert shortcut.shape == (1, 8, 3, 3)
    torch.testing.assert_close(shortcut[:, 2:6], x[:, :, ::2, ::2])
    assert shortcut[:, :2].abs().sum() == 0
    assert shortcut[:, 6:].abs().sum() == 0
    assert resnet.PRESETS["paper"].depth == 56


def test_only_the_batchnorm_models_have_batchnorm() -> None:
    for name in SPECS:
        model = build_tiny(name).model
        has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        assert has_batchnorm == (name in WITH_BATCHNORM), name


def test_every_registered_model_has_a_preset_table() -> None:
    assert set(PRESET_TABLES) == set(REGISTRY)


@pytest.mark.parametrize("name", list(SPECS))
def test_every_preset_batch_divides_by_one_two_and_four_workers(name: str) -> None:
    table = PRESET_TABLES[name]
    assert set(table) == set(PRESETS)
    for preset, config in table.items():
        assert config.global_batch % 4 == 0, f"{name} {preset}: {config.global_batch}"


def test_paper_presets_are_the_papers_sizes() -> None:
    base = transformer.PRESETS["paper"]
    assert (base.model_dim, base.num_encoder_layers, base.num_decoder_layers) == (512, 6, 6)
    assert (base.feedforward_dim, base.num_heads, base.vocab_size) == (2048, 8, 37000)
    large = lstm_lm.PRESETS["paper"]
    assert (large.num_layers, large.hidden_size, large.seq_len) == (2, 1500, 35)
    assert (large.vocab_size, large.global_batch) == (10000, 20)
    assert resnet.PRESETS["paper"].global_batch == 128
    d = vgg.PRESETS["paper"]
    assert (d.stage_widths, d.fc_width, d.image_size, d.num_classes) == (
        (64, 128, 256, 512, 512),
        4096,
        224,
        1000,
    )
    assert d.global_batch == 64
    assert mnist_cnn.PRESETS["paper"].global_batch == 100


@pytest.mark.parametrize("name", list(SPECS))
def test_default_preset_builds_and_runs_a_forward_pass(name: str) -> None:
    torch.manual_seed(0)
    workload = SPECS[name].build(BuildRequest(preset="default"))
    shard = workload.dataset.batch(step=0, size=workload.global_batch, start=0, stop=4)
    with torch.no_grad():
        loss = loss_of(workload, shard)
    assert torch.isfinite(loss)
    assert name in workload.description


@pytest.mark.parametrize(
    ("name", "expected"),
    [("vgg16", 138_357_544), ("resnet56", 853_018), ("mnist-cnn", 3_274_634)],
)
def test_paper_models_have_the_papers_parameter_counts(name: str, expected: int) -> None:
    config = PRESET_TABLES[name]["paper"]
    model_type = {"vgg16": vgg.VGG, "resnet56": resnet.CIFARResNet, "mnist-cnn": mnist_cnn.MNISTCNN}
    with torch.device("meta"):  # shapes only: no memory for 138M parameters
        model = model_type[name](config)
    assert sum(parameter.numel() for parameter in model.parameters()) == expected
