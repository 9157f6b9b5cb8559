"""What the tests share: the checkout and this machine, running jobs as a user does, the test Slurm's
jobs, the second Unix user, and plain-PyTorch references. Fixtures are in conftest.py."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pandas as pd
import pytest
import ray
import torch
import torch.nn.functional as F
from prometheus_client.parser import text_string_to_metric_families
from ray.train import UserCallback
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

from rayhpc.config import validate
from rayhpc.data import synthetic_tensors
from rayhpc.slurm.config import ClusterConfig, load_cluster
from rayhpc.slurm.render import render_sbatch
from rayhpc.tune.config import SweepConfig

ROOT = Path(__file__).resolve().parents[1]
# what Ray ships to its workers from here (Ray Train callbacks, rank functions) travels by value: the workers
# do not have the tests folder on their path
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
sys.path.insert(0, str(ROOT / "jobs"))
sys.path.insert(0, str(ROOT / "tests" / "tasks"))  # the benchmarks' helpers (jobs/bench/), whose tables some tests check


# Ray Train's controller polls its workers every 2 s, so each of the suite's many short training runs
# ends up to 2 s after its last step; polling at 0.5 s (set before any Ray or job starts, which inherit
# it) shortens the suite by about a minute and changes nothing a test checks
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


def _machine() -> tuple[int, int]:
    from rayhpc.cluster import local_cpus, local_gpus

    return local_cpus(), local_gpus()


# What a job started by a test without --address sees (a local Ray is sized from this machine):
# bad-input expectations are derived from it, so the suite passes on a laptop and a GPU node alike.
CPUS, GPUS = _machine()


def too_many_gpu_workers(flag: str, *extra: str) -> tuple[list[str], str]:
    """Arguments asking for one more GPU worker than this machine holds (`flag` sets the worker count;
    `extra` follow it, `{n}` standing for the count), and the error's start: "no GPUs" on a machine
    without, else how many GPU workers fit."""
    if GPUS == 0:
        return ["--gpu"], "error: compute.gpu (--gpu): the cluster has no GPUs"
    n = min(CPUS, GPUS) + 1
    return (["--gpu", flag, str(n), "--cpus-per-worker", "1", *(e.format(n=n) for e in extra)],
            f"error: compute.num_workers (--num-workers) {n}: the cluster can place {n - 1} worker(s) of "
            "1 CPU + 1 GPU each")


SUBMITTED: list[str] = []  # Slurm jobs the running test submitted


def run_job(script: str, *args: str, env: dict | None = None, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run `python jobs/<script> args...` the way a user does; capture its output."""
    return subprocess.run([sys.executable, str(ROOT / "jobs" / script), *args], capture_output=True, text=True,
                          env=job_env(env), timeout=timeout, cwd=kwargs.pop("cwd", ROOT), **kwargs)


def job_env(env: dict | None) -> dict:
    """A job's environment: the suite's, unbuffered, with `env`; without RAY_ADDRESS unless `env` sets it."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if "RAY_ADDRESS" not in (env or {}):
        full_env.pop("RAY_ADDRESS", None)
    return full_env


_warm: list = []  # the warm job server, started by the first run_job_warm


def run_job_warm(script: str, *args: str, env: dict | None = None, timeout: float = 120,
                 cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`run_job` for a job that ends before it starts Ray (bad input): the same script, argv, environment
    and exit status, in a process forked from one that has imported the platform already (tests/warm_jobs.py)."""
    import atexit
    import tempfile

    from warm_jobs import WarmJobs

    if not _warm:
        _warm.append(WarmJobs(ROOT))
        atexit.register(_warm[0].close)
    with tempfile.TemporaryDirectory(prefix="warm-job-") as out:
        return _warm[0].run(ROOT / "jobs" / script, list(args), job_env(env), cwd, Path(out), timeout)


