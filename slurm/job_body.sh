# ---- The part every hpcdl template shares (slurm/job_body.sh, inserted by the renderer) ----
# Above this line the template set RANKS_PER_NODE, THREADS_PER_RANK (OpenMP threads),
# CPUS_PER_RANK (cores Slurm gives a rank), CPU_BIND and NUMA (an array prefixed to the
# training command); the renderer set the quoted settings block.
set -uo pipefail
log() { echo "[hpcdl job ${SLURM_JOB_ID:-?} $(date -u +%H:%M:%S)] $*"; }

if [ -n "$SETUP" ]; then
    # Module loads / venv activation. Sourced, so exports reach every launcher below.
    log "setup: source $SETUP"
    # shellcheck disable=SC1090
    source "$SETUP" || { log "setup file $SETUP failed"; exit 1; }
fi

# Read at every start, never rendered in: a job requeued onto fewer or more nodes (drained
# nodes, `scontrol update JobId=... NumNodes=...`, `sbatch --nodes=MIN-MAX`) launches that many
# ranks, and `hpcdl train --resume auto` adapts the per-rank batch (docs/training.md).
NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}

# The MPI decides the launcher (docs/mpi.md): srun with PMI-2 for MPICH and Intel MPI (which
# also needs Slurm's libpmi2.so named in I_MPI_PMI_LIBRARY), srun with PMIx or Open MPI's own
# mpirun for Open MPI. "auto" asks mpi4py which library it loads, after the setup file ran.
if [ "$MPI" = auto ]; then
    MPI=$(hpcdl doctor --mpi-flavor 2>/dev/null | tail -n 1)
    MPI=${MPI:-unknown}
fi
if [ "$LAUNCHER" = auto ]; then
    case $MPI in
        openmpi) LAUNCHER=$OPENMPI_LAUNCHER ;;
        *) LAUNCHER=srun-pmi2 ;;
    esac
fi
pmi2_library() {  # Slurm's libpmi2.so: beside srun's install, else wherever ld.so finds it
    local prefix lib
    prefix=$(dirname "$(dirname "$(command -v srun 2>/dev/null || echo /usr/bin/srun)")")
    for lib in "$prefix"/lib64/libpmi2.so "$prefix"/lib/libpmi2.so "$prefix"/lib64/slurm/libpmi2.so \
               "$prefix"/lib/x86_64-linux-gnu/libpmi2.so.0 "$prefix"/lib/aarch64-linux-gnu/libpmi2.so.0; do
        [ -e "$lib" ] && { echo "$lib"; return; }
    done
    ldconfig -p 2>/dev/null | awk '/libpmi2\.so/ {print $NF; exit}'
}
if [ "$MPI" = impi ] && [ "$LAUNCHER" = srun-pmi2 ] && [ -z "${I_MPI_PMI_LIBRARY:-}" ]; then
    I_MPI_PMI_LIBRARY=$(pmi2_library)
    [ -n "$I_MPI_PMI_LIBRARY" ] || { log "Intel MPI under srun --mpi=pmi2 needs Slurm's" \
        "libpmi2.so: export I_MPI_PMI_LIBRARY=/path/to/libpmi2.so in the setup file" \
        "(Debian: apt-get install libpmi2-0), or use HPCDL_LAUNCHER=mpirun"; exit 2; }
    export I_MPI_PMI_LIBRARY
fi
log "MPI $MPI, launcher $LAUNCHER${I_MPI_PMI_LIBRARY:+, I_MPI_PMI_LIBRARY=$I_MPI_PMI_LIBRARY}"
log "restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST:-$(hostname)}: $NNODES node(s) x" \
    "$RANKS_PER_NODE rank(s), $THREADS_PER_RANK thread(s) per rank, launcher $LAUNCHER"
