"""Markdown tables over `hpcdl bench train` runs across hosts
(benchmarks/train_step_across_hosts.sh).

    python3 docs/results/step-across-hosts-2026-12-01/summarize.py RUN.json [RUN.json ...]

Per run and mode: the mean step, its CPU seconds (the rank's, every thread), what the host's
eth0 sent, the main thread's wait for the last buckets and the reducer thread's CPU; then per
link rate the median [min-max] over runs of each mode's step over the ceiling's and over
DDP's (images/s ratios), and of the CPU the communication adds to a step.
"""
import json
import statistics
import sys
from collections import defaultdict


def fmt(value, spec=".2f"):
    return "—" if value is None else format(value, spec)


def main(paths: list[str]) -> None:
    spread = defaultdict(lambda: defaultdict(list))
    print("| run | load before→after | mode | step s (median) | vs no_comm | vs DDP | CPU s/step |"
          " eth0 MB/step sent | last-bucket wait s | reducer thread CPU s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for path in paths:
        report = json.load(open(path))
        by_mode = {r["mode"]: r for r in report["results"]}
        load = report["machine"].get("load_average", {})
        shaping = next(iter(report["machine"].get("link_shaping", {}).values()), "") or ""
        rate = shaping.split(" rate ")[1].split()[0] if " rate " in shaping else "unshaped"
        name = "/".join(path.removesuffix(".json").split("/")[-2:])
        ceiling = by_mode.get("no_comm")
        ddp = by_mode.get("ddp_gloo")
        for mode, r in by_mode.items():
            vs_ceiling = (r["images_per_s_per_rank"] / ceiling["images_per_s_per_rank"]
                          if ceiling else None)
            vs_ddp = r["images_per_s_per_rank"] / ddp["images_per_s_per_rank"] if ddp else None
            if vs_ceiling is not None and mode != "no_comm":
                spread[rate][f"{mode} / no_comm"].append(vs_ceiling)
            if vs_ddp is not None and mode != "ddp_gloo":
                spread[rate][f"{mode} / ddp_gloo"].append(vs_ddp)
            if ceiling and r.get("cpu_s_per_step") is not None and mode != "no_comm":
                spread[rate][f"{mode} CPU s added per step"].append(
                    r["cpu_s_per_step"] - ceiling["cpu_s_per_step"])
            loads = (f"{load['before'][0]:.1f}→{load['after'][0]:.1f}" if load else "—")
            print(f"| {name} | {loads} | {mode} | {r['step_time_s']:.2f} "
                  f"({r['step_time_median_s']:.2f}) | {fmt(vs_ceiling, '.3f')} | "
                  f"{fmt(vs_ddp, '.3f')} | {fmt(r.get('cpu_s_per_step'))} | "
                  f"{fmt(r.get('nic_tx_MB_per_step'), '.1f')} | {fmt(r.get('comm_wait_s'))} | "
                  f"{fmt(r.get('comm_thread_cpu_s_per_step'))} |")
        if report.get("absent_modes"):
            for mode, why in report["absent_modes"].items():
                print(f"| {name} | | {mode} | absent: {why} | | | | | | |")
    print()
    for rate, values in spread.items():
        runs = max(len(v) for v in values.values())
        print(f"- **{rate}** ({runs} runs): " + "; ".join(
            f"{k} {statistics.median(v):.3f} [{min(v):.3f}–{max(v):.3f}]"
            for k, v in values.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
