"""The demo's final parameters before and after a restructuring, compared bit for bit.

    python3 benchmarks/demo_parameters.py --before REV [--after REV] --json FILE \
        [--after-override KEY=VALUE ...]

Each revision is checked out into a temporary git worktree and runs ``mpiexec -n 2 hpcdl demo``
from it (``PYTHONPATH`` on that tree; the top-level stages ``data_prep``, ``slurm`` and
``recipes`` linked under ``hpcdl/`` as the editable install maps them) for ``--max-steps``
steps on the ``shm`` backend: the start-up trial of ``backend: auto`` picks by timing, and a
different transport sums in a different order. The SHA-256 of every parameter and buffer of the
last checkpoint's model, in name order (``hpcdl.train.metrics.params_sha256``), is written for
both. A later revision that computes in
bf16 by default (``train.precision: auto`` on a CPU with native bf16) needs
``--after-override train.precision=float32`` to be compared with an fp32 one.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from hpcdl.results import machine_info
from hpcdl.train.metrics import params_sha256

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("data_prep", "slurm", "recipes")


def model_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's state of a checkpoint: a directory (its ``model.pt``) or a single file."""
    path = checkpoint / "model.pt" if checkpoint.is_dir() else checkpoint
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


def parameters_sha256(run_dir: Path) -> tuple[str, str]:
    """The last checkpoint's name and the SHA-256 of its model's tensors, in name order."""
    last = sorted((run_dir / "checkpoints").glob("ckpt-*.pt"))[-1]
    return last.name, params_sha256(sorted(model_state(last).items()))


def run_demo(rev: str, out: Path, steps: int, overrides: list[str]) -> dict[str, str]:
    """The demo of revision ``rev`` at -n 2 into ``out``; its commit, command and hash."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], check=True,
                            capture_output=True, text=True).stdout.strip()
    tree = out.parent / f"tree-{commit[:12]}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit],
                   check=True, capture_output=True)
    try:
        for stage in STAGES:
            if (tree / stage).is_dir():
                (tree / "hpcdl" / stage).symlink_to(Path("..") / stage)
        command = ["mpiexec", "-n", "2", sys.executable, "-m", "hpcdl.cli.main", "demo",
                   "--recipe", "recipes/demo_fmnist.yaml", "--out", str(out),
                   "--max-steps", str(steps), "--backend", "shm", "--no-progress", *overrides]
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
        subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True)
        checkpoint, sha = parameters_sha256(out)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                       check=False, capture_output=True)
    shown = " ".join([*command[:3], "python3", *command[4:]])
    return {"rev": rev, "commit": commit, "command": shown, "checkpoint": checkpoint,
            "parameters_sha256": sha}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the revision before")
    parser.add_argument("--after", default="HEAD", help="the revision after (default HEAD)")
    parser.add_argument("--after-override", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override for the later revision only (repeatable)")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--json", required=True, metavar="FILE")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = run_demo(args.before, Path(tmp) / "before", args.max_steps, [])
        after = run_demo(args.after, Path(tmp) / "after", args.max_steps, args.after_override)
    report = {"machine": machine_info(ranks=2), "max_steps": args.max_steps,
              "before": before, "after": after,
              "identical": before["parameters_sha256"] == after["parameters_sha256"]}
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"{before['commit'][:9]} {before['parameters_sha256'][:16]}  "
          f"{after['commit'][:9]} {after['parameters_sha256'][:16]}  "
          f"{'identical' if report['identical'] else 'DIFFERENT'}")
    return 0 if report["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