def tensorboard_scalars(folder: Path) -> dict[str, list[float]]:
    """Every scalar in the TensorBoard event files under `folder`, by tag, in step order (read with
    tensorboardX's protobufs: TFRecord = length, crc, Event, crc)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    found = []  # (step, wall time, tag, value), in the order they were written
    for path in Path(folder).rglob("events.out.tfevents.*"):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            for value in event.summary.value:
                if value.WhichOneof("value") == "simple_value":  # not a histogram, an image, ...
                    found.append((event.step, event.wall_time, value.tag, value.simple_value))
    scalars: dict[str, list[float]] = {}
    for _, _, tag, value in sorted(found, key=lambda f: f[:2]):
        scalars.setdefault(tag, []).append(value)
    return scalars


ATTACKER = "rhattacker"


def as_attacker(*command: str, **kwargs) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    runuser = shutil.which("runuser") or "/usr/sbin/runuser"
    return subprocess.run([runuser, "-u", ATTACKER, "--", *command], capture_output=True, text=True, env=env,
                          cwd="/tmp", **kwargs)


PLANTED = ("rayhpc/__init__.py", "torch.py", "ray.py")


def planted_folder(world_tmp) -> tuple[Path, Path]:
    """A folder every user may write (as /tmp is) where the other user has planted `rayhpc/__init__.py`,
    `torch.py` and `ray.py`: a process that imports one of them from there leaves a file in the second folder
    (the module, its pid and its command line), as code of theirs run as the victim could."""
    folder, marks = world_tmp("rh-planted"), world_tmp("rh-marks")
    for path in (folder, marks):
        path.mkdir()
        path.chmod(0o1777)
    for name in PLANTED:
        code = (f"import os, sys\nwith open(f'{marks}/{name.replace('/', '_')}-{{os.getpid()}}', 'w') as mark:\n"
                f"    mark.write(' '.join(sys.argv))\n")
        made = as_attacker("sh", "-c", f"mkdir -p {folder}/rayhpc && cat > {folder}/{name}", input=code)
        assert made.returncode == 0, made.stderr
    return folder, marks


def planted_imports(marks: Path) -> list[str]:
    """Which processes imported a planted module (`planted_folder`): 'module-pid: command line'."""
    return sorted(f"{mark.name}: {mark.read_text()}" for mark in marks.iterdir())


def python_as_attacker(code: str, *args: str, imports: str = "", env: dict | None = None,
                       timeout: float | None = None) -> subprocess.CompletedProcess:
    """`python -c CODE ARGS` as the other user. This interpreter may live where that user cannot read (a
    pyenv under /root), so it starts as root, imports `imports` (what the code needs), then drops to the
    other user before running the code."""
    proc = start_as_attacker(code, *args, imports=imports, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start_as_attacker(code: str, *args: str, imports: str = "", env: dict | None = None,
                      netns: str | None = None) -> subprocess.Popen:
    """`python_as_attacker` in the background: the process, its output captured. `netns`: on that node of the
    test Slurm (its network namespace, n1 or n2)."""
    prelude = (f"import os, pwd, sys\n{imports}\n"
               f"user = pwd.getpwnam({ATTACKER!r}); os.setgroups([]); os.setgid(user.pw_gid); os.setuid(user.pw_uid)\n")
    env = {"PATH": os.environ["PATH"], "HOME": "/tmp", **(env or {})}
    on_node = ["nsenter", f"--net=/var/run/netns/{netns}"] if netns else []
    return subprocess.Popen([*on_node, sys.executable, "-c", prelude + code, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd="/tmp")


# The other user takes a TCP port the moment it is free (its holder gone) and answers every gRPC call on it,
# keeping the bearer tokens the calls carry: `start_as_attacker(CATCH_TOKENS, PORT, WAIT_S, LISTEN_S,
# imports=CATCH_IMPORTS)` tries for WAIT_S, listens LISTEN_S once it has the port, and prints
# {"bound": [ports], "tokens": [...], "methods": [...]}. With `ps:TEXT` for PORT it reads every process's command
# line for WAIT_S, as `ps` shows them to anyone, and takes each port number (`--...port=N`, N > 0) named on a line
# that holds TEXT as soon as it appears, then listens LISTEN_S more.
CATCH_TOKENS = """
target, wait_s, listen_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
tokens, methods, servers = set(), set(), {}

class Catch(grpc.GenericRpcHandler):
    def service(self, details):
        tokens.update(v.removeprefix("Bearer ") for k, v in details.invocation_metadata if k == "authorization")
        methods.add(details.method)
        return None  # UNIMPLEMENTED: the caller tries again, with its token

