"""`rayhpc doctor [--cluster FILE] [--storage-path PATH]`: a pre-flight on this node or allocation.

One line per check, `OK` or `PROBLEM` (with the fix), or `SKIP` where the check needs an allocation
of several nodes. Run it on a login node before submitting, or inside an allocation
(`salloc -N 2 rayhpc doctor ...`) to check what only the nodes can tell: whether they reach the
head's address, share the storage folder, and run the same Ray and torch.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shlex
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from rayhpc.private import UnsafePath, check_ancestors
from rayhpc.slurm.config import ClusterConfig, time_seconds
from rayhpc.slurm.layout import BLOCK, busy_ports, node_ip, nodes_of, ports
from rayhpc.slurm.node import temp_base

SHARED_FS = {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "fuse.glusterfs", "panfs", "wekafs",
             "fuse.sshfs", "smb2", "cifs"}


def _srun(command: list[str], nodes: list[str]) -> list[str]:
    """`command` on each of `nodes` of this allocation; its output lines."""
    out = subprocess.run(["srun", "--overlap", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}",
                          f"--nodelist={','.join(nodes)}", "--kill-on-bad-exit=0", *command],
                         capture_output=True, text=True, timeout=300)
    return out.stdout.split("\n")


def allocation() -> list[str]:
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    return nodes_of(nodelist) if nodelist else []


def check_ports() -> tuple[bool, str]:
    try:
        block = ports(secrets.randbelow(1 << 20), busy_ports())
    except RuntimeError as exc:
        return False, f"ports: {exc}"
    first, last = min(block.values()), max(block.values())
    return True, f"ports: a free block of {BLOCK} here, e.g. {first}-{last} (chosen per job at start)"


def check_folder(label: str, path: Path) -> tuple[bool, str]:
    try:
        check_ancestors(path)
    except UnsafePath as exc:
        return False, f"{label} {path}: {exc}"
    if path.exists() and not os.access(path, os.W_OK):
        return False, f"{label} {path}: not writable by you; choose a folder of your own"
    return True, f"{label} {path}: yours (or root's), no other user can replace what is inside"


def check_tmp() -> tuple[bool, str]:
    tmp = Path(temp_base())
    ok, text = check_folder("temp folder", tmp)
    if not ok:
        return ok, text
    with tempfile.TemporaryDirectory(prefix="rh-doctor-", dir=tmp) as probe:
        mode = os.stat(probe).st_mode & 0o777
    return mode == 0o700, f"temp folder {tmp}: Ray's temp dirs go into random 0700 folders here (probe mode {mode:04o})"


def check_ip(cfg: ClusterConfig | None, nodes: list[str]) -> tuple[bool | None, str]:
    try:
        ip = node_ip(cfg.ray.head_ip if cfg else None)
    except RuntimeError as exc:
        return False, f"address: {exc}"
    if ipaddress.ip_address(ip).is_loopback:
        return False, f"address: {ip} is loopback: other nodes cannot reach it; set ray.head_ip"
    others = [n for n in nodes if n != socket.gethostname().split(".")[0]]
    if not others:
        return None, f"address: Ray would use {ip} here; whether other nodes reach it needs an allocation of 2+ nodes"
    with socket.socket() as server:
        server.bind((ip, 0))
        server.listen(len(others))
        code = f"import socket; socket.create_connection(({ip!r}, {server.getsockname()[1]}), timeout=10); print('ok')"
        answers = _srun([sys.executable, "-P", "-c", code], others)
    reached = answers.count("ok")
    return reached == len(others), f"address: Ray would use {ip}; {reached} of {len(others)} other node(s) reach it"


def check_gpus() -> tuple[bool, str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return True, "GPUs: CUDA_VISIBLE_DEVICES unset (Ray assigns GPUs to its workers)"
    if visible in ("NoDevFiles", "") or not all(d.strip() for d in visible.split(",")):
        return False, (f"GPUs: CUDA_VISIBLE_DEVICES={visible!r}: no usable GPU (Slurm sets NoDevFiles when the job "
                       f"has none); ask for GPUs (--gpus-per-node) or unset it")
    want = os.environ.get("SLURM_GPUS_ON_NODE")
    if want and want.isdigit() and int(want) != len(visible.split(",")):
        return False, f"GPUs: CUDA_VISIBLE_DEVICES={visible!r} lists {len(visible.split(','))}, Slurm gave {want}"
    return True, f"GPUs: CUDA_VISIBLE_DEVICES={visible!r}"


def check_storage(path: Path | None, nodes: list[str], cfg: ClusterConfig | None) -> tuple[bool | None, str]:
    if path is None:
        return None, "storage: no --storage-path given"
    if not path.is_dir():
        return False, f"storage {path}: no such folder"
    if len(nodes) > 1:  # inside an allocation: ask the nodes themselves
        probe = path / f".rayhpc-doctor-{secrets.token_hex(4)}"
        probe.write_text("")
        try:
            seen = _srun(["sh", "-c", f"test -e {shlex.quote(str(probe))} && echo seen"], nodes).count("seen")
        finally:
            probe.unlink()
        return seen == len(nodes), f"storage {path}: seen by {seen} of {len(nodes)} node(s)"
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True).stdout.strip()
    if fs in SHARED_FS or cfg is None or cfg.slurm.nodes == 1:
        return True, f"storage {path}: filesystem type {fs}"
    return False, (f"storage {path}: filesystem type {fs}, node-local to all appearances: with {cfg.slurm.nodes} nodes "
                   f"trials on the others cannot write their results here; use a shared folder")


def check_requeue(cfg: ClusterConfig | None) -> tuple[bool | None, str]:
    if cfg is None:
        return None, "requeue: no --cluster given"
    if not cfg.requeue.enabled:
        return True, "requeue: off in the cluster config (a preempted or timed-out job ends)"
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True).stdout
    allowed = re.search(r"^JobRequeue\s*=\s*0\s*$", out, re.MULTILINE) is None
    lead, limit = cfg.requeue.signal_lead_s, time_seconds(cfg.slurm.time)
    return allowed, (f"requeue: USR1 {lead} s before the {cfg.slurm.time} limit ({limit} s); the cluster "
                     + ("allows requeue" if allowed else "has JobRequeue=0: add --requeue to slurm.extra or ask the admins"))


def check_versions(nodes: list[str]) -> tuple[bool, str]:
    code = "import ray, torch; print(ray.__version__, torch.__version__)"
    if len(nodes) > 1:
        seen = {line for line in _srun([sys.executable, "-P", "-c", code], nodes) if line.strip()}
    else:
        seen = {subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True).stdout.strip()}
    return len(seen) == 1, f"versions: ray, torch {' | '.join(sorted(seen))} on {max(len(nodes), 1)} node(s)"


def doctor(cfg: ClusterConfig | None, storage: Path | None) -> tuple[str, bool]:
    nodes = allocation()
    checks = [check_ports(), check_tmp(), check_ip(cfg, nodes), check_gpus(), check_storage(storage, nodes, cfg),
              check_requeue(cfg), check_versions(nodes)]
    if cfg is not None:
        checks.insert(1, check_folder("log_dir", cfg.log_dir))
    word = {True: "OK     ", False: "PROBLEM", None: "SKIP   "}
    return "\n".join(f"{word[ok]} {text}" for ok, text in checks), all(ok is not False for ok, _ in checks)
