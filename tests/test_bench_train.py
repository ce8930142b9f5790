"""`hpcdl bench train`: the record and ratio arithmetic, the synthetic loader's contract, and
one real `mpiexec -n 2` run of all three modes (ours, no_comm, ddp_gloo) on a tiny model whose
JSON the planner reads (`results` per mode, `ratios`). No timing assertions: values are checked
for presence, sign and internal consistency only.

Serial test that launches its own mpiexec (never nested inside an MPI-launched rank)."""
import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
from thread_state import wait_until_asleep  # tests/thread_state.py

from hpcdl.bench import train as bench

RECORD_KEYS = {"mode", "ranks", "batch_per_rank", "step_time_s", "images_per_s_per_rank",
               "compute_s", "comm_wait_s", "data_wait_s"}


def test_synthetic_images_follow_the_loader_contract():
    loader = bench.SyntheticImages(batch_size=3, image_size=8, num_classes=5, length=7)
    loader.set_epoch(0)
    batches = list(loader)
    assert len(loader) == 7 and len(batches) == 7
    images, labels = batches[0]
    assert images.dtype == torch.uint8 and images.shape == (3, 3, 8, 8)
    assert labels.dtype == torch.int64 and int(labels.max()) < 5
    assert loader.data_wait_s == 0.0


def test_endless_crosses_epoch_ends():
    loader = bench.SyntheticImages(batch_size=1, image_size=8, num_classes=2, length=2)
    stream = bench.endless(loader)
    assert len([next(stream) for _ in range(5)]) == 5


def test_mode_record_splits_the_step_and_averages_over_ranks():
    per_rank = [{"step": 2.0, "comm_wait": 0.2, "data_wait": 0.1, "step_median": 2.0},
                {"step": 4.0, "comm_wait": 0.4, "data_wait": 0.3, "step_median": 4.0}]
    record = bench.mode_record("ours", per_rank, batch=16, train_flops_per_image=1e9)
    assert record["step_time_s"] == pytest.approx(3.0)
    assert record["images_per_s_per_rank"] == pytest.approx(16 / 3.0)
    assert record["compute_s"] == pytest.approx(3.0 - 0.3 - 0.2)
    assert record["step_time_max_rank_s"] == 4.0
    assert record["train_gflops_per_s"] == pytest.approx(16 / 2.5)


def test_ddp_record_has_no_separable_comm_wait():
    per_rank = [{"step": 1.0, "comm_wait": None, "data_wait": 0.0, "step_median": 1.0}]
    record = bench.mode_record("ddp_gloo", per_rank, batch=8, train_flops_per_image=1e9)
    assert record["comm_wait_s"] is None
    assert record["compute_s"] == pytest.approx(1.0)


def test_ratios_compare_ours_with_ceiling_and_ddp():
    def rec(mode, images_per_s, comm_wait=0.0):
        return {"mode": mode, "images_per_s_per_rank": images_per_s, "step_time_s": 1.0,
                "comm_wait_s": comm_wait, "data_wait_s": 0.05, "train_gflops_per_s": 40.0}

    records = {"ours": rec("ours", 9.7, 0.02), "no_comm": rec("no_comm", 10.0),
               "ddp_gloo": rec("ddp_gloo", 8.0)}
    ratios = bench.ratios_of(records, matmul=50e9, train_flops_per_image=6e9)
    assert ratios["vs_no_comm"] == pytest.approx(0.97)
    assert ratios["vs_ddp_gloo"] == pytest.approx(9.7 / 8.0)
    assert ratios["flops_fraction_of_matmul"] == pytest.approx(0.8)
    assert ratios["comm_wait"] == pytest.approx(0.02)
    assert ratios["data_wait"] == pytest.approx(0.05)