def named_ports():
    if not target.startswith("ps:"):
        return {int(target)}
    found = set()
    for entry in os.scandir("/proc"):
        if entry.name == str(os.getpid()):
            continue
        try:
            line = open(f"/proc/{entry.name}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if target[3:] in line:
            found |= {int(port) for port in re.findall(r"--[a-z-]*port=(\\d+)", line) if int(port)}
    return found

def take(port):
    probe = socket.socket()
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:  # a plain bind first: gRPC logs every failed one
        probe.bind(("0.0.0.0", port))
        probe.close()
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(4), handlers=[Catch()],
                             options=[("grpc.so_reuseport", 0)])
        if server.add_insecure_port(f"0.0.0.0:{port}") == port:
            server.start()
            servers[port] = server
    except (OSError, RuntimeError):
        probe.close()

deadline = time.monotonic() + wait_s
while time.monotonic() < deadline and (target.startswith("ps:") or not servers):
    for port in named_ports() - set(servers):
        take(port)
    time.sleep(0.01 if target.startswith("ps:") else 0.002)  # a ps line comes seconds before Ray binds its ports
if servers:
    time.sleep(listen_s)
for server in servers.values():
    server.stop(0)
print(json.dumps({"bound": sorted(servers), "tokens": sorted(tokens), "methods": sorted(methods)}), flush=True)
"""
CATCH_IMPORTS = "import concurrent.futures.thread, json, re, socket, time, grpc"


def caught(catcher: subprocess.Popen, timeout: float = 120) -> dict:
    """What a `CATCH_TOKENS` process reported once its time was up."""
    out, err = catcher.communicate(timeout=timeout)
    assert catcher.returncode == 0 and out.strip(), err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def dashboard_accepts(url: str, token: str) -> bool:
    """Whether the Ray dashboard at `url` takes `token` (its jobs API, which runs code, behind it)."""
    request = urllib.request.Request(f"{url}/api/jobs/", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status == 200
    except urllib.error.HTTPError as exc:
        assert exc.code in (401, 403), exc
        return False


RAYHPC = str(Path(sys.executable).with_name("rayhpc"))


CLUSTER = str(ROOT / "cluster_configs" / "local-slurm.yaml")


LOGS = Path("/tmp/rayhpc-slurm-logs")  # the log_dir of local-slurm.yaml


def submit(*command: str, nodes: int | None = None) -> str:
    """`rayhpc submit [--nodes N]` on the test cluster; the job id."""
    proc = subprocess.run([RAYHPC, "submit", "--cluster", CLUSTER, *(["--nodes", str(nodes)] if nodes else []), "--",
                           *command], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    SUBMITTED.append(proc.stdout.split()[2].rstrip(":"))  # "submitted job N: log ..."
    return SUBMITTED[-1]


def wait_done(job: str, timeout_s: float = 400) -> dict:
    """The job's final `scontrol show job` fields once it has left the queue."""
    deadline = time.monotonic() + timeout_s
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline, f"job {job} still queued or running after {timeout_s} s"
        time.sleep(1)
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    return dict(part.split("=", 1) for part in out.split() if "=" in part)


def job_log(job: str) -> str:
    return (LOGS / f"rayhpc-local-slurm-{job}.log").read_text()


def job_processes(job: str) -> list[str]:
    """Every process of the Slurm job on this machine (both test nodes share its process table), found
    by what Slurm put in their environment (Ray rewrites titles, not environments): 'pid cmdline'."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"SLURM_JOB_ID={job}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{proc.name} {command[:100]}")
        except OSError:
            continue
    return found


def assert_nothing_left(job: str, timeout_s: float = 30) -> None:
    """None of the job's processes, temp folders or token is left (Slurm may still be killing its
    steps for a few seconds after the job left the queue)."""
    deadline = time.monotonic() + timeout_s
    while (procs := job_processes(job)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert procs == [], f"processes of job {job} survived it:\n" + "\n".join(procs)
    assert glob.glob(f"/tmp/rh-{job}-*") == [], "the job's temp dirs were left behind"
    assert not (LOGS / job / "auth_token").exists(), "the job's token was left behind"


TWO_NODES = """
import ray, socket, time
ray.init()
where = ray.remote(num_cpus=1)(lambda: (time.sleep(3), socket.gethostname())[1])
hosts = ray.get([where.options(scheduling_strategy="SPREAD").remote() for _ in range(2)])
assert sorted(hosts) == ["node1", "node2"], hosts
"""


def wait_cluster(job: str, timeout_s: float = 120) -> dict:
    """The job's cluster.json, once its cluster is up."""
    path, deadline = LOGS / job / "cluster.json", time.monotonic() + timeout_s
    while not path.is_file():
        assert time.monotonic() < deadline, f"job {job} did not start its cluster: {job_log(job)}"
        time.sleep(0.5)
    return json.loads(path.read_text())


