"""A rank that failed in the task's code, as one line: the rank, the task's function and line it failed in,
and the cause; every rank's traceback goes to the run's `error.log`, which the line names."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from rayhpc.config import JobFailed

ERROR_LOG = "error.log"  # a failed run's every rank traceback, in its folder


class RankTraceback(Exception):
    """A rank's exception, its whole traceback as the message (which, unlike a traceback, reaches the driver)."""


def plain(text: str) -> str:
    """Ray's error text without its terminal colours (`\x1b[36m`), for a log file and one line."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def cause_of(trace: str) -> str:
    """A traceback's last line: the exception and its message."""
    return ([line.strip() for line in trace.splitlines() if line.strip()] or [""])[-1]


def rank_failure(failed: dict[int | str, str], folder: Path, task_spec: str, what: str,
                 describe: Callable[[int | str], str] = lambda rank: f"rank {rank}",
                 traces: str = "every rank's traceback") -> JobFailed:
    """The first rank of `failed` (rank, or trial id, -> its traceback) as one line: the last frame in the
    task's file names the function (else `what` does), the traceback's last line the cause; every rank's
    traceback goes to `folder`/error.log (`traces`: what the line calls that file's contents)."""
    log_file = folder / ERROR_LOG
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    log_file.write_text("".join(f"--- {describe(r)} ---\n{trace.rstrip()}\n" for r, trace in sorted(failed.items())))
    rank, trace = min(failed.items())
    cause = cause_of(trace)
    task_file = Path(task_spec.rpartition(":")[0] or task_spec).name
    frames = [f for f in re.findall(r'File "([^"]+)", line (\d+), in (\S+)', trace)
              if task_file.endswith(".py") and Path(f[0]).name == task_file]
    where = f"the task's {frames[-1][2]}() at {frames[-1][0]}:{frames[-1][1]}" if frames else what
    return JobFailed(f"{describe(rank)} failed in {where}: {cause} ({traces}: {log_file})")
