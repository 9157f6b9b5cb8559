"""`rayhpc up` / `rayhpc down`: the user's own cluster that later commands join, left as they found it, and
stopped cleanly under running jobs. Real Ray, real jobs; the suite's RAYHPC_HOME (conftest) holds the
connection file."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pandas as pd
import pytest
from ray.util.state.api import StateApiClient
from ray.util.state.common import ListApiOptions, StateResource

from helpers import (
    CATCH_IMPORTS,
    CATCH_TOKENS,
    RAYHPC,
    ROOT,
    caught,
    dashboard_accepts,
    job_env,
    planted_folder,
    planted_imports,
    run_job,
    start_as_attacker,
)
from rayhpc import user_cluster as connection  # the module; `user_cluster` is the fixture
from rayhpc.tune.results import TRIAL_PHASES, read_results

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
    assert not connection.path().exists()
    assert not connection.listening_uids(info["ports"]["gcs"])


@pytest.fixture(scope="module")
def user_cluster(ray_cluster):
    """The user's cluster (`ray_cluster`: this process then talks to Ray with the token, for the state API)."""
    info = up()
    yield info
    if connection.path().exists():
        down()


def snapshot(info: dict) -> dict[str, set]:
    """What lives on the cluster of `info`: actors (not its services), placement groups, objects, asked through
    its dashboard with its own token (given the GCS address, the state API would keep a GCS client in this
    process, and once the cluster is down that client ends the whole test session 60 s later; this process
    sends the suite's cluster's token, not this one's)."""
    client = StateApiClient(info["dashboard"], headers={
        "Authorization": f"Bearer {Path(info['token_path']).read_text().strip()}"})

    def listed(resource: StateResource) -> list:
        return client.list(resource, ListApiOptions(limit=10_000), raise_on_missing_output=False)

    return {"actors": {a.actor_id for a in listed(StateResource.ACTORS) if a.state != "DEAD"
                       and a.class_name not in CLUSTER_SERVICES},
            "groups": {g.placement_group_id for g in listed(StateResource.PLACEMENT_GROUPS) if g.state != "REMOVED"},
            "objects": {o.object_id for o in listed(StateResource.OBJECTS)}}


def assert_as_found(info: dict, before: dict[str, set], timeout_s: float = 15) -> None:
    """The cluster as `before` (Ray frees an ended driver's actors and objects asynchronously: a few s)."""
    deadline = time.monotonic() + timeout_s
    while (now := snapshot(info)) != before and time.monotonic() < deadline:
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


def assert_joined(job: subprocess.Popen, marks: Path, address: str) -> None:
    """The job ended well, joined the cluster, and ran in the process the command started."""
    out, _ = job.communicate(timeout=300)
    assert job.returncode == 0, out
    assert f"ray: joined your cluster (rayhpc up) at {address}" in out and "started local Ray" not in out, out
    ran_in = {json.loads(line)["pid"] for line in marks.read_text().splitlines()}
    assert ran_in == {job.pid}, (ran_in, job.pid)


def test_a_training_job_joins_it_and_leaves_it_as_it_found_it(user_cluster, tmp_path):
    address = user_cluster["address"]
    before = snapshot(user_cluster)
    job = start("train_mlp.py", ["--storage-path", str(tmp_path), "--num-workers", "2", "--epochs", "1"],
                tmp_path / "marks")
    assert_joined(job, tmp_path / "marks", address)
    assert_as_found(user_cluster, before)


def test_a_tp_job_and_a_parameter_server_job_join_it_and_leave_it_as_they_found_it(user_cluster, tmp_path):
    """The model-parallel and parameter-server jobs join your cluster as the others do (the sweep and the
    training run: above), each in the process the command started, and leave nothing on it."""
    address = user_cluster["address"]
    before = snapshot(user_cluster)
    for name, args in {"tp": ["train_parallel.py", "--tp", "2", "--steps", "4"],
                       "ps": ["train_ps.py", "--mode", "sync", "--num-workers", "2", "--epochs", "1"]}.items():
        job = start(args[0], [*args[1:], "--storage-path", str(tmp_path / name)], tmp_path / f"{name}.marks")
        assert_joined(job, tmp_path / f"{name}.marks", address)
        assert (tmp_path / name).is_dir(), name
    assert_as_found(user_cluster, before)


