"""`pip install .` (not editable) gives a working platform: the wheel installed into a fresh virtual
environment outside the repository runs a sweep of a task file that lives outside the repository,
finds its sbatch startup script as package data, and imports the example tasks by module path."""

import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pandas as pd
import pytest

from helpers import ROOT


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the wheel of this checkout installed; its dependencies (ray, torch, ...) come from
    the test environment's site-packages through a path line, whose .pth files (the checkout's editable
    install among them) are not read."""
    where = tmp_path_factory.mktemp("installed")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(where / "dist"), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (where / "dist").glob("rayhpc-*.whl")
    venv.create(where / "venv", with_pip=True)
    python = where / "venv" / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # every site-packages folder of the test environment (a floors venv has two), as plain path lines
    (Path(site) / "dependencies.pth").write_text("".join(f"{p}\n" for p in sys.path if p.endswith("site-packages")))
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return where


def test_the_wheel_ships_the_platform_and_no_benchmark_or_test_code(installed):
    (wheel,) = (installed / "dist").glob("rayhpc-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "rayhpc/slurm/ray_cluster.sbatch" in names and "rayhpc/examples/gpt.py" in names, names
    # every subpackage of the source (pyproject lists them one by one)
    for package in (ROOT / "platform" / "rayhpc").glob("*/__init__.py"):
        assert f"rayhpc/{package.parent.name}/__init__.py" in names, f"{package.parent.name} is not in the wheel"
    # the collectives benchmark is a platform command (`rayhpc collectives`); the benchmark scripts' helpers
    # (jobs/bench/) and the tests' references are not
    assert [n for n in names if n.startswith("rayhpc/bench/") or "test" in n or "reference" in n] == [], names


def in_venv(installed: Path, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {"PATH": f"{installed / 'venv' / 'bin'}:/usr/bin:/bin", "HOME": str(Path.home()), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(list(args), capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def test_the_installed_package_is_not_the_checkout(installed, tmp_path):
    where = in_venv(installed, "python", "-c", "import rayhpc, rayhpc.examples.digits as d; print(rayhpc.__file__); "
                    "print(d.__file__)", cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    for line in where.stdout.split():
        assert line.startswith(str(installed / "venv")) and str(ROOT) not in line, where.stdout
    loaded = in_venv(installed, "python", "-c", "from rayhpc.task import load_task; "
                     "print(load_task('rayhpc.examples.digits:DigitsCNN').objective)", cwd=tmp_path)
    assert loaded.stdout.strip() == "('val_accuracy', 'max')", loaded.stdout + loaded.stderr


def test_an_installed_rayhpc_sweeps_a_task_file_from_outside_the_repository(installed, tmp_path):
    (tmp_path / "mine").mkdir()
    shutil.copy(ROOT / "tests" / "tasks" / "line.py", tmp_path / "mine" / "line.py")
    proc = in_venv(installed, "rayhpc", "tune", "--task", "mine/line.py:Line", "--num-samples", "2", "--epochs", "1",
                   "--config", str(_space(tmp_path)), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "started local Ray" in proc.stdout and "best 2 of 2 trials by best_val_loss" in proc.stdout, proc.stdout
    table = pd.read_parquet(tmp_path / "rayhpc_results" / "line-sweep" / "results.parquet")
    assert len(table) == 2 and set(table["status"]) == {"finished"} and set(table["config.width"]) <= {4, 8}


def _space(tmp_path: Path) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text("space: {width: {choice: [4, 8]}, lr: {loguniform: [0.01, 0.1]}}\n")
    return path


def test_an_installed_rayhpc_renders_its_sbatch_startup(installed, tmp_path):
    proc = in_venv(installed, "rayhpc", "submit", "--dry-run", "--cluster", str(ROOT / "cluster_configs" /
                   "cpu-cluster.yaml"), "--", "python", "-u", "-m", "rayhpc", "tune", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    startup = proc.stdout.strip().splitlines()[-1].split()[2]  # exec bash STARTUP python ...
    assert startup.startswith(str(installed / "venv")) and startup.endswith("rayhpc/slurm/ray_cluster.sbatch")
    assert Path(startup).is_file() and "-m rayhpc.slurm.node run" in Path(startup).read_text()
