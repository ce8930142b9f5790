"""The model zoo: published parameter counts, torchvision names, shapes, one training step."""
import pytest
import torch

from hpcdl.cpus import memory_format_name
from hpcdl.models import channels_last_unsafe_layer, create_model, flops, list_models
from hpcdl.models.resnet import PreActBottleneck, ResNet
from hpcdl.optim import LARS, param_groups

FULL_SIZE = ["alexnet", "alexnet_bn", "alexnet_bvlc", "alexnet_bn_nvcaffe", "resnet50",
             "resnet50_v1", "resnet50_v2"]
SMALL = ["resnet_small", "resnet50_small", "alexnet_bn_small"]


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def preact_small(num_classes=10, zero_init_residual=False):
    """ResNet-50 v2's pre-activation block at small width, so its path trains in a test."""
    return ResNet(PreActBottleneck, (1, 1, 1, 1), num_classes, width=8, small_stem=True,
                  zero_init_residual=zero_init_residual)


def build(name, **kw):
    return preact_small(**kw) if name == "preact_small" else create_model(name, **kw)


def meta_model(name, *args, **kw):
    """Built on the meta device: shapes and names without the cost of initialising 61M floats."""
    with torch.device("meta"):
        return create_model(name, *args, **kw)


def test_registry_lists_the_zoo():
    assert set(FULL_SIZE + SMALL) <= set(list_models())


@pytest.mark.parametrize("name, count", [("alexnet", 61_100_840), ("resnet50", 25_557_032),
                                         ("resnet50_v1", 25_557_032),
                                         ("alexnet_bvlc", 60_965_224),
                                         ("alexnet_bn_nvcaffe", 60_965_224)])
def test_published_parameter_counts(name, count):
    assert n_params(meta_model(name)) == count


def test_num_classes_changes_only_the_classifier():
    assert n_params(meta_model("resnet50")) - n_params(meta_model("resnet50", 10)) \
        == 2048 * 990 + 990


def test_resnet50_names_follow_torchvision_layout():
    state = meta_model("resnet50").state_dict()
    # torchvision's resnet50 state_dict: 161 parameters + 3 buffers for each of 53 BNs.
    assert len(state) == 320
    for key in ["conv1.weight", "bn1.running_var", "layer1.0.conv1.weight",
                "layer1.0.downsample.0.weight", "layer1.0.downsample.1.bias",
                "layer4.2.bn3.weight", "fc.weight", "fc.bias"]:
        assert key in state, key
    assert state["layer3.5.conv3.weight"].shape == (1024, 256, 1, 1)
    assert state["fc.weight"].shape == (1000, 2048)


def test_v1_strides_in_first_1x1_and_v15_in_3x3():
    v15, v1 = meta_model("resnet50"), meta_model("resnet50_v1")
    assert v15.layer2[0].conv1.stride == (1, 1) and v15.layer2[0].conv2.stride == (2, 2)
    assert v1.layer2[0].conv1.stride == (2, 2) and v1.layer2[0].conv2.stride == (1, 1)


def test_v2_is_pre_activation():
    v2 = meta_model("resnet50_v2")
    block = v2.layer1[0]
    assert block.bn1.num_features == 64 and block.bn3.num_features == 64
    assert len(block.downsample) == 1                  # conv-only projection
    assert v2.bn_final.num_features == 2048


@pytest.mark.parametrize("name", ["resnet_small", "resnet50_small", "preact_small"])
def test_zero_init_residual_zeroes_last_bn_gamma(name):
    model = build(name, zero_init_residual=True)
    lasts = [m.last_bn().weight for m in model.modules() if hasattr(m, "last_bn")]
    assert lasts and all(torch.count_nonzero(w) == 0 for w in lasts)
    plain = build(name)
    assert all(torch.count_nonzero(m.last_bn().weight) > 0
               for m in plain.modules() if hasattr(m, "last_bn"))


def test_resnet50_forward_and_flops_at_224():
    model = create_model("resnet50", zero_init_residual=True).eval()
    assert all(torch.count_nonzero(b.bn3.weight) == 0
               for layer in (model.layer1, model.layer4) for b in layer)
    with torch.no_grad():
        out = model(torch.randn(1, 3, 224, 224))
    assert out.shape == (1, 1000) and torch.isfinite(out).all()
    assert 4.0e9 < flops(model, 224) < 4.2e9          # ≈ 4.1 G multiply-adds


