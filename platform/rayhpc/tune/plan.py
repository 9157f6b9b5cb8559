"""Which trials a sweep runs, and how they are packed into Ray Tune trials.

For `random` and `grid` searches every trial's hyperparameters are known up
front, so trials that can step together (the same data order, optimiser kind
and model structure: `rayhpc.tune.packing.pack_key`) are trained as one pack:
one Tune trial (one process, one checkpoint per epoch) per pack. By default
there are just enough packs to fill the cluster once, which removes nearly all
per-trial process start-up and bookkeeping. The plan is saved beside the
results, so `--resume` maps each Tune trial to the same members even on a
cluster of another size.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

from rayhpc.cluster import Resources
from rayhpc.private import replace_whole
from rayhpc.tune.config import SweepConfig

MAX_PACK = 64
PLAN_FILE = "trials.json"


def slots(cfg: SweepConfig, res: Resources, gpus: float = 0.0) -> int:
    """How many trials the cluster runs at once, each trial process holding `cfg.cpus_per_trial` CPUs
    and `gpus` GPUs (per worker), each on one node."""
    fit = max(1, res.placeable(cfg.cpus_per_trial, gpus) // cfg.workers_per_trial)
    return min(fit, cfg.max_concurrent) if cfg.max_concurrent else fit


def can_pack(cfg: SweepConfig) -> bool:
    """Whether this sweep packs at all (a TorchTrainer trains one model; a compiled or activation-checkpointed
    one is the task's own model, not a batch of them; ASHA stops members of packs and Optuna proposes packs:
    `rayhpc.tune.adaptive`)."""
    return (cfg.workers_per_trial == 1 and cfg.pack != 1 and not cfg.model_options_set
            and cfg.scheduler != "hyperband")  # HyperBand pauses and resumes whole trials


def pack_size(cfg: SweepConfig, n_trials: int, n_slots: int) -> int:
    if cfg.pack is not None:
        return cfg.pack
    return max(1, min(MAX_PACK, math.ceil(n_trials / n_slots))) if can_pack(cfg) else 1


def make_plan(configs: list[dict], size: int, key: Callable[[dict], tuple] | None) -> list[list[dict]]:
    """Packs of at most `size` trials that agree on `key` (None: one trial per pack)."""
    if key is None:
        return [[c] for c in configs]
    groups: dict[tuple, list[dict]] = {}
    for c in configs:
        groups.setdefault(key(c), []).append(c)
    packs = []
    for members in groups.values():
        n = math.ceil(len(members) / size)
        bounds = [round(i * len(members) / n) for i in range(n + 1)]  # n packs of near-equal size
        packs += [members[a:b] for a, b in zip(bounds, bounds[1:])]
    return packs


def repeated(packs: list[list[dict]], repeats: int, packed: bool) -> list[list[dict]]:
    """Each configuration as `repeats` runs with seeds seed, seed+1, ...: consecutive members of its pack
    (a sweep that does not pack: a pack each)."""
    if repeats == 1:
        return packs
    runs = [[seeded_runs(c, repeats, c["seed"]) for c in pack] for pack in packs]
    if not packed:
        return [[run] for pack in runs for config in pack for run in config]
    return [[run for config in pack for run in config] for pack in runs]


def seeded_runs(config: dict, repeats: int, seed: int) -> list[dict]:
    """A configuration's `repeats` runs: seeds `seed`, `seed`+1, ..."""
    return [{**config, "seed": seed + r} for r in range(repeats)]


def save_plan(packs: list[list[dict]] | None, exp_dir: Path) -> None:
    exp_dir.mkdir(parents=True, exist_ok=True)
    replace_whole(exp_dir / PLAN_FILE, lambda tmp: tmp.write_text(json.dumps(packs, indent=1)))  # a resume reads it


def load_plan(exp_dir: Path) -> list[list[dict]] | None:
    return json.loads((exp_dir / PLAN_FILE).read_text())