def other_environment(tmp_path: Path) -> Path:
    """The Python of another virtual environment, which sees the suite's packages (the same versions): only the
    environment differs."""
    other = tmp_path / "other-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(other)], check=True)
    site_packages = next(other.glob("lib/python*/site-packages"))
    (site_packages / "suite.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    return other / "bin" / "python"


def test_a_job_of_another_environment_is_refused_with_one_line_unless_it_names_the_cluster(user_cluster, tmp_path):
    """A job run by another environment's Python would have joined the cluster and run its workers on the
    cluster's interpreter and packages, without a word: it is one `error:` line naming both environments and
    the commands that start a matching cluster or join this one anyway, exit 2, before any Ray starts. Joining
    anyway, as the line says, runs the job there."""
    python = other_environment(tmp_path)
    args = ["--num-samples", "1", "--epochs", "1"]
    proc = subprocess.run([str(python), str(ROOT / "jobs" / "tune_mlp.py"), *args, "--storage-path",
                           str(tmp_path / "refused")], capture_output=True, text=True, cwd=ROOT, env=job_env(None),
                          timeout=180)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    ours, theirs = os.path.realpath(python.parent.parent), os.path.realpath(sys.prefix)
    assert lines[0].startswith(f"error: your cluster (rayhpc up, {connection.path()}) runs Python "), lines
    assert f" in {theirs}, " in lines[0] and "; this command runs Python " in lines[0] and f" in {ours}, " in lines[0]
    assert f"({python} -m rayhpc down && {python} -m rayhpc up)" in lines[0], lines
    insist = f"RAY_AUTH_TOKEN_PATH={user_cluster['token_path']} and --address {user_cluster['address']}"
    assert lines[0].endswith(insist), lines
    assert not (tmp_path / "refused").exists()
    joined = subprocess.run([str(python), str(ROOT / "jobs" / "tune_mlp.py"), *args, "--storage-path",
                             str(tmp_path / "joined"), "--address", user_cluster["address"]], capture_output=True,
                            text=True, cwd=ROOT, env=job_env({"RAY_AUTH_TOKEN_PATH": user_cluster["token_path"]}),
                            timeout=300)
    assert joined.returncode == 0 and "started local Ray" not in joined.stdout, joined.stdout + joined.stderr
    assert len(read_results(tmp_path / "joined" / "mlp-sweep")) == 1


PROBE_WORKER = """
import json, os, sys
from rayhpc import cluster
env_vars = json.loads(sys.argv[1])  # the workers' environment, set otherwise
cluster.connect(cluster.resolve_address(None), **({"runtime_env": {"env_vars": env_vars}} if env_vars else {}))
import ray

@ray.remote(num_cpus=1)
def probe():
    import tempfile, torch
    return {"job": ray.get_runtime_context().get_job_id(), "threads": torch.get_num_threads(),
            "omp": os.environ["OMP_NUM_THREADS"], "tmp": tempfile.gettempdir(), "TMPDIR": os.environ["TMPDIR"],
            "own_group": os.getpgid(0) == os.getpid(), "cwd": os.getcwd(), "set": os.environ.get("PROBE_SET"),
            "safe_path": os.environ.get("PYTHONSAFEPATH")}

print(json.dumps({**ray.get(probe.remote()), "driver_job": ray.get_runtime_context().get_job_id()}))
"""


def probe_worker(folder: Path, env_vars: dict | None = None) -> dict:
    (folder / "probe.py").write_text(PROBE_WORKER)
    proc = subprocess.run([sys.executable, str(folder / "probe.py"), json.dumps(env_vars or {})],
                          capture_output=True, text=True, cwd=ROOT, env=job_env(None), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_jobs_ray_workers_are_of_that_job_with_its_environment_in_the_clusters_private_folder(user_cluster,
                                                                                                 tmp_path):
    """A job's Ray workers on the user's cluster belong to that job (each job its own), take what the job gives
    them in its runtime environment, use Ray's CPU share as torch's threads, the cluster's private folder as
    TMPDIR, `tempfile`'s and working folder, a process group of their own (Ray ends a worker by its group), and
    import nothing from their working folder."""
    one, other = probe_worker(tmp_path), probe_worker(tmp_path, {"PROBE_SET": "given"})
    for probed in (one, other):
        assert probed["job"] == probed["driver_job"] and probed["own_group"], probed
        assert probed["threads"] == int(probed["omp"]) and probed["tmp"] == probed["TMPDIR"], probed
        assert Path(probed["TMPDIR"]) == Path(user_cluster["temp_dir"]) == Path(probed["cwd"]), probed
        assert probed["safe_path"] == "1", probed
    assert one["job"] != other["job"] and (one["set"], other["set"]) == (None, "given"), (one, other)


def sweep_args(folder: Path, widths: list[int]) -> list[str]:
    """The same sweep name for both jobs, in their own folders: only their grids tell them apart. Long enough
    for their boards (updated every 2 s) to show both while both run, on a loaded machine too: 30 epochs of 8
    steps that each sleep 60 ms (tests/tasks/dropout.py), about 15 s, which leave the cores to the rest."""
    folder.mkdir()
    (folder / "sweep.yaml").write_text(f"name: same\nstorage_path: {folder}\nsearch: grid\nepochs: 30\n"
                                       f"task: {ROOT / 'tests' / 'tasks' / 'dropout.py'}:Dropout\n"
                                       f"space: {{width: {{grid: {widths}}}, lr: {{grid: [0.01]}}, step_ms: 60.0}}\n")
    return ["--config", str(folder / "sweep.yaml")]


def sweeps_shown() -> list[set[int]]:
    """The trials' `width` of each sweep `rayhpc status` shows (its board on the cluster)."""
    text = rayhpc("status").stdout
    shown = []
    for block in text.split("\nsweep ")[1:]:
        lines = block.splitlines()
        if len(lines) < 3:  # "sweep NAME: no trials yet"
            continue
        column = lines[1].split().index("width")
        shown.append({int(line.split()[column]) for line in lines[2:] if line.strip()})
    return shown


def test_two_sweeps_at_once_see_only_their_own_and_leave_it_as_they_found_it(user_cluster, tmp_path):
    address, grids = user_cluster["address"], {"a": [8, 16], "b": [32, 64]}
    before = snapshot(user_cluster)
    jobs = {name: start("tune_mlp.py", sweep_args(tmp_path / name, grid), tmp_path / f"{name}.marks")
            for name, grid in grids.items()}
    # while both run, each has its own board (what `rayhpc status` shows) with its own trials
    deadline, seen = time.monotonic() + 120, set()
    while len(seen) < 2 and time.monotonic() < deadline and all(j.poll() is None for j in jobs.values()):
        seen |= {frozenset(hidden) for hidden in sweeps_shown() if len(hidden) == 2}
    for name, job in jobs.items():
        assert_joined(job, tmp_path / f"{name}.marks", address)
        # its start-up, through the first trial's own marks (its process, Ray Tune and imports, data and model)
        marks = [json.loads(line) for line in (tmp_path / f"{name}.marks").read_text().splitlines()]
        phases = [m["phase"] for m in marks]
        assert phases[phases.index("ray"):phases.index("first result") + 1] == ["ray", *TRIAL_PHASES, "first result"]
        assert [m["t"] for m in marks] == sorted(m["t"] for m in marks), marks
    assert sorted(map(sorted, seen)) == [grids["a"], grids["b"]], seen
    for name, grid in grids.items():
        table = read_results(tmp_path / name / "same")
        assert sorted(table["config.width"]) == grid and set(table["status"]) == {"finished"}
    assert_as_found(user_cluster, before)
    assert not list(connection.jobs_dir().iterdir()), "a job that ended is still registered"


def test_ctrl_c_stops_a_job_on_it_and_only_that_job(user_cluster, tmp_path):
    job = subprocess.Popen([sys.executable, str(ROOT / "jobs" / "tune_mlp.py"), "--storage-path", str(tmp_path),
                            "--num-samples", "2", "--epochs", "100000"], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=job_env(None))
    deadline = time.monotonic() + 120
    while not list((tmp_path / "mlp-sweep").glob("train_pack_*/pack/checkpoint_*")):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.2)
    job.send_signal(signal.SIGINT)  # to the command's process only, as a terminal's Ctrl-C
    out, err = job.communicate(timeout=60)
    assert job.returncode == 128 + signal.SIGINT, (job.returncode, err)
    assert err.startswith("interrupted by SIGINT: sweep mlp-sweep stopped;") and err.count("\n") == 1, err
    # the command it prints is the one the user ran, and resumes it
    resume = shlex.split(err.split("resume with: ", 1)[1])
    assert resume == ["python", str(ROOT / "jobs" / "tune_mlp.py"), "--name", "mlp-sweep", "--storage-path",
                      str(tmp_path), "--resume"], err
    before = set((tmp_path / "mlp-sweep").glob("train_pack_*/pack/checkpoint_*"))
    job = subprocess.Popen([sys.executable, *resume[1:]], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env=job_env(None))
    deadline = time.monotonic() + 120
    while not set((tmp_path / "mlp-sweep").glob("train_pack_*/pack/checkpoint_*")) - before:
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.2)
    last = {p.parent: max(q for q in before if q.parent == p.parent) for p in before}
    new = set((tmp_path / "mlp-sweep").glob("train_pack_*/pack/checkpoint_*")) - before
    assert all(p > last[p.parent] for p in new if p.parent in last), (sorted(new), sorted(before))  # went on
    job.send_signal(signal.SIGINT)
    out, err = job.communicate(timeout=60)
    stopped = [line for line in err.splitlines() if "(train_pack pid=" not in line]  # Ray forwards its workers'
    assert job.returncode == 128 + signal.SIGINT and len(stopped) == 1, err
    assert stopped[0].startswith("interrupted by SIGINT: sweep mlp-sweep"), err

    assert connection.problem(user_cluster) is None, "the cluster went with the job"


