"""The pure parts of ``comm.backend: auto``'s start-up trial (hpcdl/comm/trial.py): what is
tried in which order, the layout it times (the reducer's own), how a layout is scored and
picked, the budget, and when the rule decides instead. The collective part:
tests/mpi/test_comm_trial.py."""
import pytest
import torch
from mpi4py import MPI

from hpcdl.buckets import (
    LAST_BUCKET_BYTES,
    MIB,
    TRIAL_BUCKET_MB,
    TRIAL_FIT_SHARE,
    TRIAL_SAMPLE_MB,
)
from hpcdl.comm.reducer import layout_buckets
from hpcdl.comm.trial import (
    TRIAL_MARGIN,
    TRIAL_ROUNDS,
    Layout,
    Measurement,
    bucket_numels,
    choose,
    fitted_sample_bytes,
    layout_score,
    round_cpu,
    rule_result,
    sampled_buckets,
    transport_cpu_per_step,
    trial_budget,
    trial_candidates,
    trial_layouts,
)
from hpcdl.train.config import CommConfig, RecipeError, config_from_dict
from hpcdl.train.session import job_seconds_left, open_communicator, recipe_gradients
from hpcdl.train.trainer import recipe_model


def test_the_rules_backend_is_tried_first_and_unavailable_ones_are_left_out_with_a_reason():
    names, excluded = trial_candidates(["mpi", "ring", "shm", "gloo", "ccl"], "shm",
                                       {"ccl": "no libccl.so.2", "gloo": "no gloo"})
    assert names == ["shm", "mpi", "ring"]
    assert excluded == {"gloo": "no gloo", "ccl": "no libccl.so.2"}


def test_every_candidate_is_timed_at_the_recipes_bucket_and_the_winner_at_the_others():
    first, others = trial_layouts(25.0, vary=True)
    assert first == Layout(25.0, LAST_BUCKET_BYTES / MIB)
    assert others == [mb for mb in TRIAL_BUCKET_MB if mb != 25.0]
    assert trial_layouts(8.0, vary=False) == (Layout(8.0, 1.0), [])


@pytest.mark.parametrize("layout", [Layout(0.004, 1.0), Layout(0.004, 0.0), Layout(0.05, 0.01)])
def test_the_trial_times_the_buckets_the_reducer_lays_out(layout):
    params = [(f"p{i}", torch.empty(n)) for i, n in enumerate([300, 7, 1200, 45, 2000, 9, 600])]
    reducer = layout_buckets(params[::-1], layout.bucket_bytes,
                             last_bucket_bytes=layout.last_bucket_bytes)
    timed = bucket_numels([p.numel() for _, p in params], 4, layout)
    assert timed == [b.numel for b in reducer]


