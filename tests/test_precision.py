"""train.precision and comm.wire_dtype: the schema, the keys they replace, what ``auto`` resolves
to on CPUs with and without native bf16 (their facts passed in, not this machine's), and the
line a run logs."""
import glob
import logging
import os

import pytest
import yaml

from hpcdl.cli.main import main
from hpcdl.cpus import bf16_native
from hpcdl.train.config import RecipeError, config_from_dict, load_recipe, resolve_precision
from hpcdl.train.precision import agreed_precision, describe, wire_dtype_for

RECIPES = os.path.join(os.path.dirname(__file__), "..", "recipes")
EXIT_BAD_INPUT = 2

# /proc/cpuinfo flags (the part that matters) and torch's capability of the CPUs a job meets
AVX2_EPYC = ({"avx2", "fma", "f16c"}, "AVX2")                     # Zen 2/3
SKYLAKE = ({"avx2", "avx512f", "avx512bw", "avx512_vnni"}, "AVX512")  # bf16 only emulated
ZEN4 = ({"avx2", "avx512f", "avx512bw", "avx512_bf16"}, "AVX512")
SAPPHIRE_RAPIDS = ({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "AVX512")


def recipe(train=None, comm=None):
    return {"name": "t", "model": {"name": "resnet_small", "num_classes": 3},
            "batch": {"global": 8}, "epochs": 1, "optimizer": {"name": "sgd"},
            "schedule": {"name": "poly", "base_lr": 0.1},
            **({"train": train} if train is not None else {}),
            **({"comm": comm} if comm is not None else {})}


# -- the schema -------------------------------------------------------------------------------
def test_a_recipe_without_the_keys_trains_in_float32_and_the_wire_follows():
    config = config_from_dict(recipe())
    assert config.train.precision == "float32" and config.comm.wire_dtype == "auto"


def test_every_shipped_recipe_asks_for_auto_on_both_keys():
    paths = glob.glob(os.path.join(RECIPES, "*.yaml"))
    assert paths
    for path in paths:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
        assert raw["train"]["precision"] == "auto", path   # said in the file, not defaulted
        assert raw["comm"]["wire_dtype"] == "auto", path
        assert load_recipe(path).train.precision == "auto"


@pytest.mark.parametrize("override,key", [("train.precision=fp16", "train.precision"),
                                          ("train.precision=true", "train.precision"),
                                          ("comm.wire_dtype=float16", "comm.wire_dtype")])
def test_a_bad_value_is_named_by_its_dotted_key(tmp_path, override, key):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe()))
    with pytest.raises(RecipeError, match=key.replace(".", r"\.")):
        load_recipe(str(path), [override])


