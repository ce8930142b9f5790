"""Recipes: schema validation, dotted overrides, batch resolution, the resolved config."""
import glob
import os

import pytest
import yaml

from hpcdl.train.config import (
    BatchConfig,
    RecipeError,
    load_recipe,
    parse_overrides,
    resolve_batch,
    write_resolved_config,
)

RECIPES = os.path.join(os.path.dirname(__file__), "..", "recipes")

MINIMAL = """
name: t
model: {name: resnet_small, num_classes: 3}
batch: {global: 8}
epochs: 1
optimizer: {name: sgd, momentum: 0.9}
schedule: {name: poly, base_lr: 0.1}
"""


@pytest.fixture
def recipe(tmp_path):
    def write(text=MINIMAL):
        path = tmp_path / "r.yaml"
        path.write_text(text)
        return str(path)
    return write


def test_minimal_recipe_gets_schema_defaults(recipe):
    config = load_recipe(recipe())
    assert config.batch.global_ == 8 and config.batch.per_rank is None
    assert config.train.keep_checkpoints == 3 and config.comm.bucket_mb == 25.0
    assert config.data.image_size == 224


def test_every_shipped_recipe_validates():
    paths = glob.glob(os.path.join(RECIPES, "*.yaml"))
    assert paths, "no recipes shipped"
    for path in paths:
        assert load_recipe(path).name


def test_unknown_key_is_reported_by_dotted_name_and_file(recipe):
    path = recipe(MINIMAL + "train: {per_rnak: 3}\n")
    with pytest.raises(RecipeError, match=r"r\.yaml.*train\.per_rnak"):
        load_recipe(path)


def test_unknown_top_level_key_is_reported(recipe):
    with pytest.raises(RecipeError, match="epoch_count"):
        load_recipe(recipe(MINIMAL + "epoch_count: 3\n"))


def test_missing_required_nested_key_is_reported(recipe):
    with pytest.raises(RecipeError, match=r"missing required key batch\.global"):
        load_recipe(recipe(MINIMAL.replace("batch: {global: 8}", "batch: {per_rank: 2}")))


def test_missing_section_name_is_reported(recipe):
    with pytest.raises(RecipeError, match=r"optimizer\.name"):
        load_recipe(recipe(MINIMAL.replace("{name: sgd, momentum: 0.9}", "{momentum: 0.9}")))


def test_wrong_type_names_key_and_value(recipe):
    with pytest.raises(RecipeError, match=r"train\.seed.*'abc'"):
        load_recipe(recipe(), ["train.seed=abc"])


def test_overrides_parse_yaml_scalars(recipe):
    config = load_recipe(recipe(), ["batch.per_rank=4", "train.channels_last=true", "epochs=2.5",
                                    "schedule.base_lr=1e-3", "model.width=8"])
    assert config.batch.per_rank == 4
    assert config.train.channels_last is True
    assert config.epochs == 2.5
    assert config.schedule["base_lr"] == pytest.approx(1e-3)
    assert config.model["width"] == 8  # model-specific keys pass through to create_model


def test_channels_last_is_true_false_or_auto(recipe):
    assert load_recipe(recipe()).train.channels_last is False   # omitted: contiguous
    assert load_recipe(recipe(), ["train.channels_last=auto"]).train.channels_last == "auto"
    with pytest.raises(RecipeError, match=r"train\.channels_last.*'nhwc'"):
        load_recipe(recipe(), ["train.channels_last=nhwc"])


def test_override_of_unknown_key_is_an_error(recipe):
    with pytest.raises(RecipeError, match=r"batch\.per_rnak"):
        load_recipe(recipe(), ["batch.per_rnak=4"])


def test_override_without_equals_is_an_error():
    with pytest.raises(RecipeError, match="KEY=VALUE"):
        parse_overrides(["batch.per_rank"])


def test_override_null_clears_optional_value(recipe):
    config = load_recipe(recipe(MINIMAL.replace("{global: 8}", "{global: 8, per_rank: 2}")),
                         ["batch.per_rank=null"])
    assert config.batch.per_rank is None


def test_bad_values_are_rejected(recipe):
    for override, key in [("batch.accumulation=0", "batch.accumulation"),
                          ("epochs=0", "epochs"), ("comm.wire_dtype=int8", "comm.wire_dtype")]:
        with pytest.raises(RecipeError, match=key):
            load_recipe(recipe(), [override])


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(RecipeError, match="nope.yaml"):
        load_recipe(str(tmp_path / "nope.yaml"))


def test_per_rank_derived_from_global_batch():
    assert resolve_batch(BatchConfig(global_=64, per_rank=None, accumulation=2), 4) == (8, 2)


def test_global_batch_mismatch_says_how_to_fix():
    with pytest.raises(RecipeError, match=r"batch\.global=64.*= 32.*batch\.per_rank=16"):
        resolve_batch(BatchConfig(global_=64, per_rank=8, accumulation=1), 4)


def test_indivisible_global_batch_is_an_error():
    with pytest.raises(RecipeError, match="not divisible by 3 ranks"):
        resolve_batch(BatchConfig(global_=8, per_rank=None), 3)


def test_resolved_config_round_trips(recipe, tmp_path):
    config = load_recipe(recipe(), ["batch.per_rank=2", "train.seed=7"])
    path = write_resolved_config(config, str(tmp_path / "run"))
    again = load_recipe(path)
    assert again.to_dict() == config.to_dict()
    assert yaml.safe_load(open(path))["train"]["seed"] == 7


def test_elastic_batch_keeps_the_global_batch_at_a_new_rank_count():
    from hpcdl.train.config import elastic_batch

    assert elastic_batch(BatchConfig(global_=256, per_rank=None), 2) == (128, 1)
    # a fixed per-rank batch is what fitted in memory: accumulate instead of growing it
    assert elastic_batch(BatchConfig(global_=256, per_rank=64), 2) == (64, 2)
    assert elastic_batch(BatchConfig(global_=256, per_rank=64), 8) == (32, 1)
    assert elastic_batch(BatchConfig(global_=256, per_rank=None), 2, saved_per_rank=64) \
        == (128, 1)


def test_elastic_batch_refuses_a_rank_count_that_cannot_split_it_naming_those_that_can():
    from hpcdl.train.config import elastic_batch

    with pytest.raises(RecipeError, match=r"over 3 ranks.*1, 2, 4, 8, 16, 32, 64, 128, 256"):
        elastic_batch(BatchConfig(global_=256, per_rank=64), 3)
