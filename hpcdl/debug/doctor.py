"""``hpcdl doctor``: is this launch laid out the way the job needs? (docs/debugging.md, 1-2)

Run under the job's own launcher. Each rank describes itself (:func:`collect_rank_info`);
rank 0 gathers the dicts and the checks (:func:`diagnose`) are pure functions over that list.
They catch what costs allocations on CPU clusters: more threads than cores, ranks on the same
cores, a rank across two sockets (the layout is one rank per socket, You et al., ICPP'18), HDF5
locking on a parallel file system, and mpi4py built against another MPI than the launcher's.
"""
from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import socket
import sys
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hpcdl.cpus import affinity_cores, cpu_socket, format_cpu_list, online_cpus, threads_per_rank
from hpcdl.mpi_library import NETMOD_SETTINGS, RANK_ENV, WORLD_SIZE_ENV, launcher_of

#: File systems where HDF5's POSIX locks fail or serialise readers.
PARALLEL_FS = ("lustre", "gpfs", "nfs", "nfs4", "beegfs", "cephfs", "ceph", "pvfs2",
               "orangefs", "panfs", "wekafs", "fuse.glusterfs")
#: Threading / math-library settings worth seeing side by side.
THREAD_ENV = ("OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "KMP_AFFINITY", "KMP_BLOCKTIME",
              "KMP_HW_SUBSET", "MKL_NUM_THREADS", "MKL_DYNAMIC", "OPENBLAS_NUM_THREADS")
#: Environment variables launchers set, as (variable, what it means).
LAUNCHER_SIZE_ENV = (*WORLD_SIZE_ENV, "MPI_LOCALNRANKS", "SLURM_NTASKS")
LAUNCHER_RANK_ENV = (*RANK_ENV, "SLURM_PROCID")
LOW_SPACE_BYTES = 1 << 30
#: Clocks further apart than this make cross-host timestamps (stall reports, logs) misleading.
CLOCK_SKEW_S = 0.5
#: Pinning settings of each MPI's launcher and of srun, shown and checked (check_mpi_pinning).
PINNING_ENV_PREFIXES = ("I_MPI_PIN", "OMPI_MCA_hwloc_base_binding", "OMPI_MCA_rmaps_base_mapping",
                        "PRTE_MCA_hwloc_default_binding", "PRTE_MCA_rmaps_default_mapping",
                        "HYDRA_BINDING", "HYDRA_MAPPING", "SLURM_CPU_BIND",
                        "SLURM_CPUS_PER_TASK")
#: What Intel MPI's Hydra passes its ranks about the pinning it did: not a user's setting.
HYDRA_INTERNAL_ENV = ("I_MPI_PIN_INFO", "I_MPI_PIN_MAPPING")


@dataclass(frozen=True)
class Finding:
    """One problem the doctor found: ``level`` is "error" (exit non-zero) or "warning"."""

    level: str
    check: str
    message: str
    fix: str


# -- what one rank knows about itself -----------------------------------------------------------
def mount_of(path: str, mounts_text: str) -> tuple[str, str]:
    """(mount point, fs type) of ``path`` from /proc/mounts text (longest matching prefix)."""
    path = os.path.realpath(path)
    best = ("/", "unknown")
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, fields[2])
    return best


def _read_mounts() -> str:
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""


