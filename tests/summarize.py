"""Add up the JUnit files of one test run into a single closing line.

The MPI stages run pytest on every rank; rank 0's file stands for its stage (the others ran
the same tests and a failure there already failed the stage's exit code).
"""
from __future__ import annotations

import glob
import os
import sys
import xml.etree.ElementTree as ET


def counts(path: str) -> tuple[int, int, int]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    return tests - failed - skipped, failed, skipped


def main(directory: str) -> int:
    files = [f for f in sorted(glob.glob(os.path.join(directory, "*.xml")))
             if ".rank" not in f or f.endswith(".rank0.xml")]
    passed = failed = skipped = 0
    for path in files:
        p, f, s = counts(path)
        print(f"{os.path.basename(path)}: {p} passed, {f} failed, {s} skipped")
        passed, failed, skipped = passed + p, failed + f, skipped + s
    print(f"total: {passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed or not passed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "test-results"))
