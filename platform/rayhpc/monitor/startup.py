"""Where a command's fixed cost goes: named marks on the way to its first result, timed from the process's start.

A job calls `mark(phase)` as each phase ends (imports, the task check, Ray's start, the first result, the
work, the shutdown). With RAYHPC_TIMINGS=FILE each mark is appended to FILE as a JSON line (`{"phase": ..., "t": unix time, "pid": ...}`), which
`jobs/bench_sweep.py --first-result` and `jobs/bench_train.py --first-result` read to print the
breakdown of a run beside the ideal and `torchrun`. Standard library only: the first mark is taken
before Ray or torch is imported.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

VARIABLE = "RAYHPC_TIMINGS"
_marks: list[tuple[str, float]] = []


def start_ticks(pid: int | str = "self") -> int:
    """When process `pid` started, in clock ticks since boot (/proc/PID/stat): with the pid, names one
    process for good (a pid alone may be another process's later). OSError where it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        raise OSError(f"/proc/{pid}/stat: unreadable") from None


def process_start() -> float:
    """This process's start as a unix time, from /proc (clock ticks since boot; 10 ms resolution). The boot's
    time from the uptime (10 ms), not /proc/stat's btime, which is in whole seconds: up to 1 s early (0.7 s on
    one machine), every process's start with it, and the phases that end at one (a trial's or a rank's
    process) looked that much shorter, the next ones that much longer."""
    try:
        ticks = start_ticks()
        boot = time.time() - float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def mark(phase: str, at: float | None = None) -> None:
    """The end of `phase`, now or `at` (a unix time another process measured, taken as the last mark's time
    where it is earlier: a process Ray started before that phase); the first mark of a phase counts: a
    resumed loop does not move it."""
    if any(name == phase for name, _ in _marks):
        return
    now = time.time() if at is None else max(at, _marks[-1][1]) if _marks else at
    _marks.append((phase, now))
    path = os.environ.get(VARIABLE)
    if path:
        with open(path, "a") as out:  # a file the benchmark made in its own private folder
            out.write(json.dumps({"phase": phase, "t": now, "pid": os.getpid()}) + "\n")


def read(path: str | Path) -> dict[str, float]:
    """The marks a run wrote to `path` (RAYHPC_TIMINGS): phase -> unix time."""
    lines = Path(path).read_text().splitlines() if Path(path).exists() else []
    return {entry["phase"]: entry["t"] for entry in map(json.loads, lines)}