# Pretend nodes (HPCDL_RANKS_PER_NODE=k, a testing aid, docs/slurm.md): every k ranks act as one
# node, so each stages into its own directory ({node} is filled in by stage and train) and
# staging runs as many ranks per node as training, giving every pretend node its first rank.
LOCAL_ROOT=$LOCAL_DATA
if [ -n "${HPCDL_RANKS_PER_NODE:-}" ]; then
    LOCAL_DATA="$LOCAL_ROOT/node-{node}"
    log "pretend nodes: HPCDL_RANKS_PER_NODE=$HPCDL_RANKS_PER_NODE, staging into $LOCAL_DATA"
fi

# launcher_command PER_NODE CPUS CMD...: sets LAUNCH to the command that starts CMD as
# PER_NODE ranks on each node. An array, not a function, so that `"${LAUNCH[@]}" &` gives the
# launcher's own PID for forwarding signals (a backgrounded function would be a subshell that
# dies of the signal instead of forwarding it).
launcher_command() {
    local per_node=$1 cpus=$2; shift 2
    local ntasks=$((NNODES * per_node))
    case $LAUNCHER in
        srun-pmi2|srun-pmix)
            # srun forwards SIGUSR1 to every task on every node.
            LAUNCH=(srun "--mpi=${LAUNCHER#srun-}" --nodes="$NNODES" --ntasks="$ntasks"
                    --ntasks-per-node="$per_node" --cpus-per-task="$cpus"
                    --cpu-bind="$CPU_BIND" --kill-on-bad-exit=1 "$@") ;;
        mpirun)
            # Never inside an srun step (nested launchers hang): mpirun starts its own daemons.
            if "$MPIRUN" --version 2>&1 | grep -q "Open MPI"; then
                LAUNCH=("$MPIRUN" -n "$ntasks" --map-by "ppr:$per_node:node:PE=$cpus" "$@")
            else  # MPICH / Intel MPI / MVAPICH2 (Hydra); I_MPI_PIN_DOMAIN does the binding
                LAUNCH=("$MPIRUN" -n "$ntasks" -ppn "$per_node" "$@")
            fi ;;
        ibrun)
            # TACC: ibrun takes the layout from #SBATCH --ntasks-per-node; per_node must match.
            LAUNCH=(ibrun -n "$ntasks" "$@") ;;
        *)
            log "unknown launcher '$LAUNCHER' (srun-pmi2, srun-pmix, mpirun, ibrun)"; exit 2 ;;
    esac
}

run_step() {  # run_step NAME PER_NODE CPUS CMD...: run one launcher step in the foreground
    local name=$1; shift
    launcher_command "$@"
    log "$name: ${LAUNCH[*]}"
    "${LAUNCH[@]}" || { local rc=$?; log "$name failed (exit $rc)"; exit "$rc"; }
}

# The node-local shards go with the job, whatever its end: a failed doctor, stage or training,
# a `exit` anywhere below, or a signal that ends this shell (bash runs the EXIT trap then too).
# Kept only for a requeued run (it skips the copy) or when HPCDL_KEEP_LOCAL=1. Staging may
# have started on every node, so the removal runs through the launcher, one task per node.
staged=0 keep_local=0
remove_local_data() {
    local rc=$?
    trap - EXIT
    if [ "$staged" = 1 ] && [ "$keep_local" = 0 ] && [ "${HPCDL_KEEP_LOCAL:-0}" != 1 ]; then
        log "removing the staged shards $LOCAL_ROOT on every node (job exit $rc)"
        launcher_command 1 1 rm -rf "$LOCAL_ROOT"
        "${LAUNCH[@]}" || log "could not remove $LOCAL_ROOT on every node"
    fi
    exit "$rc"
}
trap remove_local_data EXIT

# A time-limit signal before training starts (a long staging) would kill this shell by
# default: note it, and requeue instead of starting to train.
time_up=0
trap 'time_up=1; log "time-limit signal before training"' USR1

