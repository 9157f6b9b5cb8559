"""The sbatch text `rayhpc submit` renders from each shipped cluster config, against golden files."""

import os
from pathlib import Path

import pytest

from conftest import ROOT
from rayhpc.config import ConfigError, validate
from rayhpc.slurm.config import ClusterConfig, load_cluster
from rayhpc.slurm.render import render_sbatch

GOLDEN = ROOT / "tests" / "golden"
CONFIGS = sorted(p.stem for p in (ROOT / "cluster_configs").glob("*.yaml"))
COMMAND = ["python", "-u", "jobs/tune_mlp.py", "--num-samples", "16"]


@pytest.mark.parametrize("name", CONFIGS)
def test_rendered_sbatch_matches_the_golden_file(name):
    cfg = load_cluster(ROOT / "cluster_configs" / f"{name}.yaml")
    # fixed paths, so the text does not depend on where the checkout or home is
    cfg = cfg.model_copy(update={"log_dir": Path("/home/user/rayhpc-logs")})
    text = render_sbatch(cfg, COMMAND, startup=Path("/opt/rayhpc/cluster_configs/slurm/ray_cluster.sbatch"))
    golden = GOLDEN / f"{name}.sbatch"
    if os.environ.get("REGEN_GOLDEN") == "1":
        golden.write_text(text)
    assert golden.is_file() and golden.read_text() == text, (
        f"the sbatch rendered from cluster_configs/{name}.yaml differs from {golden.relative_to(ROOT)}; if the "
        f"change is intended, regenerate with: REGEN_GOLDEN=1 python -m pytest tests/test_slurm_render.py")


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
def test_job_ports_stay_out_of_the_ephemeral_range_and_apart(ephemeral):
    from rayhpc.slurm.layout import block_bases, ports

    n = len(block_bases(ephemeral))
    low, high = ephemeral
    for job in range(2 * n):
        used = set(ports(job, ephemeral).values())
        assert all(1024 <= p <= 65535 for p in used), (job, sorted(used))
        if (low, high) != (1024, 65535):  # that range leaves no room: every block, collisions possible
            assert not any(low <= p <= high for p in used), (job, ephemeral, sorted(used))
    first, second = ports(0, ephemeral), ports(1, ephemeral)
    assert first["max_worker"] < second["gcs"], (first, second)  # neighbouring jobs never share a port
    assert ports(n, ephemeral) == first  # ids n apart share a block (documented)
