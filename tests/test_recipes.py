"""The papers' recipes load through the trainer's validator and build with the factories."""
import glob
import os

import pytest
import torch

from hpcdl.models import create_model
from hpcdl.optim import LARS, create_optimizer, create_schedule, scaled_lr
from hpcdl.train.config import load_recipe, resolve_batch

RECIPE_DIR = os.path.join(os.path.dirname(__file__), "..", "recipes")
IMAGENET_TRAIN_IMAGES = 1_281_167
PAPER_RECIPES = {
    "alexnet_bn_lars_8k": 8192, "alexnet_bn_lars_16k": 16384, "alexnet_bn_lars_32k": 32768,
    "resnet50_lars_8k": 8192, "resnet50_lars_16k": 16384, "resnet50_lars_32k": 32768,
    "resnet50_goyal_sgd_8k": 8192,
}
ALL = sorted(glob.glob(os.path.join(RECIPE_DIR, "*.yaml")))


def recipe_path(name):
    return os.path.join(RECIPE_DIR, f"{name}.yaml")


def test_every_published_run_has_a_recipe():
    present = {os.path.basename(p)[:-5] for p in ALL}
    assert set(PAPER_RECIPES) <= present


@pytest.mark.parametrize("path", ALL, ids=os.path.basename)
def test_recipe_loads_and_builds(path):
    cfg = load_recipe(path)
    assert cfg.source.strip(), f"{path}: no source cited"
    model_kw = {k: v for k, v in cfg.model.items() if k != "name"}
    with torch.device("meta"):                     # names and shapes only: no 61M-float init
        model = create_model(cfg.model["name"], **model_kw)
    steps_per_epoch = max(1, IMAGENET_TRAIN_IMAGES // cfg.batch.global_)
    schedule = create_schedule(cfg.schedule, steps_per_epoch,
                               int(cfg.epochs * steps_per_epoch))
    optimizer = create_optimizer(cfg.optimizer, model, lr=schedule(0))
    assert all(g["lr"] == schedule(0) for g in optimizer.param_groups)
    assert schedule(schedule.warmup_steps) == pytest.approx(cfg.schedule["base_lr"])


@pytest.mark.parametrize("name, global_batch", sorted(PAPER_RECIPES.items()))
def test_paper_recipe_batch_layout(name, global_batch):
    cfg = load_recipe(recipe_path(name))
    assert cfg.batch.global_ == global_batch
    ranks = 256 if "goyal" in name else 2048       # Goyal: 256 GPUs; You et al.: 2,048 ranks
    assert resolve_batch(cfg.batch, ranks) == (global_batch // ranks, 1)


@pytest.mark.parametrize("name", [n for n in PAPER_RECIPES if "lars" in n])
def test_lars_recipes_use_eta_0001_and_poly_power_2(name):
    cfg = load_recipe(recipe_path(name))
    assert cfg.optimizer["name"] == "lars" and cfg.optimizer["trust_coefficient"] == 0.001
    assert cfg.schedule["name"] == "poly" and cfg.schedule["power"] == 2.0
    assert cfg.schedule["warmup_epochs"] > 0
    with torch.device("meta"):
        model = create_model(cfg.model["name"])
    assert isinstance(create_optimizer(cfg.optimizer, model), LARS)


def test_goyal_baseline_is_linear_scaling_with_step_decay():
    cfg = load_recipe(recipe_path("resnet50_goyal_sgd_8k"))
    assert cfg.optimizer["name"] == "sgd" and cfg.optimizer["weight_decay"] == 1e-4
    assert cfg.schedule["base_lr"] == pytest.approx(scaled_lr(0.1, 8192))
    assert cfg.schedule["warmup_epochs"] == 5 and cfg.schedule["milestones"] == [30, 60, 80]
    schedule = create_schedule(cfg.schedule, 100, 9000)
    assert schedule(2999) == pytest.approx(3.2) and schedule(3000) == pytest.approx(0.32)
