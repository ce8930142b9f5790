"""Relaxed consistency off MPI: the recipe keys, PowerSGD's byte arithmetic, and the planner's
local-SGD and compression terms (hpcdl/comm/policy.py, hpcdl/comm/powersgd.py,
hpcdl/plan/model.py). The collectives themselves are tested in tests/mpi/test_consistency.py."""
import pytest

from hpcdl.plan.machine import load_machine
from hpcdl.plan.model import Placement, PlanInputs, allreduce_s, bucket_sizes, plan
from hpcdl.plan.workload import Workload
from hpcdl.train.config import CONSISTENCY_ALGORITHMS, RecipeError, config_from_dict

RESNET50 = Workload("resnet50", 224, 4_089_184_256, 25_557_032, "test")

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
                  for n in bucket_sizes(RESNET50.parameters * 4.0, 25e6))
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
               for n in bucket_sizes(RESNET50.parameters * 4.0, 25e6))
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
