"""A slice's start (the sweep's definition read from, or written to, the study folder) and `rayhpc status --study`."""

from __future__ import annotations

import collections
from pathlib import Path

import yaml

from rayhpc.config import ConfigError, check_agrees, load_yaml, validate
from rayhpc.private import UnsafePath, check_trusted, private_dir, write_private
from rayhpc.study.folder import LEDGER_FILE, SLICES_DIR, Study, slice_id

SPEC_FILE = "sweep.yaml"
NOT_DEFINING = {"study", "name"}  # a slice's own: every slice of a study has its own name


def open_study(path: Path, create: bool = True) -> Study:
    """The study at `path`: a folder only this user can enter (made 0700 where missing), and everything in it
    this user's, since slices load its checkpoints and ASHA's state."""
    root = Path(path).expanduser().resolve()
    try:
        if create:
            private_dir(root)
        check_trusted(root, below=True)
    except (UnsafePath, FileNotFoundError) as exc:
        raise ConfigError(f"study (--study) {root}: {exc}") from None
    return Study(root)


def as_slice(cfg, explicit: set[str]):
    """(the sweep this slice runs, its study, its name): the study's definition where the study exists, and the
    keys given explicitly must agree with it; else `cfg`'s becomes the study's. The slice's own Tune experiment
    goes in the study's `slices/<name>/`."""
    if cfg.resume:
        raise ConfigError("resume (--resume): a study continues by itself: start a slice on it again "
                          "(--study DIR, without --resume)")
    if cfg.workers_per_trial > 1:
        raise ConfigError(f"workers_per_trial (--workers-per-trial) {cfg.workers_per_trial}: a study's slices run "
                          "trials of one process each (packed or not); use 1")
    study = open_study(cfg.study)
    defining = {k: v for k, v in cfg.saved().items() if k not in NOT_DEFINING}
    with study.locked():
        spec = study.path / SPEC_FILE
        if spec.exists():
            saved = validate(type(cfg), load_yaml(spec))
            check_agrees(defining, saved.saved(), set(explicit) - NOT_DEFINING, f"study {study.path}'s",
                         "drop it to join the study, or give another --study folder")
            cfg = saved.model_copy(update={"address": cfg.address})
        else:
            write_private(spec, yaml.safe_dump(defining, sort_keys=False), replace=False)
    me = slice_id()
    return cfg.model_copy(update={"study": study.path, "storage_path": study.path / SLICES_DIR, "name": me,
                                  "resume": False}), study, me


def study_status(path: Path) -> str:
    """The whole sweep: its slices (alive or not), its trials by state, the best so far."""
    study = open_study(path, create=False)
    if not (study.path / LEDGER_FILE).exists():
        raise ConfigError(f"study (--study) {study.path}: no study there yet (no {LEDGER_FILE})")
    spec = load_yaml(study.path / SPEC_FILE)
    with study.locked():
        alive = sorted(name for name in study.slices if study.alive(name))
        states = collections.Counter()
        for pack in study.packs.values():
            if pack["rows"] is not None:
                states.update(row["status"] for row in pack["rows"])
            else:
                states["running" if pack["holder"] in alive else "to resume (its slice ended)"] += len(pack["members"])
        if study.plan is not None:
            states["not started"] += sum(len(p) for i, p in enumerate(study.plan) if i not in study.packs)
        else:
            states["not started"] += max(0, spec.get("num_samples", 16) - sum(len(p["members"])
                                                                               for p in study.packs.values()))
        objective = next((s["objective"] for s in study.slices.values() if s.get("objective")), ["val_loss", "min"])
        table = study.results()
    lines = [f"study {study.path}: search {spec.get('search', 'random')}, task {spec.get('task', 'mlp')}",
             f"slices: {len(alive)} running ({', '.join(alive) or 'none'}), {len(study.slices) - len(alive)} ended",
             "trials: " + ", ".join(f"{n} {state}" for state, n in sorted(states.items())),
             _best(table, objective)]
    return "\n".join(lines)


def _best(table, objective) -> str:
    column = f"best_{objective[0]}"
    if table.empty or column not in table or table[column].isna().all():
        return f"best: no trial has reported {objective[0]} yet"
    best = table.loc[(table[column].idxmin() if objective[1] == "min" else table[column].idxmax())]
    config = ", ".join(f"{k.removeprefix('config.')} {v:.4g}" if isinstance(v, float) else
                       f"{k.removeprefix('config.')} {v}" for k, v in best.items() if k.startswith("config."))
    return f"best: trial {best['trial_id']} {column} {best[column]:.4g} ({config})"
