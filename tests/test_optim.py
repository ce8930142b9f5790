"""LARS against a float64 reference written from the formula (You et al., arXiv:1708.03888):

    λ = η·‖w‖ / (‖g‖ + β·‖w‖ + ε), λ = 1 if ‖w‖ = 0 or ‖g‖ = 0 (lars=False: λ = 1)
    v ← m·v + lr·λ·(g + β·w);   w ← w − v   (nesterov: w ← w − (m·v + lr·λ·(g + β·w)))
    trust_clip: λ ← min(λ, 1)
    trust_ratio_wd=False: λ = η·‖w‖ / (‖g‖ + ε)          (NVCaffe's later GetLocalRate)
    larc_clip: the effective rate lr·λ becomes min(λ, lr) (NVIDIA LARC "clip")
"""
import copy
import math

import pytest
import torch

from hpcdl.models import create_model
from hpcdl.optim import (
    LARS,
    apply_momentum_correction,
    create_optimizer,
    list_optimizers,
    param_groups,
    set_learning_rate,
    step_parameters,
    steps_tensor_by_tensor,
)


def reference_step(ws, gs, vs, *, lr, momentum, weight_decay, trust_coefficient=0.001, eps=0.0,
                   nesterov=False, trust_clip=False, lars=True, trust_ratio_wd=True,
                   larc_clip=False):
    """One step on lists of float64 tensors, one tensor at a time, straight from the formula."""
    new_ws, new_vs = [], []
    for w, g, v in zip(ws, gs, vs, strict=True):
        w_norm, g_norm = math.sqrt(float((w * w).sum())), math.sqrt(float((g * g).sum()))
        if lars and w_norm > 0 and g_norm > 0:
            decay_term = weight_decay * w_norm if trust_ratio_wd else 0.0
            trust = trust_coefficient * w_norm / (g_norm + decay_term + eps)
        else:
            trust = 1.0
        if trust_clip:
            trust = min(trust, 1.0)
        rate = min(trust, lr) if larc_clip and lars else lr * trust
        d = g + weight_decay * w
        v_new = momentum * v + rate * d
        w_new = w - (momentum * v_new + rate * d if nesterov else v_new)
        new_ws.append(w_new)
        new_vs.append(v_new)
    return new_ws, new_vs


