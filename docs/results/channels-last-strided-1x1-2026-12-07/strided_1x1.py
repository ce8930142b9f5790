"""A 1x1 stride-2 convolution's gradients in channels_last against a float64 reference, by
input channels and threads, each case in its own process (a case may crash or hang):
``python3 strided_1x1.py OUT.json``. What hpcdl.models.channels_last rests on."""
import json
import subprocess
import sys

import torch

from hpcdl.cpus import cpu_capability, cpu_model_name

CASE = """
import sys, torch
torch.manual_seed(0)
ic, threads, repeats = map(int, sys.argv[1:4])
torch.set_num_threads(threads)
conv = torch.nn.Conv2d(ic, 2 * ic, 1, stride=2, bias=False)
x = torch.randn(8, ic, 32, 32)
ref, xd = conv.double(), x.double().requires_grad_()
ref(xd).square().sum().backward()
gw, gx = ref.weight.grad.clone(), xd.grad.clone()
conv = conv.float().to(memory_format=torch.channels_last)
worst = 0.0
for _ in range(repeats):
    conv.weight.grad = None
    xc = x.clone().to(memory_format=torch.channels_last).requires_grad_()
    conv(xc).square().sum().backward()
    worst = max(worst, float((conv.weight.grad.double() - gw).abs().max() / gw.abs().max()),
                float((xc.grad.double() - gx).abs().max() / gx.abs().max()))
print(worst)
"""
CHANNELS = (2, 4, 6, 7, 8, 12, 16, 24, 64, 256)
THREADS = (1, 2)
REPEATS, TIMEOUT_S = 30, 60


def run_case(ic: int, threads: int) -> dict:
    try:
        done = subprocess.run([sys.executable, "-c", CASE, str(ic), str(threads),
                               str(REPEATS)], capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"ic": ic, "threads": threads, "outcome": f"hung (> {TIMEOUT_S} s)"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [""])[-1]
        return {"ic": ic, "threads": threads, "outcome": f"exit {done.returncode} {last}"}
    return {"ic": ic, "threads": threads, "outcome": "ran",
            "worst_relative_error": float(done.stdout)}


def main(out: str) -> None:
    cases = [run_case(ic, t) for ic in CHANNELS for t in THREADS]
    for c in cases:
        print(c["ic"], c["threads"], c["outcome"], c.get("worst_relative_error", ""))
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"cpu_model": cpu_model_name(), "cpu_capability": cpu_capability(),
                   "torch": torch.__version__, "repeats": REPEATS, "batch": 8,
                   "input": [32, 32], "cases": cases}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
