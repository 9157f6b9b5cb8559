"""Start-up overhead of Ray inside a Slurm job, for 1 and 2 nodes (or --nodes 1,2,4,8).

    python jobs/bench_slurm.py --cluster cluster_configs/local-slurm.yaml --nodes 1,2
    bash .ci/slurm-cluster start --nodes 8 && python jobs/bench_slurm.py --nodes 1,2,4,8

Ray's own start: a Slurm job of the same nodes times Ray's own commands back to back:
`ray start --head` (which returns once the node is up), then `ray start --address` on every
other node at once. Ready: jobs through the platform's startup run `true`, and the
startup logs when every node had joined, in seconds since the batch script started.
Overhead = ready - Ray's own start. (Ray's documented example sleeps 10 s for the head and
5 s per worker node instead.)

    python jobs/bench_slurm.py --sweep [--trials 16] [--epochs 30] [--repeats 1]

The reference sweep (a grid of 4 widths x trials/4 learning rates) through `rayhpc submit` on 2 nodes,
against the same spec as an array job on the same CPUs (`rayhpc submit --array`, as many tasks at once
as the Ray job has CPUs): each wall from the submission until the results table is written and the
jobs have left the queue.
"""

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from rayhpc.slurm.config import load_cluster

ROOT = Path(__file__).resolve().parents[1]
from rayhpc.slurm.submit import log_dir, sbatch, submit

TIMING = re.compile(r"rayhpc: timing: head launched ([\d.]+) s, head up ([\d.]+) s, "
                    r"all nodes joined ([\d.]+) s")


def run_job(cluster, nodes: int) -> tuple[float, float, float]:
    job = submit(cluster, ["true"], nodes=nodes)
    wait(job)
    log = Path(cluster.log_dir) / f"rayhpc-{cluster.name}-{job}.log"
    match = TIMING.search(log.read_text())
    if not match or "ray start failed" in log.read_text():
        sys.exit(f"job {job}: no timing line in {log}:\n{log.read_text()}")
    return tuple(float(v) for v in match.groups())


OWN_START = """#!/bin/bash
#SBATCH --job-name=rayhpc-bench-ray-start
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task={cpus}
#SBATCH --output={log}
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="{log}.token"
# the token and Ray's folders as the platform's startup makes them: created exclusively (0600, never
# through a link), and on each node a new 0700 folder of a random name, Ray's temp dir inside it
# (Ray makes its own 0777)
python -c 'import os, secrets; from rayhpc.private import write_private
write_private(os.environ["RAY_AUTH_TOKEN_PATH"], secrets.token_hex(32), replace=False)' || exit 1
D=$(mktemp -d "/tmp/rh-bench-$SLURM_JOB_ID-XXXXXXXX") || exit 1
# free ports on the head, as the platform takes them (no fixed port another job could hold)
read -r port dashboard < <(python -c 'import socket
socks = [socket.socket() for _ in range(2)]
[s.bind(("", 0)) for s in socks]
print(*[s.getsockname()[1] for s in socks])')
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)
ip=$(getent ahostsv4 "$head" | awk 'NR==1{{print $1}}')
t0=$(date +%s.%N)
# the head in the batch step, so that it outlives `ray start`; it returns once the node is up
ray start --head --node-ip-address="$ip" --port="$port" --dashboard-port="$dashboard" --temp-dir="$D/ray" \\
    --num-cpus={cpus} --disable-usage-stats --include-dashboard=true >/dev/null 2>&1 || echo "ray start failed on $head"
# then every other node at once, each `ray start` returning once its node has joined
for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST" | tail -n +2); do
    srun --overlap -N1 -n1 -w "$node" bash -c 'D=$(mktemp -d "/tmp/rh-bench-$1-XXXXXXXX") && exec ray start \\
        --address="$0" --temp-dir="$D/ray" \\
        --node-ip-address="$(getent ahostsv4 "$(hostname -s)" | awk "NR==1{{print \\$1}}")" --num-cpus={cpus} \\
        --disable-usage-stats' "$ip:$port" "$SLURM_JOB_ID" >/dev/null 2>&1 || echo "ray start failed on $node" &
done
wait
t1=$(date +%s.%N)
awk -v a="$t0" -v b="$t1" 'BEGIN{{printf "ray-own-start %.2f\\n", b-a}}'
# only this job's Ray (`ray stop` stops every Ray on the node); KILL, since the GCS server
# outlives a TERM once its session dir is gone
srun --overlap --ntasks-per-node=1 bash -c 'for _ in $(seq 50); do pkill -KILL -f "/tmp/[r]h-bench-$0-" || break
    sleep 0.1; done; cd /tmp && rm -rf "rh-bench-$0-"*' "$SLURM_JOB_ID"  # relative: no pkill match
rm -f "$RAY_AUTH_TOKEN_PATH"
"""