def make_tensors(dtype=torch.float64, seed=0):
    """Weights of several shapes, one all-zero (a zero-initialised BN γ), one with zero grad."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(8, 4, 3, 3), (16,), (5, 7), (3,), (11,)]
    ws = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    ws[1].zero_()                      # ‖w‖ = 0: must still move (λ = 1)
    gs = [torch.randn(s, generator=gen, dtype=dtype) * 0.01 for s in shapes]
    gs[3].zero_()                      # ‖g‖ = 0: λ = 1, only weight decay acts
    return ws, gs


def grads_for_step(ws, step, dtype=torch.float64):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(w.shape, generator=gen, dtype=dtype) * 0.01 for w in ws]


CASES = [
    dict(momentum=0.9, weight_decay=0.0),
    dict(momentum=0.9, weight_decay=5e-4),
    dict(momentum=0.9, weight_decay=5e-4, eps=1e-5),
    dict(momentum=0.9, weight_decay=1e-4, nesterov=True),
    dict(momentum=0.9, weight_decay=1e-4, trust_clip=True),
    dict(momentum=0.9, weight_decay=1e-4, trust_coefficient=0.02, trust_clip=True),
    dict(momentum=0.0, weight_decay=5e-4),
    dict(momentum=0.9, weight_decay=5e-4, lars=False),
    dict(momentum=0.9, weight_decay=5e-4, trust_ratio_wd=False),
    dict(momentum=0.9, weight_decay=5e-4, trust_coefficient=0.02, larc_clip=True),
    dict(momentum=0.9, weight_decay=5e-4, trust_coefficient=1e-5, larc_clip=True),
    dict(momentum=0.9, weight_decay=5e-4, trust_ratio_wd=False, larc_clip=True, nesterov=True),
]


def run_lars(ws, grads_per_step, lr, **case):
    params = [torch.nn.Parameter(w.clone()) for w in ws]
    lars_flag = case.pop("lars", True)
    opt = LARS([{"params": params, "lars": lars_flag}], lr=lr, **case)
    for gs in grads_per_step:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params], opt


def run_reference(ws, grads_per_step, lr, **case):
    vs = [torch.zeros_like(w) for w in ws]
    for gs in grads_per_step:
        ws, vs = reference_step(ws, gs, vs, lr=lr, **case)
    return ws


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_one_step_matches_float64_reference(case):
    ws, gs = make_tensors()
    got, _ = run_lars(ws, [gs], 2.5, **dict(case))
    want = run_reference(ws, [gs], 2.5, **dict(case))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_several_steps_match_float64_reference(case):
    ws, gs = make_tensors()
    steps = [gs] + [grads_for_step(ws, s) for s in range(1, 4)]
    got, _ = run_lars(ws, steps, 1.5, **dict(case))
    want = run_reference(ws, steps, 1.5, **dict(case))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-11, atol=1e-13)


def test_float32_parameters_follow_float64_reference():
    ws64, gs64 = make_tensors()
    steps64 = [gs64, grads_for_step(ws64, 1)]
    got, _ = run_lars([w.float() for w in ws64], [[g.float() for g in gs] for gs in steps64],
                      3.0, momentum=0.9, weight_decay=5e-4)
    want = run_reference(ws64, steps64, 3.0, momentum=0.9, weight_decay=5e-4)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-6)


def test_zero_initialised_tensor_moves():
    ws, gs = make_tensors()
    got, _ = run_lars(ws, [gs], 1.0, momentum=0.9, weight_decay=0.0)
    assert ws[1].abs().sum() == 0
    # λ = 1 for the zero tensor, so the step is lr·g exactly.
    torch.testing.assert_close(got[1], -1.0 * gs[1])


def test_trust_ratio_scales_step_per_tensor():
    """Two tensors whose gradients differ 100× in scale take steps of the same relative size."""
    w = [torch.ones(10, dtype=torch.float64), torch.ones(10, dtype=torch.float64)]
    g = [torch.full((10,), 1.0, dtype=torch.float64), torch.full((10,), 100.0,
                                                                 dtype=torch.float64)]
    got, _ = run_lars(w, [g], 1.0, momentum=0.0, trust_coefficient=0.01)
    torch.testing.assert_close(got[0], got[1])
    torch.testing.assert_close(got[0], torch.full((10,), 0.99, dtype=torch.float64))


def test_mixed_groups_each_follow_their_rule():
    ws, gs = make_tensors()
    params = [torch.nn.Parameter(w.clone()) for w in ws]
    opt = LARS([{"params": params[:3], "weight_decay": 1e-3},
                {"params": params[3:], "weight_decay": 0.0, "lars": False}],
               lr=2.0, momentum=0.9)
    for p, g in zip(params, gs, strict=True):
        p.grad = g.clone()
    opt.step()
    want_a = run_reference(ws[:3], [gs[:3]], 2.0, momentum=0.9, weight_decay=1e-3)
    want_b = run_reference(ws[3:], [gs[3:]], 2.0, momentum=0.9, weight_decay=0.0, lars=False)
    for p, w in zip(params, want_a + want_b, strict=True):
        torch.testing.assert_close(p.detach(), w, rtol=1e-12, atol=1e-14)


def test_parameters_without_grad_are_left_alone():
    ws, gs = make_tensors()
    params = [torch.nn.Parameter(w.clone()) for w in ws]
    opt = LARS(params, lr=1.0)
    params[0].grad = gs[0].clone()
    opt.step()
    assert not torch.equal(params[0].detach(), ws[0])
    for p, w in zip(params[1:], ws[1:], strict=True):
        assert torch.equal(p.detach(), w)
        assert p not in opt.state


def test_param_groups_follow_mlperf_skip_list():
    model = create_model("resnet_small", num_classes=10, width=4)
    groups = param_groups(model, 5e-5)
    by_flag = {g["lars"]: g for g in groups}
    names = {id(p): n for n, p in model.named_parameters()}
    skipped = {names[id(p)] for p in by_flag[False]["params"]}
    adapted = {names[id(p)] for p in by_flag[True]["params"]}
    assert by_flag[False]["weight_decay"] == 0.0 and by_flag[True]["weight_decay"] == 5e-5
    assert "fc.bias" in skipped and "bn1.weight" in skipped and "bn1.bias" in skipped
    assert "layer1.0.bn2.weight" in skipped
    assert adapted == {n for n, p in model.named_parameters() if n.endswith("weight")
                       and p.ndim > 1}
    assert len(skipped) + len(adapted) == len(list(model.parameters()))


def test_param_groups_skip_linear_bias_in_alexnet():
    model = create_model("alexnet_bn_small", num_classes=10, width=4)
    skipped = {id(p) for g in param_groups(model, 1e-4) if not g["lars"] for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in skipped) == (p.ndim == 1), name


def test_state_dict_round_trip_resumes_exactly():
    ws, gs = make_tensors()
    steps = [gs] + [grads_for_step(ws, s) for s in range(1, 5)]
    full, _ = run_lars(ws, steps, 1.0, momentum=0.9, weight_decay=1e-4, nesterov=True)

    half_ws, opt = run_lars(ws, steps[:2], 1.0, momentum=0.9, weight_decay=1e-4, nesterov=True)
    saved = copy.deepcopy(opt.state_dict())
    params = [torch.nn.Parameter(w.clone()) for w in half_ws]
    resumed = LARS([{"params": params, "lars": True}], lr=99.0)   # overwritten by the load
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["nesterov"] is True
    for gs_step in steps[2:]:
        for p, g in zip(params, gs_step, strict=True):
            p.grad = g.clone()
        resumed.step()
    for p, w in zip(params, full, strict=True):
        assert torch.equal(p.detach(), w)


def test_steps_are_deterministic():
    ws, gs = make_tensors(dtype=torch.float32)
    a, _ = run_lars(ws, [gs, gs], 1.0, momentum=0.9, weight_decay=5e-4)
    b, _ = run_lars(ws, [gs, gs], 1.0, momentum=0.9, weight_decay=5e-4)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_scale_momentum_multiplies_buffers():
    ws, gs = make_tensors()
    _, opt = run_lars(ws, [gs], 1.0, momentum=0.9)
    before = [s["momentum_buffer"].clone() for s in opt.state.values()]
    apply_momentum_correction(opt, 0.5)
    for b, s in zip(before, opt.state.values(), strict=True):
        torch.testing.assert_close(s["momentum_buffer"], 0.5 * b)


@pytest.mark.parametrize("kwargs, word", [
    (dict(lr=-1.0), "lr"), (dict(lr=1.0, momentum=1.0), "momentum"),
    (dict(lr=1.0, weight_decay=-1.0), "weight_decay"),
    (dict(lr=1.0, trust_coefficient=0.0), "trust_coefficient"),
    (dict(lr=1.0, momentum=0.0, nesterov=True), "nesterov"),
])
def test_bad_hyperparameters_are_named(kwargs, word):
    with pytest.raises(ValueError, match=word):
        LARS([torch.nn.Parameter(torch.ones(2))], **kwargs)


def test_create_optimizer_builds_lars_with_skip_list():
    model = create_model("resnet_small", num_classes=10, width=4)
    opt = create_optimizer({"name": "lars", "momentum": 0.9, "weight_decay": 5e-5,
                            "trust_coefficient": 0.001, "eps": 0.0, "nesterov": False,
                            "trust_clip": False}, model, lr=3.0)
    assert isinstance(opt, LARS)
    assert sorted(g["lars"] for g in opt.param_groups) == [False, True]
    assert all(g["lr"] == 3.0 for g in opt.param_groups)


def test_create_optimizer_sgd_and_lr_from_cfg():
    model = create_model("resnet_small", num_classes=10, width=4)
    opt = create_optimizer({"name": "sgd", "momentum": 0.9, "weight_decay": 1e-4,
                            "nesterov": False, "lr": 3.2}, model)
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["lr"] == 3.2
    assert list_optimizers() == ["lars", "sgd"]


def _caffe_step(name: str) -> tuple[torch.nn.Module, torch.nn.Module, dict]:
    """One step of ``name`` with Caffe's bias multipliers, from the same start and gradients."""
    torch.manual_seed(0)
    before = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    for p in before.parameters():
        p.data.normal_()
        p.grad = torch.randn_like(p)
    after = copy.deepcopy(before)  # (deepcopy leaves .grad behind)
    for p, q in zip(before.parameters(), after.parameters(), strict=True):
        q.grad = p.grad.clone()
    cfg = {"name": name, "momentum": 0.9, "weight_decay": 0.1, "bias_lr_mult": 2.0,
           "bias_decay_mult": 0.0}
    if name == "lars":
        cfg.update(skip_list=False, trust_coefficient=0.01)
    opt = create_optimizer(cfg, after, lr=0.0)
    set_learning_rate(opt, 0.5)
    opt.step()
    return before, after, {id(g["params"][0]): g for g in opt.param_groups}


