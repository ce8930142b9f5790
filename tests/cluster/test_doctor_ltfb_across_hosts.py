"""`hpcdl doctor` and LTFB across the test cluster's hosts (MPICH, one rank per host)."""
from __future__ import annotations

import json
import re

from test_slurm_across_hosts import DEMO_RECIPE, shards  # noqa: F401  (the shards fixture)


def test_doctor_names_every_host_and_their_mpi_and_finds_they_reach_each_other(cluster):
    done = cluster.mpirun("mpich", cluster.hosts, 1, "hpcdl doctor --staging /tmp --json -")
    report = json.loads(done.stdout[done.stdout.index("{"):])
    ranks = report["ranks"]
    assert [r["host"] for r in ranks] == cluster.hosts
    assert [r["node_index"] for r in ranks] == [0, 1, 2]
    assert {r["num_nodes"] for r in ranks} == {3}
    assert ranks[0]["mpi_name"].startswith("MPICH")
    # One kernel clock under every namespace host: the probe must find them together.
    assert all(abs(r["clock_offset_s"]) < 0.5 for r in ranks)
    assert "unreachable" not in done.stderr


def test_ltfb_trainers_on_different_hosts_exchange_their_models_over_the_network(cluster,
                                                                                 shards):  # noqa: F811
    """Two trainers, one per host: every tournament swaps the models across eth0."""
    out = cluster.workdir("ltfb") / "run"
    rx0, tx0 = cluster.eth0_bytes("h2")
    done = cluster.mpirun("mpich", ["h1", "h2"], 1,
                          f"hpcdl train --recipe {DEMO_RECIPE} --data {shards} --out {out} "
                          "--algorithm ltfb --trainers 2 --tournament-interval 2 "
                          "--max-steps 6 --no-progress epochs=3 batch.global=12 "
                          "batch.per_rank=null train.log_every_steps=1 data.workers=0")
    rx1, tx1 = cluster.eth0_bytes("h2")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "ltfb" and summary["steps"] == 6, done.stdout[-2000:]
    rounds = summary["rounds"]
    assert [r["round"] for r in rounds] == [1, 1, 2, 2, 3, 3]
    params = summary.get("params") or 0
    # Each tournament sends h2's model to h1 and back: at least one model's bytes per round.
    assert tx1 - tx0 > 0 and rx1 - rx0 > 0
    if params:
        assert tx1 - tx0 >= 3 * 4 * params
    logs = sorted(p.name for p in (out / "logs").glob("rank-*.log"))
    assert logs == ["rank-0000.log", "rank-0001.log"]
    assert re.search(r"\bh2\b", (out / "logs" / "rank-0001.log").read_text())


def test_demo_without_a_shared_out_stops_naming_the_host_that_cannot_see_it(cluster):
    done = cluster.mpirun("mpich", ["h1", "h2"], 1, "hpcdl demo --max-steps 2", check=False,
                          timeout=300)
    text = done.stdout + done.stderr
    assert done.returncode == 2, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("hpcdl demo:")]
    assert len(lines) == 1 and "on h2" in lines[0] and "--out" in lines[0], text[-3000:]
    assert [f for f in cluster.listing("h1", "/tmp") if f.startswith("hpcdl-demo-")] == []


def test_demo_trains_across_hosts_with_out_on_the_shared_file_system(cluster):
    out = cluster.workdir("demo") / "run"
    done = cluster.mpirun("mpich", ["h1", "h2"], 1,
                          f"hpcdl demo --out {out} --max-steps 4 --no-progress", check=False,
                          timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert (summary["ranks"], summary["steps"]) == (2, 4)
    assert "[rank 1/2 h2]" in (out / "logs" / "rank-0001.log").read_text()