def _library_info() -> dict[str, Any]:
    import mpi4py
    import torch
    from mpi4py import MPI

    from hpcdl.comm.ccl import find_library
    from hpcdl.mpi_library import identify

    vendor, vendor_version = MPI.get_vendor()
    library = identify(MPI.Get_library_version())
    info: dict[str, Any] = {
        "mpi_library": library.text,
        "mpi_flavor": library.flavor,
        "mpi_name": str(library),
        "mpi_vendor": f"{vendor} {'.'.join(map(str, vendor_version))}",
        "mpi_standard": ".".join(map(str, MPI.Get_version())),
        "mpi4py": mpi4py.__version__,
        "mpi4py_config": {k: str(v) for k, v in mpi4py.get_config().items()},
        "thread_level": {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                         MPI.THREAD_SERIALIZED: "serialized",
                         MPI.THREAD_MULTIPLE: "multiple"}.get(MPI.Query_thread(), "?"),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "ipex": importlib.util.find_spec("intel_extension_for_pytorch") is not None,
        # oneCCL's C API library is where the ``ccl`` backend would open it (not opened here:
        # opening reads oneCCL's settings for good)
        "oneccl": find_library() is not None,
    }
    # MPICH's network module where one is set (hpcdl sets ofi under srun --mpi=pmi2)
    netmod = next((os.environ[k] for k in NETMOD_SETTINGS if k in os.environ), None)
    if netmod:
        info["mpich_netmod"] = netmod
    try:
        import h5py

        info["h5py"] = h5py.__version__
        info["hdf5"] = h5py.version.hdf5_version
    except ImportError:
        info["h5py"] = info["hdf5"] = None
    return info


def collect_rank_info(mpi_comm: Any, staging_dir: str, data_dir: str | None = None) -> dict:
    """Everything the checks need about this rank (collective over ``mpi_comm``)."""
    from mpi4py import MPI

    from hpcdl.topology import node_layout, node_path, ranks_per_node_from_env

    # "Which node": the communicator's rule (honours HPCDL_RANKS_PER_NODE), so the table shows
    # the nodes the loader and staging will use. Cores are another question: the ranks that
    # compete for them are those that really share the machine, pretend nodes or not.
    node_index, num_nodes, local_rank, local_size = node_layout(mpi_comm)
    machine = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.rank)
    cpus = sorted(affinity_cores())
    node_masks = machine.allgather(cpus)
    machine.Free()
    staging_dir = node_path(staging_dir, node_index)  # --staging /tmp/stage-{node}
    node_cpus = online_cpus()
    mounts = _read_mounts()
    staging_mount, staging_fs = mount_of(staging_dir, mounts)
    try:
        free = shutil.disk_usage(staging_dir).free
    except OSError:
        free = None
    info = {
        "rank": mpi_comm.rank, "size": mpi_comm.size, "host": socket.gethostname(),
        "node_index": node_index, "num_nodes": num_nodes, "local_rank": local_rank,
        "local_size": local_size, "ranks_per_node_switch": ranks_per_node_from_env(),
        "pid": os.getpid(), "cpus": cpus, "sockets": sorted({cpu_socket(c) for c in cpus}),
        # Cores the job may use on this node: the union of its ranks' masks (a Slurm job with
        # part of a node sees only its cgroup's cores), not every core the kernel lists.
        "node_cpus": len(set().union(*map(set, node_masks))),
        "node_sockets": len({cpu_socket(c) for c in node_cpus}),
        "hpcdl_threads": _hpcdl_threads(cpus, node_masks),
        "env": {k: os.environ[k] for k in THREAD_ENV if k in os.environ},
        "launcher_env": {k: os.environ[k] for k in LAUNCHER_SIZE_ENV + LAUNCHER_RANK_ENV
                         if k in os.environ},
        "launcher": launcher_of(os.environ),
        "pinning_env": {k: v for k, v in os.environ.items()
                        if k.startswith(PINNING_ENV_PREFIXES) and k not in HYDRA_INTERNAL_ENV},
        "node_online_cpus": len(node_cpus),
        "hdf5_file_locking": os.environ.get("HDF5_USE_FILE_LOCKING"),
        "staging_dir": staging_dir, "staging_exists": os.path.isdir(staging_dir),
        "staging_free_bytes": free, "staging_fs": staging_fs,
        "staging_mount": staging_mount, "python": platform.python_version(),
    }
    if data_dir:
        info["data_dir"] = data_dir
        info["data_mount"], info["data_fs"] = mount_of(data_dir, mounts)
    info.update(_library_info())
    return info