def test_sgd_caffe_bias_multipliers_double_the_rate_and_skip_decay_on_biases_only():
    """BVLC AlexNet's ``param { lr_mult: 2 decay_mult: 0 }`` on every conv/fc bias: the bias
    moves by 2·lr·g, the weight by lr·(g + wd·w); BN's β keeps lr and decay (float64 check)."""
    before, after, _ = _caffe_step("sgd")
    (w0, b0, g0, beta0), (w1, b1, g1, beta1) = before.parameters(), after.parameters()
    def sgd(p, lr, wd):  # float64, first step: v = g + wd·w, w -= lr·v
        return p.double() - lr * (p.grad.double() + wd * p.double())

    torch.testing.assert_close(b1.double(), sgd(b0, 2 * 0.5, 0.0))
    torch.testing.assert_close(w1.double(), sgd(w0, 0.5, 0.1))
    torch.testing.assert_close(beta1.double(), sgd(beta0, 0.5, 0.1))
    torch.testing.assert_close(g1.double(), sgd(g0, 0.5, 0.1))


def test_lars_caffe_bias_multipliers_keep_the_trust_ratio_and_double_the_rate():
    before, after, groups = _caffe_step("lars")
    w0, b0 = before[0].weight, before[0].bias
    bias_group = groups[id(after[0].bias)]
    assert bias_group["lr"] == 1.0 and bias_group["weight_decay"] == 0.0 and bias_group["lars"]
    rate = 0.01 * b0.norm().double() / b0.grad.norm().double()  # η‖w‖/‖g‖, no decay
    torch.testing.assert_close(after[0].bias.double(),
                               b0.double() - 2 * 0.5 * rate * b0.grad.double())
    assert groups[id(after[0].weight)]["lr"] == 0.5
    assert not torch.equal(after[0].weight, w0)


