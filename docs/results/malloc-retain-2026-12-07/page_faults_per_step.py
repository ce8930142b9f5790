"""Page faults, seconds and peak memory per training step under three glibc allocator
policies, each in its own process: glibc's defaults, the mmap threshold at 32 MiB with no
trimming (hpcdl's policy before 2026-12-07), and that plus no mmap for heap blocks
(hpcdl.cpus.retain_freed_memory since). AlexNet-BN, batch 32, 224 px, one thread, plain torch
forward/backward and hpcdl's LARS; 2 untimed steps, then 5 timed.

    python3 page_faults_per_step.py OUT.json
"""
import json
import subprocess
import sys

STEP = r"""
import ctypes, ctypes.util, json, resource, sys, time
import torch
policy = sys.argv[1]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
if policy != "glibc_default":
    # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    assert libc.mallopt(-3, 32 << 20) and libc.mallopt(-1, 2 ** 31 - 1)
if policy == "every_size_kept":
    assert libc.mallopt(-4, 0)  # M_MMAP_MAX
torch.set_num_threads(1)
from hpcdl.models import create_model
from hpcdl.optim.lars import LARS, param_groups
torch.manual_seed(0)
model = create_model("alexnet_bn", num_classes=1000)
opt = LARS(param_groups(model, 5e-4), lr=0.01, momentum=0.9)
x, y = torch.randn(32, 3, 224, 224), torch.randint(0, 1000, (32,))
def step():
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
for _ in range(2):
    step()
before, t0, c0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), time.process_time()
for _ in range(5):
    step()
after = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"policy": policy,
                  "page_faults_per_step": (after.ru_minflt - before.ru_minflt) / 5,
                  "step_s": (time.perf_counter() - t0) / 5,
                  "cpu_s_per_step": (time.process_time() - c0) / 5,
                  "peak_rss_mb": after.ru_maxrss / 1024}))
"""


def main(out: str) -> None:
    from hpcdl.results import bench_report, write_json

    rows = []
    for policy in ("glibc_default", "threshold_32_mib", "every_size_kept"):
        done = subprocess.run([sys.executable, "-c", STEP, policy], check=True,
                              capture_output=True, text=True, env={"OMP_NUM_THREADS": "1",
                                                                    "PATH": "/usr/bin:/bin"})
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    write_json(out, bench_report("malloc-policy", rows, {}))


if __name__ == "__main__":
    main(sys.argv[1])