def _hpcdl_threads(cpus: Sequence[int], node_masks: Sequence[Sequence[int]]) -> int:
    """The thread count ``hpcdl train`` will give torch (hpcdl/cpus.py's rule)."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    limit = int(env) if env.isdigit() else None
    threads, _ = threads_per_rank(frozenset(cpus), [frozenset(m) for m in node_masks], limit)
    return threads


# -- the checks (pure) --------------------------------------------------------------------------
def threads_of(info: Mapping[str, Any]) -> int:
    """Threads this rank computes with: hpcdl's rule when known, else torch's own default."""
    return int(info.get("hpcdl_threads") or info["torch_threads"])


def check_launcher_mismatch(ranks: Sequence[Mapping[str, Any]]) -> Iterator[Finding]:
    """The launcher started P > 1 processes but MPI says each is a world of one."""
    for info in ranks:
        if info["size"] != 1:
            continue
        claimed = {k: v for k, v in info.get("launcher_env", {}).items()
                   if k in LAUNCHER_SIZE_ENV and str(v).isdigit() and int(v) > 1}
        if not claimed:
            continue
        said = ", ".join(f"{k}={v}" for k, v in sorted(claimed.items()))
        yield Finding(
            "error", "launcher-mismatch",
            f"the launcher started this process as one of several ({said}) but MPI reports "
            f"size 1 on {info['host']}: mpi4py is linked to {info['mpi_library']!r}, a different "
            f"MPI than the launcher's, so every rank trains alone",
            "launch with the mpiexec of the MPI mpi4py was built against (`python -c \"import "
            "mpi4py; print(mpi4py.get_config())\"`), or rebuild mpi4py against the site MPI: "
            "`module load <mpi>; MPICC=mpicc pip install --no-binary=mpi4py --force-reinstall "
            "mpi4py` (with Slurm: srun --mpi=pmix or pmi2, whichever the MPI supports)")


def check_oversubscription(ranks: Sequence[Mapping[str, Any]]) -> Iterator[Finding]:
    """Threads x ranks on a node must not exceed its cores."""
    for host, infos in _by_host(ranks).items():
        cores = infos[0]["node_cpus"]
        total = sum(threads_of(i) for i in infos)
        if total > cores:
            per = sorted({threads_of(i) for i in infos})
            yield Finding(
                "warning", "oversubscribed",
                f"{host}: {len(infos)} rank(s) x {'/'.join(map(str, per))} thread(s) = {total} "
                f"threads on {cores} core(s) available to the job"
                f"{_omp_note(infos)}",
                f"run at most {cores} threads per node: fewer ranks per node, or "
                f"OMP_NUM_THREADS={max(1, cores // len(infos))} with one rank per socket "
                f"(mpiexec -n P -ppn <sockets> -bind-to socket; srun --cpu-bind=sockets)")


def _omp_note(infos: Sequence[Mapping[str, Any]]) -> str:
    omp = {i["env"].get("OMP_NUM_THREADS") for i in infos} - {None}
    return f" (OMP_NUM_THREADS={'/'.join(sorted(omp))})" if omp else ""


def check_shared_cores(ranks: Sequence[Mapping[str, Any]]) -> Iterator[Finding]:
    """Two ranks of one node whose affinity masks overlap compete for the same cores."""
    for host, infos in _by_host(ranks).items():
        pairs = [(a["rank"], b["rank"], sorted(set(a["cpus"]) & set(b["cpus"])))
                 for i, a in enumerate(infos) for b in infos[i + 1:]]
        pairs = [p for p in pairs if p[2]]
        if pairs:
            shown = "; ".join(f"ranks {a},{b} share cores {format_cpu_list(c)}"
                              for a, b, c in pairs[:4])
            more = f" (and {len(pairs) - 4} more pairs)" if len(pairs) > 4 else ""
            yield Finding(
                "warning", "shared-cores", f"{host}: {shown}{more}",
                f"bind each rank to its own cores: {binding_fix(infos[0])}")


def check_socket_span(ranks: Sequence[Mapping[str, Any]]) -> Iterator[Finding]:
    """One rank per socket was meant (ranks on the node == sockets) but a rank spans two."""
    for host, infos in _by_host(ranks).items():
        sockets = infos[0]["node_sockets"]
        if sockets < 2 or len(infos) != sockets:
            continue
        spanning = [i for i in infos if len(i["sockets"]) > 1]
        if spanning:
            listed = ", ".join(f"rank {i['rank']} on sockets {format_cpu_list(i['sockets'])}"
                               for i in spanning)
            yield Finding(
                "warning", "socket-span",
                f"{host}: {len(infos)} ranks for {sockets} sockets (one rank per socket) but "
                f"{listed}: its threads cross the socket link to reach memory",
                f"bind one rank per socket: {binding_fix(infos[0])} (check with `hpcdl doctor` "
                f"again: each rank should list one socket)")


# -- the MPI implementations' pinning traps (one rank per socket, You et al. ICPP'18) ----------
#: Values of I_MPI_PIN / I_MPI_PIN_DOMAIN that undo one rank per socket.
_IMPI_OFF = ("0", "no", "off", "disable")
_IMPI_ONE_CORE_DOMAINS = ("core", "1", "cache1")


def binding_fix(info: Mapping[str, Any], cores: int | None = None) -> str:
    """The launch line that gives one rank per socket bound to that socket's cores, for the
    rank's MPI (``mpi_flavor``) and launcher (:func:`hpcdl.mpi_library.launcher_of`)."""
    pe = cores or "<cores per socket>"
    launcher, flavor = info.get("launcher"), info.get("mpi_flavor")
    if launcher == "srun":
        return (f"srun --ntasks-per-socket=1 --cpus-per-task={pe} --cpu-bind=sockets (Slurm "
                f"binds; the MPI then pins inside each task's mask)")
    if flavor == "openmpi":
        return (f"mpirun --map-by ppr:1:package:PE={pe} --bind-to core, or --map-by package "
                f"--bind-to package (Open MPI 5 says package for socket)")
    if flavor == "impi":
        return ("export I_MPI_PIN_DOMAIN=socket and unset I_MPI_PIN_PROCESSOR_LIST; mpiexec "
                "-ppn <sockets per node>")
    return "mpiexec -ppn <sockets per node> -bind-to socket -map-by socket (Hydra)"