def submit_held(cfg, command: list[str], tmp_path: Path) -> str:
    """The job of `cfg` running `command`, submitted held (so a test can prepare the nodes first)."""
    script = tmp_path / f"job-{uuid.uuid4().hex[:6]}.sbatch"
    script.write_text(render_sbatch(cfg, command))
    SUBMITTED.append(subprocess.run(["sbatch", "--parsable", "--hold", str(script)], capture_output=True, text=True,
                                    cwd=ROOT, check=True).stdout.strip())
    return SUBMITTED[-1]


def with_changes(**sections) -> ClusterConfig:
    """local-slurm.yaml with some keys of some sections changed (`ray={"join_timeout_s": 8}`, `log_dir=...`)."""
    data = load_cluster(CLUSTER).model_dump(mode="json")
    for key, value in sections.items():
        data[key] = {**(data[key] or {}), **value} if isinstance(value, dict) else str(value)
    return validate(ClusterConfig, data)  # validated as a loaded config is


def skip_requeue_delay(job: str, timeout_s: float = 120) -> None:
    """Slurm holds a requeued job back for a while (about 150 s here); an admin would start it
    at once, as the test does, once it is pending again."""
    deadline = time.monotonic() + timeout_s
    while subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout.strip() \
            != "PENDING":
        assert time.monotonic() < deadline, f"job {job} was not requeued"
        time.sleep(0.5)
    # slurmd refuses to launch a job whose credential is not newer than the revocation of the last run's
    # ("Job credential revoked"), compared in whole seconds: a restart within the same second fails
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)


def reference_schedule(optimizer, warmup: int, total: int, floor: float):
    """torch's own schedulers: a linear warm-up from lr/(warmup+1), then cosine down to floor x lr."""
    sched = torch.optim.lr_scheduler
    return sched.SequentialLR(optimizer, [
        sched.LinearLR(optimizer, start_factor=1 / (warmup + 1), end_factor=1.0, total_iters=warmup),
        sched.CosineAnnealingLR(optimizer, T_max=total - 1 - warmup, eta_min=floor * optimizer.defaults["lr"]),
    ], milestones=[warmup])


def scrape(cluster: dict) -> dict[str, list]:
    """The platform's samples on the node's metrics endpoint, by name (Ray's `ray_` prefix dropped)."""
    url = f"http://{cluster['node_ip_address']}:{cluster['metrics_export_port']}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_rayhpc_"):
                samples.setdefault(s.name.removeprefix("ray_"), []).append(s)
    return samples


def assert_speedup_and_efficiency(rows: pd.DataFrame) -> None:
    """One mode's rows by worker count (1 and 2): speedup and efficiency against the one-worker row."""
    assert rows.loc[1, "speedup"] == 1.0 and rows.loc[1, "efficiency"] == 1.0
    assert math.isclose(rows.loc[2, "efficiency"], rows.loc[2, "speedup"] / 2)
    assert math.isclose(rows.loc[2, "speedup"], rows.loc[2, "samples_per_s"] / rows.loc[1, "samples_per_s"]), rows


