"""`hpcdl bench train` across two hosts: each mode's bytes per step are read from each host's
own eth0 counters (not computed from a formula), so they must show what the mode's algorithm
sends: the whole gradient (or more) out of each host for the fp32 allreduce modes, half of that
with bf16 on the wire, nothing for the no-communication ceiling. No timing assertions.
"""
from __future__ import annotations

import json

import pytest

BATCH, IMAGE, CLASSES = 4, 16, 10


def gradient_bytes() -> int:
    from hpcdl.models import create_model

    model = create_model("resnet_small", num_classes=CLASSES)
    return sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)


def test_each_mode_records_the_bytes_its_algorithm_puts_on_eth0(cluster):
    hosts = cluster.hosts[:2]
    out = cluster.workdir("bench-train") / "train.json"
    cluster.mpirun("mpich", hosts, 1, f"{cluster.python('mpich')} -m hpcdl.cli.main bench "
                   f"train --model resnet_small --num-classes {CLASSES} --image-size {IMAGE} "
                   f"--synthetic --batch {BATCH} --steps 2 --warmup 1 --no-breakdown "
                   f"--matmul-size 64 --bucket-mb 0.05 "
                   f"--modes no_comm,ours,ours@gloo,ours_bf16,ddp_gloo --json {out}")
    report = json.loads(out.read_text())
    machine = report["machine"]
    assert machine["hosts"] == hosts and machine["ranks_per_host"] == {h: 1 for h in hosts}
    assert set(machine["link_shaping"]) == set(hosts)
    by_mode = {r["mode"]: r for r in report["results"]}
    n = gradient_bytes()
    # MPI_Allreduce / gloo / the ring between 2 hosts: each host sends at least the buffer
    # (reduce-scatter + allgather halves, or the whole buffer once).
    for mode in ("ours", "ours@gloo", "ddp_gloo"):
        assert by_mode[mode]["nic_tx_bytes_per_step"] >= n, mode
        assert by_mode[mode]["nic_rx_bytes_per_step"] >= n, mode
    assert by_mode["ours@gloo"]["backend"] == "gloo"
    assert by_mode["ours_bf16"]["wire_dtype"] == "bfloat16"
    assert by_mode["ours_bf16"]["backend"] == "ring"
    # bf16: 2 bytes a value on the wire; the ring sends 2(P-1)/P of the buffer = n/2 here.
    assert n / 2 <= by_mode["ours_bf16"]["nic_tx_bytes_per_step"] <= 0.6 * n
    assert by_mode["no_comm"]["nic_tx_bytes_per_step"] < 0.01 * n
    for record in by_mode.values():
        assert record["cpu_s_per_step"] > 0
    assert by_mode["ours"]["comm_thread_cpu_s_per_step"] >= 0
    assert by_mode["no_comm"]["comm_thread_cpu_s_per_step"] == pytest.approx(0, abs=0.02)
