"""One markdown table over `hpcdl bench train` JSON files, then median [min-max] per model.

    python3 benchmarks/summarize_train.py RUN.json [RUN.json ...]
"""
import json
import statistics
import sys
from collections import defaultdict

RATIOS = ("vs_no_comm", "vs_ddp_gloo", "allreduce_vs_no_comm", "allreduce_vs_ddp_gloo",
          "sharded_vs_allreduce", "comm_wait")
MODES = ("ours", "ours_allreduce", "no_comm", "ddp_gloo")


def main(paths: list[str]) -> None:
    spread = defaultdict(lambda: defaultdict(list))
    print("| run | " + " | ".join(f"{m} img/s" for m in MODES) + " | " + " | ".join(RATIOS)
          + " |")
    print("|---|" + "---:|" * (len(MODES) + len(RATIOS)))
    for path in paths:
        report = json.load(open(path))
        rates = {r["mode"]: r["images_per_s_per_rank"] for r in report["results"]}
        ratios = report["ratios"]
        name = path.rsplit("/", 1)[-1].removesuffix(".json")
        model = name.rsplit("-run", 1)[0]
        for key in RATIOS:
            if key in ratios:
                spread[model][key].append(ratios[key])
        cells = [f"{rates[m]:.2f}" if m in rates else "—" for m in MODES]
        cells += [f"{ratios[k]:.3f}" if k in ratios else "—" for k in RATIOS]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print()
    for model, values in spread.items():
        parts = [f"{k} {statistics.median(v):.3f} [{min(v):.3f}–{max(v):.3f}]"
                 for k, v in values.items()]
        print(f"- {model} ({len(next(iter(values.values())))} runs): " + "; ".join(parts))


if __name__ == "__main__":
    main(sys.argv[1:])
