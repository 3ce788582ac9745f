"""CI's own bookkeeping: each nox session timed (wall, the CPU of its processes, the host's busy
CPU over the same span), and at the end a table of those, the ten slowest tests of all
sessions (read from each session's JUnit XML) and the ten that spent the most CPU (the lines
tests/conftest.py writes into OUT/cpu-SESSION/), so that the next change sees what it cost.

``python3 .ci/sessions.py run NAME OUT -- COMMAND...`` runs COMMAND and appends its timing to
OUT/sessions.jsonl (its exit status is the command's); ``python3 .ci/sessions.py report OUT``
prints the table. Standard library only: it runs before any venv exists.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

SLOWEST = 10


def host_busy_s() -> float:
    """Seconds of CPU the whole host has spent busy since boot (every core, every process:
    Ray's daemons too, which no parent waits for), from /proc/stat."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    idle, iowait = ticks[3], ticks[4]
    return (sum(ticks) - idle - iowait) / os.sysconf("SC_CLK_TCK")


def run(name: str, out: Path, command: list[str]) -> int:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started, busy0, t0 = time.time(), host_busy_s(), time.monotonic()
    status = subprocess.call(command)
    wall, busy1 = time.monotonic() - t0, host_busy_s()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    row = {
        "session": name,
        "status": status,
        "started": round(started, 1),
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "host_busy_s": round(busy1 - busy0, 1),
        "host_busy_from_s": round(busy0, 1),
        "host_busy_to_s": round(busy1, 1),
        "cores": os.cpu_count(),
    }
    out.mkdir(parents=True, exist_ok=True)
    with (out / "sessions.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    return status


def slowest(out: Path) -> list[tuple[float, str, str]]:
    """Every test case of every session's JUnit XML as (seconds, session, test id), slowest
    first."""
    cases = []
    for path in sorted(out.glob("*.xml")):
        for case in ET.parse(path).getroot().iter("testcase"):
            test = f"{case.get('classname', '')}::{case.get('name', '')}"
            cases.append((float(case.get("time") or 0.0), path.stem, test))
    return sorted(cases, reverse=True)


def most_cpu(out: Path) -> list[tuple[float, float, str, str]]:
    """Every test's (CPU seconds, wall seconds, session, test id), the most CPU first."""
    tests = []
    for path in sorted(out.glob("cpu-*/*.jsonl")):
        session = path.parent.name.removeprefix("cpu-")
        for line in path.read_text().splitlines():
            row = json.loads(line)
            tests.append((row["cpu_s"], row["wall_s"], session, row["test"]))
    return sorted(tests, reverse=True)


def report(out: Path) -> int:
    rows = [json.loads(line) for line in (out / "sessions.jsonl").read_text().splitlines()]
    print("\nCI sessions (wall; CPU of the session's own processes; the host's busy CPU):")
    for r in rows:
        share = r["host_busy_s"] / (r["wall_s"] * r["cores"]) if r["wall_s"] else 0.0
        print(
            f"  {r['session']:<18} exit {r['status']:<3} wall {r['wall_s']:7.1f} s"
            f"  cpu {r['cpu_s']:7.1f} s  host busy {r['host_busy_s']:7.1f} s"
            f" ({share:.0%} of {r['cores']} cores)"
        )
    span = max(r["started"] + r["wall_s"] for r in rows) - min(r["started"] for r in rows)
    busy = max(r["host_busy_to_s"] for r in rows) - min(r["host_busy_from_s"] for r in rows)
    cores = rows[0]["cores"]
    share = busy / (span * cores) if span else 0.0
    whole = f"  {'all of them':<18}          wall {span:7.1f} s"
    print(
        f"{whole}{'':19}host busy {busy:7.1f} s ({share:.0%} of {cores} cores)"
        " from the first start to the last end; sessions that overlap share the host's figure"
    )
    print(f"\nThe {SLOWEST} slowest tests (setup, call and teardown):")
    for seconds, session, test in slowest(out)[:SLOWEST]:
        print(f"  {seconds:7.1f} s  {session:<8} {test}")
    costly = most_cpu(out)
    if costly:
        counted = sum(cpu for cpu, *_ in costly)
        print(f"\nThe {SLOWEST} tests that spent the most CPU (their own process and the ones it")
        print(f"waited for; {counted:.0f} s counted over all tests, Ray's unwaited daemons not):")
        for cpu, wall, session, test in costly[:SLOWEST]:
            print(f"  {cpu:7.1f} s cpu {wall:7.1f} s wall  {session:<8} {test}")
    return 0


def main(argv: list[str]) -> int:
    if len(argv) >= 5 and argv[0] == "run" and argv[3] == "--":
        return run(argv[1], Path(argv[2]), argv[4:])
    if len(argv) == 2 and argv[0] == "report":
        return report(Path(argv[1]))
    print("error: usage: sessions.py run NAME OUT -- COMMAND... | report OUT", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