def _requested_threads(info: Mapping[str, Any]) -> int | None:
    value = str(info.get("env", {}).get("OMP_NUM_THREADS", "")).strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def _narrow_reason(info: Mapping[str, Any]) -> str:
    """Why this launcher/MPI gave a rank fewer cores than it wants: each one's known default."""
    env, launcher = info.get("pinning_env", {}), info.get("launcher")
    if launcher == "srun":
        return (f"srun bound it (SLURM_CPU_BIND={env.get('SLURM_CPU_BIND', 'unset')}, "
                f"--cpus-per-task={env.get('SLURM_CPUS_PER_TASK', 'unset, so 1')})")
    if info.get("mpi_flavor") == "openmpi":
        return ("Open MPI's mpirun binds to core and maps by core by default when it starts 2 "
                "or fewer ranks: one core per rank")
    if info.get("mpi_flavor") == "impi":
        shown = " ".join(f"{k}={v}" for k, v in sorted(env.items()) if k.startswith("I_MPI_PIN"))
        return f"Intel MPI pinned it ({shown or 'default I_MPI_PIN_DOMAIN=auto'})"
    return ("the launcher bound it (Hydra: -bind-to core or HYDRA_BINDING="
            f"{env.get('HYDRA_BINDING', 'unset')})")


def check_narrow_binding(ranks: Sequence[Mapping[str, Any]]) -> Iterator[Finding]:
    """A rank bound to fewer cores than its threads (OMP_NUM_THREADS), or to one core when
    the node gives each rank of a one-rank-per-socket layout several: its threads share
    those cores and the rest of the socket idles."""
    for host, infos in _by_host(ranks).items():
        narrow = []
        for info in infos:
            wanted = _requested_threads(info)
            if wanted is None and info["local_size"] <= info["node_sockets"]:
                wanted = info.get("node_online_cpus", 0) // max(info["local_size"], 1)
            if wanted and len(info["cpus"]) < wanted:
                narrow.append((info, wanted))
        if narrow:
            listed = ", ".join(f"rank {i['rank']} has {len(i['cpus'])} core(s) for {w} "
                               f"thread(s)" for i, w in narrow[:4])
            first, wanted = narrow[0]
            yield Finding(
                "warning", "narrow-binding",
                f"{host}: {listed}: {_narrow_reason(first)}",
                f"give each rank its socket's cores: {binding_fix(first, wanted)}")


