"""What one rank reads from the file system at resume does not grow with the rank count:
`mpiexec -n P hpcdl train --resume auto` at P = 2 and 8 (oversubscribed, the tiny model), each
rank's bytes read during the resume from /proc/self/io (``rchar``, logged by the trainer).

Before, every rank loaded the whole checkpoint, which held every rank's RNG states and BN
statistics: each rank read the model plus P ranks' state (P x about 15 KB here). Now rank 0
reads the manifest and ``model.pt`` (broadcast to the others) and each rank its own file.

Serial test that launches its own mpiexec (never nested inside an MPI-launched rank)."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec"),
              pytest.mark.skipif(not os.path.exists("/proc/self/io"),
                                 reason="needs /proc/self/io (Linux) to count bytes read")]

RANKS = (2, 8)
OVERRIDES = ["batch.global=8", "batch.per_rank=null"]  # 4, 1 per rank at 2, 8 ranks
READ = re.compile(r"\[rank (\d+)/\d+ .*resumed from \S+ at step 2 .*this rank read (\d+) bytes")


def hpcdl_train(ranks, recipe, shards, out, *extra):
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "hpcdl.cli.main", "train",
           "--recipe", recipe, "--data", shards, "--out", str(out), "--no-eval",
           "--no-progress", "--max-steps", "2", *extra, *OVERRIDES]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIEXEC_TIMEOUT": "300"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish(proc):
    out, _ = proc.communicate(timeout=360)
    assert proc.returncode == 0, out[-4000:]
    return out


def bytes_read_per_rank(out):
    reads = {}
    for name in (n for n in os.listdir(out / "logs") if n.endswith(".log")):
        for line in open(out / "logs" / name):
            if m := READ.search(line):
                reads[int(m.group(1))] = int(m.group(2))
    return reads


@pytest.fixture(scope="module")
def reads(tmp_path_factory, tiny_shards, tiny_recipe):
    """{P: ({rank: bytes read at resume}, model.pt bytes, largest rank file bytes, the
    manifest's file records)}."""
    root = tmp_path_factory.mktemp("reads")
    first = [hpcdl_train(p, tiny_recipe, tiny_shards, root / f"p{p}", "--checkpoint-every", "2")
             for p in RANKS]
    for proc in first:
        finish(proc)
    result = {}
    for p in RANKS:  # one at a time: the resumes are what is measured
        finish(hpcdl_train(p, tiny_recipe, tiny_shards, root / f"p{p}", "--resume", "auto"))
        manifest = json.loads((root / f"p{p}" / "checkpoints" / "ckpt-000000002.pt" /
                               "manifest.json").read_text())
        result[p] = (bytes_read_per_rank(root / f"p{p}"), manifest["files"]["model.pt"]["bytes"],
                     max(r["bytes"] for n, r in manifest["files"].items() if n != "model.pt"),
                     manifest["files"])
    print({p: r[0] for p, r in result.items()}, "model.pt", result[RANKS[0]][1])
    return result


def test_every_rank_logs_what_it_read_at_resume(reads):
    for p, (per_rank, _, _, _) in reads.items():
        assert sorted(per_rank) == list(range(p))


def test_only_rank_0_reads_the_model_the_others_their_own_file(reads):
    per_rank, model, rank_file, _ = reads[max(RANKS)]
    assert per_rank[0] >= model
    for rank in range(1, max(RANKS)):
        assert rank_file <= per_rank[rank] < model, (rank, per_rank[rank])


def test_what_a_rank_reads_at_resume_does_not_grow_with_the_rank_count(reads):
    (small, _, rank_file, _), (large, _, _, _) = reads[min(RANKS)], reads[max(RANKS)]
    extra = max(RANKS) - min(RANKS)
    # The slack: rank 0 reads the manifest (one ~130-byte record a rank) up to 3 times (the
    # line index, the check, the line decision); 1/8 of a rank file for imports and noise.
    # Reading every rank's state (before: a rank file's worth a rank) exceeds it by far.
    slack = 3 * 130 * extra + rank_file // 8
    assert max(large.values()) <= max(small.values()) + slack, (small, large)
    assert max(large[r] for r in range(1, max(RANKS))) <= \
        max(small[r] for r in range(1, min(RANKS))) + rank_file // 8, (small, large)


def test_what_a_rank_writes_does_not_grow_with_the_rank_count(reads):
    """One file a rank, each the same size at 2 and 8 ranks (torch's zip pads records to 64
    bytes), and model.pt the same: nothing of another rank is written by any rank."""
    small, large = reads[min(RANKS)][3], reads[max(RANKS)][3]
    assert sorted(large) == ["model.pt"] + [f"rank-{r:05d}.pt" for r in range(max(RANKS))]
    assert large["model.pt"]["bytes"] == small["model.pt"]["bytes"]
    sizes = [r["bytes"] for n, r in small.items() if n != "model.pt"]
    for name, record in large.items():
        if name != "model.pt":
            assert record["bytes"] <= max(sizes) + 64, (name, record, sizes)
