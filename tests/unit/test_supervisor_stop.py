"""The supervisor of every Ray the platform starts (`python -m rayhpc.ray_start`) stops its node with the GCS
last: every other process below it is gone before the GCS is killed, and `ray start` (held meanwhile) after
it. A stand-in tree, no Ray: `ray start` is a shell whose children are a GCS (a copy of `sleep` named
`gcs_server`, which is how the platform tells the GCS: its executable's name) and two other processes."""

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from helpers import ROOT, job_env
from rayhpc.processes import alive, descendants, is_gcs


def test_the_supervisor_kills_every_other_process_before_the_gcs_and_ray_start_after_it(tmp_path):
    gcs = tmp_path / "gcs_server"
    shutil.copy(shutil.which("sleep"), gcs)
    tree = f"{gcs} 600 & sleep 600 & sleep 600 & wait"
    supervisor = subprocess.Popen([sys.executable, "-P", "-m", "rayhpc.ray_start", str(os.getpid()), "--",
                                   "sh", "-c", tree], cwd=ROOT, env=job_env({}))
    deadline = time.monotonic() + 30
    while len(below := descendants(supervisor.pid)) < 4:
        assert supervisor.poll() is None and time.monotonic() < deadline, below
        time.sleep(0.02)
    (ray_start,) = [pid for pid in below if Path(f"/proc/{pid}/comm").read_text().strip() == "sh"]
    (gcs_pid,) = [pid for pid in below if is_gcs(pid)]
    seen = []  # the processes alive at each look, every millisecond
    watching = True

    def watch():
        while watching:
            seen.append({pid for pid in below if alive(pid)})
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    supervisor.terminate()
    try:
        assert supervisor.wait(timeout=30) == 0
    finally:
        watching = False
        watcher.join()
    assert not [pid for pid in below if alive(pid)]
    # never the GCS gone while another process of the node runs, nor `ray start` gone while the GCS runs (a look
    # may fall between two kills or not, on a loaded machine: what it sees must never break the order)
    others = set(below) - {gcs_pid, ray_start}
    broken = [alive_now for alive_now in seen if (gcs_pid not in alive_now and alive_now & others)
              or (ray_start not in alive_now and gcs_pid in alive_now)]
    assert len(seen) > 10 and not broken, (broken[:3], gcs_pid, ray_start)
