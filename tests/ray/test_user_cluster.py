"""`rayhpc up` / `rayhpc down`: the user's own cluster that later commands join, left as they found it, and
stopped cleanly under running jobs. Real Ray, real jobs; the suite's RAYHPC_HOME (conftest) holds the
connection file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from ray.util.state import list_actors, list_objects, list_placement_groups

from helpers import ROOT, job_env, run_job
from rayhpc.tune.results import read_results
from rayhpc.up import connection, warm

# Ray Train's autoscaling coordinator: one detached actor per cluster, made by its first Train run
CLUSTER_SERVICES = {"_AutoscalingCoordinatorActor"}


def rayhpc(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rayhpc", *args], capture_output=True, text=True, cwd=ROOT,
                          env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, timeout=timeout)


def up(*flags: str) -> dict:
    proc = rayhpc("up", "--num-cpus", "2", "--num-gpus", "0", *flags)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return connection.read()


def down() -> str:
    proc = rayhpc("down")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def assert_gone(info: dict) -> None:
    """Nothing of the cluster `info` left: no process, no temp folder, no connection file, no listener."""
    deadline = time.monotonic() + 10
    while connection.leftovers(info["marker"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not connection.leftovers(info["marker"]), "processes of the cluster are left"
    assert not Path(info["temp_dir"]).exists() and not Path(info["ray_tmpdir"]).exists()
    assert not connection.path().exists() and not connection.socket_path().exists()
    assert not connection.listening_uids(info["ports"]["gcs"])


@pytest.fixture(scope="module")
def user_cluster(ray_cluster):
    """The user's cluster (`ray_cluster`: this process then talks to Ray with the token, for the state API)."""
    info = up()
    yield info
    if connection.path().exists():
        down()


def snapshot(address: str) -> dict[str, set]:
    """What lives on the cluster: actors (not its services), placement groups, objects. `address` is the
    dashboard's URL: given the GCS address, the state API would keep a GCS client in this process, and
    once the cluster is down that client ends the whole test session 60 s later."""
    return {"actors": {a.actor_id for a in list_actors(address=address) if a.state != "DEAD"
                       and a.class_name not in CLUSTER_SERVICES},
            "groups": {g.placement_group_id for g in list_placement_groups(address=address) if g.state != "REMOVED"},
            "objects": {o.object_id for o in list_objects(address=address)}}


def assert_as_found(address: str, before: dict[str, set], timeout_s: float = 15) -> None:
    """The cluster as `before` (Ray frees an ended driver's actors and objects asynchronously: a few s)."""
    deadline = time.monotonic() + timeout_s
    while (now := snapshot(address)) != before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert now == before, {k: now[k] - before[k] for k in now}


def test_up_writes_a_private_connection_file_and_status_shows_it(user_cluster):
    file = connection.path()
    assert file.stat().st_mode & 0o777 == 0o600 and file.parent.stat().st_mode & 0o777 == 0o700
    assert set(user_cluster) >= {"address", "ports", "nodes", "token_path", "head", "pid", "temp_dir"}
    assert Path(user_cluster["temp_dir"]).stat().st_mode & 0o777 == 0o700
    again = rayhpc("up")
    assert again.returncode == 0 and again.stdout.startswith("already up: "), again.stdout + again.stderr
    status = rayhpc("status")
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"your cluster (rayhpc up) on {connection.host()}: {user_cluster['address']}" in status.stdout
    assert "1 node(s); in use: 0/2 CPU" in status.stdout, status.stdout


