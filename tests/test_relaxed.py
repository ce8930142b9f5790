"""Relaxed consistency off MPI: the recipe keys, PowerSGD's byte arithmetic, and the planner's
local-SGD and compression terms (hpcdl/comm/policy.py, hpcdl/comm/powersgd.py,
hpcdl/plan/model.py). The collectives themselves are tested in tests/mpi/test_consistency.py."""
import pytest
from plan_fixtures import parameter_elements

from hpcdl.errors import BadInputError
from hpcdl.plan.machine import load_machine
from hpcdl.plan.model import Placement, PlanInputs, allreduce_s, gradient_buckets, plan
from hpcdl.plan.workload import Workload
from hpcdl.train.config import CONSISTENCY_ALGORITHMS, RecipeError, config_from_dict

RESNET50 = Workload("resnet50", 224, 4_089_184_256, 25_557_032, "test",
                    parameter_elements=parameter_elements("resnet50"))

pytestmark = pytest.mark.usefixtures("isolated_plan_dirs")


def recipe(**comm):
    return {"name": "r", "model": {"name": "resnet_small"}, "batch": {"global": 8},
            "epochs": 1, "optimizer": {"name": "lars"}, "schedule": {"name": "poly"},
            "comm": comm}


def test_recipe_keys_of_each_algorithm_are_read():
    comm = config_from_dict(recipe(algorithm="local_sgd", local_steps=8,
                                   sync_warmup_steps=100, powersgd_rank=2)).comm
    assert (comm.algorithm, comm.local_steps, comm.sync_warmup_steps, comm.powersgd_rank) == \
        ("local_sgd", 8, 100, 2)
    assert config_from_dict(recipe()).comm.algorithm == "sync"  # today's behaviour by default


@pytest.mark.parametrize("bad, message", [
    ({"algorithm": "gossip"}, "comm.algorithm='gossip': choose one of sync"),
    ({"local_steps": 0}, "comm.local_steps=0"),
    ({"powersgd_rank": 0}, "comm.powersgd_rank=0"),
    ({"sync_warmup_steps": -1}, "comm.sync_warmup_steps=-1"),
])
def test_bad_consistency_keys_are_named(bad, message):
    with pytest.raises(RecipeError, match=message.replace("(", r"\(")):
        config_from_dict(recipe(**bad))


def test_recipe_algorithms_are_the_policies():
    from hpcdl.comm.policy import ALGORITHMS

    assert CONSISTENCY_ALGORITHMS == ALGORITHMS


def test_powersgd_bytes_follow_the_papers_reshape():
    from hpcdl.comm.powersgd import compressed_bytes, compresses, matrix_shape

    assert matrix_shape((64, 32, 3, 3)) == (64, 288)
    # conv: r(n+m) floats; bias: dense; a 2x2 matrix gains nothing at rank 4: dense
    assert compressed_bytes([(64, 32, 3, 3), (64,), (2, 2)], 4) == 4 * (4 * (64 + 288) + 64 + 4)
    assert not compresses((2, 2), 4) and not compresses((64,), 1)


def test_local_sgd_replaces_the_gradient_allreduce_by_a_model_average_every_h():
    skx = load_machine("skx")
    inputs = PlanInputs(32768, 2048, 2, synthetic_data=True)
    sync = plan(skx, RESNET50, inputs)
    local = plan(skx, RESNET50, PlanInputs(32768, 2048, 2, synthetic_data=True, local_steps=8))
    average = sum(allreduce_s("ring", skx, Placement(2048, 2), n)
                  for n in gradient_buckets(RESNET50, 4.0, 25))
    assert local.comm_s == pytest.approx(average / 8)
    assert local.comm_exposed_s == pytest.approx(average / 8)  # after the step: not hidden
    assert local.comm_s < sync.comm_s / 4  # (hidden or not: ResNet-50 hides most of it)
    assert local.compute_s == sync.compute_s


def test_hierarchical_local_sgd_adds_one_nodes_gradient_allreduce():
    skx = load_machine("skx")
    flat = plan(skx, RESNET50, PlanInputs(32768, 2048, 2, local_steps=8))
    hier = plan(skx, RESNET50, PlanInputs(32768, 2048, 2, local_steps=8,
                                          hierarchical_local=True))
    node = sum(allreduce_s("ring", skx, Placement(2, 2), n)
               for n in gradient_buckets(RESNET50, 4.0, 25))
    assert hier.comm_s == pytest.approx(flat.comm_s + node)