def test_without_multipliers_the_groups_are_unchanged():
    model = create_model("resnet_small", num_classes=10, width=4)
    plain = create_optimizer({"name": "sgd", "bn_weight_decay": False}, model)
    same = create_optimizer({"name": "sgd", "bn_weight_decay": False, "bias_lr_mult": 1.0},
                            model)
    assert len(plain.param_groups) == len(same.param_groups) == 2
    assert all("lr_mult" not in g for g in same.param_groups)


@pytest.mark.parametrize("cfg, word", [
    ({"name": "adam"}, "adam"),
    ({"name": "lars", "momentun": 0.9}, "momentun"),
    ({"name": "sgd", "trust_coefficient": 0.001}, "trust_coefficient"),
])
def test_create_optimizer_rejects_bad_config(cfg, word):
    with pytest.raises(ValueError, match=word):
        create_optimizer(cfg, create_model("resnet_small", num_classes=10, width=4))


def test_bfloat16_parameters_step_close_to_reference():
    ws64, gs64 = make_tensors()
    got, _ = run_lars([w.bfloat16() for w in ws64], [[g.bfloat16() for g in gs64]], 2.0,
                      momentum=0.9, weight_decay=5e-4)
    want = run_reference([w.bfloat16().double() for w in ws64],
                         [[g.bfloat16().double() for g in gs64]], 2.0, momentum=0.9,
                         weight_decay=5e-4)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.double(), w, rtol=2e-2, atol=2e-2)


def test_larc_clip_caps_the_local_rate_at_the_global_one():
    """A tensor whose η‖w‖/‖g‖ exceeds lr moves at lr (LARC clip), one below keeps λ."""
    w = torch.ones(4, dtype=torch.float64)
    small_grad = torch.full((4,), 1e-6, dtype=torch.float64)
    (big,), _ = run_lars([w], [[small_grad]], 0.5, momentum=0.0, trust_coefficient=0.1,
                         larc_clip=True)
    torch.testing.assert_close(big, w - 0.5 * small_grad)