def plain_trial(model, train, val, hp: dict, epochs: int, loss_fn, metric_fn=None):
    """One trial the plain PyTorch way; returns (final weights, (validation loss, metric, the epoch's training loss
    as the mean over its samples) after each epoch)."""
    if hp["optimizer"] == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=hp["lr"], momentum=hp["momentum"], weight_decay=hp["weight_decay"])
    else:
        adam = torch.optim.AdamW if hp["optimizer"] == "adamw" else torch.optim.Adam
        opt = adam(model.parameters(), lr=hp["lr"], weight_decay=hp["weight_decay"], betas=(hp["beta1"], hp["beta2"]),
                   eps=hp["eps"])
    total = epochs * math.ceil(len(train) / hp["batch_size"])
    schedule = reference_schedule(opt, hp["warmup_steps"], total, hp["min_lr_ratio"]) if hp["decay"] == "cosine" \
        else None  # the other tests' trials keep a constant lr
    sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=hp["seed"])
    history = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        trained, samples = 0.0, 0
        for x, y in DataLoader(train, batch_size=hp["batch_size"], sampler=sampler):
            loss = loss_fn(model(x), y)
            trained, samples = trained + loss.item() * len(x), samples + len(x)
            opt.zero_grad()
            loss.backward()
            if hp["clip_grad_norm"]:
                torch.nn.utils.clip_grad_norm_(model.parameters(), hp["clip_grad_norm"])
            opt.step()
            if schedule is not None:
                schedule.step()
        model.eval()
        with torch.no_grad():
            batches = list(DataLoader(val, batch_size=1000))
            out = [(loss_fn(model(x), y), metric_fn(model(x), y) if metric_fn else 0.0, len(x)) for x, y in batches]
        n = sum(b[2] for b in out)
        history.append((sum(b[0] * b[2] for b in out) / n, sum(b[1] * b[2] for b in out) / n, trained / samples))
    return model.state_dict(), history


def mlp_split(task):
    """The mlp task's 20% hold-out, computed here as the split's definition says."""
    x, y = synthetic_tensors(task.obj.data_cfg.synthetic)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0)).tolist()
    n_val = round(len(x) * 0.2)
    full = TensorDataset(x, y)
    return Subset(full, order[n_val:]), Subset(full, order[:n_val])


def sweep(tmp_path, **kw) -> SweepConfig:
    return validate(SweepConfig, {"storage_path": str(tmp_path), **kw})


def kill_driver_after(config, ray_address: str, exp_dir, epochs: int) -> list:
    """Run `jobs/tune_mlp.py --config config` and SIGKILL its driver once a trial (pack) has checkpointed
    `epochs` epochs, at a moment when Tune's saved state is whole and names that trial; the trials' result.json
    files (the one that reached `epochs` first: Tune copies them into the experiment folder only as it saves
    its state, so they are read once the resume has ended).

    Tune copies its state into the experiment folder file by file, in a thread: a kill during the copy
    leaves a file cut short, which a resume meets as tests/ray/test_sweep.py's cut-short cases do. Here the
    driver is stopped (SIGSTOP, every thread) and killed only where each state file reads whole and the newest
    names the trial (Tune saves it after a trial's first report, which comes with a checkpoint)."""
    from rayhpc.engine.checkpoint import latest_checkpoint, load_progress
    from rayhpc.tune.trainable import PACK_CHECKPOINTS

    def epoch(trial_dir: Path) -> int:
        try:
            return load_progress(last).epoch if (last := latest_checkpoint(trial_dir / PACK_CHECKPOINTS)) else 0
        except OSError:  # pruned as it was read
            return 0

    args = [sys.executable, str(ROOT / "jobs" / "tune_mlp.py"), "--config", str(config), "--address", ray_address]
    driver = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    deadline = time.monotonic() + 180
    while not (reached := [d for d in sorted(exp_dir.glob("train_pack_*")) if epoch(d) >= epochs]):
        assert driver.poll() is None and time.monotonic() < deadline, f"no trial reached epoch {epochs}"
        time.sleep(0.05)
    trial_id = re.match(r"train_pack_([0-9a-f]+(?:_\d{5})?)_", reached[0].name).group(1)  # a plan's, a searcher's
    driver.send_signal(signal.SIGSTOP)
    while not (tune_state_whole(exp_dir) and any(trial_id in p.read_text()
                                                 for p in sorted(exp_dir.glob("experiment_state-*.json"))[-1:])):
        assert time.monotonic() < deadline, f"Tune's state in {exp_dir} never read whole, naming trial {trial_id}"
        driver.send_signal(signal.SIGCONT)
        time.sleep(0.02)
        driver.send_signal(signal.SIGSTOP)
    driver.kill()
    driver.wait()
    return [d / "result.json" for d in reached]