def test_compression_divides_the_gradient_bytes_and_is_not_overlapped():
    skx = load_machine("skx")
    dense = plan(skx, RESNET50, PlanInputs(32768, 2048, 2))
    packed = plan(skx, RESNET50, PlanInputs(32768, 2048, 2, compression_ratio=10))
    assert packed.gradient_bytes == pytest.approx(dense.gradient_bytes / 10)
    assert packed.comm_exposed_s == pytest.approx(packed.comm_s)


@pytest.mark.parametrize("bad, message", [
    ({"local_steps": 0}, "--local-steps must be >= 1"),
    ({"compression_ratio": 0.5}, "--compression-ratio must be >= 1"),
    ({"hierarchical_local": True}, "needs --local-steps H > 1"),
])
def test_bad_relaxed_plan_inputs_are_clear_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        plan(load_machine("skx"), RESNET50, PlanInputs(32768, 2048, 2, **bad))


# -- hpcdl bench relaxed: recipes and the report's arithmetic ---------------------------------
def bench_args(**kw):
    import argparse

    from hpcdl.bench import relaxed

    parser = argparse.ArgumentParser()
    relaxed.add_arguments(parser)
    return parser.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_bench_runs_differ_only_in_their_consistency_keys():
    from hpcdl.bench.relaxed import recipe

    args = bench_args(local_steps=4)
    sync, local = recipe(args, "sync", 4, 100), recipe(args, "local_sgd", 4, 100)
    assert sync["comm"] == {"backend": "mpi", "bucket_mb": 1}
    assert local["comm"]["algorithm"] == "local_sgd" and local["comm"]["local_steps"] == 4
    assert local["comm"]["sync_warmup_steps"] == 25  # 0.25 of 100 steps per epoch
    assert {k: v for k, v in local.items() if k not in ("comm", "name")} == \
        {k: v for k, v in sync.items() if k not in ("comm", "name")}
    config_from_dict(local)  # a valid recipe


def test_bench_report_compares_bytes_per_step_and_top1_with_sync():
    from hpcdl.bench.relaxed import finish

    records = [{"run": "sync", "top1": 0.90, "steps": 10, "bytes_per_rank": 8000},
               {"run": "local_sgd", "top1": 0.897, "steps": 10, "bytes_per_rank": 1000},
               {"run": "powersgd", "top1": 0.88, "steps": 10, "bytes_per_rank": 1000}]
    ratios = finish(records, bench_args())
    assert ratios["local_sgd_bytes_reduction"] == pytest.approx(8.0)
    assert ratios["local_sgd_top1_minus_sync"] == pytest.approx(-0.3)
    assert ratios["local_sgd_goal_met"] and not ratios["powersgd_goal_met"]  # -2 points
    # the planner predicts each method at 2,048 sockets: local SGD saves AlexNet-BN time
    assert records[1]["plan_alexnet_bn_min"] < records[0]["plan_alexnet_bn_min"]