def test_flops_of_resnet50_v1_and_alexnet():
    # v1 strides in the 1×1, so its 3×3s run at the lower resolution: fewer than v1.5's 4.09 G.
    assert 3.8e9 < flops(create_model("resnet50_v1"), 224) < 3.9e9
    assert 0.70e9 < flops(create_model("alexnet"), 224) < 0.73e9


def test_flops_counts_a_linear_layer_exactly_and_leaves_model_alone():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 8 * 8, 5)).train()
    assert flops(model, 8) == 4 * 8 * 8 * 3 * 9 + 256 * 5
    assert flops(model, (3, 8, 8)) == flops(model, (8, 8)) == flops(model, 8)
    assert model.training
    assert not model[0]._forward_hooks


@pytest.mark.parametrize("name", SMALL)
@pytest.mark.parametrize("size", [28, 32, 64])
def test_small_members_take_28_to_64_px(name, size):
    model = create_model(name, num_classes=10).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, size, size)).shape == (2, 10)


@pytest.mark.parametrize("name", SMALL + ["preact_small"])
def test_channels_last_matches_contiguous(name):
    model = build(name, num_classes=10).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = model(x)
        model = model.to(memory_format=torch.channels_last)
        got = model(x.to(memory_format=torch.channels_last))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", FULL_SIZE + SMALL + ["preact_small"])
def test_the_zoo_at_its_widths_trains_in_channels_last(name):
    model = meta_model(name) if name in FULL_SIZE else build(name)
    assert channels_last_unsafe_layer(model) is None


def test_a_strided_1x1_below_avx512s_channel_block_rules_out_channels_last():
    """oneDNN blocks a 1x1's input channels by 8 (AVX2) or 16 (AVX-512) and writes past its
    workspace below that in channels_last (hpcdl.models.channels_last): 4 and 8 channels are
    named on every CPU, 16 are not, and so are grouped layers by their channels per group."""
    assert channels_last_unsafe_layer(create_model("resnet_small", width=4)) == (
        "layer2.0.downsample.0 (1x1 convolution, stride 2, 4 input channels)")
    assert "8 input channels" in channels_last_unsafe_layer(create_model("resnet_small", width=8))
    assert channels_last_unsafe_layer(create_model("resnet_small", width=16)) is None
    grouped = torch.nn.Sequential(torch.nn.Conv2d(32, 32, 1, stride=(2, 1), groups=4))
    assert channels_last_unsafe_layer(grouped) == (
        "0 (1x1 convolution, stride 2x1, 8 input channels)")
    unstrided = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 1), torch.nn.Conv2d(8, 8, 3, stride=2))
    assert channels_last_unsafe_layer(unstrided) is None


def test_such_a_layer_keeps_every_request_contiguous():
    layer = "layer2.0.downsample.0 (1x1 convolution, stride 2, 4 input channels)"
    for channels_last, precision in ((True, "float32"), ("auto", "bfloat16")):
        assert memory_format_name(channels_last, 8, precision) == "channels_last"
        assert memory_format_name(channels_last, 8, precision, layer) == "contiguous"