def test_down_while_a_sweep_runs_ends_it_with_one_line_and_resume_continues(user_cluster, tmp_path):
    """Then a cluster that is gone (the process that ran it SIGKILLed) is noticed at once by the resumed run, which starts a
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

    info = up()
    # the process that holds the cluster, killed: its Ray ends with it (its supervisor's parent-death signal);
    # the connection file stays
    os.kill(info["pid"], signal.SIGKILL)
    ended, deadline = f"its process {info['pid']} has ended", time.monotonic() + 15
    while connection.problem(info) != ended and time.monotonic() < deadline:
        time.sleep(0.1)  # its port may close before the holder has ended: both say it is gone
    assert connection.problem(info) == ended
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


# what the other user sees of our Ray's start in /proc: the port each of its servers is told to bind, which
# they would bind first (as another user they cannot read the environment, only command lines)
WATCH_PORTS = """
seen = {"gcs_server": set(), "dashboard": set()}
flags = {"gcs_server": b"--gcs_server_port=", "dashboard": b"--port="}
deadline = time.monotonic() + float(sys.argv[1])
while time.monotonic() < deadline and not all(seen.values()):
    for pid in os.listdir("/proc"):
        try:
            args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
        except OSError:
            continue
        kind = ("gcs_server" if args[0].endswith(b"/gcs_server") else
                "dashboard" if len(args) > 1 and args[1].endswith(b"dashboard/dashboard.py") else None)
        if kind and os.stat(f"/proc/{pid}").st_uid != os.getuid():
            seen[kind] |= {a[len(flags[kind]):].decode() for a in args if a.startswith(flags[kind])}
    time.sleep(0.002)
