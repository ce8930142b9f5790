"""hpcdl plan --simulate: the planner's allreduce schedule on a fat tree in SimGrid.

The schedules and placements are checked without SimGrid; the simulations need its Python
module (Debian's python3-simgrid or PyPI's simgrid) and skip with a line saying so. The
tolerance of a simulated time against the α-β formula comes from SimGrid's configured
precision (hpcdl.plan.simulate.SURF_PRECISION_S per event, MAXMIN_PRECISION per shared rate).
"""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from hpcdl.plan.machine import load_machine
from hpcdl.plan.model import PlanInputs, plan, rabenseifner_allreduce_s, ring_allreduce_s
from hpcdl.plan.simulate import (
    MAXMIN_PRECISION,
    SURF_PRECISION_S,
    SimulationError,
    expand_nodelist,
    find_simgrid,
    hierarchical_phases,
    load_fabric,
    node_positions,
    rabenseifner_phases,
    ring_phases,
    simulate_patterns,
    simulate_plans,
)
from hpcdl.plan.workload import workload

needs_simgrid = pytest.mark.skipif(
    find_simgrid() is None,
    reason="SimGrid's Python module is not installed (apt-get install python3-simgrid, "
           "or pip install simgrid): the simulations are skipped")


def _sent_by(phases, node) -> float:
    """Bytes node ``node`` puts on the wire over a whole schedule (each phase × repeats)."""
    return sum(ph.repeats * sum(b for s, _, b in ph.messages if s == node) for ph in phases)


# --------------------------------------------------------------------------- placement
def test_slurm_node_list_expands_in_order_with_padding():
    assert expand_nodelist("c[001-004,010]") == ["c001", "c002", "c003", "c004", "c010"]
    assert expand_nodelist("a1,b[2-3]") == ["a1", "b2", "b3"]


def test_node_list_places_each_node_by_its_number_counted_from_one():
    assert node_positions("c[001-004,010]", 5, 64) == [0, 1, 2, 3, 9]


def test_node_list_beyond_the_fabric_is_rejected_naming_the_node():
    with pytest.raises(SimulationError, match="c100"):
        node_positions("c[099-100]", 2, 64)


def test_scattered_keeps_list_order_and_random_shuffles_the_same_nodes():
    scattered = node_positions("scattered", 20, 200, seed=3)
    shuffled = node_positions("random", 20, 200, seed=3)
    assert scattered == sorted(scattered) and len(set(scattered)) == 20
    assert sorted(shuffled) == scattered and shuffled != scattered
    assert node_positions("contiguous", 4, 200) == [0, 1, 2, 3]


# --------------------------------------------------------------------------- schedules
@pytest.mark.parametrize("p", [2, 5, 8])
def test_ring_schedule_sends_what_the_formula_counts(p):
    n, gamma = 1e6, 1e-10
    phases = ring_phases(list(range(p)), n, gamma)
    assert _sent_by(phases, 0) == pytest.approx(2 * (p - 1) / p * n, rel=1e-12)
    # β and γ terms at α = 0, β = 1: the formula's byte count and reduction count
    steps = sum(ph.repeats for ph in phases)
    assert steps == 2 * (p - 1)
    assert sum(ph.repeats * ph.reduce_s for ph in phases) == pytest.approx(
        ring_allreduce_s(p, n, 0, 0, gamma), rel=1e-12)


@pytest.mark.parametrize("p", [8, 12])
def test_rabenseifner_schedule_matches_the_formula_step_for_step(p):
    """With every message at α + bytes·β (no sharing) the schedule's time is the formula's:
    the step time is the largest message of the step."""
    n, alpha, beta, gamma = 1e6, 1e-6, 1e-10, 3e-10
    phases = rabenseifner_phases(list(range(p)), n, gamma)
    t = sum(ph.repeats * (alpha + max(b for *_, b in ph.messages) * beta + ph.reduce_s)
            for ph in phases)
    assert t == pytest.approx(rabenseifner_allreduce_s(p, n, alpha, beta, gamma), rel=1e-12)


def test_hierarchical_schedule_puts_n_per_node_on_the_wire_in_q_flows():
    n, q, nodes = 1.2e6, 2, 3
    phases = hierarchical_phases([10, 20, 30], q, n, 0.0)
    wire = [ph for ph in phases if any(s != d for s, d, _ in ph.messages)]
    per_node = sum(ph.repeats * sum(b for s, d, b in ph.messages if s == 10 and d != 10)
                   for ph in wire)
    assert per_node == pytest.approx(2 * (nodes - 1) / nodes * n, rel=1e-12)
    assert all(sum(1 for s, d, _ in ph.messages if s == 10 and d != 10) == q for ph in wire)


# --------------------------------------------------------------------------- the fabric
@pytest.mark.parametrize("name", ["skx", "knl"])
def test_paper_machines_state_their_fat_tree(name):
    fabric = load_fabric(load_machine(name))
    assert fabric.levels == 2 and fabric.nodes_per_leaf == 28 and fabric.leaf_uplinks == 20
    assert "28/20" in fabric.sources["leaf_uplinks"]


def test_unknown_fabric_figure_is_rejected_by_name():
    with pytest.raises(SimulationError, match="radix"):
        load_fabric(load_machine("skx"), {"radix": "48"})


def test_a_machine_without_fabric_is_one_switch_at_its_network_rate():
    machine = load_machine("local")
    fabric = load_fabric(machine)
    assert fabric.levels == 1 and fabric.node_link_Bps == machine["network.bandwidth_Bps"]


def test_relaxed_consistency_is_not_simulated():
    machine = load_machine("skx")
    inp = PlanInputs(global_batch=1024, procs=8, procs_per_node=1, local_steps=4)
    with pytest.raises(SimulationError, match="local SGD"):
        simulate_plans(machine, inp, [], load_fabric(machine))