# Full size: ResNet-50 v1.5 and AlexNet-BN, the papers' two networks; v1, v2 and AlexNet share
# their code paths (v2's block trains as preact_small; v1 and AlexNet run forward above).
@pytest.mark.parametrize("name", ["resnet50", "alexnet_bn"] + SMALL + ["preact_small"])
def test_each_model_trains_one_step(name):
    torch.manual_seed(0)
    model = build(name, num_classes=10).train()
    # 63 px is the smallest input AlexNet's pools accept; ResNet-50 takes 32.
    size = 64 if name == "alexnet_bn" else 32
    x, y = torch.randn(2, 3, size, size), torch.randint(0, 10, (2,))
    opt = LARS(param_groups(model, 5e-4), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    moved = sum(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert moved == len(before)


def test_unknown_model_and_option_are_named():
    with pytest.raises(ValueError, match="resnet51"):
        create_model("resnet51")
    with pytest.raises(ValueError, match="widht"):
        create_model("resnet_small", widht=8)


def _layer_kinds(model):
    return [type(m).__name__ for m in model.features]


def test_nvcaffe_alexnet_bn_follows_train_val2_prototxt():
    """borisgin/nvcaffe models/alexnet_bn/train_val2.prototxt: BN without γ/β after pool1,
    pool2, relu3 and relu4; groups 2 on conv2/4/5; biases kept; no LRN."""
    model = meta_model("alexnet_bn_nvcaffe")
    assert _layer_kinds(model) == [
        "Conv2d", "ReLU", "MaxPool2d", "BatchNorm2d",
        "Conv2d", "ReLU", "MaxPool2d", "BatchNorm2d",
        "Conv2d", "ReLU", "BatchNorm2d",
        "Conv2d", "ReLU", "BatchNorm2d",
        "Conv2d", "ReLU", "MaxPool2d"]
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert [(bn.num_features, bn.affine, bn.eps, bn.momentum) for bn in bns] == [
        (96, False, 1e-4, 0.1), (256, False, 1e-4, 0.1), (384, False, 1e-4, 0.1),
        (384, False, 1e-4, 0.1)]
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [96, 256, 384, 384, 256]
    assert [c.groups for c in convs] == [1, 2, 1, 2, 2]
    assert all(m.bias is not None for m in model.modules()
               if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)))


def test_bvlc_alexnet_has_lrn_before_pool1_and_pool2_and_caffe_fillers():
    torch.manual_seed(0)
    model = create_model("alexnet_bvlc")
    kinds = _layer_kinds(model)
    assert kinds[:8] == ["Conv2d", "ReLU", "LocalResponseNorm", "MaxPool2d",
                         "Conv2d", "ReLU", "LocalResponseNorm", "MaxPool2d"]
    assert "BatchNorm2d" not in kinds
    assert model.features.conv2.bias.eq(0.1).all() and model.features.conv1.bias.eq(0).all()
    assert model.classifier.fc6.weight.std().item() == pytest.approx(0.005, rel=0.01)
    assert model.features.conv3.weight.std().item() == pytest.approx(0.01, rel=0.01)


@pytest.mark.parametrize("name", ["alexnet_bvlc", "alexnet_bn_nvcaffe"])
def test_caffe_alexnets_take_227_px_and_count_bvlc_flops(name):
    """pool5 is 256×6×6 at 227 px; grouped convs halve conv2/4/5's multiply-adds
    (BVLC AlexNet: 724 M per image)."""
    model = create_model(name)
    assert model(torch.zeros(2, 3, 227, 227)).shape == (2, 1000)
    assert flops(model, 227) == 724_406_816


def test_the_planner_counts_the_caffe_alexnets(tmp_path):
    """`hpcdl plan --model alexnet_bn_nvcaffe` takes its cost from the registry like any model."""
    from hpcdl.plan.workload import workload

    w = workload("alexnet_bn_nvcaffe", 227, cache_path=str(tmp_path / "layers.json"))
    assert w.forward_macs == 724_406_816 and w.parameters == 60_965_224


def test_one_profile_gives_every_leaf_per_image_and_the_functions_between_them():
    """The profile behind the FLOP count, the planner's layer table and the job renderer's
    memory estimate: per image, every leaf module, and the residual sums a ResNet calls
    outside its modules."""
    from torch import nn

    from hpcdl.models.profile import profile

    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 8 * 8, 5))
    ops = profile(model, (3, 8, 8))
    assert [op.name for op in ops if op.module is not None] == ["0", "1", "2", "3"]
    conv, relu, flat, fc = (op for op in ops if op.module is not None)
    assert (conv.macs, conv.pixels, conv.params) == (4 * 8 * 8 * 3 * 9, 64, 4 * 3 * 9)
    assert relu.in_elements == relu.out_elements == flat.out_elements == 4 * 8 * 8
    assert (fc.macs, fc.out_elements, fc.params) == (256 * 5, 5, 256 * 5 + 5)
    assert sum(op.macs for op in ops) == flops(model, 8)
    resnet = create_model("resnet_small", num_classes=3)
    adds = [op for op in profile(resnet, (3, 32, 32)) if op.function in ("add", "add_",
                                                                          "__add__", "__iadd__")]
    assert adds and all(op.out_elements > 0 for op in adds)
