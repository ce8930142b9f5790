"""Which MPI and launcher a rank runs under, and each MPI's traps for one rank per socket
(hpcdl/mpi_library.py, hpcdl/debug/doctor.py): pure functions on the library's own strings and
the launchers' environments. The real runs are tests/mpi/test_mpi_library.py (under each MPI of
the matrix) and the Slurm jobs of tests/test_slurm_jobs.py."""
import pytest

from hpcdl.debug.doctor import binding_fix, diagnose
from hpcdl.mpi_library import identify, launcher_of, mpich_netmod_for_slurm_pmi1, set_wheel_mpi_root

# MPI_Get_library_version as each library prints it (the first three from the wheels the
# matrix installs; MVAPICH2 and Cray MPICH from their documentation's format).
LIBRARY_STRINGS = {
    "MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25 20:45:26 UTC 2026\n"
    "MPICH ABI:          18:2:6\n": ("mpich", "5.0.2", "MPICH 5.0.2"),
    "Intel(R) MPI Library 2021.13 for Linux* OS\n": ("impi", "2021.13", "Intel MPI 2021.13"),
    "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11, repo rev: "
    "v5.0.11rc1, Sep 16, 2026\x00": ("openmpi", "5.0.11", "Open MPI 5.0.11"),
    "MVAPICH2 Version      :\t2.3.7\nMVAPICH2 Release date :\tWed March 02 22:00:00 EST 2022\n"
    "MVAPICH2 Device       :\tch3:mrail\n": ("mvapich", "2.3.7", "MVAPICH 2.3.7"),
    "MPI VERSION    : CRAY MPICH version 8.1.25.17 (ANL base 3.4a2)\n"
    "MPI BUILD INFO : Sun Feb 26 15:15 2023 (git hash aecd99f)\n":
        ("cray-mpich", "8.1.25.17", "Cray MPICH 8.1.25.17"),
    "SomeMPI 1.0\n": ("unknown", "", "unknown MPI"),
}


@pytest.mark.parametrize("text", LIBRARY_STRINGS)
def test_library_is_named_from_its_own_version_string(text):
    library = identify(text)
    assert (library.flavor, library.version, str(library)) == LIBRARY_STRINGS[text]
    assert "\n" not in library.text and "\x00" not in library.text


