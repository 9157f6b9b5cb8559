"""Which trials a sweep runs, and how they are packed into Ray Tune trials.

For `random` and `grid` searches every trial's hyperparameters are known up
front, so trials that share a batch size and optimizer can be trained
together as one `PackedMLP`: one Tune trial (one process, one checkpoint per
epoch) per pack. By default there are just enough packs to fill the cluster
once, which removes nearly all per-trial process start-up and bookkeeping.
The plan is saved beside the results, so `--resume` maps each Tune trial to
the same members even on a cluster of another size.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rayhpc.tune.config import SweepConfig
from rayhpc.tune.space import sample_configs

MAX_PACK = 64
PLAN_FILE = "trials.json"


def slots(cfg: SweepConfig, cpus: float) -> int:
    """How many trials the cluster runs at once."""
    fit = max(1, math.floor(cpus / (cfg.cpus_per_trial * cfg.workers_per_trial) + 1e-9))
    return min(fit, cfg.max_concurrent) if cfg.max_concurrent else fit


def pack_size(cfg: SweepConfig, n_trials: int, n_slots: int) -> int:
    if cfg.pack is not None:
        return cfg.pack
    if cfg.scheduler == "asha" or cfg.workers_per_trial > 1:
        return 1  # ASHA stops Tune trials, and a TorchTrainer trains one model: one trial each
    return max(1, min(MAX_PACK, math.ceil(n_trials / n_slots)))


def make_plan(cfg: SweepConfig, n_slots: int) -> list[list[dict]] | None:
    """Member hyperparameters of each Tune trial, or None when a searcher proposes trials (optuna)."""
    if cfg.search == "optuna":
        return None
    configs = sample_configs(cfg.space, cfg.num_samples, cfg.search, cfg.seed)
    size = pack_size(cfg, len(configs), n_slots)
    groups: dict[tuple, list[dict]] = {}
    for c in configs:  # members of a pack step together: same batch size and optimizer
        groups.setdefault((c["batch_size"], c["optimizer"]), []).append(c)
    packs = []
    for members in groups.values():
        n = math.ceil(len(members) / size)
        bounds = [round(i * len(members) / n) for i in range(n + 1)]  # n packs of near-equal size
        packs += [members[a:b] for a, b in zip(bounds, bounds[1:])]
    return packs


def save_plan(packs: list[list[dict]] | None, exp_dir: Path) -> None:
    exp_dir.mkdir(parents=True, exist_ok=True)
    (exp_dir / PLAN_FILE).write_text(json.dumps(packs, indent=1))


def load_plan(exp_dir: Path) -> list[list[dict]] | None:
    return json.loads((exp_dir / PLAN_FILE).read_text())