def ray_own_start(cluster, nodes: int) -> float:
    """Seconds Ray's own commands take to bring up `nodes` nodes in a Slurm job: `ray start --head`
    (head and dashboard, as the platform starts them), then `ray start --address` on the others."""
    log = Path(cluster.log_dir) / f"bench-ray-start-{time.time_ns()}.log"
    text = OWN_START.format(log=log, nodes=nodes, cpus=cluster.slurm.cpus_per_task or 1)
    partition = [f"--partition={cluster.slurm.partition}"] if cluster.slurm.partition else []
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # this venv's ray
    job = sbatch(partition, script=text, env=env)
    wait(job)
    match = re.search(r"ray-own-start ([\d.]+)", log.read_text())
    if not match or "ray start failed" in log.read_text():
        sys.exit(f"job {job}: no ray-own-start line in {log}:\n{log.read_text()}")
    return float(match.group(1))


def wait(job: str) -> None:
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
        time.sleep(0.5)


def sweep_wall(cluster, file: str, work: Path, name: str, flags: list[str], array: bool) -> float:
    """Seconds from submitting the reference sweep `name` (through `rayhpc submit`, or `--array`) until its
    results table is written and no job of it is left in the queue."""
    command = [sys.executable, "-m", "rayhpc", "submit", "--cluster", file, *["--array"] * array,
               "--", *([] if array else [sys.executable, "-u", str(ROOT / "jobs" / "tune_mlp.py")]),
               "--config", str(work / "sweep.yaml"), "--name", name, *flags]
    start = time.time()
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{' '.join(command)}:\n{out.stdout}\n{out.stderr}")
    results = work / name / "results.parquet"
    names = ",".join(f"rayhpc-{cluster.name}{suffix}" for suffix in ("", "-array", "-collect"))
    while not results.exists() or subprocess.run(["squeue", "-h", "-n", names, "-o", "%i"],
                                                 capture_output=True, text=True).stdout.strip():
        time.sleep(0.2)
    return time.time() - start


def sweeps(cluster, a) -> None:
    """`--sweep`: the reference sweep through `rayhpc submit` and as an array job, side by side."""
    import tempfile

    import yaml

    nodes, cpus = cluster.slurm.nodes, cluster.slurm.cpus_per_task or 1
    work = Path(tempfile.mkdtemp(prefix="bench_slurm_sweep_", dir=cluster.log_dir))  # on every node's filesystem
    lrs = [0.001 * 3 ** (i / 2) for i in range(a.trials // 4)]
    (work / "sweep.yaml").write_text(yaml.safe_dump({
        "storage_path": str(work), "search": "grid", "num_samples": 1, "epochs": a.epochs,
        "space": {"hidden": {"grid": [8, 16, 32, 64]}, "lr": {"grid": lrs}}}))
    rows = {"rayhpc submit (Ray on the nodes)": [], "array job": []}
    for i in range(a.repeats):
        rows["rayhpc submit (Ray on the nodes)"].append(sweep_wall(cluster, a.cluster, work, f"ray{i}", [], array=False))
        rows["array job"].append(sweep_wall(cluster, a.cluster, work, f"array{i}", ["--max-concurrent", str(nodes * cpus)],
                                            array=True))
    walls = {name: sorted(runs)[len(runs) // 2] for name, runs in rows.items()}
    print(f"reference sweep: {len(lrs) * 4} trials, {a.epochs} epochs, {nodes} nodes x {cpus} CPU(s); median of "
          f"{a.repeats} run(s), from submission to the results table\n")
    for name, wall in walls.items():
        print(f"{name:34s} {wall:7.1f}s {wall / walls['array job']:6.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cluster", default="cluster_configs/local-slurm.yaml")
    p.add_argument("--nodes", default="1,2", help="comma-separated node counts")
    p.add_argument("--repeats", type=int, default=3, help="jobs per node count (the median is shown)")
    p.add_argument("--sweep", action="store_true", help="instead: the reference sweep through rayhpc submit and as "
                   "an array job")
    p.add_argument("--trials", type=int, default=16, help="with --sweep")
    p.add_argument("--epochs", type=int, default=30, help="with --sweep")
    a = p.parse_args()
    cluster = load_cluster(a.cluster)
    log_dir(cluster)  # made 0700 if missing; refused if another user controls it
    if a.sweep:
        return sweeps(cluster, a)
    print(f"{'nodes':>5} {'Ray own start s':>16} {'head up s':>17} {'all joined s':>13} {'overhead s':>11}")
    overhead = {}
    for nodes in [int(n) for n in a.nodes.split(",")]:
        own = median([ray_own_start(cluster, nodes) for _ in range(a.repeats)])
        ready = median([run_job(cluster, nodes) for _ in range(a.repeats)])
        overhead[nodes] = ready[2] - own
        print(f"{nodes:>5} {own:>16.1f} {ready[1]:>17.1f} {ready[2]:>13.1f} {overhead[nodes]:>11.1f}", flush=True)
    print(f"(median of {a.repeats} jobs each; overhead = all joined - Ray's own start)")
    if 2 in overhead and max(overhead) > 2:
        n = max(overhead)
        print(f"overhead at {n} nodes - at 2 nodes: {overhead[n] - overhead[2]:+.1f} s")


def median(runs: list):
    """The middle run (by its last field, for tuples)."""
    return sorted(runs, key=lambda r: r[-1] if isinstance(r, tuple) else r)[len(runs) // 2]


if __name__ == "__main__":
    main()