def test_each_mode_gets_its_fraction_of_the_peak_and_its_ratio_to_plain_torch():
    def rec(mode, images_per_s, gflops):
        return {"mode": mode, "images_per_s_per_rank": images_per_s, "step_time_s": 1.0,
                "comm_wait_s": 0.0, "data_wait_s": 0.0, "train_gflops_per_s": gflops}

    records = {"no_comm": rec("no_comm", 12.0, 30.0), "torch": rec("torch", 10.0, 25.0)}
    for record, cpu_s in ((records["no_comm"], 2.0), (records["torch"], 4.0)):
        record.update(batch_per_rank=8, cpu_s_per_step=cpu_s)
    bench.compare_with_peak_and_torch(records, matmul=100e9, matmul_per_cpu_s=40e9,
                                      train_flops_per_image=5e9)
    # 8 images x 5 GFLOP in 2 CPU s = 20 GFLOP per CPU s, against the matmul's 40
    assert records["no_comm"]["cpu_flops_fraction_of_matmul"] == pytest.approx(0.5)
    assert records["torch"]["cpu_flops_fraction_of_matmul"] == pytest.approx(0.25)
    assert records["no_comm"]["flops_fraction_of_matmul"] == pytest.approx(0.30)
    assert records["torch"]["flops_fraction_of_matmul"] == pytest.approx(0.25)
    assert records["no_comm"]["vs_torch"] == pytest.approx(1.2)
    assert records["torch"]["vs_torch"] == 1.0
    ratios = bench.ratios_of(records, matmul=100e9, train_flops_per_image=1e9)
    assert ratios["no_comm_vs_torch"] == pytest.approx(1.2)
    assert ratios["flops_fraction_of_matmul"] == pytest.approx(0.30)   # of no_comm


def test_without_the_torch_mode_no_record_has_a_torch_ratio():
    records = {"no_comm": {"mode": "no_comm", "images_per_s_per_rank": 5.0,
                           "train_gflops_per_s": 10.0}}
    bench.compare_with_peak_and_torch(records, matmul=20e9)
    assert "vs_torch" not in records["no_comm"]
    assert "cpu_flops_fraction_of_matmul" not in records["no_comm"]   # no CPU rates given
    assert records["no_comm"]["flops_fraction_of_matmul"] == pytest.approx(0.5)


def test_modes_parse_and_no_comm_shorthand():
    args = argparse.Namespace(no_comm=False, modes="ours,ddp_gloo")
    assert bench.parse_modes(args) == ["ours", "ddp_gloo"]
    assert bench.parse_modes(argparse.Namespace(no_comm=True, modes="ours")) == ["no_comm"]
    assert bench.parse_modes(argparse.Namespace(no_comm=False, modes="no_comm,torch")) == [
        "no_comm", "torch"]
    with pytest.raises(SystemExit, match="byteps"):
        bench.parse_modes(argparse.Namespace(no_comm=False, modes="ours,byteps"))


def test_every_mode_falls_back_to_contiguous_on_one_thread():
    from hpcdl.cpus import memory_format_name

    assert memory_format_name(channels_last=True, threads=1) == "contiguous"
    assert memory_format_name(channels_last=True, threads=2) == "channels_last"
    assert memory_format_name(channels_last=False, threads=4) == "contiguous"
    assert memory_format_name("auto", threads=1, precision="bfloat16") == "contiguous"


def test_auto_layout_is_channels_last_for_bf16_only():
    from hpcdl.cpus import memory_format_name

    assert memory_format_name("auto", threads=2, precision="bfloat16") == "channels_last"
    assert memory_format_name("auto", threads=8, precision="float32") == "contiguous"
    assert memory_format_name(True, threads=2, precision="float32") == "channels_last"
    assert memory_format_name(False, threads=2, precision="bfloat16") == "contiguous"


def test_the_bench_layout_flag_is_the_recipe_key():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    for flag, key in (("auto", "auto"), ("channels_last", True), ("contiguous", False)):
        args = parser.parse_args(["--synthetic", "--memory-format", flag])
        assert bench.bench_config(args, ranks=1).train.channels_last == key
    assert parser.parse_args(["--synthetic"]).memory_format == "auto"


