"""A slice without Ray: one process (a Slurm array task) training the study's trials one at a time.

    python -m rayhpc.tune.study_array --study DIR [--task SPEC]

Array mode is this: `rayhpc submit --array --study DIR` runs one per array task. Each claims a trial
(a pack of one) from the study, trains it as the sweep's trials train (`rayhpc.tune.single.train_alone`),
records its row once, and claims the next until none is left, so the tasks that run take over the trials of
tasks that died. Optuna proposes each trial from the study's journal and is told its value; ASHA decides after
each epoch from the study's shared rung records. Each epoch's end is checkpointed in the study's pack folder,
as a Ray slice's packs are: a trial cut short by the task's death goes on from there in whichever task (or
slice) claims it next.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import traceback
from pathlib import Path

import torch

from rayhpc.config import load_yaml, validate
from rayhpc.study.folder import LOCK_FILE, Study, slice_id
from rayhpc.study.slice import SPEC_FILE, open_study
from rayhpc.task import task_for
from rayhpc.tracking.runs import JobRun, start_tracker, system_tags
from rayhpc.tune.config import SweepConfig, bind_sweep
from rayhpc.tune.single import task_device, train_alone

COLUMNS_FILE = "columns.json"  # what the rows hold: searched keys, value columns, objective (written at submission)


def run_task(study: Study, task_spec: str | None = None) -> int:
    """Train claimed trials until none is left; how many this process finished."""
    cfg = validate(SweepConfig, load_yaml(study.path / SPEC_FILE))
    columns = json.loads((study.path / COLUMNS_FILE).read_text())
    objective = tuple(columns["objective"])
    task = task_for(task_spec or cfg.task, cfg.data)
    cfg, _ = bind_sweep(cfg, task)  # the space resolved (the task's own where the sweep gives none)
    me = slice_id()
    study.join(me, objective)
    propose = keeper = None
    if cfg.search == "optuna":
        from rayhpc.tune.slice_search import OptunaProposer  # only Optuna studies
        from rayhpc.tune.space import tune_domains

        propose = OptunaProposer(study.path, tune_domains(cfg.space), [], objective[1], cfg.seed, me)
    if cfg.scheduler == "asha":
        from rayhpc.tune.adaptive import STATE_FILE, RungKeeper  # only ASHA studies

        keeper = RungKeeper(str(study.path / STATE_FILE), *objective, cfg.epochs, cfg.asha.grace_period,
                            cfg.asha.reduction_factor, lock=str(study.path / LOCK_FILE))
    tracker = start_tracker(cfg.tracking, study.path.name, study.path, study.path)
    tags = system_tags(cfg.task, "array trial") if tracker is not None else {}
    done = 0
    while True:
        with study.locked():
            pack = study.claim(me, propose, 1, cfg.num_samples)
        if pack is None:
            break
        hp = {**cfg.defaults(task.hp_model), **pack["members"][0]}
        key = f"{pack['pack']}-0"
        with JobRun(tracker, key, hp, {**tags, "rayhpc.trial": key}, f"{study.path.name}/{key}") as run:
            row, value = _train(task, cfg, hp, key, columns, keeper, run.log, study.pack_dir(pack["pack"]))
            run.status = row["status"]
        with study.locked():
            if study.finish(me, pack["pack"], [row]) and propose is not None and pack["optuna"]:
                propose.tell(pack["optuna"], [value])
        done += 1
    with study.locked():
        study.write_results()
    if tracker is not None:
        tracker.shutdown()
    return done


def _train(task, cfg: SweepConfig, hp: dict, member: str, columns: dict, keeper, track, folder: Path
           ) -> tuple[dict, float | None]:
    """(the trial's row, as a Ray sweep writes it; its objective value for Optuna, None if it failed);
    `track(epoch, values)`: its tracked run's log; `folder`: its checkpoints'."""
    metric = columns["objective"][0]

    def asha(values: dict, epoch: int) -> bool:
        track(epoch, values)
        return keeper is not None and keeper.decide(metric, [(member, epoch, values[metric])])[0] and \
            epoch < cfg.epochs

    row = {"trial_id": member, **{f"config.{p}": hp[p] for p in columns["searched"]}, "node": socket.gethostname(),
           "pack_size": 1}
    try:
        result = train_alone(task, hp, cfg, folder=folder, then=asha, device=task_device(cfg.gpus_per_trial),
                             threads=int(os.environ.get("SLURM_CPUS_PER_TASK", "1")))
    except Exception as exc:  # noqa: BLE001 - the trial's error is its row; the task goes on with the next
        traceback.print_exc()
        return {**row, "status": "error", **{c: None for c in columns["values"]}, "iterations": 0,
                "train_seconds": None, "error": f"{type(exc).__name__}: {exc}"}, None
    stopped = cfg.epochs is not None and result["iterations"] < cfg.epochs
    return {**row, "status": "early-stopped" if stopped else "finished",
            **{c: result.get(c) for c in columns["values"]}, "iterations": result["iterations"],
            "train_seconds": result["train_seconds"], "error": None}, result.get(metric)


def submit_study_array(cluster, cfg: SweepConfig, explicit: set[str], tasks: int | None, dry_run: bool) -> str:
    """`rayhpc submit --array --study DIR`: the study made (or joined) and its trials planned here, the task
    checked in this process, then an array of `tasks` slices (default: one per trial). The array's id, or the
    script with `dry_run`."""
    from rayhpc.config import ConfigError
    from rayhpc.job import bind_task
    from rayhpc.slurm.render import render_study_array
    from rayhpc.slurm.submit import log_dir, sbatch
    from rayhpc.study.slice import as_slice

    if cfg.scheduler == "pbt":
        raise ConfigError("scheduler (--scheduler) pbt: array tasks train one trial each, apart; use fifo or asha")
    if cfg.pack not in (None, 1):
        raise ConfigError(f"pack (--pack) {cfg.pack}: array tasks train one trial each; use 1 or leave it unset")
    cfg, study, _ = as_slice(cfg, explicit)
    cfg, task, info, _ = bind_task(cfg, bind_sweep)
    trials = cfg.num_samples if cfg.search == "optuna" else len(cfg.configs(task.hp_model))
    text = render_study_array(cluster, cfg, tasks or trials, study.path, task.copied_spec(study.path / "task"))
    if dry_run:
        return text
    prepare_tasks(study, cfg, task, info)
    log_dir(cluster)
    return sbatch([], script=text)


def prepare_tasks(study: Study, cfg: SweepConfig, task, info) -> None:
    """What the study's array tasks read: its plan of trials (random, grid), the rows' columns, a file task."""
    from rayhpc.private import write_private
    from rayhpc.tune.results import value_columns
    from rayhpc.tune.space import searched

    with study.locked():
        if cfg.search != "optuna":
            study.ensure_plan(lambda: [[c] for c in cfg.configs(task.hp_model)])
        write_private(study.path / COLUMNS_FILE, json.dumps({
            "searched": searched(cfg.space), "values": value_columns(info.metric_names, info.objective),
            "objective": list(info.objective)}))
    task.copy_files(study.path / "task")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", required=True, help="the study folder")
    parser.add_argument("--task", help="the task, where not the sweep's own (a copy shipped with the job)")
    args = parser.parse_args(argv)
    # one thread per CPU the task was given (Slurm's --cpus-per-task): more makes small torch ops slower
    torch.set_num_threads(int(os.environ.get("SLURM_CPUS_PER_TASK", "1")))
    study = open_study(Path(args.study), create=False)
    done = run_task(study, args.task)
    print(f"slice {study.me}: {done} trial(s) of study {study.path}")
    return 0


if __name__ == "__main__":
    from rayhpc.entry import run_main

    run_main(main)  # bad input: one `error:` line in the task's log, exit 2