def tune_state_whole(exp_dir: Path) -> bool:
    """Whether every state file Tune keeps in the experiment folder reads to its end: JSON, or pickles (some
    named .json) read opcode by opcode, nothing in them run."""
    import pickletools

    try:
        for path in [*exp_dir.glob("*.json"), *exp_dir.glob("*.pkl")]:
            data = path.read_bytes()
            if data.startswith(b"\x80"):  # a pickle's PROTO opcode
                for _ in pickletools.genops(data):
                    pass
            else:
                json.loads(data)
    except ValueError:  # JSONDecodeError too
        return False
    return True


EPOCHS = 3


def assert_same_weights(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=lambda m: f"{key}: {m}")


class KillWorkerOnce(UserCallback):
    """In Ray Train's controller: logs each report with the live worker PIDs, and SIGKILLs one
    worker right after the first report of optimizer step `step` (a mid-epoch checkpoint), and of
    each of `steps` if it is several."""

    def __init__(self, step: int, log: str, *more: int):
        self.left, self.log = {step, *more}, log

    def after_report(self, run_context, metrics, checkpoint):
        from ray.util.state import list_actors

        workers = list_actors(filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
        pids = sorted(w.pid for w in workers)
        kill = metrics[0]["global_step"] in self.left
        with open(self.log, "a") as f:
            f.write(json.dumps({"step": metrics[0]["global_step"], "pids": pids, "kill": kill}) + "\n")
        if kill:
            self.left.discard(metrics[0]["global_step"])
            os.kill(pids[-1], signal.SIGKILL)


def assert_restarted_after(log: Path, steps: list[int]) -> None:
    """Each kill `KillWorkerOnce` logged started a new worker group, which went on after the killed
    step's checkpoint (mid-epoch), not from step 0."""
    reports = [json.loads(line) for line in log.read_text().splitlines()]
    kills = [i for i, r in enumerate(reports) if r["kill"]]
    assert [reports[i]["step"] for i in kills] == steps, reports
    for i in kills:
        # a report the old group had already made (the controller handles reports after the workers made them)
        # comes first, with the surviving old worker's PID
        old = set(reports[i]["pids"])
        after = [r for r in reports[i + 1:] if not set(r["pids"]) & old]
        assert after, f"the worker group was not restarted: {reports}"
        assert after[0]["step"] > reports[i]["step"], f"it did not resume from the checkpoint: {reports}"


def require(what: str, present: bool) -> None:
    """A test that needs `what` (root, Slurm, Prometheus, Chromium) and finds it missing: a skip that says so,
    or, under CI (CI=true, where everything is installed), a failure."""
    if present:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} is missing", pytrace=False)
    pytest.skip(f"needs {what}")


def tune_stops(reports: list[dict], scheduler, epochs: int, members: int = 8) -> dict[int, int]:
    """Member -> the epoch at which Ray Tune's own `scheduler` (ASHA, the median rule) stops it, fed each
    member's reported val_loss in the order a pack reported them (`reports`: its result.json lines)."""
    from collections import namedtuple
    from types import SimpleNamespace

    from ray.tune.schedulers import TrialScheduler

    controller = SimpleNamespace(get_live_trials=lambda: [])  # the median rule asks it; nothing to pause
    trial = namedtuple("Trial", "trial_id")  # hashable: the median rule keys its records by trial
    trials = [trial(f"member-{j}") for j in range(members)]
    for trial in trials:
        scheduler.on_trial_add(controller, trial)
    stops: dict[int, int] = {}
    for report in reports:
        for j, trial in enumerate(trials):
            if j in stops:
                continue
            result = {"epoch": report["epoch"], "val_loss": report["members"]["val_loss"][j]}
            if scheduler.on_trial_result(controller, trial, result) == TrialScheduler.STOP and report["epoch"] < epochs:
                stops[j] = report["epoch"]
    return stops