def test_the_baselines_plain_step_is_one_scheduled_sgd_step_of_cross_entropy():
    """DDP's and Horovod's modes share this step: the scheduled lr, then one step of the
    cross-entropy gradient on the normalised batch, computed here by hand."""
    from hpcdl.bench.baselines import plain_step
    from hpcdl.data import normalize

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 5))
    reference = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 5))
    reference.load_state_dict(model.state_dict())
    images = torch.randint(0, 256, (6, 3, 4, 4), dtype=torch.uint8)
    labels = torch.randint(0, 5, (6,))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    step = plain_step(model, optimizer, schedule=lambda s: 0.5 / (s + 1), bf16=False,
                      memory_format=torch.contiguous_format)
    assert step((images, labels)) is None and optimizer.param_groups[0]["lr"] == 0.5
    torch.nn.functional.cross_entropy(reference(normalize(images)), labels).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p, q.detach() - 0.5 * q.grad)
    step((images, labels))
    assert optimizer.param_groups[0]["lr"] == 0.25


def test_modes_take_turns_in_rotated_order_after_their_warmup():
    from mpi4py import MPI

    calls = []

    def stepper(mode):
        def step(batch):
            calls.append(mode)
            return 0.0 if mode == "ours" else None
        return step

    loader = bench.SyntheticImages(batch_size=1, image_size=8, num_classes=2, length=3)
    steppers = {m: stepper(m) for m in ("ours", "no_comm", "ddp_gloo")}
    samples = bench.time_rounds(MPI.COMM_SELF, steppers, loader, steps=5, warmup=1, rounds=3)
    assert calls[:3] == ["ours", "no_comm", "ddp_gloo"]            # warm-up, untimed
    # shares 2, 2, 1; round r starts at mode r
    assert calls[3:] == (["ours"] * 2 + ["no_comm"] * 2 + ["ddp_gloo"] * 2
                         + ["no_comm"] * 2 + ["ddp_gloo"] * 2 + ["ours"] * 2
                         + ["ddp_gloo", "ours", "no_comm"])
    assert {m: len(s) for m, s in samples.items()} == {"ours": 5, "no_comm": 5, "ddp_gloo": 5}
    assert samples["ours"][0]["comm_wait"] == 0.0 and samples["ddp_gloo"][0]["comm_wait"] is None


def test_rounds_default_to_at_most_the_steps_and_never_exceed_them():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--synthetic", "--steps", "2"])
    bench.check_args(args)
    assert args.rounds == 2
    with pytest.raises(SystemExit, match="--rounds 3"):
        bench.check_args(parser.parse_args(["--synthetic", "--steps", "2", "--rounds", "3"]))


def test_kernels_fall_into_categories():
    assert bench.kernel_category("aten::convolution_backward") == "convolution"
    assert bench.kernel_category("aten::mkldnn_convolution") == "convolution"
    assert bench.kernel_category("aten::addmm") == "matmul"
    assert bench.kernel_category("aten::native_batch_norm_backward") == "batch_norm"
    assert bench.kernel_category("aten::threshold_backward") == "elementwise"
    assert bench.kernel_category("aten::max_pool2d_with_indices") == "pooling"
    assert bench.kernel_category("aten::empty") == "other"


def test_matmul_reference_is_a_positive_rate():
    assert bench.matmul_rates(64, seconds=0.01)[0] > 0


def run_bench_train(out, *flags):
    """``mpiexec -n 2 hpcdl bench train`` on a tiny synthetic model with ``flags``; returns
    the process (asserted successful) and the bench JSON it wrote to ``out``."""
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "hpcdl.cli.main", "bench", "train",
           "--model", "resnet_small", "--num-classes", "10", "--image-size", "16",
           "--synthetic", "--batch", "4", "--warmup", "1", "--matmul-size", "128",
           "--bucket-mb", "0.01", "--json", str(out), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIEXEC_TIMEOUT": "240"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
