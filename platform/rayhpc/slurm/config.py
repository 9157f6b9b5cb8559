"""A cluster description (`cluster_configs/<cluster>.yaml`): Slurm settings, environment set-up,
container, Ray settings and requeue behaviour, validated with one-line errors."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rayhpc.config import ConfigError, StrictModel, load_yaml, validate

TIME = re.compile(r"^(\d+-)?\d+(:\d\d){0,2}$")  # Slurm's --time: minutes, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def time_seconds(value: str) -> int:
    """Slurm's --time in seconds: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    days, _, rest = value.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:  # D-H, D-H:M, D-H:M:S
        h, m, sec = (parts + [0, 0])[:3]
    else:  # M, M:S, H:M:S
        h, m, sec = ([0] * (3 - len(parts)) + parts) if len(parts) == 3 else (0, *(parts + [0])[:2])
    return ((int(days or 0) * 24 + h) * 60 + m) * 60 + sec


def plain(value: str) -> str:
    """A value that becomes part of an `#SBATCH` line or a shell word: no newline, carriage return or
    other control character (each would start a new directive or cut the line)."""
    if CONTROL.search(value):
        raise ValueError(f"{value!r} contains a control character (newline, carriage return, tab...): "
                         f"it would inject or break #SBATCH lines")
    return value


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

    @field_validator("partition", "account", "qos")
    @classmethod
    def _word(cls, value: str | None) -> str | None:
        if value is not None and (not plain(value) or " " in value):
            raise ValueError(f"{value!r} must be one word (no spaces)")
        return value

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
            if not flag.startswith("--") or " " in flag.split("=", 1)[0]:
                raise ValueError(f"{flag!r}: give each extra flag as '--name=value'")
            plain(flag)
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
        for name, value in env.items():
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
                raise ValueError(f"{name!r} is not an environment variable name")
            plain(value)
        return env

    @field_validator("modules")
    @classmethod
    def _modules(cls, modules: list[str]) -> list[str]:
        return [plain(m) for m in modules]


class ContainerSettings(StrictModel):
    """Run Ray and the command inside an Apptainer/Singularity image."""

    image: str = Field(..., description="image file (.sif) or URI")
    runtime: Literal["apptainer", "singularity"] = Field("apptainer", description="container runtime")
    binds: list[str] = Field([], description="--bind paths, e.g. /n/holyscratch01:/scratch")
    gpu: bool = Field(True, description="pass --nv where the node has GPUs")

    @field_validator("image")
    @classmethod
    def _image(cls, value: str) -> str:
        # ~ is expanded here, once: quoted for the shell it would reach the runtime as a literal ~
        return str(Path(plain(value)).expanduser()) if value.startswith("~") else plain(value)

    @field_validator("binds")
    @classmethod
    def _binds(cls, binds: list[str]) -> list[str]:
        return [plain(b) for b in binds]


class RaySettings(StrictModel):
    """How Ray runs inside the allocation."""

    object_store_gb: float | None = Field(None, gt=0, description="object store per node (GB); Ray's default if unset")
    dashboard: bool = Field(True, description="start the dashboard on the head node")
    dashboard_host: str = Field("127.0.0.1", description="address the dashboard binds on the head: its loopback "
                                "(reach it by the printed ssh tunnel) or e.g. 0.0.0.0; token-protected either way")
    head_ip: str | None = Field(None, description="head address other nodes reach; found automatically if unset")
    join_timeout_s: float = Field(120.0, gt=0, description="longest wait for every node to join")

    @field_validator("dashboard_host", "head_ip")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            address = ipaddress.IPv4Address(value)
        except ValueError:
            raise ValueError(f"{value!r} is not an IPv4 address (e.g. 127.0.0.1, 0.0.0.0 or 10.1.2.3)") from None
        return str(address)


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
        # Slurm's --output takes no quoting: a space would cut the path, a newline inject a directive
        if CONTROL.search(str(path)) or " " in str(path):
            raise ValueError(f"{str(path)!r}: Slurm's --output cannot hold spaces or control characters; "
                             f"choose a path without them")
        return path.expanduser().resolve()

    @model_validator(mode="after")
    def _signal_before_the_end(self) -> ClusterConfig:
        limit = time_seconds(self.slurm.time)
        if self.requeue.enabled and self.requeue.signal_lead_s >= limit:
            raise ValueError(f"requeue.signal_lead_s {self.requeue.signal_lead_s}: must be smaller than slurm.time "
                             f"{self.slurm.time!r} ({limit} s), or the warning arrives before the job starts")
        return self


def load_cluster(path: str | Path) -> ClusterConfig:
    """The cluster config at `path`; a missing file or bad key is one `ConfigError` line."""
    path = Path(path)
    if not path.is_file():
        choices = sorted(p.name for p in Path("cluster_configs").glob("*.yaml"))
        raise ConfigError(f"cluster (--cluster) {path}: no such file" + (f"; found {', '.join(choices)}" if choices else ""))
    return validate(ClusterConfig, load_yaml(path))