print(json.dumps({k: sorted(v) for k, v in seen.items()}), flush=True)
"""


def in_home(home: Path, *args: str) -> subprocess.Popen:
    """`rayhpc ARGS` with RAYHPC_HOME `home`: a cluster of the user's beside `user_cluster`, in the background."""
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAYHPC_HOME": str(home)}
    return subprocess.Popen([sys.executable, "-m", "rayhpc", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT, env=env)


def succeeded(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out


def test_a_freed_gcs_port_receives_no_token_and_no_clusters_token_opens_another(user_cluster, attacker, tmp_path):
    """The attack: the other user binds the GCS port of a cluster of ours the moment it is free (the port is in
    /proc/net/tcp) and answers every call, keeping the bearer tokens they carry. Ray's processes go on calling
    a stopped GCS for seconds, and every cluster of the user shared one token (~/.ray/auth_token), so the
    token of a finished sweep opened the user's `rayhpc up` dashboard (its jobs API runs code). Three ways a
    cluster ends: a sweep's own Ray that finishes, `rayhpc down`, a killed `rayhpc up` holder. None sends a
    token to the freed port (the GCS is stopped last), each cluster had its own, and the one that is still
    up (`user_cluster`) takes none of theirs. And while the sweep's Ray starts, its GCS and dashboard are
    handed no port to bind (0: each binds one of the system's choosing), so there is none to take first."""
    watcher = start_as_attacker(WATCH_PORTS, "120", imports="import json, time")
    # long enough (20 epochs) that its token is read while it runs, on a loaded machine too
    sweep = subprocess.Popen([sys.executable, str(ROOT / "jobs" / "tune_mlp.py"), "--num-samples", "2", "--epochs",
                              "20", "--storage-path", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=job_env({"RAYHPC_HOME": str(tmp_path / "s")}))
    seen = []  # what it printed up to the line, all of it if the line never came
    started = next((line for line in sweep.stdout
                    if seen.append(line) or line.startswith("ray: started local Ray at ")), None)
    assert started is not None, "".join(seen)
    port, folder = started.split()[5].rsplit(":", 1)[1], Path(started.split()[7])
    assert (folder / "auth_token").exists(), sweep.communicate()[0]
    tokens = {"sweep": (folder / "auth_token").read_text()}
    catchers = {"sweep": start_as_attacker(CATCH_TOKENS, port, "180", "4", imports=CATCH_IMPORTS)}
    ups = {end: in_home(tmp_path / end, "up", "--num-cpus", "1", "--no-dashboard")
           for end in ("down", "killed")}
    for end, up_proc in ups.items():
        succeeded(up_proc)
        info = connection.read(tmp_path / end / "clusters" / f"{connection.host()}.json")
        tokens[end] = Path(info["token_path"]).read_text()
        catchers[end] = start_as_attacker(CATCH_TOKENS, str(info["ports"]["gcs"]), "60", "4", imports=CATCH_IMPORTS)
        time.sleep(0.5)  # the catcher is trying to bind
        if end == "down":
            succeeded(in_home(tmp_path / end, "down"))
        else:
            os.kill(info["pid"], signal.SIGKILL)
    out, _ = sweep.communicate(timeout=300)
    assert sweep.returncode == 0, out
    for end, catcher in catchers.items():
        got = caught(catcher)
        assert got["bound"] and got["tokens"] == [], f"{end}: the freed GCS port received {got}"
    assert len(set(tokens.values())) == 3
    kept = connection.read()  # the user's cluster that stays up (an earlier test may have replaced the first)
    if kept is None or connection.problem(kept) is not None:
        kept = up()
    own = Path(kept["token_path"]).read_text()
    assert dashboard_accepts(kept["dashboard"], own)
    assert not any(dashboard_accepts(kept["dashboard"], token) for token in tokens.values())
    assert caught(watcher) == {"gcs_server": ["0"], "dashboard": ["0"]}


def test_your_cluster_started_and_joined_in_a_folder_another_user_writes_imports_nothing_from_it(attacker, world_tmp,
                                                                                                 tmp_path):
    """The attack: the other user plants `rayhpc/__init__.py`, `torch.py` and `ray.py` where the victim runs
    `rayhpc up`, a sweep and `rayhpc down` (/tmp, a shared scratch). The cluster's holder, its
    Ray and every worker of the jobs that join it ran the planted code (the workers inherited the folder `rayhpc
    up` was run in). Each command runs to its end, the sweep on that cluster, and nothing imported from there."""
    folder, marks = planted_folder(world_tmp)
    env = job_env({"RAYHPC_HOME": str(tmp_path / "home")})

    def in_folder(*command: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(command), capture_output=True, text=True, cwd=folder, env=env, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    in_folder(RAYHPC, "up", "--num-cpus", "2", "--num-gpus", "0")
    try:
        sweep = in_folder(sys.executable, str(ROOT / "jobs" / "tune_mlp.py"), "--num-samples", "2", "--epochs", "1",
                          "--storage-path", str(tmp_path / "results"))
        assert "ray: joined your cluster (rayhpc up)" in sweep.stdout, sweep.stdout
    finally:
        in_folder(RAYHPC, "down")
    assert planted_imports(marks) == []