# 1. Check ranks, binding, threads, the MPI build and the file systems under this very
#    launcher before spending the allocation (when this hpcdl has doctor; HPCDL_DOCTOR=0 skips).
mkdir -p "$LOCAL_DIR" 2>/dev/null  # on this node; other nodes' must exist (e.g. /tmp)
if [ "${HPCDL_DOCTOR:-1}" = 1 ] && hpcdl doctor --help >/dev/null 2>&1; then
    run_step doctor "$RANKS_PER_NODE" "$CPUS_PER_RANK" hpcdl doctor --data "$DATA" \
        --staging "$LOCAL_DIR"
fi

# 2. Stage this node's shards to node-local disk, one rank per node (ibrun cannot place one
#    rank per node in a multi-rank layout; extra ranks on a node are tolerated by stage).
TRAIN_DATA=$DATA
if [ "${HPCDL_STAGE:-1}" = 1 ]; then
    stage_per_node=1
    [ "$LAUNCHER" = ibrun ] || [ -n "${HPCDL_RANKS_PER_NODE:-}" ] && stage_per_node=$RANKS_PER_NODE
    staged=1  # from here on, a partial copy may be on any node
    run_step stage "$stage_per_node" 1 hpcdl prep stage --shards "$DATA" --to "$LOCAL_DATA" \
        "${STAGE_ARGS[@]}"
    TRAIN_DATA=$LOCAL_DATA
fi

# 3. Train. The time-limit signal (#SBATCH --signal=B:USR1@...) reaches only this shell; it
#    is forwarded to the ranks, which checkpoint and exit with CHECKPOINT_EXIT; the job then
#    requeues itself and the next run continues with --resume auto. One log holds every
#    restart (--open-mode=append).
requeue() {
    log "$1; requeueing job $SLURM_JOB_ID (next run: --resume auto)"
    scontrol requeue "$SLURM_JOB_ID" || { log "scontrol requeue failed"; exit 1; }
    keep_local=1  # the next run of this job finds its shards staged
    exit 0
}
[ "$time_up" = 1 ] && requeue "no time left to train"

launcher_command "$RANKS_PER_NODE" "$CPUS_PER_RANK" "${NUMA[@]}" hpcdl train \
    --recipe "$RECIPE" --data "$TRAIN_DATA" --out "$RUN_DIR" --resume auto \
    "${TRAIN_ARGS[@]}" "${OVERRIDES[@]}"

forward_time_limit() {
    log "time-limit signal: forwarding USR1 to the training ranks, waiting for the checkpoint"
    kill -USR1 "$train_pid" 2>/dev/null
    # ibrun is a script that does not forward signals; its ranks run in Slurm steps.
    [ "$LAUNCHER" = ibrun ] && scancel --signal=USR1 "$SLURM_JOB_ID" 2>/dev/null
    return 0
}
trap forward_time_limit USR1

log "train: ${LAUNCH[*]}"
train_start=$(date +%s)
"${LAUNCH[@]}" &
train_pid=$!
[ "$time_up" = 1 ] && forward_time_limit  # came between the check above and the trap
# `wait` returns early (status > 128) each time the trap runs; wait again until the launcher
# is gone, then once more to read its exit status (bash keeps it for a reaped PID).
while wait "$train_pid"; [ $? -gt 128 ] && kill -0 "$train_pid" 2>/dev/null; do :; done
wait "$train_pid"
rc=$?
trap - USR1

# srun --kill-on-bad-exit counts the first rank's CHECKPOINT_EXIT as a failure and kills the
# ranks still writing their way out (exit 143 for the launcher, seen across hosts, where ranks
# end milliseconds apart): the run's own summary, written by this launch, says what happened.
stopped_on_signal() {
    local summary=$RUN_DIR/summary.json
    [ -f "$summary" ] && [ "$(stat -c %Y "$summary")" -ge "$train_start" ] &&
        grep -q '"stopped": "signal"' "$summary"
}
if [ "$rc" -eq "$CHECKPOINT_EXIT" ] || { [ "$rc" -ne 0 ] && stopped_on_signal; }; then
    requeue "checkpoint written"
fi
log "training finished with exit code $rc"
exit "$rc"  # the EXIT trap frees the node-local disk