def check_mpi_pinning_env(ranks: Sequence[Mapping[str, Any]]) -> Iterator[Finding]:
    """Pinning settings that undo one rank per socket, by MPI (Intel MPI developer reference,
    'Process Pinning'; Open MPI mpirun(1) 'Mapping, ranking and binding')."""
    for host, infos in _by_host(ranks).items():
        info = infos[0]
        env, flavor = info.get("pinning_env", {}), info.get("mpi_flavor")
        per_socket = info["node_sockets"] >= 2 and len(infos) == info["node_sockets"]
        for message in _pinning_env_traps(flavor, env, per_socket):
            yield Finding("warning", "mpi-pinning", f"{host}: {message}", binding_fix(info))


def _pinning_env_traps(flavor: str | None, env: Mapping[str, str],
                       one_per_socket: bool) -> list[str]:
    traps = []
    if flavor == "impi":
        domain = env.get("I_MPI_PIN_DOMAIN", "").strip().lower()
        if "I_MPI_PIN_PROCESSOR_LIST" in env and not domain:
            traps.append(f"I_MPI_PIN_PROCESSOR_LIST={env['I_MPI_PIN_PROCESSOR_LIST']} with "
                         f"I_MPI_PIN_DOMAIN unset pins each rank to ONE logical processor: its "
                         f"threads all share that core")
        if domain.split(":")[0] in _IMPI_ONE_CORE_DOMAINS:
            traps.append(f"I_MPI_PIN_DOMAIN={env['I_MPI_PIN_DOMAIN']} gives each rank a "
                         f"one-core domain")
        if one_per_socket and env.get("I_MPI_PIN", "").strip().lower() in _IMPI_OFF:
            traps.append(f"I_MPI_PIN={env['I_MPI_PIN']}: ranks are not pinned, so a rank's "
                         f"threads and memory drift across sockets")
    if flavor == "openmpi" and one_per_socket:
        for key in ("OMPI_MCA_hwloc_base_binding_policy", "PRTE_MCA_hwloc_default_binding_policy"):
            if env.get(key, "").strip().lower().startswith(("core", "hwthread")):
                traps.append(f"{key}={env[key]} binds each rank to one core")
    return traps


def check_hdf5_locking(ranks: Sequence[Mapping[str, Any]]) -> Iterator[Finding]:
    """HDF5's POSIX file locks on Lustre/GPFS/NFS fail (errno 38/524) or serialise opens."""
    seen = set()
    for info in ranks:
        locking = (info.get("hdf5_file_locking") or "").strip().upper()
        if locking in ("FALSE", "0", "BEST_EFFORT"):
            continue
        for role in ("staging", "data"):
            fs = info.get(f"{role}_fs")
            if fs not in PARALLEL_FS or (role, fs, info["host"]) in seen:
                continue
            seen.add((role, fs, info["host"]))
            yield Finding(
                "warning", "hdf5-locking",
                f"{info['host']}: the {role} directory {info.get(f'{role}_dir')} is on {fs} "
                f"and HDF5_USE_FILE_LOCKING is {info.get('hdf5_file_locking') or 'unset'}: "
                f"opening shards takes POSIX locks that {fs} refuses or serialises",
                "export HDF5_USE_FILE_LOCKING=FALSE in the job script (shards are read-only "
                "during training), or stage the shards to node-local disk (hpcdl stage)")


