"""The P3 artifact's models: published parameter counts, every preset's output shape, heads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradsync.errors import UserError
from gradsync.models import build_workload, inception_v3, resnet50, sockeye, vgg, vgg19
from gradsync.models.base import PRESETS

# Exact counts of the published architectures, and the papers' rounded figures.
PAPER_COUNTS = {
    "resnet50": (lambda: resnet50.ResNet50(resnet50.PRESETS["paper"]), 25_557_032, 25.6e6),
    "inception-v3": (
        lambda: inception_v3.InceptionV3(inception_v3.PRESETS["paper"]),
        23_834_568,
        23.8e6,
    ),
    "vgg19": (lambda: vgg.VGG(vgg19.PRESETS["paper"]), 143_667_240, 143.7e6),
}
IMAGE_MODELS = ["resnet50", "inception-v3", "vgg19"]


def num_parameters(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


@pytest.mark.parametrize("name", list(PAPER_COUNTS))
def test_paper_presets_have_the_published_parameter_counts(name: str) -> None:
    make, exact, published = PAPER_COUNTS[name]
    with torch.device("meta"):  # shapes only: no memory for 144M parameters
        count = num_parameters(make())
    assert count == exact
    assert abs(count - published) / published < 0.005


def test_inception_auxiliary_head_adds_the_published_3_3m_parameters() -> None:
    with torch.device("meta"):
        model = inception_v3.InceptionV3(inception_v3.PRESETS["paper"], aux=True)
    assert num_parameters(model) == 27_161_264


@pytest.mark.parametrize("name", IMAGE_MODELS)
@pytest.mark.parametrize("preset", PRESETS)
def test_image_models_give_one_logit_per_class_at_every_preset(name: str, preset: str) -> None:
    config = {
        "resnet50": resnet50.PRESETS,
        "inception-v3": inception_v3.PRESETS,
        "vgg19": vgg19.PRESETS,
    }[name][preset]
    images = torch.zeros(2, 3, config.image_size, config.image_size)
    if preset == "paper":  # meta tensors: the shapes of a 224/299 forward without the compute
        with torch.device("meta"):
            model = PAPER_COUNTS[name][0]()
            logits = model(images.to("meta"))
    else:
        torch.manual_seed(0)
        logits = build_workload(name, preset=preset).model.eval()(images)
    assert tuple(logits.shape) == (2, config.num_classes)


@pytest.mark.parametrize("preset", ["tiny", "default"])
def test_sockeye_gives_vocabulary_logits_per_target_position(preset: str) -> None:
    torch.manual_seed(0)
    workload = build_workload("sockeye", preset=preset)
    config = sockeye.PRESETS[preset]
    batch = workload.dataset.batch(step=0, size=workload.global_batch, start=0, stop=2)
    logits = workload.model(*batch.inputs)
    assert tuple(logits.shape) == (2, config.seq_len, config.vocab_size)
    assert torch.isfinite(workload.loss(logits, batch.targets))


def test_sockeye_paper_preset_runs_one_short_sentence() -> None:
    config = sockeye.PRESETS["paper"]
    model = sockeye.SockeyeRNN(config).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 3]]), torch.tensor([[2, 7, 8]]))
    assert tuple(logits.shape) == (1, 3, config.vocab_size)
    assert (config.embed_dim, config.hidden_size, config.global_batch) == (512, 1024, 64)


def test_inception_returns_auxiliary_logits_only_in_training() -> None:
    workload = build_workload("inception-v3", preset="tiny", options={"aux": "true"})
    images = workload.dataset.batch(step=0, size=8, start=0, stop=4).inputs[0]
    logits, aux_logits = workload.model.train()(images)
    assert logits.shape == aux_logits.shape == (4, 10)
    assert workload.model.eval()(images).shape == (4, 10)
    labels = torch.zeros(4, dtype=torch.long)
    smoothing = inception_v3.PRESETS["tiny"].label_smoothing
    expected = nn.functional.cross_entropy(logits, labels, label_smoothing=smoothing)
    expected = expected + 0.4 * nn.functional.cross_entropy(
        aux_logits, labels, label_smoothing=smoothing
    )
    torch.testing.assert_close(workload.loss((logits, aux_logits), labels), expected)


def test_resnet50_projects_shortcuts_only_where_the_shape_changes() -> None:
    model = resnet50.ResNet50(resnet50.PRESETS["paper"])
    projected = [block.projection is not None for block in model.blocks]
    # The first block of every stage changes width (and, after stage 1, the map size).
    stage_starts = (0, 3, 7, 13)  # blocks 3, 4, 6, 3
    assert projected == [index in stage_starts for index in range(16)]
    assert len(projected) == 16  # 16 bottlenecks x 3 + conv1 + fc = 50 layers


def test_vgg19_is_configuration_e_with_sixteen_convolutions() -> None:
    model = build_workload("vgg19", preset="tiny").model
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 16
    assert vgg19.PRESETS["paper"].stage_widths == vgg.PRESETS["paper"].stage_widths


def test_sockeye_sparse_and_tied_options() -> None:
    sparse = build_workload("sockeye", preset="tiny", options={"sparse": "true"})
    batch = sparse.dataset.batch(step=0, size=8, start=0, stop=8)
    sparse.loss(sparse.model(*batch.inputs), batch.targets).backward()
    assert sparse.model.source_embedding.weight.grad.is_sparse
    assert sparse.model.target_embedding.weight.grad.is_sparse
    assert not sparse.model.output.weight.grad.is_sparse

    tied = build_workload("sockeye", preset="tiny", options={"sparse": "true", "tied": "true"})
    assert tied.model.output.weight is None
    tied.loss(tied.model(*batch.inputs), batch.targets).backward()
    assert tied.model.source_embedding.weight.grad.is_sparse
    assert not tied.model.target_embedding.weight.grad.is_sparse  # the output layer reads it all


def test_sockeye_padding_does_not_change_real_positions() -> None:
    model = build_workload("sockeye", preset="tiny", dropout=False).model.eval()
    source = torch.tensor([[5, 6, 7, 3, 0, 0, 0, 0]])
    target_in = torch.tensor([[2, 9, 8, 7, 0, 0, 0, 0]])
    shorter = model(source[:, :4], target_in[:, :4])
    padded = model(source, target_in)[:, :4]
    torch.testing.assert_close(padded, shorter, rtol=1e-5, atol=1e-6)


def test_bad_options_of_the_new_models_are_user_errors() -> None:
    with pytest.raises(UserError, match="not a valid bool"):
        build_workload("inception-v3", preset="tiny", options={"aux": "sometimes"})
    with pytest.raises(UserError, match="takes no --model-option"):
        build_workload("resnet50", preset="tiny", options={"aux": "true"})
    with pytest.raises(UserError, match="unknown --model-option 'shared'"):
        build_workload("sockeye", preset="tiny", options={"shared": "true"})
