"""A sweep's best trials as plain files: `rayhpc export SWEEP_DIR --best K DEST`.

Each trial becomes `DEST/<trial_id>/` with `model.pt` (its model's state dict: `model = task.model(hp);
model.load_state_dict(torch.load("model.pt"))`), `hp.json` (every hyperparameter it was trained with) and
`metrics.json` (its row of the results table). Members of packs come out as their own models
(`rayhpc.tune.weights`). The same folder is what `tracking.log_checkpoint` uploads as a run's artifact.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

from rayhpc.config import ConfigError
from rayhpc.engine.checkpoint import complete_checkpoints, load_extra, write_export
from rayhpc.private import UnsafePath, check_trusted, private_dir
from rayhpc.tune.trainable import member_values, pack_checkpoints
from rayhpc.tune.weights import checkpoint_weights, sweep_objective, trial_weights


def export_best(sweep: Path, k: int, dest: Path) -> list[Path]:
    """Write the `k` best trials of the sweep in `sweep` (by its objective) to `dest`; their folders."""
    from rayhpc.tune.results import read_results

    sweep = sweep.expanduser().resolve()
    if not (sweep / "sweep.yaml").is_file():
        raise ConfigError(f"SWEEP_DIR {sweep}: not a sweep's folder (it has no sweep.yaml)")
    try:  # before its definition names a task file to load: the folder and all in it are this user's alone
        check_trusted(sweep, below=True)
    except UnsafePath as exc:
        raise ConfigError(f"SWEEP_DIR: {exc}") from None
    objective = sweep_objective(sweep)
    table = read_results(sweep)
    column = f"best_{objective[0]}"
    if table.empty or column not in table:
        raise ConfigError(f"SWEEP_DIR {sweep}: no trial reported {objective[0]} yet, so none is best")
    best = table.dropna(subset=[column]).sort_values(column, ascending=objective[1] == "min").head(k)
    try:
        private_dir(dest.expanduser().resolve())
    except UnsafePath as exc:
        raise ConfigError(f"DEST: {exc}") from None
    out = []
    for _, row in best.iterrows():
        weights = trial_weights(f"{sweep}:{row['trial_id']}", objective)
        out.append(write_export(dest.expanduser().resolve() / str(row["trial_id"]), weights.hp, weights.state,
                               row.to_dict()))
    return out


def write_checkpoint_artifact(trial_dir: Path, member: int, hp: dict, which: str,
                              objective: tuple[str, str]) -> Path | None:
    """A run's artifact (`tracking.log_checkpoint`): member `member`'s weights (`hp`: its hyperparameters) from
    the trial's last checkpoint, or (`best`) from the kept checkpoint where its objective was best, in a new
    private temporary folder (the tracker removes it once uploaded)."""
    kept = complete_checkpoints(pack_checkpoints(trial_dir))
    if not kept:
        return None
    chosen, metrics = kept[-1], {}
    if which == "best":
        scored = [(c, _member_metrics(c, member)) for c in kept]
        scored = [(c, m) for c, m in scored if m and math.isfinite(m.get(objective[0], math.nan))]
        if scored:
            pick = min if objective[1] == "min" else max
            chosen, metrics = pick(scored, key=lambda cm: cm[1][objective[0]])
    hp, state = checkpoint_weights(chosen, member, hp)
    folder = Path(tempfile.mkdtemp(prefix="rayhpc-artifact-"))  # 0700, an unpredictable name
    return write_export(folder, hp, state, {**metrics, "checkpoint": chosen.name})


def _member_metrics(folder: Path, member: int) -> dict:
    state = (load_extra(folder) or {}).get("pack")
    if state is None:
        return {}
    return member_values((state.get("metrics") or {}).get("members") or {}, member)
