#!/usr/bin/env bash
# Packaging smoke test: what a cluster user installs is a wheel, not this checkout.
# Build the wheel, install it into a fresh venv, and from a directory outside the repository
# run the README's first commands: `mpiexec -n 2 hpcdl demo` (a few steps) and
# `hpcdl train --recipe demo_fmnist` (a shipped recipe by name). Also check that the wheel
# installs nothing but `hpcdl` at the top level (no generic `slurm`, `data_prep`, `recipes`).
#
# The fresh venv sees the dependencies (torch, mpi4py, ...) of the python that runs this
# script through a .pth file naming its site-packages directories: a .pth line only adds a
# path, it does not run the .pth files found there, so an editable install of this checkout
# stays invisible and `import hpcdl` can only come from the wheel (checked below).
# Usage: tests/wheel_smoke.sh [PYTHON]   (about a minute on 2 cores)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${1:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/hpcdl-wheel-smoke.XXXXXX")
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-300}

echo "--- wheel: build from a copy of the checkout's files (the build writes build/ and egg-info)"
mkdir "$work/src"
if git -C "$repo" rev-parse --git-dir >/dev/null 2>&1; then
    (cd "$repo" && git ls-files -z --cached --others --exclude-standard \
        | xargs -0 -I{} sh -c 'test -e "{}" && printf "%s\0" "{}"' \
        | tar --null -T - -cf -) | tar -xf - -C "$work/src"
else
    cp -a "$repo/." "$work/src"
fi
# Build with the setuptools at hand when it can make wheels by itself (>= 70.1), else in
# pip's isolated build environment (fetches setuptools, as `pip install -e .` did).
isolation=--no-build-isolation
"$python" -c "import setuptools.command.bdist_wheel" 2>/dev/null || isolation=
"$python" -m pip wheel -q --no-deps $isolation -w "$work/dist" "$work/src"
wheel=$(ls "$work"/dist/hpcdl-*.whl)

echo "--- wheel: top-level names and package data of $(basename "$wheel")"
"$python" - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
top = sorted({n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")})
assert top == ["hpcdl"], f"the wheel installs top-level {top}; only hpcdl may be there"
for wanted in ("hpcdl/recipes/demo_fmnist.yaml", "hpcdl/slurm/job_body.sh",
               "hpcdl/demo_data/train-images-idx3-ubyte.gz", "hpcdl/data_prep/shard.py"):
    assert wanted in names, f"the wheel lacks {wanted}"
print(f"ok: {len(names)} files, top level {top}")
PY

echo "--- venv: fresh, the wheel installed without dependencies"
# No pip in the venv (ensurepip takes longer than the rest): this python's pip installs into it.
"$python" -m venv --without-pip "$work/venv"
"$python" -c "import site, sysconfig; print('\n'.join(dict.fromkeys(site.getsitepackages() + \
    [sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib']])))" \
    > "$(ls -d "$work"/venv/lib/python3*/site-packages)/zz-host-dependencies.pth"
"$python" -m pip --python "$work/venv/bin/python" install -q --no-deps --no-index "$wheel"
cd "$work"   # outside the checkout: nothing can be imported from the source tree
"$work/venv/bin/python" - "$work/venv" <<'PY'
import sys, hpcdl, hpcdl.recipes, hpcdl.slurm, hpcdl.data_prep
for module in (hpcdl, hpcdl.recipes, hpcdl.slurm, hpcdl.data_prep):
    assert module.__file__.startswith(sys.argv[1]), f"{module.__name__} from {module.__file__}"
for generic in ("slurm", "data_prep", "recipes"):
    try:
        __import__(generic)
    except ImportError:
        continue
    raise AssertionError(f"a top-level '{generic}' is importable from the wheel's venv")
print("ok: hpcdl imported from the wheel:", hpcdl.__file__)
PY

echo "--- mpiexec -n 2 hpcdl demo --max-steps 4 (from the wheel)"
mpiexec -n 2 "$work/venv/bin/hpcdl" demo --out "$work/demo" --max-steps 4 --no-progress
test -s "$work/demo/summary.json"

echo "--- mpiexec -n 2 hpcdl train --recipe demo_fmnist (a shipped recipe by name)"
mpiexec -n 2 "$work/venv/bin/hpcdl" train --recipe demo_fmnist --data "$work/demo/data/shards" \
    --out "$work/train" --max-steps 2 --no-eval --no-progress
test -s "$work/train/summary.json"
echo "wheel smoke test: ok"
