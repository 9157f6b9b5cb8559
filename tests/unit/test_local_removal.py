"""The local Ray's folder is removed whole even when a forced exit (another thread) begins while the main
thread is removing it: the forced exit waits for that removal instead of finding nothing left to do and
ending the process halfway through it (CI once found a session folder left behind)."""

import threading
import time

from rayhpc import cluster


def test_a_second_removal_waits_for_the_one_under_way(tmp_path, monkeypatch):
    folder = tmp_path / "rayhpc-local"
    (folder / "ray" / "session_1").mkdir(parents=True)
    started = threading.Event()

    def slow_kill(pids, timeout_s=10.0):  # the main thread's removal, busy killing Ray's processes
        started.set()
        time.sleep(0.5)
        return []

    monkeypatch.setattr(cluster.processes, "kill_gcs_last", slow_kill)
    monkeypatch.setattr(cluster.processes, "marked", lambda *a, **k: [])
    monkeypatch.setattr(cluster, "_local", [cluster.LocalCluster(folder, "marker", {})])
    main = threading.Thread(target=cluster.remove_local_temp)
    main.start()
    assert started.wait(5)
    cluster.remove_local_temp()  # the forced exit's call: returns only once the folder is gone
    assert not folder.exists(), "the forced exit returned (and would end the process) before the folder went"
    main.join(5)
    assert cluster._local == []