def test_a_bad_precision_is_one_line_and_exit_2(capsys, tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe(train={"precision": "half"})))
    code = main(["train", "--recipe", str(path), "--data", str(tmp_path), "--out",
                 str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("hpcdl train: ")]
    assert code == EXIT_BAD_INPUT and len(lines) == 1 and "Traceback" not in err, err
    assert "train.precision" in lines[0] and "'half'" in lines[0] and str(path) in lines[0]
    assert not (tmp_path / "out").exists()


def test_shard_update_refuses_only_an_explicit_bf16_wire():
    assert config_from_dict(recipe(comm={"shard_update": True})).comm.shard_update
    with pytest.raises(RecipeError, match="comm.shard_update.*comm.wire_dtype"):
        config_from_dict(recipe(comm={"shard_update": True, "wire_dtype": "bfloat16"}))


# -- the keys it replaces (recipes and run directories written before) -------------------------
@pytest.mark.parametrize("old,new", [
    ({"bf16": False}, "float32"),
    ({"bf16": False, "bf16_emulated": True}, "float32"),   # emulation only mattered with bf16
    ({"bf16": True}, "auto"),                              # bf16 where native, else float32
    ({"bf16": True, "bf16_emulated": False}, "auto"),
    ({"bf16": True, "bf16_emulated": True}, "bfloat16"),   # bf16 even where emulated
])
def test_old_bf16_keys_are_read_as_the_precision_they_meant(caplog, old, new):
    with caplog.at_level(logging.WARNING, logger="hpcdl"):
        config = config_from_dict(recipe(train={"seed": 2, **old}), origin="old.yaml")
    assert config.train.precision == new and config.train.seed == 2
    assert "bf16" not in config.to_dict()["train"]
    assert f"old.yaml: train.bf16={old['bf16']}" in caplog.text and new in caplog.text


def test_a_resumed_runs_old_config_yaml_loads_and_is_written_back_in_the_new_keys(tmp_path):
    from hpcdl.train.config import write_resolved_config

    old = recipe(train={"seed": 0, "channels_last": False, "bf16": False, "bf16_emulated": False},
                 comm={"backend": "auto", "bucket_mb": 25, "wire_dtype": "float32"})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    config = load_recipe(str(tmp_path / "config.yaml"))
    assert (config.train.precision, config.comm.wire_dtype) == ("float32", "float32")
    write_resolved_config(config, str(tmp_path))
    again = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert again["train"]["precision"] == "float32" and "bf16" not in again["train"]


def test_old_and_new_keys_together_are_refused():
    with pytest.raises(RecipeError, match="train.precision"):
        config_from_dict(recipe(train={"bf16": True, "precision": "float32"}))


# -- what auto means on each CPU ------------------------------------------------------------
@pytest.mark.parametrize("cpu,native", [(AVX2_EPYC, False), (SKYLAKE, False), (ZEN4, True),
                                        (SAPPHIRE_RAPIDS, True)])
def test_native_bf16_is_avx512_bf16_or_amx(cpu, native):
    flags, capability = cpu
    assert bf16_native(flags, capability) is native
    assert resolve_precision("auto", native) == ("bfloat16" if native else "float32")
    assert agreed_precision("auto", native=native) == resolve_precision("auto", native)


@pytest.mark.parametrize("capability", ["DEFAULT", "AVX2"])
def test_torch_dispatching_below_avx512_is_not_native_bf16(capability):
    """ATEN_CPU_CAPABILITY=default or avx2 on a bf16 CPU: torch's own kernels lack the bf16
    instructions, and a job that set it asked for that numeric path: auto gives float32."""
    flags, _ = SAPPHIRE_RAPIDS
    assert not bf16_native(flags, capability)


@pytest.mark.parametrize("requested", ["float32", "bfloat16"])
@pytest.mark.parametrize("native", [False, True])
def test_an_explicit_precision_is_kept_on_every_cpu(requested, native):
    assert agreed_precision(requested, native=native) == requested


def test_this_machines_answer_agrees_with_its_flags_and_torch():
    import torch

    from hpcdl.cpus import cpu_flags

    expected = bool({"avx512_bf16", "amx_bf16"} & cpu_flags()) and \
        torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    assert bf16_native() is expected


def test_the_start_line_says_what_was_asked_what_it_is_and_why():
    line = describe("auto", "bfloat16", native=True)
    assert line.startswith("precision: bfloat16 (auto: native bf16") and "float32" in line
    assert "no native bf16" in describe("auto", "float32", native=False)
    assert "emulated" in describe("bfloat16", "bfloat16", native=False)


# -- the wire ----------------------------------------------------------------------------------
@pytest.mark.parametrize("precision,backend,comm,wire", [
    ("bfloat16", "shm", {}, "bfloat16"),
    ("bfloat16", "ring", {}, "bfloat16"),
    ("bfloat16", "mpi", {}, "float32"),          # mpi sums float32 only
    ("bfloat16", "gloo", {}, "bfloat16"),        # all-to-all of bf16 slices, summed in fp32
    ("bfloat16", "ccl", {}, "float32"),          # carries bf16 but sums in bf16: asked only
    ("float32", "shm", {}, "float32"),
    ("bfloat16", "shm", {"wire_dtype": "float32"}, "float32"),   # explicit wins
    ("float32", "ring", {"wire_dtype": "bfloat16"}, "bfloat16"),
    ("bfloat16", "shm", {"shard_update": True}, "float32"),     # allgathers fp32 weights
    ("bfloat16", "shm", {"algorithm": "local_sgd", "local_steps": 4}, "float32"),  # weights
])
def test_the_wire_follows_the_compute_dtype_where_gradients_can_travel_in_bf16(
        precision, backend, comm, wire):
    config = config_from_dict(recipe(comm=comm))
    assert wire_dtype_for(config.comm, precision, backend) == wire


# -- hpcdl bench train ----------------------------------------------------------------------
def test_the_train_bench_defaults_to_the_recipes_auto_and_bf16_is_its_explicit_form():
    import argparse

    from hpcdl.bench import train as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args(["--synthetic"]).precision == "auto"
    assert parser.parse_args(["--synthetic", "--bf16"]).precision == "bfloat16"
    args = parser.parse_args(["--synthetic", "--precision", "float32"])
    config = bench.bench_config(args, ranks=1, precision="float32")
    assert config.train.precision == "float32" and config.comm.wire_dtype == "float32"