def check_staging_space(ranks: Sequence[Mapping[str, Any]]) -> Iterator[Finding]:
    seen = set()
    for info in ranks:
        if info.get("staging_exists") is False and info["host"] not in seen:
            seen.add(info["host"])
            yield Finding(
                "error", "staging-missing",
                f"{info['host']}: staging directory {info['staging_dir']} does not exist",
                "create it in the job script (mkdir -p) or pass --staging the node-local "
                "scratch directory ($TMPDIR)")
            continue
        free = info.get("staging_free_bytes")
        if free is None or free >= LOW_SPACE_BYTES or info["host"] in seen:
            continue
        seen.add(info["host"])
        yield Finding(
            "warning", "staging-space",
            f"{info['host']}: only {free / 2**30:.2f} GiB free in {info['staging_dir']}",
            "point --staging (and $TMPDIR) at the node-local disk with room for the shards")


def check_clock_skew(ranks: Sequence[Mapping[str, Any]]) -> list[Finding]:
    """Hosts whose wall clock is off rank 0's by more than :data:`CLOCK_SKEW_S`."""
    off = {}
    for info in ranks:
        offset = info.get("clock_offset_s")
        if offset is not None and abs(offset) > CLOCK_SKEW_S:
            off.setdefault(info["host"], offset)
    if not off:
        return []
    shown = ", ".join(f"{host} {offset:+.2f} s" for host, offset in sorted(off.items()))
    return [Finding("warning", "clock-skew", f"clocks off rank 0's ({ranks[0]['host']}): {shown}",
                    "sync the nodes' clocks (chrony/NTP): stall reports and logs compare "
                    "timestamps across hosts")]


def hosts_reach_each_other(mpi_comm: Any) -> bool:
    """The reach probe (hpcdl/debug/hosts.py): False, after printing one line per host that
    could not reach others, when the fabric is partitioned; the caller then aborts the job."""
    from hpcdl.debug.hosts import describe_unreached, reach_problems

    def unreachable_root(message: str) -> None:
        print(f"hpcdl doctor: ERROR [unreachable] {message}", file=sys.stderr, flush=True)

    problems = reach_problems(mpi_comm, on_unreachable_root=unreachable_root)
    if not problems:
        return True
    for line in describe_unreached(problems):
        print(f"hpcdl doctor: ERROR [unreachable] {line}", file=sys.stderr, flush=True)
    print("    fix: check those hosts' links and the fabric (ibstat / fi_info / ping over the "
          "MPI's interface) and drain them before submitting", file=sys.stderr, flush=True)
    return False


def check_accelerators(ranks: Sequence[Mapping[str, Any]]) -> Iterator[Finding]:
    """IPEX / oneCCL are optional: say what is missing and how to get it (never faked)."""
    info = ranks[0]
    if not info["oneccl"]:
        yield Finding(
            "info", "accelerators", "oneCCL's libccl.so.2 not found in $CCL_ROOT/lib nor on "
            "LD_LIBRARY_PATH (optional, for --backend ccl)",
            "module load ccl (sets CCL_ROOT), or eval \"$(tests/ccl_env.sh)\" to assemble it "
            "from PyPI (docs/comm.md)")
    if not info["ipex"]:
        # measured, docs/intel.md: not worth a day on a torch 2.8 environment
        yield Finding(
            "info", "accelerators", "intel-extension-for-pytorch not installed (optional, "
            "for --ipex)", "skip it: IPEX gives ≈1.0× on ResNet-50 with torch 2.8 and cannot "
            f"sit beside torch {info['torch']} (docs/intel.md)")


def check_pretend_nodes(ranks: Sequence[Mapping[str, Any]]) -> list[Finding]:
    """HPCDL_RANKS_PER_NODE is a testing aid: say that it is on, and refuse it across hosts
    (ranks of two machines would be one "node" and share memory that is not shared)."""
    k = ranks[0].get("ranks_per_node_switch")
    if not k:
        return []
    hosts = sorted(_by_host(ranks))
    nodes = max(i["node_index"] for i in ranks) + 1
    if len(hosts) > 1:
        return [Finding("error", "pretend-nodes",
                        f"HPCDL_RANKS_PER_NODE={k} is set but the ranks run on {len(hosts)} "
                        f"hosts ({', '.join(hosts[:4])}): pretend nodes would span machines",
                        "unset HPCDL_RANKS_PER_NODE on a real cluster (it is a testing aid)")]
    return [Finding("info", "pretend-nodes",
                    f"HPCDL_RANKS_PER_NODE={k}: {len(ranks)} ranks on {hosts[0]} act as {nodes} "
                    f"nodes (consecutive ranks fill nodes of {k})",
                    "a testing aid; unset it to use the real node layout")]


