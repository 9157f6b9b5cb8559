"""A sweep trial's trained weights as its own model's state dict: what `rayhpc train --init-from
SWEEP_DIR[:TRIAL_ID]` starts from.

A trial's weights are in its Tune trial's last checkpoint, in the format of the runner that
trained it: a pack's stacked state (`model.pt` with its members in `extra.pt`: the member is sliced out and, for the
built-in MLP's padded pack, cut back to its own width), a warm trial's `model.pt`, or a
TorchTrainer trial's checkpoint (`model.pt` or FSDP's DCP shards, gathered). Everything read
is checked first to be this user's alone (`check_trusted`): a checkpoint is never loaded
from where another user could have written it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from rayhpc.config import ConfigError, load_yaml, validate
from rayhpc.engine.checkpoint import latest_checkpoint, load_full_state_dict
from rayhpc.private import UnsafePath, check_trusted
from rayhpc.tune.packing import member_state_dict
from rayhpc.tune.plan import PLAN_FILE, load_plan
from rayhpc.tune.results import read_results
from rayhpc.tune.trainable import load_pack_state, members_of, pack_checkpoints

KEY = "init_from (--init-from)"


@dataclass(frozen=True)
class TrialWeights:
    trial_id: str
    hp: dict  # the trial's hyperparameters as it was trained (PBT's changes included)
    state: dict[str, torch.Tensor]  # its model's state dict, on CPU
    checkpoint: Path


def trial_weights(spec: str, objective: tuple[str, str] | None = None) -> TrialWeights:
    """The weights of the trial `spec` names: `SWEEP_DIR:TRIAL_ID`, or `SWEEP_DIR` for its best trial by
    `objective` (name, "min" or "max"; by default the sweep's own, `sweep_objective`). Any problem is one
    `ConfigError` line naming --init-from."""
    folder, _, trial_id = spec.partition(":") if not Path(spec).is_dir() else (spec, "", "")
    sweep = Path(folder).expanduser().resolve()
    if not (sweep / "sweep.yaml").is_file():
        raise ConfigError(f"{KEY} {spec}: {sweep} is not a sweep's folder (it has no sweep.yaml)")
    _trusted(sweep, below=True)  # its table, plan, trials and checkpoints: everything read below
    table = read_results(sweep)
    row = _pick(table, trial_id, objective or (None if trial_id else sweep_objective(sweep)), spec)
    tune_id, member = (row["trial_id"].rsplit("-", 1)[0], int(row["trial_id"].rsplit("-", 1)[1])) \
        if row["pack_size"] > 1 else (row["trial_id"], 0)
    trial_dir, last = _checkpoint(sweep, tune_id, row["trial_id"], spec)
    config = json.loads((trial_dir / "params.json").read_text()) if (trial_dir / "params.json").exists() else {}
    hp, state = checkpoint_weights(last, member, _members(sweep, config)[member])
    return TrialWeights(row["trial_id"], hp, state, last)


def sweep_objective(sweep: Path) -> tuple[str, str]:
    """The objective the sweep optimised: its first `objective`, else its task's (the task its `sweep.yaml`
    names)."""
    from rayhpc.task import task_for
    from rayhpc.tune.config import SweepConfig

    cfg = validate(SweepConfig, load_yaml(sweep / "sweep.yaml"))
    return cfg.objectives[0] if cfg.objectives else task_for(cfg.task, cfg.data).objective


def checkpoint_weights(folder: Path, member: int, hp: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """(hyperparameters, state dict) of member `member` (0 unless packed) in one checkpoint of a trial;
    `hp`: as planned (PBT's changes, kept in a pack's checkpoint, are applied)."""
    if (state := load_pack_state(folder)) is not None:
        return {**hp, **(state["hp"][member] if state["hp"] else {})}, member_state_dict(state, member)
    return hp, load_full_state_dict(folder)


def _trusted(path: Path, below: bool) -> None:
    try:
        check_trusted(path, below=below)
    except UnsafePath as exc:
        raise ConfigError(f"{KEY}: {exc}") from None


def _pick(table, trial_id: str, objective: tuple[str, str], spec: str):
    if table.empty:
        raise ConfigError(f"{KEY} {spec}: the sweep has no trial results yet")
    if trial_id:
        rows = table[table["trial_id"] == trial_id]
        if rows.empty:
            some = ", ".join(table["trial_id"].head(5))
            raise ConfigError(f"{KEY} {spec}: no trial {trial_id} in the sweep; its trials: {some}"
                              + (f" ... ({len(table)})" if len(table) > 5 else ""))
        return rows.iloc[0]
    column = f"best_{objective[0]}"
    done = table.dropna(subset=[column]) if column in table else table.iloc[0:0]
    if done.empty:
        raise ConfigError(f"{KEY} {spec}: no trial reported {objective[0]} (this task's objective), so there is "
                          "no best; name one as SWEEP_DIR:TRIAL_ID")
    return done.sort_values(column, ascending=objective[1] == "min").iloc[0]


def _checkpoint(sweep: Path, tune_id: str, trial_id: str, spec: str) -> tuple[Path, Path]:
    """(the Tune trial's folder, its last checkpoint), in the sweep's folder (checked to be this user's alone)."""
    found = [p for p in sweep.iterdir() if p.is_dir() and f"_{tune_id}_" in p.name]
    if len(found) != 1:
        raise ConfigError(f"{KEY} {spec}: trial {trial_id} has no checkpoint folder in {sweep} (array-job trials "
                          "keep none)" if not found else f"{KEY} {spec}: {len(found)} folders match trial {trial_id}")
    # the newest complete one (a trial killed while saving leaves half a folder); a TorchTrainer trial's
    # checkpoints are its own run's
    trainer = sweep / f"train-trial_id={tune_id}"
    last = latest_checkpoint(pack_checkpoints(found[0])) or (latest_checkpoint(trainer) if trainer.is_dir() else None)
    if last is None:
        raise ConfigError(f"{KEY} {spec}: trial {trial_id} ended before its first checkpoint")
    return found[0], last


def _members(sweep: Path, config: dict) -> list[dict]:
    packs = load_plan(sweep) if (sweep / PLAN_FILE).exists() else None
    return members_of(config, packs)