@pytest.mark.parametrize("env, launcher", [
    ({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALNRANKS": "2"}, "hydra"),
    # Hydra inside an allocation starts its proxies with srun: its own variable wins.
    ({"MPI_LOCALNRANKS": "2", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"}, "hydra"),
    ({"PRTE_LAUNCHED": "1", "PMIX_RANK": "0", "SLURM_STEP_ID": "0"}, "prterun"),
    ({"SLURM_STEP_ID": "3", "SLURM_PROCID": "1", "PMI_RANK": "1"}, "srun"),
    ({"SLURM_JOB_ID": "7"}, "unknown"),  # the batch shell itself, or a singleton
])
def test_launcher_is_read_from_the_environment_it_gives_its_ranks(env, launcher):
    assert launcher_of(env) == launcher


def rank(r, size=2, host="n1", cpus=(0, 1), sockets=(0,), node_sockets=2, online=48,
         flavor="mpich", launcher="hydra", pinning=None, omp=None):
    return {"rank": r, "size": size, "host": host, "node_index": 0, "local_rank": r,
            "local_size": size, "cpus": list(cpus), "sockets": list(sockets),
            "node_cpus": 48, "node_sockets": node_sockets, "node_online_cpus": online,
            "hpcdl_threads": len(cpus), "torch_threads": len(cpus),
            "env": {"OMP_NUM_THREADS": str(omp)} if omp else {}, "launcher_env": {},
            "hdf5_file_locking": None, "staging_dir": "/tmp", "staging_fs": "ext4",
            "staging_free_bytes": 50 << 30, "mpi_library": "x", "mpi_flavor": flavor,
            "launcher": launcher, "pinning_env": pinning or {}, "torch": "2.13.0",
            "ipex": False, "oneccl": False}


def socket_ranks(**kw):
    """Two ranks on a 2 x 24-core node, each on its own socket's 24 cores: the paper's layout."""
    return [rank(0, cpus=range(24), sockets=(0,), **kw),
            rank(1, cpus=range(24, 48), sockets=(1,), **kw)]


def found(ranks, check):
    return [f for f in diagnose(ranks) if f.check == check]


@pytest.mark.parametrize("flavor, launcher", [("mpich", "hydra"), ("impi", "hydra"),
                                              ("openmpi", "prterun"), ("impi", "srun")])
def test_one_rank_per_socket_has_no_pinning_warning(flavor, launcher):
    ranks = socket_ranks(flavor=flavor, launcher=launcher, omp=24,
                         pinning={"I_MPI_PIN_DOMAIN": "socket"} if flavor == "impi" else None)
    assert [f for f in diagnose(ranks) if f.level == "warning"] == []


def test_open_mpi_default_core_binding_is_named_with_its_fix():
    ranks = [rank(0, cpus=(0,), flavor="openmpi", launcher="prterun", omp=24),
             rank(1, cpus=(1,), flavor="openmpi", launcher="prterun", omp=24)]
    [finding] = found(ranks, "narrow-binding")
    assert "rank 0 has 1 core(s) for 24 thread(s)" in finding.message
    assert "binds to core and maps by core by default" in finding.message
    assert "--map-by ppr:1:package:PE=24" in finding.fix


def test_one_core_binding_is_caught_without_omp_num_threads():
    """No OMP_NUM_THREADS: a rank of a one-per-socket layout wants its socket's share."""
    ranks = [rank(0, cpus=(0,), flavor="openmpi", launcher="prterun"),
             rank(1, cpus=(24,), sockets=(1,), flavor="openmpi", launcher="prterun")]
    [finding] = found(ranks, "narrow-binding")
    assert "1 core(s) for 24 thread(s)" in finding.message


def test_intel_processor_list_without_domain_pins_one_processor_per_rank():
    pinning = {"I_MPI_PIN_PROCESSOR_LIST": "0,24"}
    [finding] = found(socket_ranks(flavor="impi", pinning=pinning), "mpi-pinning")
    assert "I_MPI_PIN_PROCESSOR_LIST=0,24" in finding.message and "ONE" in finding.message
    assert "I_MPI_PIN_DOMAIN=socket" in finding.fix
    # With a domain set, Intel MPI ignores the list (Developer Reference, I_MPI_PIN_DOMAIN).
    pinning["I_MPI_PIN_DOMAIN"] = "socket"
    assert found(socket_ranks(flavor="impi", pinning=pinning), "mpi-pinning") == []


@pytest.mark.parametrize("pinning, said", [({"I_MPI_PIN_DOMAIN": "core"}, "one-core domain"),
                                           ({"I_MPI_PIN": "off"}, "not pinned")])
def test_intel_pinning_settings_that_undo_one_rank_per_socket(pinning, said):
    [finding] = found(socket_ranks(flavor="impi", pinning=pinning), "mpi-pinning")
    assert said in finding.message


def test_open_mpi_core_binding_policy_variable_is_flagged():
    pinning = {"PRTE_MCA_hwloc_default_binding_policy": "core"}
    [finding] = found(socket_ranks(flavor="openmpi", launcher="prterun", pinning=pinning),
                      "mpi-pinning")
    assert "binds each rank to one core" in finding.message
    # The same variable under another MPI means nothing.
    assert found(socket_ranks(flavor="mpich", pinning=pinning), "mpi-pinning") == []


def test_srun_without_cpus_per_task_gives_one_cpu_per_task():
    pinning = {"SLURM_CPU_BIND": "quiet,cores"}
    ranks = [rank(0, cpus=(0,), flavor="impi", launcher="srun", pinning=pinning, omp=24),
             rank(1, cpus=(24,), sockets=(1,), flavor="impi", launcher="srun",
                  pinning=pinning, omp=24)]
    [finding] = found(ranks, "narrow-binding")
    assert "srun bound it" in finding.message and "cpus-per-task=unset" in finding.message
    assert "--cpus-per-task=24 --cpu-bind=sockets" in finding.fix


def test_mpich_ranks_spanning_sockets_get_hydras_binding_flags():
    ranks = [rank(0, cpus=range(48), sockets=(0, 1)), rank(1, cpus=range(48), sockets=(0, 1))]
    [span] = found(ranks, "socket-span")
    assert "-bind-to socket -map-by socket" in span.fix


@pytest.mark.parametrize("flavor, launcher, words", [
    ("mpich", "hydra", "-bind-to socket"), ("impi", "hydra", "I_MPI_PIN_DOMAIN=socket"),
    ("openmpi", "prterun", "--bind-to core"), ("openmpi", "srun", "--cpu-bind=sockets")])
def test_binding_fix_speaks_each_launchers_language(flavor, launcher, words):
    assert words in binding_fix({"mpi_flavor": flavor, "launcher": launcher}, 24)


def test_wheel_intel_mpi_root_is_set_only_where_the_wheel_is_and_never_overrides(tmp_path):
    (tmp_path / "opt" / "mpi" / "etc").mkdir(parents=True)
    env = {}
    assert set_wheel_mpi_root(env, str(tmp_path / "elsewhere")) is None and env == {}
    (tmp_path / "opt" / "mpi" / "etc" / "tuning_generic_shm.dat").write_text("")
    assert set_wheel_mpi_root(env, str(tmp_path)) == str(tmp_path)
    assert env == {"I_MPI_ROOT": str(tmp_path)}
    site = {"I_MPI_ROOT": "/opt/intel/oneapi/mpi/2021.13"}
    assert set_wheel_mpi_root(site, str(tmp_path)) is None
    assert site["I_MPI_ROOT"] == "/opt/intel/oneapi/mpi/2021.13"


MPICH_BOTH = "MPICH Version:      5.0.2\nMPICH Device:       ch4:ucx ofi\n"
SRUN_PMI2 = {"SLURM_MPI_TYPE": "pmi2", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1"}


@pytest.mark.parametrize("library, env, chosen", [
    (MPICH_BOTH, SRUN_PMI2, "ofi"),
    (MPICH_BOTH, {**SRUN_PMI2, "MPICH_CH4_NETMOD": "ucx"}, None),  # the user's choice stands
    (MPICH_BOTH, {**SRUN_PMI2, "SLURM_MPI_TYPE": "pmix"}, None),
    (MPICH_BOTH, {**SRUN_PMI2, "MPI_LOCALNRANKS": "2"}, None),  # Hydra inside the allocation
    ("MPICH Version:      4.2.0\nMPICH Device:       ch4:ucx\n", SRUN_PMI2, None),
    ("Intel(R) MPI Library 2021.13 for Linux* OS\n", SRUN_PMI2, None),
])
def test_mpich_gets_ofi_only_under_srun_pmi2_when_built_with_it_and_unchosen(library, env,
                                                                               chosen):
    env = dict(env)
    before = dict(env)
    assert mpich_netmod_for_slurm_pmi1(library, env) == chosen
    assert env == ({**before, "MPIR_CVAR_CH4_NETMOD": chosen} if chosen else before)
