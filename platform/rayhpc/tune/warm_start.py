"""`--warm-start SWEEP_DIR`: an earlier sweep's finished trials, told to Optuna before it proposes.

Each finished (or early-stopped) trial of the earlier table whose searched values lie in this sweep's
space becomes a complete Optuna trial with the values it reported for this sweep's objectives (the last
ones, as a sweep's own trials are told). Only the results table is read (Parquet: data, not code), and
only from a folder that is this user's alone, as everything a job loads.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from rayhpc.config import ConfigError
from rayhpc.private import UnsafePath, check_trusted

log = logging.getLogger(__name__)
KEY = "warm_start (--warm-start)"


def check_warm_start(folder: Path) -> Path:
    """The earlier sweep's folder, resolved: a sweep's, this user's alone, with a results table."""
    from rayhpc.tune.results import PARTS_DIR, RESULTS_FILE

    folder = folder.expanduser().resolve()
    if not (folder / "sweep.yaml").is_file():
        raise ConfigError(f"{KEY} {folder}: not a sweep's folder (it has no sweep.yaml)")
    try:
        check_trusted(folder, below=True)
    except UnsafePath as exc:
        raise ConfigError(f"{KEY}: {exc}") from None
    if not (folder / RESULTS_FILE).exists() and not (folder / PARTS_DIR).exists():
        raise ConfigError(f"{KEY} {folder}: no trial of it has ended yet (no results table)")
    return folder


def add_warm_trials(study, folder: Path, distributions: dict, objectives: list[tuple[str, str]]) -> int:
    """Tell `study` every usable trial of the sweep in `folder`; how many were told."""
    import optuna  # optional: only Optuna searches

    from rayhpc.tune.results import read_results

    table = read_results(check_warm_start(Path(folder)))
    told = skipped = 0
    for row in table.to_dict("records"):
        values = [row.get(name, math.nan) for name, _ in objectives]
        if row.get("status") not in ("finished", "early-stopped") or any(not _finite(v) for v in values):
            continue
        params = {k: _plain(row[f"config.{k}"]) for k in distributions
                  if f"config.{k}" in row and _present(row[f"config.{k}"])}
        try:
            trial = optuna.trial.create_trial(params=params, distributions={k: distributions[k] for k in params},
                                              values=[float(v) for v in values])
        except ValueError:  # a value outside this sweep's space
            skipped += 1
            continue
        study.add_trial(trial)
        told += 1
    log.info(f"warm start: Optuna told {told} trial(s) of {folder}" + (f" ({skipped} outside this space)"
                                                                       if skipped else ""))
    return told


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _present(value) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def _plain(value):
    """numpy scalars as Python's (Optuna's distributions compare Python values)."""
    return value.item() if hasattr(value, "item") else value