def test_missing_simgrid_says_what_to_install(monkeypatch):
    import hpcdl.plan.simulate as simulate

    monkeypatch.setattr(simulate, "find_simgrid", lambda: None)
    with pytest.raises(SimulationError, match="python3-simgrid"):
        simulate.simulate_patterns(load_fabric(load_machine("skx")), 2, [])


# --------------------------------------------------------------------------- simulations
def _inputs(procs: int, ppn: int, algorithm: str) -> PlanInputs:
    # 16 MB of gradients (two tensors of 2 M fp32) in 8 MiB buckets: ~ms steps, so the
    # precision-derived tolerance below stays small.
    return PlanInputs(global_batch=procs * 4, procs=procs, procs_per_node=ppn,
                      allreduce=algorithm, bucket_mb=8.0, synthetic_data=True)


def _simulate(procs, ppn, algorithm, overrides, placement="contiguous", steps=2):
    machine = load_machine("skx")
    work = replace(workload("resnet50", 224), parameters=4_000_000,
                   parameter_elements=(2_000_000, 2_000_000))
    inp = _inputs(procs, ppn, algorithm)
    p = plan(machine, work, inp)
    fabric = replace(load_fabric(machine, overrides), switch_latency_s=0.0)
    return p, simulate_plans(machine, inp, [p], fabric, placement, simulated_steps=steps)


def _rtol(p, phases_steps: int) -> float:
    """Each simulated step's end is exact to SURF_PRECISION_S (twice: its start and end) and
    each shared rate to MAXMIN_PRECISION: relative to the shortest step, times the steps."""
    shortest = p.comm_s / phases_steps
    return 2 * SURF_PRECISION_S / shortest + MAXMIN_PRECISION + 1e-12


@needs_simgrid
@pytest.mark.parametrize("algorithm,procs,ppn", [("ring", 16, 1), ("rabenseifner", 16, 1),
                                                 ("rabenseifner", 12, 1),
                                                 ("hierarchical", 16, 2)])
def test_contiguous_ranks_on_a_nonblocking_tree_reproduce_the_formula(algorithm, procs, ppn):
    p, sim = _simulate(procs, ppn, algorithm, {"levels": "2", "nodes_per_leaf": "4"})
    row = sim.rows[0]
    assert row.leaves_used > 1       # the schedule does cross the core
    # at most this many steps over the 2 buckets (ring 2(p-1), Rabenseifner 2·log2 p + 2,
    # hierarchical 2(q-1) + 2(N-1) each): an upper bound, so the tolerance errs wide
    steps = 2 * procs * 2 * max(1, math.ceil(math.log2(procs)))
    assert row.comm_simulated_s == pytest.approx(row.comm_formula_s, rel=_rtol(p, steps))
    assert row.iteration_simulated_s == pytest.approx(p.iteration_s, rel=_rtol(p, steps))


@needs_simgrid
def test_scaling_two_simulated_ring_steps_equals_simulating_all():
    fabric = {"levels": "2", "nodes_per_leaf": "2", "leaf_uplinks": "1"}
    p, two = _simulate(8, 1, "ring", fabric, placement="random", steps=2)
    _, every = _simulate(8, 1, "ring", fabric, placement="random", steps=7)
    assert two.rows[0].comm_simulated_s == pytest.approx(every.rows[0].comm_simulated_s,
                                                         rel=_rtol(p, 2 * 8))


@needs_simgrid
def test_random_placement_on_an_oversubscribed_tree_is_paced_by_the_busiest_uplinks():
    """Lower bound: in one ring step, the flows leaving the busiest leaf share its uplinks."""
    machine = load_machine("skx")
    fabric = replace(load_fabric(machine, {"levels": "2", "nodes_per_leaf": "4",
                                           "leaf_uplinks": "1"}), switch_latency_s=0.0)
    procs = 16
    where = node_positions("random", procs, 16, seed=0)
    n = 16e6
    (step, _), = {id(ph.messages): (ph.messages, 1)
                  for ph in ring_phases(where, n, 0.0)}.values()
    seconds, = simulate_patterns(fabric, 16, [(step, 1)])
    leaving: dict[int, int] = {}
    for s, d, _ in step:
        if s // 4 != d // 4:
            leaving[s // 4] = leaving.get(s // 4, 0) + 1
    bound = max(leaving.values()) * (n / procs) / fabric.uplink_Bps
    formula_step = machine["network.latency_s"] + (n / procs) / fabric.node_link_Bps
    assert max(leaving.values()) > 1
    assert seconds >= bound * (1 - MAXMIN_PRECISION)
    assert seconds > formula_step


@needs_simgrid
def test_cli_simulate_writes_the_simulation_beside_the_plan(tmp_path, capsys):
    from hpcdl.cli.main import main

    out = tmp_path / "plan.json"
    code = main(["plan", "--machine", "skx", "--model", "resnet50", "--procs", "8",
                 "--global-batch", "256", "--sweep", "4,8", "--simulate", "--placement",
                 "c[001-004]", "--fabric-set", "levels=1", "--json", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    assert [r["procs"] for r in doc["simulation"]["rows"]] == [4, 8]
    assert doc["simulation"]["main_procs"] == 8
    assert doc["simulation"]["fabric"]["levels"] == 1
    assert "simulated (SimGrid)" in capsys.readouterr().out


def test_cli_bad_placement_is_one_line_and_exit_2(capsys):
    from hpcdl.cli.main import main

    code = main(["plan", "--machine", "skx", "--model", "resnet50", "--procs", "8",
                 "--global-batch", "256", "--sweep", "8", "--simulate", "--placement",
                 "sideways"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sideways" in err[0]
