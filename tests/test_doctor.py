"""hpcdl doctor: the checks on constructed layouts, and the command under a real launcher."""
import json
import os
import subprocess
import sys

from hpcdl.cpus import parse_cpu_list
from hpcdl.debug.doctor import (
    diagnose,
    exit_code,
    format_cpu_list,
    format_report,
    mount_of,
)


def rank_info(rank, size, host="n1", cpus=(0, 1), sockets=(0,), threads=1, node_cpus=2,
              node_sockets=1, local_size=None, **extra):
    info = {"rank": rank, "size": size, "host": host, "node_index": 0, "local_rank": rank,
            "local_size": local_size or size, "cpus": list(cpus), "sockets": list(sockets),
            "node_cpus": node_cpus, "node_sockets": node_sockets, "hpcdl_threads": threads,
            "torch_threads": threads, "env": {}, "launcher_env": {},
            "hdf5_file_locking": None, "staging_dir": "/tmp", "staging_fs": "ext4",
            "staging_free_bytes": 50 << 30, "mpi_library": "MPICH Version: 5.0.2",
            "torch": "2.13.0", "ipex": False, "oneccl": False}
    info.update(extra)
    return info


def checks(findings, level="warning"):
    return {f.check for f in findings if f.level == level}


def test_clean_layout_has_no_warnings():
    ranks = [rank_info(0, 2, cpus=(0, 1), sockets=(0,), threads=2, node_cpus=4, node_sockets=2),
             rank_info(1, 2, cpus=(2, 3), sockets=(1,), threads=2, node_cpus=4, node_sockets=2)]
    findings = diagnose(ranks)
    assert checks(findings) == set() and checks(findings, "error") == set()
    assert exit_code(findings, strict=True) == 0
    assert "no problems found" in format_report(ranks, findings)


def test_threads_times_ranks_over_cores_is_oversubscribed():
    ranks = [rank_info(r, 4, threads=2, env={"OMP_NUM_THREADS": "2"}) for r in range(4)]
    [finding] = [f for f in diagnose(ranks) if f.check == "oversubscribed"]
    assert "4 rank(s) x 2 thread(s) = 8 threads on 2 core(s)" in finding.message
    assert "OMP_NUM_THREADS=2" in finding.message and "OMP_NUM_THREADS=1" in finding.fix


def test_ranks_with_overlapping_masks_share_cores():
    ranks = [rank_info(0, 2, cpus=(0, 1, 2)), rank_info(1, 2, cpus=(2, 3))]
    [finding] = [f for f in diagnose(ranks) if f.check == "shared-cores"]
    assert "ranks 0,1 share cores 2" in finding.message


def test_rank_spanning_sockets_when_one_per_socket_was_meant():
    ranks = [rank_info(0, 2, cpus=(0, 1, 2), sockets=(0, 1), node_cpus=4, node_sockets=2),
             rank_info(1, 2, cpus=(3,), sockets=(1,), node_cpus=4, node_sockets=2)]
    [finding] = [f for f in diagnose(ranks) if f.check == "socket-span"]
    assert "rank 0 on sockets 0-1" in finding.message and "rank 1" not in finding.message


def test_hdf5_locking_on_lustre_is_flagged_unless_disabled():
    ranks = [rank_info(0, 1, data_dir="/lus/shards", data_fs="lustre")]
    [finding] = [f for f in diagnose(ranks) if f.check == "hdf5-locking"]
    assert "lustre" in finding.message and "HDF5_USE_FILE_LOCKING=FALSE" in finding.fix
    ranks[0]["hdf5_file_locking"] = "FALSE"
    assert "hdf5-locking" not in checks(diagnose(ranks))


def test_size_one_while_launcher_says_more_is_an_error():
    ranks = [rank_info(0, 1, launcher_env={"PMI_SIZE": "2", "PMI_RANK": "1"})]
    findings = diagnose(ranks)
    assert "launcher-mismatch" in checks(findings, "error")
    assert exit_code(findings) == 1
    assert "PMI_SIZE=2" in format_report(ranks, findings)


def test_cpu_lists_round_trip_in_kernel_syntax():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"


def test_mount_is_the_longest_matching_prefix():
    mounts = ("rootfs / ext4 rw 0 0\n10.0.0.1@o2ib:/lus /lus lustre rw 0 0\n"
              "nfs:/home /home nfs4 rw 0 0\n")
    assert mount_of("/lus/scratch/shards", mounts) == ("/lus", "lustre")
    assert mount_of("/lustre-not", mounts) == ("/", "ext4")


def _doctor(env_extra, *launch, args=("--json", "-")):
    env = {**os.environ, **env_extra}
    return subprocess.run([*launch, sys.executable, "-m", "hpcdl.cli.main", "doctor", *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_doctor_flags_oversubscribed_launch_for_real():
    # taskset gives the job 2 cores whatever the machine has; 3 ranks x >= 1 thread > 2 cores.
    out = _doctor({"OMP_NUM_THREADS": "2"}, "taskset", "-c", "0,1", "mpiexec", "-n", "3")
    assert out.returncode == 0, out.stderr  # warnings alone do not fail the command
    report = json.loads(out.stdout)
    assert [r["rank"] for r in report["ranks"]] == [0, 1, 2]
    assert {r["env"]["OMP_NUM_THREADS"] for r in report["ranks"]} == {"2"}
    flagged = {f["check"] for f in report["findings"]}
    assert {"oversubscribed", "shared-cores"} <= flagged


def test_doctor_detects_launcher_library_mismatch_for_real():
    # Two singletons told by the environment that they are ranks 0 and 1 of 2: what a launcher
    # of another MPI does to an mpi4py built against this one.
    procs = [subprocess.Popen([sys.executable, "-m", "hpcdl.cli.main", "doctor"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PMI_SIZE": "2", "PMI_RANK": str(rank)})
             for rank in (0, 1)]
    results = [(p.communicate(timeout=120), p.returncode) for p in procs]
    for (stdout, stderr), code in results:
        assert code == 1, stderr
        assert "ERROR [launcher-mismatch]" in stdout and "PMI_SIZE=2" in stdout
        assert "MPI reports size 1" in stdout


def test_missing_staging_directory_is_an_error_naming_the_host():
    ranks = [rank_info(0, 2), rank_info(1, 2, host="n2", staging_exists=False,
                                        staging_dir="/local/none", staging_free_bytes=None)]
    [finding] = [f for f in diagnose(ranks) if f.check == "staging-missing"]
    assert finding.level == "error" and "n2: staging directory /local/none" in finding.message
