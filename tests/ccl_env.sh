#!/usr/bin/env bash
# Assemble a working oneCCL 2022.2.0 from the registry's wheels and print the environment that
# points hpcdl's `ccl` backend at it, the way a site's `module load ccl` would:
#
#   eval "$(tests/ccl_env.sh)"        # exports CCL_ROOT, LD_LIBRARY_PATH, CPATH
#
# Why by hand (docs/comm.md, "oneCCL from the registry"): `pip install oneccl-cpu` fails (it
# requires libfabric>=2.6, which no registry here has), and the CPU wheel's libccl.so.1 needs
# libccl.so.2 -- the C API's plugin loader -- which only the full `oneccl` wheel carries, with
# the CPU plugin libccl_legacy_cpu.so. So: `pip download --no-deps` the three wheels and put
# the CPU core, the loader and the CPU plugin side by side in one lib/ (the full wheel's own
# libccl.so.1 is its 230 MB SYCL build: not taken). The devel wheel gives include/oneapi/ccl.h.
#
# The result lives in ${HPCDL_CCL_CACHE:-${XDG_CACHE_HOME:-~/.cache}/hpcdl}/oneccl-2022.2.0;
# a finished one (its stamp file) is reused, so a rerun prints the same lines in milliseconds.
set -euo pipefail
version=2022.2.0
cache=${HPCDL_CCL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hpcdl}
root=$cache/oneccl-$version
python=${PYTHON:-python3}
die() { echo "ccl_env.sh: $*" >&2; exit 1; }

assemble() {
    work=$(mktemp -d "$cache/.oneccl-$version.XXXXXX")
    trap 'rm -rf "$work"' EXIT  # a failed or interrupted download leaves nothing behind
    echo "ccl_env.sh: downloading oneccl-cpu, oneccl-cpu-devel, oneccl $version" >&2
    "$python" -m pip download -q --no-deps --dest "$work/wheels" \
        "oneccl-cpu==$version" "oneccl-cpu-devel==$version" "oneccl==$version" >&2 \
        || die "pip download of the oneCCL $version wheels failed (see above)"
    # Only the members we need: the full wheel's SYCL libccl.so.1 alone unpacks to 230 MB.
    "$python" - "$work/wheels" "$work/root" <<'EOF'
import pathlib, shutil, sys, zipfile
wheels, root = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wanted = {  # wheel name prefix -> members (below <name>.data/data/) to copy
    "oneccl_cpu-": ("lib/libccl.so", "lib/libccl.so.1", "lib/libccl.so.1.0",
                    "lib/libccl_openmp.so", "lib/libccl_openmp.so.0", "lib/libccl_openmp.so.0.1"),
    "oneccl-": ("lib/libccl.so.2", "lib/libccl.so.2.0", "lib/libccl_legacy_cpu.so",
                "share/doc/ccl/licensing/license.txt",
                "share/doc/ccl/licensing/third-party-programs.txt"),
    "oneccl_cpu_devel-": ("include/",),
}
for prefix, members in wanted.items():
    [wheel] = [w for w in wheels.glob("*.whl") if w.name.startswith(prefix)]
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            rel = info.filename.split(".data/data/", 1)[-1]
            if info.is_dir() or not any(rel == m or (m.endswith("/") and rel.startswith(m))
                                        for m in members):
                continue
            target = root / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            target.chmod(0o755 if rel.startswith("lib/") else 0o644)
for need in ("lib/libccl.so.1", "lib/libccl.so.2", "lib/libccl_legacy_cpu.so",
             "include/oneapi/ccl.h"):
    if not (root / need).is_file():
        sys.exit(f"ccl_env.sh: {need} is in none of the wheels")
EOF
    echo "$version" >"$work/root/.hpcdl-assembled"
    rm -rf "$root"
    mv "$work/root" "$root"  # atomic: a half-assembled tree is never at $root
}

if [ ! -f "$root/.hpcdl-assembled" ]; then
    mkdir -p "$cache"
    assemble
fi
echo "ccl_env.sh: oneCCL $version in $root" >&2
echo "export CCL_ROOT=$root"
echo "export LD_LIBRARY_PATH=$root/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
echo "export CPATH=$root/include\${CPATH:+:\$CPATH}"
