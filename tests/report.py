"""The test command's closing report: each phase's wall time (set-up steps included) and the ten
slowest tests, from the timings the command recorded and the phases' JUnit files.

    python3 tests/report.py TIMINGS.tsv RUN_LOGS_DIR
"""

from __future__ import annotations

import glob
import os
import sys
import xml.etree.ElementTree as ET


def _minutes(seconds: str) -> str:
    try:
        s = int(seconds)
    except ValueError:
        return seconds
    return f"{s // 60} min {s % 60:02d} s"


def phases(path: str) -> list[tuple[str, str, str]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) == 3:
                rows.append((parts[0], parts[1], parts[2]))
    return rows


def counts(logs: str) -> dict[str, dict[str, int]]:
    """Per phase: tests, failures, errors, skipped (JUnit's own counts)."""
    out = {}
    for xml in sorted(glob.glob(os.path.join(logs, "*.xml"))):
        phase = os.path.basename(xml)[: -len(".xml")]
        c = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        for suite in ET.parse(xml).getroot().iter("testsuite"):
            for k in c:
                c[k] += int(suite.get(k, 0))
        out[phase] = c
    return out


def slowest(logs: str, n: int = 10) -> list[tuple[float, str, str]]:
    """The n slowest test cases over every phase; JUnit's time is setup + call + teardown, so a
    module's engine start is charged to its first test."""
    cases = []
    for xml in glob.glob(os.path.join(logs, "*.xml")):
        phase = os.path.basename(xml)[: -len(".xml")]
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            cases.append((float(case.get("time", 0) or 0), phase, name))
    cases.sort(reverse=True)
    return cases[:n]


def main(argv: list[str]) -> int:
    timings, logs = argv[1], argv[2]
    print("\n## The test command's time\n")
    print("| step or phase | wall time | result |")
    print("|---|---|---|")
    for name, secs, status in phases(timings):
        print(f"| {name} | {_minutes(secs)} | {status} |")
    c = counts(logs)
    if c:
        print("\n| pytest phase | tests | failed | errors | skipped |")
        print("|---|---|---|---|---|")
        for phase, k in c.items():
            print(f"| {phase} | {k['tests']} | {k['failures']} | {k['errors']} | {k['skipped']} |")
    slow = slowest(logs)
    if slow:
        print("\nThe ten slowest tests (setup + call + teardown: a shared engine's start is charged to")
        print("the first test that uses it):\n")
        print("| seconds | phase | test |")
        print("|---|---|---|")
        for secs, phase, name in slow:
            print(f"| {secs:.1f} | {phase} | `{name}` |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
