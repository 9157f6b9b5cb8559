"""`rayhpc sync DIR`: upload a job's offline W&B runs from a machine that reaches W&B (a login node).

The runs a job wrote offline lie under its folder (`DIR/wandb/offline-run-*`, or one level down for a
storage path of several jobs); `wandb sync` uploads them and skips the ones it uploaded before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rayhpc.config import ConfigError
from rayhpc.private import UnsafePath, check_trusted
from rayhpc.tracking.config import INSTALL, installed


def offline_runs(folder: Path) -> list[Path]:
    """The offline W&B runs in a job's folder, or in the job folders of a storage path."""
    runs = sorted(folder.glob("wandb/offline-run-*")) + sorted(folder.glob("*/wandb/offline-run-*"))
    return [r for r in runs if r.is_dir()]


def sync(folder: Path, dry_run: bool = False) -> tuple[list[Path], int]:
    """(the runs found, `wandb sync`'s exit status); `dry_run`: wandb says what it would upload."""
    folder = folder.expanduser().resolve()
    if not folder.is_dir():
        raise ConfigError(f"DIR {folder}: not a folder")
    try:  # another user's runs would go up under this user's W&B key
        check_trusted(folder, below=True)
    except UnsafePath as exc:
        raise ConfigError(f"DIR {folder}: {exc}") from None
    runs = offline_runs(folder)
    if not runs:
        raise ConfigError(f"DIR {folder}: no offline W&B runs in it (looked for wandb/offline-run-* in it and in "
                          "its job folders)")
    if not installed("wandb"):
        raise ConfigError(f"wandb is not installed: {INSTALL['wandb']}")
    flags = ["--dry-run"] if dry_run else []
    return runs, subprocess.run([sys.executable, "-P", "-m", "wandb", "sync", "--yes", *flags, *map(str, runs)]).returncode
