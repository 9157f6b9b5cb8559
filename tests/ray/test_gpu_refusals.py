"""A GPU that torch cannot use (a CPU build, a driver too old for the build's CUDA) is refused by every job
before it trains and by every runner, with one line naming the build; the parameter server places on a
one-GPU node. Proven on any machine with a GPU described to Ray that torch cannot see (described_gpu.py),
in an environment without Ray's dashboard packages (as GPU images with only ray[train,tune] are): the
local Ray starts without its dashboard and says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import job_env

CANNOT = f"but torch {torch.__version__} ("
NO_SUCH_GPU = "GPU-00000000-0000-0000-0000-000000000000"  # Ray counts one GPU; CUDA finds none by that UUID
# imported first in every Python process of the job (PYTHONPATH): aiohttp_cors, one of ray[default]'s packages,
# cannot be imported, as where only ray[train,tune] is installed
WITHOUT_DASHBOARD = """
import importlib.abc
import sys


class WithoutDashboardPackages(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "aiohttp_cors":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, WithoutDashboardPackages())
"""
UNUSABLE = "cannot use them: torch.cuda.is_available() is False"


@pytest.mark.newest  # CI: beside the Slurm tests (pyproject's markers)
def test_a_gpu_torch_cannot_use_is_refused_before_training_and_the_ps_places_on_one_gpu(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(WITHOUT_DASHBOARD)
    storage = tmp_path / "storage"
    env = job_env({"RAY_OVERRIDE_RESOURCES": '{"GPU": 1}', "CUDA_VISIBLE_DEVICES": NO_SUCH_GPU,
                   "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))})
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("described_gpu.py")), str(storage)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ray: dashboard off: Ray's dashboard packages are missing (No module named 'aiohttp_cors')" in proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["gpus"] == 1
    for name, (code, stderr) in report["jobs"].items():
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1, (name, code, stderr)
        assert CANNOT in errors[0] and UNUSABLE in errors[0], (name, errors[0])
    key = {"tune": "error: gpus_per_trial (--gpus-per-trial) 0.5: ", "train": "error: compute.gpu (--gpu) 1: "}
    for name, start in key.items():
        assert report["jobs"][name][1].startswith(start), report["jobs"][name][1]
    assert not list(storage.rglob("*.parquet")) and not list(storage.rglob("checkpoint*")), "something trained"
    for runner in ("trial", "group"):
        assert report[runner] is not None and CANNOT in report[runner] and UNUSABLE in report[runner], report
    assert report["fractional group"].startswith("gpus_per_worker 0.5: "), report["fractional group"]
    assert report["ps placed"], "the parameter server's actors did not place on the one GPU"