def test_the_wire_dtype_sets_the_bytes_a_bucket_holds():
    numels = [MIB // 4] * 4                      # 1 MiB each in fp32
    assert bucket_numels(numels, 4, Layout(2.0, 0.0)) == [MIB // 2] * 2
    assert bucket_numels(numels, 2, Layout(2.0, 0.0)) == [MIB]  # bf16: all in one


def test_a_layout_scores_its_round_plus_its_exposed_last_bucket():
    assert layout_score([0.5, 0.25, 0.125]) == 0.5 + 0.25 + 0.125 + 0.125
    assert layout_score([]) == 0.0
    # a sampled round: the large buckets' time scaled to all of theirs, the last one whole
    assert layout_score([0.5, 0.25, 0.125], scale=4.0) == 4.0 * 0.75 + 2 * 0.125


def test_a_round_samples_the_large_buckets_and_keeps_the_first_layers_whole():
    mib = MIB // 4   # fp32 elements in a MiB
    # AlexNet-like: a 16 MiB bucket, a 150 MiB parameter alone, a 30 MiB rest, 1 MiB first
    buckets = [16 * mib, 150 * mib, 30 * mib, mib]
    timed, scale = sampled_buckets(buckets, 4, sample_bytes=24 * MIB)
    assert timed == [16 * mib, 8 * mib, mib]       # up to 24 MiB, the last cut short
    assert scale == pytest.approx(196 / 24)         # the large buckets' bytes over those timed
    # a model whose large buckets fit is timed whole, unscaled (the demo: every small model)
    assert sampled_buckets([mib, mib, mib], 4, sample_bytes=24 * MIB) == ([mib] * 3, 1.0)
    assert sampled_buckets([mib], 4) == ([mib], 1.0)  # one bucket: the first layers' alone
    assert sampled_buckets([], 4) == ([], 1.0)


def test_a_slow_link_shrinks_the_sample_so_every_candidate_fits_the_budget():
    full = int(TRIAL_SAMPLE_MB * MIB)
    fast = 1 / 250e6                         # 2 Gbit/s: the whole sample fits
    assert fitted_sample_bytes(fast, MIB, 3, TRIAL_ROUNDS, 3.0) == full
    slow = 1 / 31.25e6                       # 250 Mbit/s
    sample = fitted_sample_bytes(slow, MIB, 3, TRIAL_ROUNDS, 3.0)
    assert MIB < sample < full
    # three candidates of 1 + TRIAL_ROUNDS rounds of the sample and the first layers' bucket
    rounds_s = 3 * (1 + TRIAL_ROUNDS) * (sample + MIB) * slow
    assert rounds_s == pytest.approx(TRIAL_FIT_SHARE * 3.0, rel=1e-6)
    # fewer candidates, more bytes each; a trickle still reduces a MiB a round
    assert fitted_sample_bytes(slow, MIB, 1, TRIAL_ROUNDS, 3.0) > sample
    assert fitted_sample_bytes(1e-3, MIB, 3, TRIAL_ROUNDS, 3.0) == MIB
    assert fitted_sample_bytes(0.0, MIB, 3, TRIAL_ROUNDS, 3.0) == full


def test_the_fastest_wins_only_by_the_margin_so_equals_keep_the_earlier():
    rule, other, slower = (Measurement("shm", 25.0, 1.0, 3, 3, 0.2),
                           Measurement("ring", 25.0, 1.0, 3, 3, 0.2),
                           Measurement("mpi", 25.0, 1.0, 3, 3, 0.3))
    assert choose([rule, other, slower]) is rule
    assert choose([slower, Measurement("ring", 4.0, 1.0, 9, 3, 0.1)]).bucket_mb == 4.0
    just_inside = Measurement("ring", 25.0, 1.0, 3, 3, 0.2 * (1 - TRIAL_MARGIN) * 1.01)
    clearly = Measurement("gloo", 25.0, 1.0, 3, 3, 0.2 * (1 - TRIAL_MARGIN) * 0.99)
    assert choose([rule, just_inside]) is rule
    assert choose([rule, just_inside, clearly]) is clearly


def test_between_equals_a_transport_that_waits_in_the_kernel_replaces_one_that_polls():
    """Within the margin either way, gloo (its waits block in C++ threads) replaces mpi or
    ring (tests and sleeps on a Python thread beside backward); clearly slower, it does not;
    a polling transport needs the margin to replace gloo; shm is never replaced by a tie."""
    polls = Measurement("mpi", 25.0, 1.0, 3, 3, 0.200)
    tie = Measurement("gloo", 25.0, 1.0, 3, 3, 0.200 / (1 - TRIAL_MARGIN) * 0.99)
    slower = Measurement("gloo", 25.0, 1.0, 3, 3, 0.200 / (1 - TRIAL_MARGIN) * 1.01)
    assert choose([polls, tie]) is tie
    assert choose([polls, slower]) is polls
    ring = Measurement("ring", 25.0, 1.0, 3, 3, tie.seconds * (1 - TRIAL_MARGIN) * 1.01)
    assert choose([polls, tie, ring]) is tie
    shm = Measurement("shm", 25.0, 1.0, 3, 3, 0.200)
    assert choose([shm, Measurement("gloo", 25.0, 1.0, 3, 3, 0.199)]) is shm
    # a tie with the kept measurement is not enough when another was clearly faster than gloo
    near = Measurement("ring", 25.0, 1.0, 3, 3, 0.200 * 0.96)   # kept out by the margin
    late = Measurement("gloo", 25.0, 1.0, 3, 3, 0.200 * 1.04)   # ties mpi, 8% behind ring
    assert choose([polls, near, late]) is polls


def test_a_transports_cpu_is_scaled_bucket_by_bucket_and_averaged_over_rounds():
    """Each call's CPU (the reducing thread's plus the transport's own threads') is scaled as
    its bucket's time is: the large buckets' by the bytes the sample left out, the first
    layers' bucket, timed whole, once -- so its fixed cost is not multiplied by the sample's
    scale. Rounds are averaged; nothing measured counts nothing, and a clock read that went
    backwards counts zero, never a credit."""
    assert round_cpu([0.01, 0.02, 0.005], scale=10.0) == pytest.approx(0.3 + 0.005)
    assert round_cpu([0.005]) == pytest.approx(0.005)
    assert round_cpu([]) == 0.0
    assert transport_cpu_per_step([0.1, 0.2, 0.3, 0.2]) == pytest.approx(0.2)
    assert transport_cpu_per_step([]) == 0.0
    assert transport_cpu_per_step([-0.01] * 4) == 0.0


def test_the_budget_is_trial_s_and_at_most_one_percent_of_a_known_run():
    assert trial_budget(3.0) == 3.0
    assert trial_budget(3.0, run_s=100.0) == pytest.approx(1.0)
    assert trial_budget(3.0, run_s=10 * 3600.0) == 3.0


def test_a_slurm_jobs_projected_end_is_the_runs_known_length():
    import time

    left = job_seconds_left({"SLURM_JOB_END_TIME": str(int(time.time()) + 3600)})
    assert 3500 < left <= 3600
    assert job_seconds_left({}) is None
    assert job_seconds_left({"SLURM_JOB_END_TIME": "0"}) is None  # past: unknown
    assert job_seconds_left({"SLURM_JOB_END_TIME": "soon"}) is None


def test_the_rules_choice_records_why_the_trial_did_not_decide():
    result = rule_result("shm", 25.0, 3.0, "comm.trial_s: 0")
    record = result.record()
    assert record["chosen"] == {"backend": "shm", "bucket_mb": 25.0, "first_bucket_mb": 1.0}
    assert (record["decided_by"], record["fallback"], record["candidates"]) == (
        "rule", "comm.trial_s: 0", [])
    assert record["sample_mb"] is None  # nothing was sampled
    assert (result.layout.bucket_bytes, result.layout.last_bucket_bytes) == (
        25 * MIB, LAST_BUCKET_BYTES)
    assert "rule: comm.trial_s: 0" in result.line()


def test_a_negative_trial_budget_is_refused_by_its_key():
    with pytest.raises(RecipeError, match="comm.trial_s=-1"):
        CommConfig(trial_s=-1)


def test_one_rank_opens_the_rules_backend_without_a_trial():
    config = config_from_dict({
        "name": "tiny", "model": {"name": "resnet_small", "num_classes": 3, "width": 4,
                                  "layers": [1, 1, 1]},
        "batch": {"global": 2, "per_rank": 2}, "epochs": 1,
        "optimizer": {"name": "lars"}, "schedule": {"name": "poly", "base_lr": 0.1}})
    gradients = recipe_gradients(config)  # built on the meta device: nothing allocated
    assert gradients == [p.numel() for p in recipe_model(config).parameters()]
    with open_communicator(config.comm, MPI.COMM_WORLD, gradients=gradients) as comm:
        assert comm.backend == "mpi"
        assert comm.trial.fallback == "one rank: nothing to reduce"
