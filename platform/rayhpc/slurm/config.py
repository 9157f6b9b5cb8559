"""A cluster description (`cluster_configs/<cluster>.yaml`): Slurm settings, environment set-up,
container, Ray settings and requeue behaviour, validated with one-line errors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from rayhpc.config import ConfigError, StrictModel, load_yaml, validate

TIME = re.compile(r"^(\d+-)?\d+(:\d\d){0,2}$")  # Slurm's --time: minutes, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]


class SlurmSettings(StrictModel):
    """What becomes `#SBATCH` lines."""

    partition: str | None = Field(None, description="--partition")
    account: str | None = Field(None, description="--account")
    qos: str | None = Field(None, description="--qos")
    time: str = Field("01:00:00", description="--time (wall-clock limit)")
    nodes: int = Field(1, ge=1, description="--nodes (one Ray node per Slurm node)")
    gpus_per_node: int = Field(0, ge=0, description="--gpus-per-node")
    cpus_per_task: int = Field(1, ge=1, description="--cpus-per-task (one task per node: Ray's CPUs there)")
    mem: str | None = Field(None, pattern=r"^\d+[KMGT]?$", description="--mem per node, e.g. 64G")
    extra: list[str] = Field([], description="further #SBATCH flags, verbatim, e.g. ['--constraint=h100']")

    @field_validator("time")
    @classmethod
    def _time(cls, value: str) -> str:
        if not TIME.match(value):
            raise ValueError(f"{value!r} is not a Slurm time (minutes, HH:MM:SS or D-HH:MM:SS)")
        return value

    @field_validator("extra")
    @classmethod
    def _extra(cls, flags: list[str]) -> list[str]:
        for flag in flags:
            if not flag.startswith("--") or "\n" in flag:
                raise ValueError(f"{flag!r}: give each extra flag as '--name=value'")
        return flags


class SetupSettings(StrictModel):
    """Shell set-up run on every node before Ray starts."""

    modules: list[str] = Field([], description="environment modules to load (module load ...)")
    conda_env: str | None = Field(None, description="conda environment to activate")
    venv: str | None = Field(None, description="virtual environment folder to activate")
    env: dict[str, str] = Field({}, description="environment variables to export")

    @field_validator("env")
    @classmethod
    def _names(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
                raise ValueError(f"{name!r} is not an environment variable name")
        return env


class ContainerSettings(StrictModel):
    """Run Ray and the command inside an Apptainer/Singularity image."""

    image: str = Field(..., description="image file (.sif) or URI")
    runtime: Literal["apptainer", "singularity"] = Field("apptainer", description="container runtime")
    binds: list[str] = Field([], description="--bind paths, e.g. /n/holyscratch01:/scratch")
    gpu: bool = Field(True, description="pass --nv where the node has GPUs")


class RaySettings(StrictModel):
    """How Ray runs inside the allocation."""

    object_store_gb: float | None = Field(None, gt=0, description="object store per node (GB); Ray's default if unset")
    dashboard: bool = Field(True, description="start the dashboard on the head node")
    dashboard_host: str = Field("127.0.0.1", description="address the dashboard binds on the head: its loopback "
                                "(reach it by the printed ssh tunnel) or e.g. 0.0.0.0; token-protected either way")
    head_ip: str | None = Field(None, description="head address other nodes reach; found automatically if unset")
    join_timeout_s: float = Field(120.0, gt=0, description="longest wait for every node to join")


class RequeueSettings(StrictModel):
    """Preemption and time limits: checkpoint on a warning signal, then requeue."""

    enabled: bool = Field(True, description="--requeue, and requeue the job itself on the warning signal")
    signal_lead_s: int = Field(120, ge=10, description="seconds before the end that USR1 arrives (--signal)")


class ClusterConfig(StrictModel):
    """One Slurm cluster (or partition) the platform submits to."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="cluster name (job names are rayhpc-<name>)")
    log_dir: Path = Field(Path("rayhpc-logs"), description="shared folder for per-job logs and tokens")
    slurm: SlurmSettings = SlurmSettings()
    setup: SetupSettings = SetupSettings()
    container: ContainerSettings | None = None
    ray: RaySettings = RaySettings()
    requeue: RequeueSettings = RequeueSettings()

    @field_validator("log_dir")
    @classmethod
    def _absolute(cls, path: Path) -> Path:
        return path.expanduser().resolve()


def load_cluster(path: str | Path) -> ClusterConfig:
    """The cluster config at `path`; a missing file or bad key is one `ConfigError` line."""
    path = Path(path)
    if not path.is_file():
        choices = sorted(p.name for p in Path("cluster_configs").glob("*.yaml"))
        raise ConfigError(f"cluster (--cluster) {path}: no such file" + (f"; found {', '.join(choices)}" if choices else ""))
    return validate(ClusterConfig, load_yaml(path))