def test_two_ranks_measure_every_mode_into_the_bench_json(tmp_path):
    proc, report = run_bench_train(tmp_path / "train.json", "--steps", "2")
    assert report["bench"] == "train" and report["machine"]["ranks"] == 2
    by_mode = {r["mode"]: r for r in report["results"]}
    assert set(by_mode) == {"ours", "no_comm", "ddp_gloo"}
    # --backend auto: the trial's choice is printed, ours runs on it, the JSON keeps it;
    # --bucket-mb given: every candidate was timed at that size
    trial = report["comm_trial"]
    assert trial["decided_by"] == "trial"
    assert by_mode["ours"]["backend"] == trial["chosen"]["backend"]
    assert {c["bucket_mb"] for c in trial["candidates"]} == {0.01}
    assert {r["bucket_mb"] for r in report["results"]} == {0.01}  # DDP's bucket_cap_mb too
    assert f"bench train: comm: {trial['chosen']['backend']}" in proc.stderr
    for record in by_mode.values():
        assert RECORD_KEYS <= set(record)
        assert record["ranks"] == 2 and record["batch_per_rank"] == 4
        assert record["images_per_s_per_rank"] > 0
    assert by_mode["no_comm"]["comm_wait_s"] == 0.0
    assert by_mode["ours"]["comm_wait_s"] >= 0.0
    ratios = report["ratios"]
    for key in ("images_per_s_per_rank", "vs_no_comm", "vs_ddp_gloo",
                "flops_fraction_of_matmul", "comm_wait", "data_wait"):
        assert ratios[key] >= 0, key
    breakdown = report["compute_breakdown"]
    assert breakdown["mode"] == "no_comm"
    shares = [v for k, v in breakdown.items() if k.endswith("_share")]
    assert sum(shares) == pytest.approx(1.0) and breakdown["convolution_share"] > 0
    assert ratios["dense_kernels_fraction_of_matmul"] > 0
    assert ratios["vs_no_comm"] == pytest.approx(
        by_mode["ours"]["images_per_s_per_rank"] / by_mode["no_comm"]["images_per_s_per_rank"])


def test_matmul_rates_are_per_wall_and_per_cpu_second():
    wall, cpu = bench.matmul_rates(64, seconds=0.01)
    assert wall > 0 and cpu > 0