# -- hpcdl plan: the recipe's comm keys, the synchronous warm-up, the compressor's passes ------
def plan_args(*argv):
    import argparse

    from hpcdl.cli import plan as plan_cli

    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def write_recipe(tmp_path, **comm):
    import yaml

    path = tmp_path / "relaxed.yaml"
    doc = {**recipe(**comm), "model": {"name": "resnet50"}, "batch": {"global": 32768}}
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_plan_reads_the_recipes_comm_keys_as_the_flags_do(tmp_path):
    from hpcdl.plan.predict import resolve
    from hpcdl.plan.workload import powersgd_compression_ratio

    local = write_recipe(tmp_path, algorithm="hierarchical_local_sgd", local_steps=8,
                         sync_warmup_steps=100)
    values = resolve(plan_args("--recipe", local))
    assert (values["local_steps"], values["hierarchical_local"], values["sync_warmup_steps"],
            values["compression_ratio"]) == (8, True, 100, 1.0)
    # the same run from flags alone
    flags = resolve(plan_args("--model", "resnet50", "--local-steps", "8", "--hierarchical-local",
                              "--sync-warmup-steps", "100"))
    assert {k: flags[k] for k in ("local_steps", "hierarchical_local", "sync_warmup_steps")} == \
        {k: values[k] for k in ("local_steps", "hierarchical_local", "sync_warmup_steps")}
    # PowerSGD: the ratio from the recipe's rank and the model's shapes; flags override
    compressed = write_recipe(tmp_path, algorithm="powersgd", powersgd_rank=2,
                              sync_warmup_steps=50)
    values = resolve(plan_args("--recipe", compressed))
    assert values["compression_ratio"] == pytest.approx(powersgd_compression_ratio("resnet50", 2))
    assert values["compression_ratio"] > 50 and values["local_steps"] == 1
    assert resolve(plan_args("--recipe", compressed, "--powersgd-rank", "4"))[
        "compression_ratio"] == pytest.approx(powersgd_compression_ratio("resnet50", 4))
    overridden = resolve(plan_args("--recipe", compressed, "--compression-ratio", "10",
                                   "--sync-warmup-steps", "0"))
    assert (overridden["compression_ratio"], overridden["sync_warmup_steps"]) == (10.0, 0)
    # a synchronous recipe sets none of it, whatever H it carries
    sync = resolve(plan_args("--recipe", write_recipe(tmp_path, local_steps=8)))
    assert (sync["local_steps"], sync["compression_ratio"], sync["sync_warmup_steps"]) == \
        (1, 1.0, 0)


def test_plan_names_a_bad_comm_key_of_the_recipe(tmp_path):
    from hpcdl.plan.predict import resolve

    path = write_recipe(tmp_path, algorithm="local_sgd", local_steps=0)
    with pytest.raises(BadInputError, match=r"relaxed.yaml: comm.local_steps=0"):
        resolve(plan_args("--recipe", path))


@pytest.mark.parametrize("relaxed", [{"local_steps": 8}, {"compression_ratio": 100.0}])
def test_the_synchronous_warm_up_is_costed_as_synchronous_steps(relaxed):
    skx = load_machine("skx")
    base = PlanInputs(32768, 2048, 2, epochs=2, synthetic_data=True)
    sync = plan(skx, RESNET50, base)
    fast = plan(skx, RESNET50, PlanInputs(32768, 2048, 2, epochs=2, synthetic_data=True,
                                          **relaxed))
    steps = 2 * fast.iterations_per_epoch
    warm = plan(skx, RESNET50, PlanInputs(32768, 2048, 2, epochs=2, synthetic_data=True,
                                          sync_warmup_steps=10, **relaxed))
    assert warm.iteration_s == fast.iteration_s  # the relaxed phase's breakdown
    assert warm.total_s == pytest.approx(10 * sync.iteration_s + (steps - 10) * fast.iteration_s)
    assert warm.warmup_s == pytest.approx(10 * sync.iteration_s)
    # a warm-up longer than the run: every step synchronous
    whole = plan(skx, RESNET50, PlanInputs(32768, 2048, 2, epochs=2, synthetic_data=True,
                                           sync_warmup_steps=10 ** 6, **relaxed))
    assert whole.total_s == pytest.approx(sync.total_s)
    # a synchronous run has no warm-up to cost
    assert plan(skx, RESNET50, PlanInputs(32768, 2048, 2, epochs=2, synthetic_data=True,
                                          sync_warmup_steps=10)).total_s == sync.total_s


def test_compression_costs_its_passes_over_the_gradient():
    from hpcdl.plan.model import (
        COMPRESSION_BYTES_PER_PARAMETER,
        OPTIMIZER_BYTES_PER_PARAMETER,
        optimizer_s,
    )

    skx = load_machine("skx")
    dense = plan(skx, RESNET50, PlanInputs(32768, 2048, 2))
    packed = plan(skx, RESNET50, PlanInputs(32768, 2048, 2, compression_ratio=10))
    assert dense.compression_s == 0
    # memory-bound like the LARS update: the same rank stream rate, its bytes per parameter
    assert packed.compression_s == pytest.approx(
        optimizer_s(skx, RESNET50, 2) * COMPRESSION_BYTES_PER_PARAMETER
        / OPTIMIZER_BYTES_PER_PARAMETER)
    assert packed.iteration_s == pytest.approx(packed.compute_s + packed.optimizer_s
                                               + packed.compression_s + packed.comm_exposed_s
                                               + packed.data_exposed_s)
