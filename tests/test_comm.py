"""hpcdl.comm pieces that need no peers: segmenting, signatures, the bench's arithmetic, and a
one-rank communicator (MPI singleton)."""
from __future__ import annotations

import os
import shlex
import shutil
import sys

import pytest
import torch

from hpcdl.bench.allreduce import bandwidth_ratios, bandwidth_record, parse_size
from hpcdl.comm.base import (
    describe_meta,
    mismatch_message,
    reduction_dtype,
    segment_bounds,
    signature_hash,
)


@pytest.mark.parametrize("numel,parts", [(0, 4), (3, 4), (10, 3), (12, 4), (1, 1)])
def test_segments_cover_the_buffer_with_near_equal_parts(numel, parts):
    bounds = segment_bounds(numel, parts)
    lengths = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    assert bounds[0] == 0 and bounds[-1] == numel and len(lengths) == parts
    assert max(lengths) - min(lengths) <= 1


def test_signature_hash_is_stable_across_processes():
    # Python's hash() is salted per process; the check must compare equal text equally
    assert signature_hash("allreduce(shapes=[(2, 3)])") == signature_hash(
        "allreduce(shapes=[(2, 3)])")
    assert signature_hash("a") != signature_hash("b")


def test_mismatch_message_groups_ranks_by_what_they_passed():
    texts = [describe_meta("allreduce_", {"shapes": [(2, 3)], "bucket": 0}),
             describe_meta("allreduce_", {"shapes": [(4,)], "bucket": 7}),
             describe_meta("allreduce_", {"shapes": [(2, 3)], "bucket": 3})]
    message = mismatch_message("allreduce_", texts)
    assert "ranks 0,2: allreduce_(shapes=[(2, 3)])" in message
    assert "rank 1: allreduce_(shapes=[(4,)])" in message


def test_half_precisions_reduce_in_float32_and_odd_dtypes_are_refused():
    assert reduction_dtype(torch.bfloat16) == torch.float32
    assert reduction_dtype(torch.int64) == torch.int64
    with pytest.raises(TypeError, match="bool"):
        reduction_dtype(torch.bool)


def test_sizes_are_decimal_bytes():
    assert parse_size("1M") == 10**6 and parse_size("16MB") == 16 * 10**6
    assert parse_size("512") == 512 and parse_size("1.5K") == 1500
    with pytest.raises(Exception, match="bad size"):
        parse_size("lots")


def test_busbw_follows_nccl_tests():
    record = bandwidth_record("ring", "ring", 10**8, 4, 0.1)
    assert record["algbw_GBps"] == pytest.approx(1.0)
    assert record["busbw_GBps"] == pytest.approx(1.5)  # 2(p-1)/p at p=4


def test_ratios_name_the_sizes_they_compare():
    sizes = [16 * 10**6, 10**8]
    records = [bandwidth_record(b, a, s, 2, t) for b, a, s, t in [
        ("mpi", "mpi", 10**8, 0.3), ("default", "shm", 10**8, 0.1), ("gloo", "gloo", 10**8, 0.6),
        ("ring", "ring", 16 * 10**6, 0.02), ("mpi", "mpi", 16 * 10**6, 0.04)]]
    ratios = bandwidth_ratios(records, sizes)
    assert ratios["default_vs_mpi_busbw_100MB"] == pytest.approx(3.0)
    assert ratios["default_vs_gloo_busbw_100MB"] == pytest.approx(6.0)
    assert ratios["ring_vs_mpi_busbw_16MB"] == pytest.approx(2.0)
    assert ratios["default_backend"] == "shm"


def test_one_rank_communicator_leaves_tensors_and_rejects_unknown_backends():
    import hpcdl.comm

    with pytest.raises(ValueError, match="unknown comm backend 'nccl'"):
        hpcdl.comm.init("nccl")
    with hpcdl.comm.init("mpi") as comm:
        tensor = torch.arange(5, dtype=torch.float32)
        comm.allreduce_(tensor, average=True)
        assert torch.equal(tensor, torch.arange(5, dtype=torch.float32))
        assert (comm.size, comm.num_nodes, comm.local_size) == (1, 1, 1)


def test_site_mpi_ratio_compares_the_default_with_each_mpis_best_tuning():
    from hpcdl.bench.allreduce import site_ratios

    records = [dict(bandwidth_record("default", "shm", 10**8, 2, 0.02)),
               dict(bandwidth_record("impi", "mpi", 10**8, 2, 0.10), tuning="default"),
               dict(bandwidth_record("impi", "mpi", 10**8, 2, 0.08),
                    tuning="I_MPI_ADJUST_ALLREDUCE=2")]
    ratios = site_ratios(records, ["impi"], [10**6, 10**8])
    assert ratios["default_vs_impi_busbw_100MB"] == pytest.approx(4.0)
    assert ratios["impi_best_tuning"] == "I_MPI_ADJUST_ALLREDUCE=2"


def test_site_mpi_needs_a_known_name_and_a_prefix_with_mpiexec_and_python(tmp_path):
    from hpcdl.bench.allreduce import parse_site_mpi

    with pytest.raises(SystemExit, match="NAME one of"):
        parse_site_mpi(["lam=/opt/lam"])
    with pytest.raises(SystemExit, match="bin/mpiexec"):
        parse_site_mpi([f"impi={tmp_path}"])


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
def test_driver_merges_hpcdl_and_a_site_mpi_run_into_one_report(tmp_path, monkeypatch):
    import json

    from hpcdl.bench import allreduce
    from hpcdl.cli.main import main as hpcdl_main

    # This environment's own MPI stands in for a site install: a prefix with its mpiexec and
    # python, and two of its documented tunings (the real driver tries them all).
    # Hydra finds its proxy beside the mpiexec it was started as, so the launcher's tools
    # come along (the real files, or pyenv's shims).
    site_bin = tmp_path / "site" / "bin"
    site_bin.mkdir(parents=True)
    launcher_dir = os.path.dirname(shutil.which("mpiexec"))
    for name in os.listdir(launcher_dir):
        if name.startswith(("mpiexec", "hydra")):
            os.symlink(os.path.join(launcher_dir, name), site_bin / name)
    # The python is a script that execs this one by its own path: a venv's python reached
    # through a symbolic link elsewhere looks for pyvenv.cfg beside the link, finds none, and
    # runs as the base interpreter without the venv's packages (no mpi4py).
    python = site_bin / "python"
    python.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n")
    python.chmod(0o755)
    monkeypatch.setitem(allreduce.SITE_TUNINGS, "mpich",
                        [{}, {"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "ring"}])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "allreduce.json"
    assert hpcdl_main(["bench", "allreduce", "--np", "2", "--backends", "mpi", "--sizes",
                       "1K,64K", "--repeats", "5", "--warmup", "0",
                       "--site-mpi", f"mpich={tmp_path / 'site'}", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {(r["backend"], r.get("tuning"), r["bytes"]) for r in report["results"]}
    assert ("default", None, 64000) in rows and ("mpi", None, 64000) in rows
    assert {t for b, t, _ in rows if b == "mpich"} == {
        "default", "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring"}
    assert report["ratios"]["default_vs_mpich_busbw_64KB"] > 0
    assert report["ratios"]["mpich_best_tuning"] in {"default",
                                                     "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring"}
