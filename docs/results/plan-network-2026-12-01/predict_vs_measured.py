"""The planner's allreduce time against `hpcdl bench allreduce` across the test cluster's hosts.

    python docs/results/plan-network-2026-12-01/predict_vs_measured.py \
        --machine machines/local.yaml --calibrated-rate 2gbit \
        2gbit=allreduce-2hosts-2gbit.json 2gbit=allreduce-3hosts-2gbit.json ... --json table.json

Each measured row (backend, ranks = hosts at one rank each, bytes, the slowest rank's median
time) is predicted by hpcdl.plan.model.allreduce_s from the machine file that
`hpcdl plan --calibrate` wrote across 2 hosts: ``ring`` (hpcdl's ring backend) with the ring
cost, ``mpi`` (MPICH's MPI_Allreduce, Rabenseifner's reduce-scatter + allgather at these
sizes) with the Rabenseifner cost. A row at another link rate than the calibration's is
predicted with the calibrated bandwidth scaled by the ratio of the tbf rates (the shaper sets
the rate; the protocol's share of it is what the calibration measured).
"""
from __future__ import annotations

import argparse
import json
import sys

import yaml

from hpcdl.plan.machine import parse_machine
from hpcdl.plan.model import Placement, allreduce_s

ALGORITHM = {"ring": "ring", "mpi": "rabenseifner", "default": "rabenseifner"}
UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bps(text: str) -> float:
    for unit, scale in UNITS.items():
        if text.lower().endswith(unit):
            return float(text[: -len(unit)]) * scale
    raise SystemExit(f"bad rate {text!r}: use e.g. 1gbit, 500mbit")


def machine_at(doc: dict, scale: float):
    doc = json.loads(json.dumps(doc))
    doc["network"]["bandwidth_Bps"]["value"] *= scale
    return parse_machine(doc, "<scaled>")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machine", required=True)
    parser.add_argument("--calibrated-rate", required=True)
    parser.add_argument("--calibrated-hosts", type=int, default=2)
    parser.add_argument("measured", nargs="+", metavar="RATE=FILE")
    parser.add_argument("--json")
    args = parser.parse_args()
    with open(args.machine, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    base = rate_bps(args.calibrated_rate)
    rows = []
    for item in args.measured:
        rate, path = item.split("=", 1)
        machine = machine_at(doc, rate_bps(rate) / base)
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
        for r in report["results"]:
            if r.get("backend") not in ALGORITHM or "time_s" not in r:
                continue
            hosts = int(r["ranks"])
            predicted = allreduce_s(ALGORITHM[r["backend"]], machine, Placement(hosts, 1),
                                    float(r["bytes"]))
            seen = hosts == args.calibrated_hosts and rate == args.calibrated_rate
            rows.append({"rate": rate, "hosts": hosts, "backend": r["backend"],
                         "algorithm": ALGORITHM[r["backend"]], "bytes": r["bytes"],
                         "measured_s": r["time_s"], "predicted_s": predicted,
                         "predicted_over_measured": predicted / r["time_s"],
                         "calibration_layout": seen, "file": path})
    print(f"{'rate':>7} {'hosts':>5} {'backend':>7} {'algorithm':>12} {'MB':>6} "
          f"{'measured s':>10} {'predicted s':>11} {'pred/meas':>9}  row")
    for row in rows:
        print(f"{row['rate']:>7} {row['hosts']:>5} {row['backend']:>7} {row['algorithm']:>12} "
              f"{row['bytes'] / 1e6:>6.0f} {row['measured_s']:>10.3f} {row['predicted_s']:>11.3f}"
              f" {row['predicted_over_measured']:>9.3f}  "
              f"{'calibration layout' if row['calibration_layout'] else 'held out'}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": args.machine, "calibrated_rate": args.calibrated_rate,
                       "network": doc["network"], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
