"""Shared fixtures: one real local Ray instance for the whole test session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ray_address():
    """Start one local Ray cluster (2 CPUs, token auth) shared by every test; yield its address."""
    import ray

    ray.init(num_cpus=2, logging_level="WARNING")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def run_job(script: str, *args: str, env: dict | None = None, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run `python jobs/<script> args...` the way a user does; capture its output."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("RAY_ADDRESS", None) if "RAY_ADDRESS" not in (env or {}) else None
    return subprocess.run([sys.executable, str(ROOT / "jobs" / script), *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=kwargs.pop("cwd", ROOT), **kwargs)
