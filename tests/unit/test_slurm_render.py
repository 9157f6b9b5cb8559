"""The sbatch text `rayhpc submit` renders from each shipped cluster config, against golden files."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT
from rayhpc.config import ConfigError, validate
from rayhpc.slurm.config import ClusterConfig, load_cluster
from rayhpc.slurm.render import render_array, render_collect, render_sbatch, render_study_array
from rayhpc.tune.config import SweepConfig

GOLDEN = ROOT / "tests" / "golden"
CONFIGS = sorted(p.stem for p in (ROOT / "cluster_configs").glob("*.yaml"))
COMMAND = ["python", "-u", "jobs/tune_mlp.py", "--num-samples", "16"]


def shipped(name: str) -> ClusterConfig:
    """A shipped cluster config with fixed paths, so the text does not depend on where the checkout or home is."""
    cfg = load_cluster(ROOT / "cluster_configs" / f"{name}.yaml")
    return cfg.model_copy(update={"log_dir": Path("/home/user/rayhpc-logs")})


def assert_golden(file: str, text: str, what: str) -> None:
    golden = GOLDEN / file
    if os.environ.get("REGEN_GOLDEN") == "1":
        golden.write_text(text)
    assert golden.is_file() and golden.read_text() == text, (
        f"{what} differs from {golden.relative_to(ROOT)}; if the change is intended, regenerate with: "
        f"REGEN_GOLDEN=1 python -m pytest tests/unit/test_slurm_render.py")


@pytest.mark.parametrize("name", CONFIGS)
def test_rendered_sbatch_matches_the_golden_file(name):
    text = render_sbatch(shipped(name), COMMAND, startup=Path("/opt/rayhpc/cluster_configs/slurm/ray_cluster.sbatch"))
    assert_golden(f"{name}.sbatch", text, f"the sbatch rendered from cluster_configs/{name}.yaml")


@pytest.mark.parametrize("name", CONFIGS)
def test_the_array_and_collect_scripts_match_their_golden_files(name):
    """An array sweep's two scripts come from the same settings as the cluster job: its tasks carry the
    config's partition, account, qos, memory, requeue and extra flags, its collect job the partition,
    account and qos (a cluster that bills by account refuses a job without one)."""
    cfg = shipped(name)
    sweep = SweepConfig(name="sweep", storage_path=Path("/home/user/results"), max_concurrent=4, cpus_per_trial=2,
                        gpus_per_trial=1 if cfg.slurm.gpus_per_node else None)
    folder = Path("/home/user/results/sweep")
    array = render_array(cfg, sweep, 16, folder / "array", f"{folder}/task/model.py:Model")
    collect = render_collect(cfg, "12345", folder)
    assert_golden(f"{name}-array.sbatch", array, f"the array script rendered from cluster_configs/{name}.yaml")
    assert_golden(f"{name}-collect.sbatch", collect, f"the collect script rendered from cluster_configs/{name}.yaml")
    study = render_study_array(cfg, sweep, 8, Path("/home/user/studies/s"), "/home/user/studies/s/task/model.py:Model")
    assert_golden(f"{name}-study-array.sbatch", study, f"the study's array script from cluster_configs/{name}.yaml")
    s = cfg.slurm
    for key in ("partition", "account", "qos"):
        flag = f"#SBATCH --{key}={getattr(s, key)}\n"
        assert (flag in array and flag in collect) == (getattr(s, key) is not None), (key, array, collect)


def test_nodes_flag_overrides_the_config():
    cfg = load_cluster(ROOT / "cluster_configs" / "local-slurm.yaml")
    assert "#SBATCH --nodes=1\n" in render_sbatch(cfg, ["true"], nodes=1)


@pytest.mark.parametrize("data, expected", [
    ({"name": "x", "slurm": {"gpu_per_node": 1}}, "slurm.gpu_per_node: unknown key; allowed keys: account, "),
    ({"name": "x", "slurm": {"time": "2 hours"}}, "slurm.time: '2 hours' is not a Slurm time"),
    ({"name": "x", "slurm": {"extra": ["-C h100"]}}, "slurm.extra: '-C h100': give each extra flag"),
    ({"name": "x", "container": {"image": "a.sif", "runtime": "docker"}},
     "container.runtime: Input should be 'apptainer' or 'singularity' (got 'docker')"),
    ({"slurm": {}}, "name: Field required"),
])
def test_bad_cluster_configs_are_one_line_errors(data, expected):
    with pytest.raises(ConfigError) as err:
        validate(ClusterConfig, data)
    assert str(err.value).startswith(expected) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("ephemeral", [(32768, 60999), (20000, 65535), (1024, 65535)])
def test_job_ports_stay_out_of_the_ephemeral_range_and_rays_defaults_and_apart(ephemeral):
    from rayhpc.slurm.layout import block_bases, ports, ports_at

    bases = block_bases(ephemeral)
    n, low, high = len(bases), *ephemeral
    # job j takes block j mod n: every block checked, and jobs across the wrap-around take theirs
    for job in (0, 1, n // 2, n - 1, n, n + 1, 2 * n - 1):
        assert ports(job, ephemeral=ephemeral) == ports_at(bases[job % n]), job
    for base in bases:
        used = set(ports_at(base).values())
        assert all(20000 <= p <= 65535 for p in used), (base, sorted(used))  # Ray's defaults are below 20000
        if (low, high) not in ((1024, 65535), (20000, 65535)):  # those leave no room: every block
            assert not any(low <= p <= high for p in used), (base, ephemeral, sorted(used))
    first, second = ports(0, ephemeral=ephemeral), ports(1, ephemeral=ephemeral)
    assert max(first.values()) < min(second.values()), (first, second)  # neighbouring jobs never share a port


def test_a_block_with_a_port_in_use_on_any_node_is_skipped():
    from rayhpc.slurm.layout import BLOCK, OFFSETS, block_bases, ports

    bases = block_bases((32768, 60999))
    free = ports(7, ephemeral=(32768, 60999))
    assert free == {name: bases[7] + offset for name, offset in OFFSETS.items()}
    moved = ports(7, busy={bases[7] + BLOCK - 1}, ephemeral=(32768, 60999))  # its last port held elsewhere
    assert min(moved.values()) == bases[8], moved
    last = ports(len(bases) - 1, busy={bases[-1]}, ephemeral=(32768, 60999))
    assert min(last.values()) == bases[0]  # wraps around
    with pytest.raises(RuntimeError, match=f"no free block of {BLOCK} ports"):
        ports(0, busy=set(range(20000, 65536)), ephemeral=(32768, 60999))


RAYHPC = str(Path(sys.executable).with_name("rayhpc"))
BASE = "name: x\nslurm: {partition: debug, time: '01:00:00'}\n"


@pytest.mark.parametrize("yaml_text, expected", [
    # an injected directive, a cut line, a split path: refused before anything is submitted
    ('name: x\nslurm: {partition: "gpu\\n#SBATCH --uid=0"}\n', "error: slurm.partition: 'gpu\\n#SBATCH --uid=0' "
     "contains a control character"),
    ('name: x\nslurm: {account: "lab\\r#SBATCH --uid=0"}\n', "error: slurm.account: 'lab\\r#SBATCH --uid=0' contains"),
    ('name: x\nslurm: {qos: "high low"}\n', "error: slurm.qos: 'high low' must be one word"),
    ('name: x\nslurm: {extra: ["--constraint=h100\\n#SBATCH --uid=0"]}\n', "error: slurm.extra: '--constraint=h100"),
    ('name: x\nlog_dir: "/tmp/my logs"\n', "error: log_dir: '/tmp/my logs': Slurm's --output cannot hold spaces"),
    ('name: x\nlog_dir: "/tmp/a\\nb"\n', "error: log_dir: '/tmp/a\\nb': Slurm's --output cannot hold"),
    ('name: x\nray: {head_ip: "10.0.0.1 --uid=0"}\n', "error: ray.head_ip: '10.0.0.1 --uid=0' is not an IPv4 address"),
    ('name: x\nray: {dashboard_host: "$(id)"}\n', "error: ray.dashboard_host: '$(id)' is not an IPv4 address"),
    ('name: x\ncontainer: {image: "a.sif\\n#SBATCH --uid=0"}\n', "error: container.image: 'a.sif\\n#SBATCH"),
    # a warning that would arrive before the job starts (the default lead is 120 s)
    ('name: x\nslurm: {time: "00:01:00"}\n', "error: requeue.signal_lead_s 120: must be smaller than slurm.time "
     "'00:01:00' (60 s)"),
    ('name: x\nslurm: {time: "5"}\nrequeue: {signal_lead_s: 300}\n', "error: requeue.signal_lead_s 300: must be "
     "smaller than slurm.time '5' (300 s)"),
])
def test_dry_run_refuses_what_would_inject_or_break_sbatch_lines(yaml_text, expected, tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml_text)
    proc = subprocess.run([RAYHPC, "submit", "--dry-run", "--cluster", str(cluster), "--", "true"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.startswith(expected) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_binary_cluster_config_is_one_error_line(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_bytes(b"name: x\n\xff\xfe\x00binary")
    proc = subprocess.run([RAYHPC, "submit", "--dry-run", "--cluster", str(cluster), "--", "true"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: --config {cluster}: not a text (UTF-8) file"), proc
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_container_path_is_quoted_once_and_tilde_is_expanded():
    cfg = validate(ClusterConfig, {"name": "x", "container": {"image": "~/my images/r.sif", "binds": ["/a b:/c"]}})
    text = render_sbatch(cfg, ["true"])
    home = str(Path.home())
    line = next(x for x in text.splitlines() if x.startswith("export RAYHPC_CONTAINER="))
    # the variable holds shell words the startup reads into an array: the path is one of them
    words = shlex.split(shlex.split(line.split("=", 1)[1])[0])
    assert words == ["apptainer", "exec", "--bind", "/a b:/c", f"{home}/my images/r.sif"], words


def test_a_node_whose_ray_aborted_names_the_check_that_failed(tmp_path):
    """`ray start` shows only the stack of a raylet that aborted; the node's start-up prints the aborting
    line of each of its Ray processes' logs (and nothing else) before its folder is removed."""
    from rayhpc.slurm.node import RAY_DIR, fatal_lines

    logs = tmp_path / RAY_DIR / "session_2026-11-27_03-00-00_000000_1" / "logs"
    logs.mkdir(parents=True)
    (logs / "raylet.out").write_text(
        "[2026-11-27 03:12:44,100 I 2661 2661] (raylet) main.cc:20: Starting raylet\n"
        "[2026-11-27 03:12:45,980 C 2661 2661] (raylet) node_manager.cc:33: Check failed: bound\n"
        "*** StackTrace Information ***\n    raylet(+0x36974c) ray::raylet::NodeManager::NodeManager()\n")
    (logs / "gcs_server.out").write_text("[2026-11-27 03:12:44,000 W 2600 2600] (gcs_server) gcs.cc:1: slow\n")
    (tmp_path / RAY_DIR / "session_latest").symlink_to(logs.parent)  # as Ray makes it: the same logs, read once
    assert fatal_lines(tmp_path) == ["raylet.out: [2026-11-27 03:12:45,980 C 2661 2661] (raylet) node_manager.cc:33: "
                                     "Check failed: bound"]
    assert fatal_lines(tmp_path / "none") == []
