"""Shared nodes without trust, on the two-node test Slurm: another Unix user (created here, as an
attacker would be) who pre-creates paths and holds ports; private folders, ports, clean-up, and the
operator commands (`rayhpc status JOBID`, `rayhpc stop JOBID`, `rayhpc doctor`)."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import (
    CATCH_IMPORTS,
    CATCH_TOKENS,
    CLUSTER,
    LOGS,
    RAYHPC,
    ROOT,
    SUBMITTED,
    TWO_NODES,
    as_attacker,
    assert_nothing_left,
    caught,
    job_log,
    job_processes,
    planted_folder,
    planted_imports,
    python_as_attacker,
    skip_requeue_delay,
    start_as_attacker,
    submit,
    submit_held,
    wait_cluster,
    wait_done,
    with_changes,
)
from rayhpc.private import UnsafePath, check_ancestors
from rayhpc.processes import carrying, descendants
from rayhpc.slurm.layout import OFFSETS
from rayhpc.slurm.submit import log_dir, slurm_job


def test_a_job_folder_another_user_created_first_stops_the_job_and_the_token_never_reaches_it(slurm, attacker,
                                                                                               tmp_path, world_tmp):
    logs = world_tmp("rayhpc-shared")  # a folder every user may create entries in, as /tmp
    logs.mkdir()
    logs.chmod(0o1777)
    job = submit_held(with_changes(log_dir=logs), ["true"], tmp_path)
    # the attack: the victim's next job folder, world-writable, with a world-writable token file in it
    assert as_attacker("mkdir", "-m", "777", f"{logs}/{job}").returncode == 0
    assert as_attacker("install", "-m", "666", "/dev/null", f"{logs}/{job}/auth_token").returncode == 0
    subprocess.run(["scontrol", "release", job], check=True)
    info = wait_done(job)
    log = (logs / f"rayhpc-local-slurm-{job}.log").read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", log
    assert f"error: rayhpc.slurm.layout: {logs}/{job} exists and belongs to uid" in log, log
    assert (logs / job / "auth_token").read_text() == "", "the job wrote its token into the attacker's file"
    assert "ray start" not in log and not list(logs.glob(f"{job}/ray-*.log")), "Ray started anyway"
    assert job_processes(job) == []


@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_a_log_dir_in_a_folder_others_may_write_without_the_sticky_bit_is_refused(attacker, tmp_path, world_tmp, mode):
    """In a folder others may write to without the sticky bit, another user could rename the log folder away
    and put one of theirs in its place (the job folders, the token): `rayhpc submit` refuses before it
    writes anything, naming the folder, its mode and the fix. With the sticky bit (as /tmp) the folder is
    accepted, the log folder made 0700, and the other user cannot move it."""
    shared = world_tmp("rayhpc-open")
    shared.mkdir()
    shared.chmod(mode)
    proc = submit_with_log_dir(shared / "logs", tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, \
        f"a log_dir in a folder of mode {mode:04o} was not refused: {proc.stdout}{proc.stderr}"
    assert proc.stderr.startswith(f"error: log_dir {shared}/logs: {shared} (mode {mode:04o}) can be written by other "
                                  f"users and has no sticky bit: they could replace what is inside; chmod go-w {shared}"), \
        proc.stderr
    assert not (shared / "logs").exists(), "the refused log folder was made anyway"

    shared.chmod(mode | stat.S_ISVTX)
    assert log_dir(with_changes(log_dir=shared / "logs")) == shared / "logs"
    assert stat.S_IMODE((shared / "logs").stat().st_mode) == 0o700
    assert as_attacker("mv", str(shared / "logs"), str(shared / "theirs")).returncode != 0
    assert (shared / "logs").is_dir()


def test_a_log_dir_others_may_create_files_in_is_refused_before_their_fifos_are_opened(slurm, attacker, tmp_path,
                                                                                       world_tmp):
    """The attack: a shared sticky log folder, where the other user makes FIFOs (or files of theirs) under the
    names the next job's script and Slurm log would take. `rayhpc submit` refuses the folder at once, in one
    line, opens none of them and submits nothing; with a folder of one's own, the script goes to sbatch on
    stdin and no file of it is left in the log folder."""
    logs = world_tmp("rayhpc-shared-logs")
    logs.mkdir()
    logs.chmod(0o1777)
    probe = subprocess.run(["sbatch", "--parsable", "--hold", "--output=/dev/null", "--wrap=true"],
                           capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run(["scancel", probe], check=True)
    names = [f"rayhpc-local-slurm-{int(probe) + i}.log" for i in range(1, 6)]
    names += [f"rayhpc-local-slurm-{time.strftime('%Y%m%d-%H%M%S', time.localtime(time.time() + i))}.sbatch"
              for i in range(30)]
    for name in names:
        assert as_attacker("mkfifo", "-m", "666", f"{logs}/{name}").returncode == 0
    proc = submit_with_log_dir(logs, tmp_path)  # a FIFO opened for writing would block it: the test would hang
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"error: log_dir {logs}: {logs} (mode 1777) lets other users create files in it"), \
        proc.stderr
    assert sorted(p.name for p in logs.iterdir()) == sorted(names)

    own = tmp_path / "logs"
    proc = submit_with_log_dir(own, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in own.iterdir() if p.suffix == ".sbatch"] == [], "the script was written beside the logs"


def test_a_path_through_a_symbolic_link_is_checked_where_it_really_is(attacker, tmp_path, world_tmp):
    """What `check_ancestors` is given unresolved (a cluster config's log_dir is resolved when loaded; the
    temp folder `rayhpc doctor` checks is not): a link in a folder of one's own that leads into a folder
    others may write without the sticky bit is refused, naming that folder; a link the other user made
    (in a sticky shared folder, pointing at /tmp, which passes every check itself) is refused, naming
    the link."""
    shared = world_tmp("rh-open")
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "inner").mkdir(mode=0o700)
    (tmp_path / "logs").symlink_to(shared / "inner")
    with pytest.raises(UnsafePath, match=f"^{shared} \\(mode 0777\\) can be written by other users and has no sticky"):
        check_ancestors(tmp_path / "logs" / "job")

    sticky = world_tmp("rh-sticky")
    sticky.mkdir()
    sticky.chmod(0o1777)
    assert as_attacker("ln", "-s", "/tmp", f"{sticky}/logs").returncode == 0
    uid = int(subprocess.run(["id", "-u", attacker], capture_output=True, text=True, check=True).stdout)
    with pytest.raises(UnsafePath, match=f"^{sticky}/logs is a symbolic link of uid {uid}, not yours"):
        check_ancestors(sticky / "logs" / "job")


def submit_with_log_dir(log_dir: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """`rayhpc submit -- true` on the test cluster's config with `log_dir` (a job it submits is cancelled
    after the test)."""
    config = tmp_path / "cluster.yaml"
    config.write_text(json.dumps(with_changes(log_dir=log_dir).model_dump(mode="json")))  # JSON is YAML
    proc = subprocess.run([RAYHPC, "submit", "--cluster", str(config), "--", "true"], capture_output=True, text=True,
                          cwd=tmp_path)
    if proc.returncode == 0:  # a refusal is broken: the job went in
        SUBMITTED.append(proc.stdout.split()[2].rstrip(":"))
    return proc


def listening_ports(pid: int) -> set[int]:
    """TCP ports process `pid` listens on, read in its own network namespace."""
    try:
        inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")}
        lines = [line.split() for name in ("tcp", "tcp6") for line in
                 Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]]
    except OSError:
        return set()
    return {int(f[1].rsplit(":", 1)[1], 16) for f in lines if f[3] == "0A" and f[9] in inodes}


def test_ray_lives_in_private_folders_binds_its_own_ports_and_stop_leaves_nothing(slurm, attacker):
    job = submit("python", "-c", "import time; time.sleep(600)")
    info = wait_cluster(job)
    # the connection file: routable addresses (never loopback), every port, the tunnel, the token
    assert info["nodes"] == {"node1": "10.77.0.11", "node2": "10.77.0.12"} and info["head_ip"] == "10.77.0.11", info
    assert info["token_path"] == str(LOGS / job / "auth_token") and info["tunnel"].startswith("ssh -N -L "), info
    assert info["address"] == f"10.77.0.11:{info['ports']['gcs']}", info
    low = info["ports"]["client_server"]
    assert [info["ports"][name] - low for name in OFFSETS] == list(OFFSETS.values()) and low >= 20000, info
    # Ray's temp dirs: inside random 0700 folders of the job's user, out of other users' reach
    for node in ("node1", "node2"):
        temp = Path(json.loads((LOGS / job / "nodes" / f"{node}.ray.json").read_text())["temp_dir"])
        folder = temp.parent.stat()
        assert folder.st_mode & 0o777 == 0o700 and folder.st_uid == os.getuid(), (node, temp)
        assert temp.parent.name.startswith(f"rh-{job}-") and temp.parent.name != f"rh-{job}-{node}"
        assert as_attacker("ls", str(temp)).returncode != 0, "another user can reach Ray's sockets"
    # the port numbers on the job's `ray start` lines, which the other user reads in `ps` seconds before Ray binds
    # them: 0 (bound by the process that serves it, then published by Ray), but for the block's client server
    starts = [line for line in as_attacker("ps", "-ww", "-eo", "args").stdout.splitlines() if " start --block " in line
              and f"rh-{job}-" in line]
    assert len(starts) == 2, starts  # one per node
    named = {flag: int(value) for line in starts for flag, value in re.findall(r"(--[a-z-]*port)=(\d+)", line)}
    assert {flag: port for flag, port in named.items() if port} == {"--ray-client-server-port": low}, starts
    # the job's processes hold the block's ports (the metrics servers start in the background)
    deadline = time.monotonic() + 60
    ours = [int(p.split()[0]) for p in job_processes(job) if p.split()[1] != "srun"]
    while not {info["ports"][name] for name in OFFSETS} <= (ports := set().union(*map(listening_ports, ours))):
        assert time.monotonic() < deadline, f"the block's ports never opened: {sorted(ports)}"
        time.sleep(1)
    # rayhpc status JOBID: Slurm's view and Ray's together
    status = subprocess.run([RAYHPC, "status", job], capture_output=True, text=True)
    assert status.returncode == 0, status.stderr
    assert f"job {job} (rayhpc-local-slurm): RUNNING" in status.stdout and "nodes node[1-2]" in status.stdout
    assert "2 node(s); in use: " in status.stdout and info["address"] in status.stdout, status.stdout
    # rayhpc stop JOBID: cancelled, and each node's clean-up report says nothing was left
    stop = subprocess.run([RAYHPC, "stop", job], capture_output=True, text=True, timeout=180)
    assert stop.returncode == 0 and "node1: clean" in stop.stdout and "node2: clean" in stop.stdout, stop
    assert_nothing_left(job)


def test_a_port_block_someone_holds_on_one_node_is_skipped(slurm, tmp_path):
    from rayhpc.slurm.layout import BLOCK, block_bases

    job = submit_held(with_changes(), ["python", "-c", TWO_NODES], tmp_path)
    low, high = map(int, subprocess.run(["nsenter", "--net=/var/run/netns/n1", "cat",
                                         "/proc/sys/net/ipv4/ip_local_port_range"], capture_output=True, text=True,
                                        check=True).stdout.split())
    bases = block_bases((low, high))
    taken = bases[int(job) % len(bases)] + OFFSETS["dashboard_metrics"]  # in the block the job id maps to
    holder = subprocess.Popen(["nsenter", "--net=/var/run/netns/n2", sys.executable, "-c",
                               f"import socket, time; s = socket.socket(); s.bind(('0.0.0.0', {taken})); s.listen(); "
                               f"print('held', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        subprocess.run(["scontrol", "release", job], check=True)
        info = wait_done(job)
    finally:
        holder.kill()
    assert info["JobState"] == "COMPLETED", job_log(job)
    first, last = map(int, re.search(r"; ports (\d+)-(\d+)", job_log(job)).groups())
    assert last == first + BLOCK - 1 and not first <= taken <= last, (first, last, taken)
    assert_nothing_left(job)


@pytest.mark.parametrize("attack", ["the ports on ray start's command lines", "autoscaler_metrics",
                                    "dashboard_metrics"])
def test_a_port_another_user_takes_before_the_head_starts_never_receives_the_token(slurm, attacker, tmp_path,
                                                                                    attack):
    """The other user binds the ports the job is about to use, before its head's Ray binds them: each port number
    on the job's `ray start` lines, read from `ps` as they appear (seconds before Ray binds them), or one of the
    job's block (the moment the layout is printed). Every port of Ray's that its processes call with the token
    is 0 on those lines, bound by its owner and published once bound: the only number there is the block's Ray
    client server (Ray will not bind it with 0), which no process of Ray calls. So nothing the other user
    receives carries the job's token. A held client server port (`ray://` clients would send their token there)
    stops the job before its command, with one line naming the port; a held metrics port (a Prometheus endpoint)
    costs that endpoint only, and the job runs."""
    cfg = with_changes()
    log_dir(cfg)
    job = submit_held(cfg, ["python", "-c", "print('the command ran')"], tmp_path)
    subprocess.run(["scontrol", "release", job], check=True)
    deadline, block = time.monotonic() + 120, None
    while block is None:
        assert time.monotonic() < deadline, "the job did not lay out its ports"
        log = Path(LOGS / f"rayhpc-local-slurm-{job}.log")
        block = re.search(r"; ports (\d+)-(\d+)", log.read_text()) if log.exists() else None
        time.sleep(0.02)
    low = int(block.group(1))
    target = f"ps:rh-{job}-" if attack not in OFFSETS else str(low + OFFSETS[attack])
    catcher = start_as_attacker(CATCH_TOKENS, target, "20", "20", imports=CATCH_IMPORTS, netns="n1")
    info = wait_done(job)
    got = caught(catcher)
    log = job_log(job)
    assert got["tokens"] == [], got
    if attack in OFFSETS:
        assert got["bound"] == [low + OFFSETS[attack]], "the other user never held the port: Ray took it first"
        assert info["JobState"] == "COMPLETED" and "the command ran" in log, log
    else:
        port = low + OFFSETS["client_server"]
        assert got["bound"] == [port], got  # every other port on the lines is 0
        assert info["JobState"] == "FAILED" and "the command ran" not in log, log
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert errors == [(f"error: port {port} (Ray's client server) on the head is held by another process "
                           f"(another user's?), not this job's Ray: the job stops; see {LOGS}/{job}/ray-node1.log")], log
    assert_nothing_left(job)


def test_a_job_submitted_from_a_folder_another_user_writes_imports_nothing_from_it(slurm, attacker, world_tmp,
                                                                                     tmp_path):
    """The attack: the other user plants `rayhpc/__init__.py`, `torch.py` and `ray.py` in the folder the victim
    submits from (a shared scratch). The batch script and its steps run there (SLURM_SUBMIT_DIR): every
    `python -m rayhpc.slurm.*` step, the one that writes the token among them, each node's Ray (its client
    server and dashboard modules start with `-m` and `-c`) and its workers would import the planted code. The
    job (a sweep by the script's path) runs to its end, and nothing imported from there."""
    folder, marks = planted_folder(world_tmp)
    config = tmp_path / "cluster.yaml"
    venv = Path(sys.executable).parent.parent
    config.write_text(json.dumps(with_changes(setup={"venv": str(venv)}).model_dump(mode="json")))  # JSON is YAML
    proc = subprocess.run([RAYHPC, "submit", "--cluster", str(config), "--", "python", "-u",
                           str(ROOT / "jobs" / "tune_mlp.py"), "--num-samples", "2", "--epochs", "1",
                           "--storage-path", str(tmp_path / "results")], capture_output=True, text=True, cwd=folder)
    assert proc.returncode == 0, proc.stderr
    SUBMITTED.append(job := proc.stdout.split()[2].rstrip(":"))
    info = wait_done(job)
    assert info["JobState"] == "COMPLETED" and f"WorkDir={folder}" in " ".join(f"{k}={v}" for k, v in info.items()), \
        job_log(job)
    assert planted_imports(marks) == []
    assert_nothing_left(job)


@pytest.mark.parametrize("theirs", ["links to the victim's file", "the log folder"])
def test_the_startup_submitted_directly_writes_its_log_only_into_a_folder_of_the_users(slurm, attacker, world_tmp,
                                                                                     tmp_path, theirs):
    """The attack: a shared sticky folder the victim submits `sbatch ray_cluster.sbatch` from, where the other user
    makes the names its log would take first. The script used to have Slurm append its log to
    `rayhpc-%x-%j.log` there: a link of theirs named so led it into any file of the victim's. Now Slurm writes
    nothing there (/dev/null) and the startup appends its own log to `rayhpc-logs/<name>-<job>.log`, a folder
    of the victim's that no one else can create files in; where they made that folder first, the job stops
    before anything runs, says why in its comment, and writes nothing into theirs."""
    shared = world_tmp("rh-submit")
    shared.mkdir()
    shared.chmod(0o1777)
    victim = tmp_path / "victims-file"
    victim.write_text("mine\n")
    probe = subprocess.run(["sbatch", "--parsable", "--hold", "--output=/dev/null", "--wrap=true"],
                           capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run(["scancel", probe], check=True)
    for job in range(int(probe) + 1, int(probe) + 6):
        assert as_attacker("ln", "-s", str(victim), f"{shared}/rayhpc-rayhpc-ray-{job}.log").returncode == 0
    if theirs == "the log folder":
        assert as_attacker("mkdir", "-m", "777", f"{shared}/rayhpc-logs").returncode == 0
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # the venv, activated
    env.pop("RAYHPC_LOG_DIR", None)
    job = subprocess.run(["sbatch", "--parsable", "--nodes=1", str(ROOT / "cluster_configs" / "slurm" / "ray_cluster.sbatch"),
                          "python", "-c", "print('the command ran')"], capture_output=True, text=True, env=env,
                         cwd=shared, check=True).stdout.strip()
    SUBMITTED.append(job)
    info = wait_done(job)
    assert victim.read_text() == "mine\n", "the job's log went into the victim's file"
    if theirs == "the log folder":
        assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", info
        shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
        comment = re.search(r"\bComment=(.*?)(?= [A-Z][A-Za-z:]*=|$)", shown).group(1)  # words, spaces between
        assert comment.startswith(f"error: log_dir {shared}/rayhpc-logs: {shared}/rayhpc-logs belongs to uid"), shown
        assert list((shared / "rayhpc-logs").iterdir()) == [], "the job wrote into the other user's folder"
    else:
        log = shared / "rayhpc-logs" / f"rayhpc-ray-{job}.log"
        assert info["JobState"] == "COMPLETED" and "the command ran" in log.read_text(), info
        assert stat.S_IMODE(log.stat().st_mode) == 0o600 and stat.S_IMODE(log.parent.stat().st_mode) == 0o700
    assert_nothing_left(job)


def stub_runtime(tmp_path: Path) -> tuple[str, Path]:
    """A stand-in `apptainer`: records its arguments (one per line), checks the image is one existing
    file, and runs the command after it. Returns (PATH with it first, the folder of its records)."""
    bin_dir, records = tmp_path / "bin", tmp_path / "records"
    bin_dir.mkdir()
    records.mkdir()
    (bin_dir / "apptainer").write_text(f"""#!/bin/bash
printf '%s\\n' "$@" > {records}/$$.args
shift   # exec
while [[ $1 == --* ]]; do [ "$1" = --bind ] && shift; shift; done
[ -f "$1" ] || {{ echo "stub apptainer: no image file '$1'" >&2; exit 1; }}
shift
exec "$@"
""")
    (bin_dir / "apptainer").chmod(0o755)
    return f"{bin_dir}:{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin", records


def test_container_paths_with_spaces_reach_the_runtime_as_one_word_for_ray_and_the_command(slurm, tmp_path):
    path, records = stub_runtime(tmp_path)
    image = tmp_path / "my images" / "ray hpc.sif"
    image.parent.mkdir()
    image.write_text("")
    cfg = with_changes(setup={"env": {"PATH": path}},
                       container={"image": str(image), "binds": [f"{tmp_path}/a b:/scratch"]})
    job = submit_held(cfg, ["python", "-c", "import sys; print('ARGS', sys.argv[1:])", "a b", "$HOME", "*"], tmp_path)
    subprocess.run(["scontrol", "release", job], check=True)
    info = wait_done(job)
    log = job_log(job)
    assert info["JobState"] == "COMPLETED", log
    assert "ARGS ['a b', '$HOME', '*']" in log, log
    runs = [p.read_text().splitlines() for p in records.glob("*.args")]
    ray_runs = [r for r in runs if "ray" in r and "start" in r]
    assert len(ray_runs) == 2 and len(runs) == 3, runs  # Ray on both nodes, and the command
    for run in runs:
        assert run[:4] == ["exec", "--bind", f"{tmp_path}/a b:/scratch", str(image)], run
    assert_nothing_left(job)


def test_usr1_during_start_up_requeues_without_running_the_command(slurm, tmp_path):
    ran = tmp_path / "ran"
    job = submit("python", "-c", f"open({str(ran)!r}, 'a').write('ran\\n')")
    deadline = time.monotonic() + 120
    while f"rayhpc: job {job} (restart 0)" not in (LOGS / f"rayhpc-local-slurm-{job}.log").read_text(
            errors="replace") if (LOGS / f"rayhpc-local-slurm-{job}.log").exists() else True:
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.1)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
    skip_requeue_delay(job)
    info = wait_done(job)
    log = job_log(job)
    assert "USR1 received during start-up: the command will not start; requeueing" in log, log
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log
    assert ran.read_text() == "ran\n", "the command ran more than once"
    assert_nothing_left(job)


def test_usr1_after_the_command_ended_does_not_requeue(slurm):
    # the command ends at once; a sender it leaves behind waits until the startup has reaped the
    # command (a zombie still answers kill -0), then sends USR1 while the startup cleans up. The sender
    # drops the job's marker so that the clean-up's reaper does not kill it before it sends.
    job = submit("bash", "-c", "env -u RAYHPC_COMMAND bash -c 'while kill -0 $1 2>/dev/null; do sleep 0.01; "
                               "done; sleep 0.1; kill -USR1 $0' $PPID $$ & exit 0")
    info = wait_done(job)
    log = job_log(job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", log
    assert "USR1 received after the command ended: ignored" in log, log
    assert_nothing_left(job)


def netns_of(pid: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def test_a_killed_head_leaves_nothing_on_either_node(slurm):
    """The head's batch script and Ray die at once (SIGKILL, no trap runs): Slurm ends the job, and each
    node's rayhpc.slurm.node, told by Slurm to stop, reaps the job's processes there."""
    job = submit("python", "-c", "import time; time.sleep(600)")
    wait_cluster(job)
    deadline = time.monotonic() + 60  # the command starts after the cluster is announced: killed with the rest
    while not any("time.sleep(600)" in p for p in job_processes(job)):
        assert time.monotonic() < deadline, job_processes(job)
        time.sleep(0.2)
    head_ns = netns_of(str(subprocess.run(["ip", "netns", "pids", "n1"], capture_output=True, text=True,
                                          check=True).stdout.split()[0]))
    head = [p.split()[0] for p in job_processes(job) if netns_of(p.split()[0]) == head_ns]
    ray_procs = [p for p in head if "rayhpc.slurm.node" not in Path(f"/proc/{p}/cmdline").read_text()]
    assert len(ray_procs) > 3, head
    for pid in ray_procs:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    info = wait_done(job)
    assert info["JobState"] in ("FAILED", "CANCELLED"), info["JobState"]
    assert_nothing_left(job, timeout_s=60)


def test_doctor_in_a_two_node_allocation_checks_the_nodes_and_names_problems(slurm, attacker, tmp_path, world_tmp):
    theirs = world_tmp("rayhpc-theirs")
    assert as_attacker("mkdir", "-m", "755", str(theirs)).returncode == 0
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(Path(CLUSTER).read_text().replace("log_dir: /tmp/rayhpc-slurm-logs", f"log_dir: {theirs}"))
    out = tmp_path / "doctor.log"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "NoDevFiles"}
    job = subprocess.run(["sbatch", "--parsable", "--nodes=2", f"--output={out}",
                          f"--wrap={RAYHPC} doctor --cluster {cluster} --storage-path {tmp_path}"],
                         capture_output=True, text=True, env=env, check=True).stdout.strip()
    info = wait_done(job)
    lines = out.read_text().splitlines()
    assert info["ExitCode"] == "1:0", lines  # problems found
    want = {"OK      ports: a free block", "OK      address: Ray would use 10.77.0.11; 1 of 1 other node(s) reach it",
            f"OK      storage {tmp_path}: seen by 2 of 2 node(s)", "OK      versions: ray, torch",
            f"PROBLEM log_dir {theirs}: {theirs} belongs to uid", "PROBLEM GPUs: CUDA_VISIBLE_DEVICES='NoDevFiles'",
            "OK      requeue: USR1 30 s before the 00:10:00 limit"}
    missing = [w for w in want if not any(line.startswith(w) for line in lines)]
    assert missing == [], "\n".join(lines)
    assert next(line for line in lines if "versions" in line).endswith("on 2 node(s)")


def test_status_of_another_users_job_never_follows_their_connection_file(slurm, attacker, world_tmp):
    """The attack: the other user's job (named rayhpc-*) logs into a folder of theirs, where they write the
    job's `cluster.json`: "the cluster" is a port they listen on, and its token the victim's own. `rayhpc
    status JOBID` and `rayhpc status` show the job as Slurm sees it, and never connect there."""
    theirs = world_tmp("rh-theirs")
    assert as_attacker("mkdir", "-m", "755", str(theirs)).returncode == 0
    job = as_attacker("sbatch", "--parsable", "--job-name=rayhpc-trap", f"--output={theirs}/%x-%j.log",
                      "--wrap=sleep 600").stdout.strip()
    assert job, "the other user could not submit"
    SUBMITTED.append(job)
    with socket.socket() as trap:
        trap.bind(("", 0))
        trap.listen()
        trap.setblocking(False)
        port = trap.getsockname()[1]
        fake = {"job": int(job), "restart": 0, "head": "node1", "head_ip": "127.0.0.1", "address": f"127.0.0.1:{port}",
                "token_path": str(Path.home() / ".ray" / "auth_token"), "ports": {}, "nodes": {},
                "dashboard": f"http://127.0.0.1:{port}", "tunnel": "ssh ..."}
        assert as_attacker("sh", "-c", f"mkdir -m 700 {theirs}/{job} && echo '{json.dumps(fake)}' > "
                                       f"{theirs}/{job}/cluster.json").returncode == 0
        deadline = time.monotonic() + 60
        while slurm_job(job).get("JobState") != "RUNNING":
            assert time.monotonic() < deadline, slurm_job(job)
            time.sleep(0.5)
        one = subprocess.run([RAYHPC, "status", job], capture_output=True, text=True, timeout=60)
        listed = subprocess.run([RAYHPC, "status"], capture_output=True, text=True, timeout=60)
        with pytest.raises(BlockingIOError):
            trap.accept()[0].close()  # nobody connected
    no_cluster = ["ray: no cluster running (no connection file yet)"]
    assert one.returncode == 0 and one.stdout.splitlines()[1:] == no_cluster, one.stdout + one.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith(job))
    assert row.split()[-2:] == ["-", "-"], listed.stdout


INNER = ("inner=$(sbatch --parsable --job-name=rayhpc-inner --output=/dev/null --wrap='sleep 600') && "
         "echo inner job $inner && "
         "while [ \"$(squeue -h -j $inner -o %T)\" != RUNNING ]; do sleep 0.5; done")


def test_a_job_submitted_from_inside_a_job_outlives_the_first_jobs_clean_up(slurm):
    """sbatch exports the environment, so a job submitted by the command carries the first job's marker;
    the first job's clean-up (on every node of the test cluster, so on the inner job's too) must leave it."""
    outer = submit("sh", "-c", INNER)
    info = wait_done(outer)
    log = job_log(outer)
    assert info["JobState"] == "COMPLETED", log
    inner = log.split("inner job ", 1)[1].split()[0]
    SUBMITTED.append(inner)
    assert slurm_job(inner).get("JobState") == "RUNNING", (slurm_job(inner), log)
    assert job_processes(inner), "the inner job's processes are gone"


def processes_on(job: str, node: str) -> list[int]:
    """The job's processes on one test node: those in its network namespace (the node itself; Ray's retitled
    agents can lose SLURMD_NODENAME from what /proc shows of their environment, never their namespace)."""
    netns = Path("/var/run/netns") / f"n{node.removeprefix('node')}"
    namespace = f"net:[{netns.stat().st_ino}]"
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"SLURM_JOB_ID={job}".encode() in (proc / "environ").read_bytes().split(b"\0") \
                    and netns_of(proc.name) == namespace:
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def signal_all(pids: set[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def test_after_a_lost_head_node_the_surviving_node_removes_the_token_and_the_next_job_its_temp_folder(slurm):
    """A lost head takes the batch script and its clean-up with it: every process of the job on the head is
    killed at once. The node that survives removes the job's token, connection file and Prometheus targets
    when Slurm ends the job; the head's temp folder is removed by the user's next job there, as are the
    secrets of an ended job whose every node was killed before its clean-up (only of a job that ran on that
    node: a log folder two Slurm clusters share holds the other's jobs too)."""
    job = submit("python", "-c", "import time; time.sleep(600)")
    head = wait_cluster(job)["head"]
    secrets = [LOGS / job / "auth_token", LOGS / job / "cluster.json", LOGS / "prometheus" / f"{job}.json"]
    assert all(path.exists() for path in secrets)
    # the node is lost: everything of the job on it dies at once. Ray's agents retitle themselves, which
    # clobbers the node's name in their /proc environ, so they are found below the raylet; the tree is
    # frozen (SIGSTOP) before the kill, so no process forks or is re-parented out of reach meanwhile
    deadline = time.monotonic() + 10
    while (alive := processes_on(job, head)) and time.monotonic() < deadline:
        tree = {*alive, *descendants(*alive)}
        signal_all(tree, signal.SIGSTOP)
        signal_all({*tree, *descendants(*tree)}, signal.SIGKILL)
        time.sleep(0.2)
    assert not alive, f"processes of job {job} on {head} outlived SIGKILL: {alive}"
    wait_done(job)
    # the surviving node removes the secrets, then reaps its Ray and removes its own temp folder (/tmp is
    # shared by the test cluster's nodes); wait for that. A node killed before its clean-up ran leaves both to
    # the user's next job, as the lost head does (the test below proves the surviving node's part alone)
    deadline = time.monotonic() + 30
    while (any(path.exists() for path in secrets) or len(glob.glob(f"/tmp/rh-{job}-*")) > 1) \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    head_temp = Path(json.loads((LOGS / job / "nodes" / f"{head}.ray.json").read_text())["temp_dir"]).parent
    assert head_temp.exists(), "the lost head's temp folder (the test's precondition)"
    killed, elsewhere = (stale_job_secrets(fake, node) for fake, node in (("990101", head), ("990102", "nodeX")))
    next_job = submit("true")
    assert wait_done(next_job)["JobState"] == "COMPLETED", job_log(next_job)
    assert_nothing_left(job)
    assert [path for path in secrets if path.exists()] == [], job_log(job)
    assert [path.exists() for path in killed + elsewhere] == [False] * 3 + [True] * 3
    for fake in ("990101", "990102"):
        shutil.rmtree(LOGS / fake)
        (LOGS / "prometheus" / f"{fake}.json").unlink(missing_ok=True)


def stale_job_secrets(job: str, ran_on: str) -> list[Path]:
    """The secrets of an ended job whose Ray ran on `ran_on`, as a job whose every node was killed leaves them."""
    (LOGS / job / "nodes").mkdir(mode=0o700, parents=True, exist_ok=True)
    (LOGS / job / "nodes" / f"{ran_on}.ray.json").write_text("{}")
    paths = [LOGS / job / "auth_token", LOGS / job / "cluster.json", LOGS / "prometheus" / f"{job}.json"]
    for path in paths:
        path.write_text("x")
    return paths


@pytest.mark.parametrize("head", ["gone", "up", "up, the job ends"])
def test_a_worker_nodes_ray_that_ends_by_itself_removes_the_token_only_when_the_head_is_gone(slurm, tmp_path,
                                                                                               head):
    """The lost-head test above may see the job end before the surviving node's Ray notices; here the node's
    Ray (a stand-in that exits 1) ends first. With the head's port refusing, its token and targets go; with
    the head up (a listening socket), they stay for the command still running there. When the job ends
    (SIGTERM, here with a SIGHUP hard on its heels, as from a lost srun) they go whatever the head."""
    job, job_dir = "990001", tmp_path / "990001"
    job_dir.mkdir(mode=0o700)
    (tmp_path / "prometheus").mkdir(mode=0o700)
    secrets = [job_dir / "auth_token", job_dir / "cluster.json", tmp_path / "prometheus" / f"{job}.json"]
    for path in secrets:
        path.write_text("x")
    ends = head.endswith("ends")
    # stopped while both arrive, so both are pending when it goes on
    stand_in = "kill -STOP $PPID; kill -TERM $PPID; kill -HUP $PPID; kill -CONT $PPID; sleep 30" if ends else "exit 1"
    with socket.socket() as gcs:
        gcs.bind(("127.0.0.1", 0))
        if head.startswith("up"):  # else bound and not listening: connections are refused
            gcs.listen()
        # the stand-in as the node's container runtime: it is given `ray start ...` and ignores it
        env = {**os.environ, "SLURM_JOB_ID": job, "RAY_ADDRESS": f"127.0.0.1:{gcs.getsockname()[1]}",
               "RAYHPC_CONTAINER": shlex.join(["sh", "-c", stand_in])}
        node = subprocess.run([sys.executable, "-m", "rayhpc.slurm.node", "run", str(job_dir), "--"], env=env,
                              capture_output=True, text=True, timeout=60)
    assert node.returncode == (0 if ends else 1), node.stderr
    assert [path.exists() for path in secrets] == [head == "up"] * 3, (head, node.stdout, node.stderr)
    assert not glob.glob(f"/tmp/rh-{job}-*"), "the node's temp folder outlived its Ray"


def test_stop_of_another_users_job_is_one_error_line_and_the_job_runs_on(slurm, attacker):
    job = subprocess.run(["sbatch", "--parsable", "--job-name=rayhpc-theirs", "--output=/dev/null", "--wrap=sleep 600"],
                         capture_output=True, text=True, check=True).stdout.strip()
    SUBMITTED.append(job)
    stop = rayhpc_as_attacker("stop", job)
    assert stop.returncode == 2 and stop.stderr.startswith(f"error: job {job}: scancel: "), stop.stderr
    assert len(stop.stderr.strip().splitlines()) == 1 and "Traceback" not in stop.stderr, stop.stderr
    assert subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip(), \
        "another user's `rayhpc stop` ended the job"




def rayhpc_as_attacker(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`rayhpc ARGS` as the other user."""
    return python_as_attacker(f"rayhpc.cli.main({list(args)!r})", env=env,
                              imports="import shutil, json, subprocess, pathlib, rayhpc.cli, rayhpc.cluster, "
                                      "rayhpc.slurm.submit")


def test_status_shows_other_users_private_jobs_and_odd_names_without_a_traceback(slurm, attacker):
    mine = submit("python", "-c", "import time; time.sleep(600)")
    odd = subprocess.run(["sbatch", "--parsable", "--job-name=rayhpc-a|b", "--output=/dev/null", "--wrap=sleep 600"],
                         capture_output=True, text=True, check=True).stdout.strip()
    try:
        wait_cluster(mine)
        status = rayhpc_as_attacker("status")
        assert status.returncode == 0 and status.stderr == "", status
        rows = {line.split()[0]: line for line in status.stdout.splitlines()[1:]}
        assert "rayhpc-a|b" in rows[odd] and "rayhpc-local-slurm" in rows[mine], status.stdout
        # the other user cannot read the job's folder: no head or dashboard shown, and no error
        assert rows[mine].split()[-2:] == ["-", "-"], rows[mine]
        # a token file this user cannot read: one error line, not a traceback in every command
        token = rayhpc_as_attacker("status", "--address", "127.0.0.1:1",
                                   env={"RAY_AUTH_TOKEN_PATH": str(LOGS / mine / "auth_token")})
        assert token.returncode == 2 and token.stderr.startswith("error: RAY_AUTH_TOKEN_PATH "), token.stderr
        assert len(token.stderr.strip().splitlines()) == 1, token.stderr
    finally:
        subprocess.run(["scancel", mine, odd], check=True)
    wait_done(mine)
    assert_nothing_left(mine)


def test_the_clean_up_finds_a_process_whose_retitling_hid_its_marker(tmp_path):
    """setproctitle may overwrite the environment block /proc/PID/environ shows, marker and job id
    included (a Ray agent outlived two jobs so): `reap` also kills what runs below a marked process."""
    from rayhpc.slurm import node

    job = str(900000 + os.getpid() % 99999)
    script = tmp_path / "retitled.py"
    script.write_text("import subprocess, sys, time\n"
                      "if sys.argv[1:] == ['child']:\n"
                      "    import ray._raylet\n"
                      "    ray._raylet.setproctitle('ray::DashboardAgent')  # as Ray's agents retitle themselves\n"
                      "    time.sleep(60)\n"
                      "else:\n"
                      "    subprocess.Popen([sys.executable, __file__, 'child'])\n"
                      "    time.sleep(60)\n")
    markers = [f"{node.NODE_MARKER}={job}:n1"]
    env = {"PATH": os.environ["PATH"], node.NODE_MARKER: f"{job}:n1", "SLURM_JOB_ID": job}
    parent = subprocess.Popen([sys.executable, str(script)], env=env)
    try:
        deadline = time.monotonic() + 30
        while not (child := descendants(parent.pid)) or \
                Path(f"/proc/{min(child)}/cmdline").read_bytes()[:5] != b"ray::":
            assert time.monotonic() < deadline, "the child never retitled itself"
            time.sleep(0.1)
        assert carrying(*markers, job=job) == [parent.pid], "the retitled child still shows its marker"
        assert node.job_processes(job, markers) == sorted([parent.pid, *child])
        assert node.reap(job, markers) == []
        assert parent.wait(timeout=10) == -signal.SIGKILL and not descendants(parent.pid)
    finally:
        signal_all({*descendants(parent.pid), parent.pid}, signal.SIGKILL)
        parent.wait()
