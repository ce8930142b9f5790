#!/usr/bin/env bash
# The test command (README.md): install the test extras, run the serial tests, then the MPI
# tests for real under mpiexec -n 2, 3 and 4 (oversubscribed on a 2-core machine is fine).
# Any stage that fails, or that collects no test at all (pytest exit 5), fails the run.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e '.[mpich,test]' || exit 1

results=test-results
rm -rf "$results" && mkdir -p "$results"
status=0

stage() {  # stage NAME COMMAND...: run one pytest stage and remember a failure
    local name=$1; shift
    echo "=== $name: $*"
    "$@"
    local rc=$?
    if [ $rc -eq 5 ]; then echo "!!! $name collected no tests (pytest exit 5)"; status=1
    elif [ $rc -ne 0 ]; then echo "!!! $name failed (exit $rc)"; status=1; fi
}

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# A hung collective ends the run instead of CI's clock (MPICH's hydra honours this).
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-900}

stage serial python3 -m pytest tests --ignore=tests/mpi -q -rs --junitxml="$results/serial.xml"
for n in 2 3 4; do
    stage "mpi-n$n" mpiexec -n "$n" python3 -m pytest tests/mpi -q -rs \
        --junitxml="$results/mpi-n$n.xml"
    for hang in "$results/mpi-n$n".rank*.hang.txt; do  # the watchdog's stacks, if it fired
        [ -s "$hang" ] && { echo "--- $hang"; cat "$hang"; }
    done
done

python3 tests/summarize.py "$results" || status=1
exit $status