CHECKS = (check_pretend_nodes, check_launcher_mismatch, check_oversubscription,
          check_shared_cores, check_socket_span, check_narrow_binding, check_mpi_pinning_env,
          check_hdf5_locking, check_staging_space, check_clock_skew, check_accelerators)


def diagnose(ranks: Sequence[Mapping[str, Any]]) -> list[Finding]:
    """Every check over the gathered per-rank dicts, errors first."""
    findings = [f for check in CHECKS for f in check(ranks)]
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(findings, key=lambda f: order.get(f.level, 3))


def exit_code(findings: Sequence[Finding], strict: bool = False) -> int:
    """1 when any error (or, with ``strict``, any warning) was found."""
    bad = ("error", "warning") if strict else ("error",)
    return 1 if any(f.level in bad for f in findings) else 0


def _by_host(ranks: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    groups: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for info in ranks:
        groups[info["host"]].append(info)
    return groups


# -- output -------------------------------------------------------------------------------------
ROW_COLUMNS = ("rank", "host", "node", "local", "cores", "sockets", "threads", "OMP", "free GiB")


def table_rows(ranks: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for i in ranks:
        free = i.get("staging_free_bytes")
        rows.append({
            "rank": f"{i['rank']}/{i['size']}", "host": i["host"], "node": i["node_index"],
            "local": f"{i['local_rank']}/{i['local_size']}", "cores": format_cpu_list(i["cpus"]),
            "sockets": format_cpu_list(i["sockets"]),
            "threads": f"{threads_of(i)} (torch {i['torch_threads']})",
            "OMP": i["env"].get("OMP_NUM_THREADS", "-"),
            "free GiB": "?" if free is None else f"{free / 2**30:.1f}"})
    return rows


def format_report(ranks: Sequence[Mapping[str, Any]], findings: Sequence[Finding]) -> str:
    rows = table_rows(ranks)
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in ROW_COLUMNS}
    lines = ["  ".join(c.ljust(widths[c]) for c in ROW_COLUMNS)]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in ROW_COLUMNS) for r in rows]
    lines.append("")
    first = ranks[0]
    for key in ("mpi_name", "launcher", "mpi_library", "mpich_netmod", "mpi_vendor",
                "mpi_standard", "thread_level", "mpi4py", "mpi4py_config", "torch", "ipex",
                "oneccl", "h5py", "hdf5", "hdf5_file_locking",
                "staging_dir", "staging_fs", "data_dir", "data_fs"):
        if key not in first:
            continue
        values = {str(i.get(key)) for i in ranks}
        shown = values.pop() if len(values) == 1 else "DIFFERS: " + "; ".join(
            f"rank {i['rank']}={i.get(key)}" for i in ranks)
        lines.append(f"{key:18s} {shown}")
    for label, env, none in (("thread env", first["env"], "(none set)"),
                             ("launcher env", first.get("launcher_env", {}), "(none seen)"),
                             ("pinning env", dict(sorted(first.get("pinning_env", {}).items())),
                              "(none set)")):
        lines.append(f"{label:18s} {' '.join(f'{k}={v}' for k, v in env.items()) or none}")
    lines.append("")
    if not any(f.level in ("error", "warning") for f in findings):
        lines.append("no problems found")
    for f in findings:
        lines.append(f"{f.level.upper()} [{f.check}] {f.message}")
        lines.append(f"    fix: {f.fix}")
    return "\n".join(lines)


def report_json(ranks: Sequence[Mapping[str, Any]], findings: Sequence[Finding]) -> dict:
    return {"ranks": [dict(r) for r in ranks], "findings": [asdict(f) for f in findings],
            "errors": sum(f.level == "error" for f in findings),
            "warnings": sum(f.level == "warning" for f in findings)}