# the dropout task (tests/tasks/) with every training option away from its default: AdamW, a warm-up of 10 steps
# (of 8 a epoch: checkpoints after epoch 1 are mid-warm-up, after epoch 2 mid-decay), cosine decay, clipping that
# bites, 2 micro-batches
FIXED = {"batch_size": 32, "optimizer": "adamw", "weight_decay": 0.05, "beta1": 0.8, "warmup_steps": 10,
         "decay": "cosine", "min_lr_ratio": 0.1, "clip_grad_norm": 0.5, "accumulate": 2, "step_ms": 30.0}


def two_ranks(lr: float, seed: int = 0) -> dict:
    """The final weights of `plain_ranks` on two ranks."""
    return plain_ranks(2, lr, seed).weights


@dataclasses.dataclass
class PlainRun:
    weights: dict
    step_losses: list  # each optimizer step's loss: the mean over the step's samples on every rank
    epochs: list  # (validation loss, the training loss as the mean over the epoch's samples) after each epoch


def plain_ranks(world: int, lr: float, seed: int = 0, epochs: int = EPOCHS) -> PlainRun:
    """The trial as `world` plain DDP ranks train it, in one process: rank r's DistributedSampler batches of
    32 / world (32 global), each as 2 micro-batches whose gradients add up (weighted by their share), and its
    own RNG stream (every rank seeds alike, then draws its own dropout masks and DataLoader seeds); the
    gradients averaged over the ranks, clipped by their total norm, torch's AdamW under LinearLR then
    CosineAnnealingLR; a validation pass per epoch on every rank. Checked: Adam in place
    of AdamW, clipping off, or a constant lr in the platform fail; one micro-batch in place of 2 changes no
    value here (the masks are drawn in the same order), so the accumulation tests count the micro-batches."""
    from dropout import Dropout  # the test task file (tests/tasks/), as jobs load it

    task, hp, batch = Dropout(), {"width": 16, "p": 0.25, "step_ms": 0.0}, 32 // world
    data, _ = task.data(hp)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
    n_val = round(0.25 * len(data))
    train, val = Subset(data, order[n_val:]), Subset(data, order[:n_val])
    torch.manual_seed(seed)
    model = task.model(hp)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.8, 0.999), weight_decay=0.05)
    rng = [torch.get_rng_state()] * world
    samplers = [DistributedSampler(train, num_replicas=world, rank=r, shuffle=True, seed=seed) for r in range(world)]
    schedule = reference_schedule(opt, 10, epochs * math.ceil(len(samplers[0]) / batch), 0.1)
    run = PlainRun({}, [], [])

    def as_rank(r, fn):
        torch.set_rng_state(rng[r])
        out = fn()
        rng[r] = torch.get_rng_state()
        return out

    for epoch in range(epochs):
        model.train()
        for s in samplers:
            s.set_epoch(epoch)
        loaders = [as_rank(r, lambda r=r: iter(DataLoader(train, batch_size=batch, sampler=samplers[r])))
                   for r in range(world)]
        trained = []
        for step, batches in enumerate(zip(*loaders), epoch * len(loaders[0])):
            grads, losses = [], []
            for r, (bx, by) in enumerate(batches):
                model.zero_grad()
                for mx, my in zip(bx.tensor_split(2), by.tensor_split(2)):
                    loss = as_rank(r, lambda: F.mse_loss(model(mx), my))
                    (loss * len(mx) / len(bx)).backward()
                    losses.append((loss.item() * len(mx), len(mx)))
                grads.append([p.grad.clone() for p in model.parameters()])
            for p, *g in zip(model.parameters(), *grads):
                p.grad = sum(g) / world
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            schedule.step()
            run.step_losses.append(sum(s for s, _ in losses) / sum(n for _, n in losses))
            trained += losses
        model.eval()
        for r in range(world):  # each rank's validation pass (no dropout; its DataLoader draws a seed)
            val_losses = as_rank(r, lambda: [(F.mse_loss(model(bx), by).item() * len(bx), len(bx))
                                             for bx, by in DataLoader(val, batch_size=256)])
        mean = lambda pairs: sum(s for s, _ in pairs) / sum(n for _, n in pairs)  # noqa: E731
        run.epochs.append((mean(val_losses), mean(trained)))
    run.weights = {k: v.detach() for k, v in model.state_dict().items()}
    return run