def start(script: str, args: list[str], marks: Path) -> subprocess.Popen:
    """`python jobs/SCRIPT ARGS` as a user runs it, its phases marked in `marks` (with the pid that ran them)."""
    return subprocess.Popen([sys.executable, str(ROOT / "jobs" / script), *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=job_env({"RAYHPC_TIMINGS": str(marks)}))


def assert_joined_in_the_starter(job: subprocess.Popen, marks: Path, address: str) -> None:
    """The job ended well, joined the cluster, and ran in a child of the cluster's warm starter (the process the
    command started only waited for it)."""
    out, _ = job.communicate(timeout=300)
    assert job.returncode == 0, out
    assert f"ray: joined your cluster (rayhpc up) at {address}" in out and "started local Ray" not in out, out
    ran_in = {json.loads(line)["pid"] for line in marks.read_text().splitlines()}
    assert len(ran_in) == 1 and ran_in != {job.pid}, (ran_in, job.pid)


def test_a_training_job_joins_it_and_leaves_it_as_it_found_it(user_cluster, tmp_path):
    address = user_cluster["address"]
    before = snapshot(user_cluster["dashboard"])
    job = start("train_mlp.py", ["--storage-path", str(tmp_path), "--num-workers", "2", "--epochs", "1"],
                tmp_path / "marks")
    assert_joined_in_the_starter(job, tmp_path / "marks", address)
    assert_as_found(user_cluster["dashboard"], before)


def sweep_args(folder: Path, hidden: list[int], epochs: int = 40) -> list[str]:
    """The same sweep name for both jobs, in their own folders: only their grids tell them apart."""
    folder.mkdir()
    (folder / "sweep.yaml").write_text(f"name: same\nstorage_path: {folder}\nsearch: grid\nepochs: {epochs}\n"
                                       f"space: {{hidden: {{grid: {hidden}}}, lr: {{grid: [0.01]}}}}\n")
    return ["--config", str(folder / "sweep.yaml")]


def sweeps_shown() -> list[set[int]]:
    """The trials' `hidden` of each sweep `rayhpc status` shows (its board on the cluster)."""
    text = rayhpc("status").stdout
    shown = []
    for block in text.split("\nsweep ")[1:]:
        lines = block.splitlines()
        if len(lines) < 3:  # "sweep NAME: no trials yet"
            continue
        column = lines[1].split().index("hidden")
        shown.append({int(line.split()[column]) for line in lines[2:] if line.strip()})
    return shown


def test_two_sweeps_at_once_see_only_their_own_and_leave_it_as_they_found_it(user_cluster, tmp_path):
    address, grids = user_cluster["address"], {"a": [8, 16], "b": [32, 64]}
    before = snapshot(user_cluster["dashboard"])
    jobs = {name: start("tune_mlp.py", sweep_args(tmp_path / name, grid), tmp_path / f"{name}.marks")
            for name, grid in grids.items()}
    # while both run, each has its own board (what `rayhpc status` shows) with its own trials
    deadline, seen = time.monotonic() + 120, set()
    while len(seen) < 2 and time.monotonic() < deadline and all(j.poll() is None for j in jobs.values()):
        seen |= {frozenset(hidden) for hidden in sweeps_shown() if len(hidden) == 2}
    for name, job in jobs.items():
        assert_joined_in_the_starter(job, tmp_path / f"{name}.marks", address)
    assert sorted(map(sorted, seen)) == [grids["a"], grids["b"]], seen
    for name, grid in grids.items():
        table = read_results(tmp_path / name / "same")
        assert sorted(table["config.hidden"]) == grid and set(table["status"]) == {"finished"}
    assert_as_found(user_cluster["dashboard"], before)
    assert not list(connection.jobs_dir().iterdir()), "a job that ended is still registered"


def test_ctrl_c_reaches_a_job_in_the_warm_starter_and_other_code_runs_in_its_own_process(user_cluster, tmp_path,
                                                                                          monkeypatch, caplog):
    job = subprocess.Popen([sys.executable, str(ROOT / "jobs" / "tune_mlp.py"), "--storage-path", str(tmp_path),
                            "--num-samples", "2", "--epochs", "100000"], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=job_env(None))
    deadline = time.monotonic() + 120
    while not list((tmp_path / "mlp-sweep").glob("train_pack_*/checkpoint_*")):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.2)
    job.send_signal(signal.SIGINT)  # to the command's process only, as a terminal's Ctrl-C
    out, err = job.communicate(timeout=60)
    assert job.returncode == 128 + signal.SIGINT, (job.returncode, err)
    assert err.startswith("interrupted by SIGINT: sweep mlp-sweep stopped;") and err.count("\n") == 1, err

    monkeypatch.setattr(warm, "fingerprint", lambda: "other code")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with caplog.at_level("INFO", logger="rayhpc"):
        assert warm.run("tune_main", ["--help"]) is None  # the starter refuses: the command runs here
    assert "your cluster's warm starter runs other code than this command" in caplog.text


def test_down_while_a_sweep_runs_ends_it_with_one_line_and_resume_continues(user_cluster, tmp_path):
    """Then a cluster that is gone (its holder SIGKILLed) is noticed at once by the resumed run, which starts a
    Ray of its own, says so, and removes what the cluster left."""
    config = tmp_path / "sweep.yaml"
    config.write_text(f"name: downed\nstorage_path: {tmp_path}\nnum_samples: 4\npack: 1\nmax_concurrent: 1\n"
                      "epochs: 5\ndata: {synthetic: {num_samples: 6000}}\n")
    exp_dir = tmp_path / "downed"
    driver = subprocess.Popen([sys.executable, str(ROOT / "jobs" / "tune_mlp.py"), "--config", str(config)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=job_env(None))
    deadline = time.monotonic() + 180
    while not (len(before := read_results(exp_dir)) and (before["status"] == "finished").any()):
        assert driver.poll() is None and time.monotonic() < deadline, "no trial finished before the deadline"
        time.sleep(0.2)
    text = down()
    assert "stopping 1 job(s) on it (SIGTERM: each saves its state): pids " in text, text
    out, err = driver.communicate(timeout=60)
    assert driver.returncode == 128 + signal.SIGTERM, (driver.returncode, err)
    lines = [line for line in err.strip().splitlines() if not line.startswith("(")]  # not forwarded by Ray
    assert len(lines) == 1 and lines[0].startswith("your cluster (rayhpc up) went away (rayhpc down): sweep "
                                                   "downed stopped"), err
    assert_gone(user_cluster)
    finished_before = read_results(exp_dir).query("status == 'finished'").set_index("trial_id")
    assert 0 < len(finished_before) < 4

    info = up("--no-warm")  # no warm starter: this cluster is killed at once
    os.kill(info["pid"], signal.SIGKILL)  # its Ray ends with it (tied to the process that started it)
    deadline = time.monotonic() + 15
    while connection.problem(info) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert connection.problem(info) == f"its process {info['pid']} has ended"
    proc = run_job("tune_mlp.py", "--config", str(config), "--resume")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    gone = [line for line in proc.stdout.splitlines() if "is gone" in line]
    assert gone == [f"ray: the cluster of `rayhpc up` in {connection.path()} is gone (its process {info['pid']} "
                    "has ended); this job starts a Ray of its own"], proc.stdout
    assert "started local Ray" in proc.stdout
    assert_gone(info)  # what the killed cluster left (its folders, files, socket) was removed by the job
    final = pd.read_parquet(exp_dir / "results.parquet").set_index("trial_id")
    assert len(final) == 4 and set(final["status"]) == {"finished"}
    pd.testing.assert_frame_equal(final.loc[finished_before.index][["val_loss", "train_seconds"]],
                                  finished_before[["val_loss", "train_seconds"]])