def test_matmul_reference_runs_in_bf16_for_a_bf16_step():
    assert bench.matmul_rates(64, seconds=0.01, dtype="bfloat16")[0] > 0


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
def test_bf16_mode_measures_every_mode_in_bf16_or_says_why_not(tmp_path):
    from hpcdl.cpus import bf16_native

    proc, report = run_bench_train(tmp_path / "train_bf16.json", "--steps", "1", "--bf16",
                                   "--no-breakdown")
    assert report["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert report["machine"]["bf16_native"] is bf16_native()
    if bf16_native():
        assert {r["precision"] for r in report["results"]} == {"bfloat16"}
        assert {r["mode"] for r in report["results"]} == {"ours", "no_comm", "ddp_gloo"}
    else:  # one clear line, naming the CPU, and a JSON that says it was skipped
        assert report["results"] == [] and "no native bf16" in report["skipped"]
        assert "skipped" in proc.stdout and report["machine"]["cpu"] in proc.stdout


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
def test_the_torch_mode_is_timed_beside_no_comm_with_its_ratios(tmp_path):
    _, report = run_bench_train(tmp_path / "train.json", "--steps", "2", "--modes",
                                "no_comm,torch", "--precision", "float32", "--no-breakdown")
    by_mode = {r["mode"]: r for r in report["results"]}
    assert set(by_mode) == {"no_comm", "torch"}
    matmul = report["ratios"]["matmul_gflops_per_s_per_rank"]
    for record in by_mode.values():
        assert record["precision"] == "float32" and record["memory_format"] == "contiguous"
        assert record["images_per_s_per_rank"] > 0
        assert record["flops_fraction_of_matmul"] == pytest.approx(
            record["train_gflops_per_s"] / matmul)
        assert record["cpu_flops_fraction_of_matmul"] > 0
    assert by_mode["torch"]["vs_torch"] == 1.0
    assert by_mode["torch"]["comm_wait_s"] is None
    assert report["ratios"]["no_comm_vs_torch"] == by_mode["no_comm"]["vs_torch"] == \
        pytest.approx(by_mode["no_comm"]["images_per_s_per_rank"]
                      / by_mode["torch"]["images_per_s_per_rank"])


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
def test_ddp_with_its_fp16_hook_is_the_16_bit_baseline(tmp_path):
    _, report = run_bench_train(tmp_path / "train.json", "--steps", "2", "--modes",
                                "ddp_gloo,ddp_gloo_fp16,ours_bf16", "--precision", "float32",
                                "--no-breakdown")
    by_mode = {r["mode"]: r for r in report["results"]}
    assert by_mode["ddp_gloo_fp16"]["wire_dtype"] == "float16"
    assert by_mode["ddp_gloo_fp16"]["backend"] == "gloo"
    assert by_mode["ours_bf16"]["wire_dtype"] == "bfloat16"
    assert by_mode["ddp_gloo"]["wire_dtype"] == "float32"
    assert by_mode["ours_bf16"]["overlap_update"] is True   # the default
    assert by_mode["ddp_gloo"]["overlap_update"] is False
    ratios = report["ratios"]
    assert ratios["bf16_wire_vs_ddp_gloo_fp16"] == pytest.approx(
        by_mode["ours_bf16"]["images_per_s_per_rank"]
        / by_mode["ddp_gloo_fp16"]["images_per_s_per_rank"])
    assert ratios["ddp_fp16_wire_vs_ddp_gloo"] > 0


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
def test_shard_update_flag_shards_ours_and_leaves_the_ceiling_whole(tmp_path):
    _, report = run_bench_train(tmp_path / "train.json", "--steps", "2", "--modes",
                                "ours,no_comm,ours_allreduce", "--shard-update",
                                "--no-breakdown")
    by_mode = {r["mode"]: r for r in report["results"]}
    assert by_mode["ours"]["shard_update"] is True
    assert by_mode["no_comm"]["shard_update"] is False
    assert by_mode["ours_allreduce"]["shard_update"] is False
    assert not any(r["overlap_update"] for r in report["results"])  # a sharded optimizer
    ratios = report["ratios"]
    assert ratios["sharded_vs_allreduce"] == pytest.approx(
        by_mode["ours"]["images_per_s_per_rank"]
        / by_mode["ours_allreduce"]["images_per_s_per_rank"])
    assert ratios["allreduce_vs_no_comm"] > 0


def test_ours_allreduce_mode_needs_shard_update():
    with pytest.raises(SystemExit, match="--shard-update"):
        bench.parse_modes(argparse.Namespace(no_comm=False, modes="ours,ours_allreduce",
                                             shard_update=False))
    assert bench.parse_modes(argparse.Namespace(no_comm=False, modes=None,
                                                shard_update=True))[-1] == "ours_allreduce"


def test_own_backend_modes_parse_and_refuse_sharding():
    args = argparse.Namespace(no_comm=False, modes="no_comm,ours,ours@gloo,ours_bf16",
                              shard_update=False)
    assert bench.parse_modes(args) == ["no_comm", "ours", "ours@gloo", "ours_bf16"]
    assert bench.own_backend("ours@gloo") == "gloo" and bench.own_backend("ours") is None
    with pytest.raises(SystemExit, match="--shard-update"):
        bench.parse_modes(argparse.Namespace(no_comm=False, modes="ours,ours@ring",
                                             shard_update=True))


def test_step_costs_are_per_step_means_over_ranks_and_shares_of_the_step():
    per_rank = [{"step": 2.0, "comm_wait": 0.1, "data_wait": 0.0, "step_median": 2.0,
                 "nic_tx_bytes": 100.0, "nic_rx_bytes": 90.0, "cpu_s": 1.0,
                 "comm_thread_cpu_s": 0.2},
                {"step": 2.0, "comm_wait": 0.1, "data_wait": 0.0, "step_median": 2.0,
                 "nic_tx_bytes": 300.0, "nic_rx_bytes": 110.0, "cpu_s": 3.0,
                 "comm_thread_cpu_s": 0.6}]
    record = bench.mode_record("ours", per_rank, batch=4, train_flops_per_image=1e9)
    assert record["nic_tx_bytes_per_step"] == 200.0 and record["nic_rx_bytes_per_step"] == 100.0
    assert record["cpu_share_of_step"] == pytest.approx(2.0 / 2.0)
    assert record["comm_thread_cpu_share"] == pytest.approx(0.4 / 2.0)


def test_counters_of_a_step_are_differences_and_none_without_a_nic():
    read = bench.step_counters("no-such-nic0")
    before = read()
    sum(i * i for i in range(200_000))   # some CPU time
    deltas = bench.counter_deltas(before, read())
    assert deltas["nic_tx_bytes"] is None and deltas["nic_rx_bytes"] is None
    assert deltas["cpu_s"] >= 0 and deltas["comm_thread_cpu_s"] == 0
    assert bench.thread_cpu_s([threading.get_native_id()]) > 0


def test_comm_thread_cpu_counts_every_thread_started_after_the_compute_ones_but_the_loaders():
    """DDP's gloo threads and hpcdl's reducer are counted alike: every thread that was not
    there when the compute threads were taken, except the loader's decode threads."""
    from hpcdl.data.loader import LOADER_THREAD_NAME

    if not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"):
        pytest.skip("this kernel has no /proc/TID/schedstat: thread CPU only in 10-ms ticks")
    compute = bench.compute_thread_ids(1)
    assert threading.get_native_id() in compute
    read = bench.step_counters(None, compute)
    burnt: dict[str, float] = {}
    go, stop = threading.Event(), threading.Event()

    def burn(name: str) -> None:
        go.wait()
        started = time.thread_time()
        sum(i * i for i in range(100_000))
        burnt[name] = time.thread_time() - started
        stop.wait()

    workers = [threading.Thread(target=burn, args=(name,), name=name)
               for name in ("transport", f"{LOADER_THREAD_NAME}_0")]
    for worker in workers:
        worker.start()
    before = read()
    go.set()
    while len(burnt) < 2:
        time.sleep(0.001)
    wait_until_asleep(*(w.native_id for w in workers))  # in stop.wait(): clocks stopped
    counted = bench.counter_deltas(before, read())["comm_thread_cpu_s"]
    ids = bench.comm_thread_ids(compute)
    stop.set()
    for worker in workers:
        worker.join()
    assert workers[0].native_id in ids and workers[1].native_id not in ids
    assert threading.get_native_id() not in ids
    # the transport's thread burnt its loop after ``before`` (it waited for ``go``)
    assert counted >= burnt["transport"]


def test_a_step_shorter_than_a_clock_tick_still_costs_cpu_seconds():
    # a small model's step takes a few ms: the process clock must not round it to nothing
    # (os.times() counts 10-ms ticks), or the per-CPU-second FLOP fraction goes missing
    read = bench.step_counters(None)
    before = read()
    started = time.process_time()
    while time.process_time() - started < 0.001:
        pass
    assert bench.counter_deltas(before, read())["cpu_s"] >= 0.001


def test_no_overlap_update_makes_ours_step_once_as_ddp_does():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    default = parser.parse_args(["--synthetic"])
    off = parser.parse_args(["--synthetic", "--no-overlap-update"])
    assert bench.overlaps_update("ours", default) and bench.overlaps_update("ours@gloo", default)
    assert not bench.overlaps_update("ddp_gloo", default)
    assert not bench.overlaps_update("no_comm", default)
    assert not bench.overlaps_update("ours", off)
    assert bench.bench_config(off, 2).comm.overlap_update is False
    assert bench.bench_config(default, 2).comm.overlap_update is True
