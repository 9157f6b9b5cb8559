"""A process's start as the start-up marks take it (`rayhpc.monitor.startup.process_start`): when it started,
to the clock tick, not up to a second early (the boot's time in whole seconds)."""

import subprocess
import sys
import time

from helpers import ROOT, job_env

REPORT = "import time; from rayhpc.monitor.startup import process_start; print(process_start(), time.time())"


def test_a_process_started_after_its_launch_and_before_it_ran():
    launched = time.time()
    proc = subprocess.run([sys.executable, "-c", REPORT], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env=job_env({}))
    started, running = map(float, proc.stdout.split())
    # clock ticks and the uptime are in 10 ms steps
    assert launched - 0.03 <= started <= running + 0.03, (launched, started, running)