def test_trust_clip_and_larc_clip_together_are_refused():
    with pytest.raises(ValueError, match="larc_clip"):
        LARS([torch.nn.Parameter(torch.ones(2))], trust_clip=True, larc_clip=True)


def test_lr_has_a_default_so_horovod_can_rebuild_the_optimizer():
    """Horovod's DistributedOptimizer calls type(opt)(param_groups): every argument needs a
    default."""
    opt = LARS([torch.nn.Parameter(torch.ones(2))], lr=2.0)
    rebuilt = type(opt)(opt.param_groups)
    assert rebuilt.param_groups[0]["lr"] == 2.0


def test_without_skip_list_every_tensor_is_adapted_and_decayed():
    """Intel Caffe / NVCaffe: the local rate and decay apply to every learnable blob,
    biases included (borisgin/nvcaffe's AlexNet-BN has no BN parameters)."""
    model = create_model("alexnet_bn_small", num_classes=10, width=4)
    groups = param_groups(model, 5e-4, skip_list=False)
    assert len(groups) == 1 and groups[0]["lars"] and groups[0]["weight_decay"] == 5e-4
    assert len(groups[0]["params"]) == len(list(model.parameters()))
    opt = create_optimizer({"name": "lars", "weight_decay": 5e-4, "skip_list": False,
                            "trust_ratio_wd": False}, model, lr=1.0)
    assert [g["lars"] for g in opt.param_groups] == [True]
    assert opt.param_groups[0]["trust_ratio_wd"] is False


def test_sgd_without_bn_weight_decay_leaves_gamma_and_beta_undecayed():
    """Goyal et al. §5.1: no weight decay on BN's γ and β; conv/fc weights and the fc bias
    keep it."""
    model = create_model("resnet_small", num_classes=10, width=4)
    opt = create_optimizer({"name": "sgd", "weight_decay": 1e-4, "bn_weight_decay": False},
                           model, lr=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {names[id(p)]: g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert decay["bn1.weight"] == decay["layer1.0.bn2.bias"] == 0.0
    assert decay["conv1.weight"] == decay["fc.bias"] == 1e-4
    assert len(decay) == len(list(model.parameters()))
    # One step against the float64 formula: a BN γ with zero grad stays where it is.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    before = model.bn1.weight.detach().clone()
    conv_before = model.conv1.weight.detach().clone().double()
    opt.step()
    assert torch.equal(model.bn1.weight.detach(), before)
    torch.testing.assert_close(model.conv1.weight.detach().double(),
                               conv_before - 0.1 * 1e-4 * conv_before, rtol=1e-6, atol=1e-9)


def _with_gradients(model, seed):
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator)


@pytest.mark.parametrize("build", [
    lambda m: LARS(param_groups(m, 5e-5), lr=0.5, momentum=0.9, weight_decay=5e-5),
    lambda m: LARS(param_groups(m, 5e-5), lr=0.5, momentum=0.9, nesterov=True),
    lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4),
], ids=["lars", "lars_nesterov", "sgd"])
def test_a_step_taken_in_parts_is_one_step(build):
    """The Trainer's overlapped update steps one gradient bucket after another: for an
    optimizer whose step is per tensor that is the very same step, bit for bit."""
    torch.manual_seed(0)
    whole = create_model("resnet_small", num_classes=3, width=4, layers=[1, 1, 1])
    parts = copy.deepcopy(whole)
    one, pieces = build(whole), build(parts)
    assert steps_tensor_by_tensor(one)
    params = list(parts.parameters())
    split = [params[0::3], params[1::3], params[2::3]]  # each part spans the groups
    for step in range(3):
        _with_gradients(whole, step)
        _with_gradients(parts, step)
        one.step()
        for part in split:
            step_parameters(pieces, part)
    for a, b in zip(whole.parameters(), parts.parameters(), strict=True):
        assert torch.equal(a, b)
    assert [len(g["params"]) for g in pieces.param_groups] == \
        [len(g["params"]) for g in one.param_groups]


def test_only_an_optimizer_whose_step_is_per_tensor_is_stepped_in_parts():
    class Coupled(LARS):   # a subclass may add a norm across tensors
        pass

    model = torch.nn.Linear(2, 2)
    assert not steps_tensor_by_tensor(Coupled(model.parameters()))
    assert not steps_tensor_by_tensor(torch.optim.Adam(model.parameters()))
