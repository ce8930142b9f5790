"""Under whichever MPI the matrix launched (tests/mpi_exec.sh sets HPCDL_EXPECT_MPI), the doctor's
per-rank record names that library and the launcher that started the ranks: the real run of
the pure functions tested in tests/test_doctor_mpi.py."""
import os

from hpcdl.debug.doctor import collect_rank_info, diagnose

# Each MPI's own mpiexec: Hydra for MPICH and Intel MPI, PRRTE's prterun for Open MPI 5.
OWN_LAUNCHER = {"mpich": "hydra", "impi": "hydra", "openmpi": "prterun"}


def test_doctor_names_the_library_and_launcher_of_this_run(world, tmp_path):
    info = collect_rank_info(world, str(tmp_path))
    expected = os.environ.get("HPCDL_EXPECT_MPI")
    assert info["mpi_flavor"] in OWN_LAUNCHER, info["mpi_library"]
    if expected:  # tests/mpi_exec.sh said which MPI it started, with that MPI's own mpiexec
        assert info["mpi_flavor"] == expected, info["mpi_library"]
        assert info["launcher"] == OWN_LAUNCHER[expected], info["launcher_env"]
    else:  # by hand: that MPI's mpiexec, or srun
        assert info["launcher"] in (OWN_LAUNCHER[info["mpi_flavor"]], "srun")
    assert info["mpi_name"].split()[0] in info["mpi_library"]  # "Intel", "Open", "MPICH"
    everyone = world.allgather((info["mpi_flavor"], info["launcher"], info["size"]))
    assert set(everyone) == {(info["mpi_flavor"], info["launcher"], world.size)}
    findings = {f.check for f in diagnose(world.allgather(info))}
    assert "launcher-mismatch" not in findings
