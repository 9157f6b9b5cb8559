"""Time to first result: a command run cold (it starts and stops a Ray of its own) and with the user's
cluster up (`rayhpc up`: it joins), each run's wall split into the phases it marks (RAYHPC_TIMINGS,
`rayhpc.monitor.startup`): imports and config, task check, Ray's start (or join), the first result
(sweep) or fit() (training), the work, the shutdown, and the process's exit."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rayhpc.monitor.startup import VARIABLE, read

PHASES = ("imports and config", "task check", "ray", "trial process", "trial set-up (Ray Tune, imports)",
          "trial data and model", "first result", "work", "shutdown")


def rayhpc(*args: str, env: dict) -> str:
    proc = subprocess.run([sys.executable, "-m", "rayhpc", *args], capture_output=True, text=True,
                          env={**os.environ, **env})
    if proc.returncode:
        raise SystemExit(f"rayhpc {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def cold(work: Path) -> dict:
    """The environment of a cold run: a rayhpc folder with no cluster in it (not the user's, which may
    have one up)."""
    return {"RAYHPC_HOME": str(work / "home-cold")}


@contextlib.contextmanager
def cluster_up(work: Path, cpus: int):
    """The user's cluster (`rayhpc up`, `cpus` CPUs) in a rayhpc folder of the benchmark's; the
    environment of the runs that join it."""
    env = {"RAYHPC_HOME": str(work / "home-up")}
    rayhpc("up", "--num-cpus", str(cpus), "--num-gpus", "0", env=env)
    try:
        yield env
    finally:
        rayhpc("down", env=env)


def timed(command: list[str], env: dict, work: Path, name: str) -> dict:
    """Run `command`; its wall from launch to exit and each phase's seconds (`exit`: after the last mark)."""
    marks = work / f"{name}.timings"
    launch = time.time()
    proc = subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, **env, VARIABLE: str(marks), "PYTHONUNBUFFERED": "1"})
    end = time.time()
    if proc.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stdout}\n{proc.stderr}")
    at = read(marks)
    row, before = {"wall": end - launch, "stdout": proc.stdout}, launch
    for phase in PHASES:
        if phase in at:
            row[phase], before = at[phase] - before, at[phase]
    row["exit"] = end - before
    return row


def timed_plain_tuner(config: Path, work: Path, name: str) -> dict:
    """The sweep of `config` as plain Ray Tune runs it (`plain_tuner.py`): its wall from launch to exit, and the
    seconds of each phase it marks."""
    out, launch = work / f"{name}.json", time.time()
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("plain_tuner.py")), str(config),
                           "--storage-path", str(work / name), "--out", str(out), "--launch-time", str(launch)],
                          capture_output=True, text=True, env={**os.environ, "RAY_ADDRESS": ""})
    end = time.time()
    if proc.returncode:
        raise SystemExit(f"plain_tuner.py {config} failed:\n{proc.stdout}\n{proc.stderr}")
    at = {k: launch + v for k, v in json.loads(out.read_text()).items() if k != "trials"}
    row, before = {"wall": end - launch}, launch
    for phase in PHASES:
        if phase in at:
            row[phase], before = at[phase] - before, at[phase]
    row["exit"] = end - before
    return row


def median(rows: list[dict]) -> dict:
    keys = [k for k in rows[0] if isinstance(rows[0][k], float)]
    return {k: statistics.median(r[k] for r in rows if k in r) for k in keys}


def breakdown(row: dict) -> str:
    return ", ".join(f"{phase} {row[phase]:.1f}" for phase in (*PHASES, "exit") if phase in row)
