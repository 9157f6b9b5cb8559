"""Run a sweep: check everything, then start (or join) Ray and let Ray Tune execute the plan."""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import shutil
import time
from pathlib import Path

import pandas as pd
from ray import tune
from ray.tune import Callback
from ray.tune.schedulers import (
    ASHAScheduler,
    FIFOScheduler,
    HyperBandScheduler,
    MedianStoppingRule,
)
from ray.tune.search import BasicVariantGenerator, SearchGenerator

from rayhpc import cluster, interrupt
from rayhpc.config import ConfigError
from rayhpc.engine import checkpoint
from rayhpc.job import Started, start_job
from rayhpc.monitor.board import SweepMonitor
from rayhpc.task.failure import plain, rank_failure
from rayhpc.tune.config import SweepConfig, bind_objectives, bind_sweep
from rayhpc.tune.curves import MemberCurves
from rayhpc.tune.objectives import measured_names
from rayhpc.tune.optim import PACKED
from rayhpc.tune.packing import pack_key, packing_problem, shared_keys, step_seconds
from rayhpc.tune.pbt import PbtRules, mutable
from rayhpc.tune.plan import (
    MAX_PACK,
    PLAN_FILE,
    can_pack,
    load_plan,
    make_plan,
    pack_size,
    repeated,
    save_plan,
    slots,
)
from rayhpc.tune.progress import ProgressPrinter
from rayhpc.tune.results import ResultsRecorder, read_results
from rayhpc.tune.space import conditional, log_quanta, searched, tune_domains
from rayhpc.tune.tracking import sweep_tracking
from rayhpc.tune.trainable import TrialSettings, pack_checkpoints, train_pack

log = logging.getLogger(__name__)


def run_sweep(cfg: SweepConfig, *, explicit: set[str] = frozenset(), callbacks: tuple = ()) -> pd.DataFrame:
    """Run (or resume) the sweep `cfg` and return its results table, one row per trial
    (`table.attrs["objective"]`: the value it optimised and whether "min" or "max").

    Everything that can be wrong with the input is checked before Ray starts (`rayhpc.job`).
    `callbacks` are extra Ray Tune callbacks (tests use one to kill a trial).
    """
    entered, study = time.monotonic(), None
    if cfg.study is not None:  # a slice of a study: the study's sweep, this slice's own Tune experiment
        from rayhpc.study.slice import as_slice

        cfg, study, me = as_slice(cfg, set(explicit))
    job = start_job(cfg, explicit, bind=bind_sweep, check=check_resources, gpus=trial_gpus,
                    objectives=bind_objectives)
    cfg = job.cfg
    gpus = trial_gpus(cfg, job.resources)
    if cfg.model_options_set and cfg.workers_per_trial == 1:
        options = ", ".join(f"{k} {v}" for k, v in cfg.model_options_set.items())
        log.info(f"sweep {cfg.name}: {options}: its trials run unpacked, each the task's own model")
    if study is not None:
        study.join(me, job.info.objective)
    packs = _plan(job, study)
    _describe(cfg, packs, gpus, study)
    grid = _fit(_tuner(job, packs, gpus, callbacks, study), cfg, entered)
    _report_failures(grid, cfg, job.task.spec)
    if study is not None:
        with study.locked():  # the union of every slice's trials so far
            study.write_results()
            table = study.results()
    else:
        table = read_results(cfg.experiment_dir)
    table.attrs["objective"] = job.info.objective  # (reported name, "min" or "max"): what "best" means
    return table


def _fit(tuner, cfg: SweepConfig, entered: float):
    """Run the tuner; a stop signal stops the sweep (its state and results so far saved: KeyboardInterrupt).
    A time budget (from `entered`, the job's start) stops it the same way, as the end of this run: the
    trials it stopped can be resumed (`--resume`; a requeued Slurm job does so)."""
    budget = None
    if cfg.time_budget is not None:
        budget = interrupt.stop_after(cfg.time_budget - (time.monotonic() - entered),
                                      f"time budget {cfg.time_budget:g} s reached")
    try:
        grid = tuner.fit()
    finally:
        interrupt.install()  # Tune's handlers stay installed after fit()
        if budget is not None:
            budget.cancel()
    if interrupt.planned():
        why = interrupt.planned()
        interrupt.settle()
        log.warning(f"{why}: sweep {cfg.name} stopped; trials not finished continue with: "
                    f"{interrupt.resume_command(cfg)}")
    elif interrupt.received():  # Tune stopped the sweep early, its state and the results so far saved
        raise KeyboardInterrupt
    return grid


def _report_failures(grid, cfg: SweepConfig, task_spec: str) -> None:
    """Trials that failed in the task's code: one line naming the first, its function and the cause, every
    failed trial's traceback in the sweep's error.log; an error (exit 1) where every trial failed."""
    failed = {_trial_id(result.path): plain(str(result.error)) for result in grid if result.error is not None}
    if not failed:
        return
    exc = rank_failure(failed, cfg.experiment_dir, task_spec, "the trial", lambda trial: f"trial {trial}",
                       "every failed trial's traceback")
    if len(failed) == len(grid):
        # no trial reported an epoch: nothing to resume, so the same command starts the sweep again
        if not any((result.metrics or {}).get("training_iteration") for result in grid):
            cfg.saved_file.unlink(missing_ok=True)
        raise exc
    log.warning(f"sweep {cfg.name}: {len(failed)} of {len(grid)} trials failed; {exc}")


def _trial_id(path: str) -> str:
    """Tune's trial id (`1a2b3_00004`) from its folder's name (`train_pack_1a2b3_00004_4_pack=4_...`)."""
    found = re.search(r"_([0-9a-f]{5}_\d{5})(?:_|$)", Path(path).name)
    return found.group(1) if found else Path(path).name


def _plan(job: Started[SweepConfig], study=None) -> list[list[dict]] | None:
    """The saved plan of a resumed sweep, else a new one (None: a searcher proposes the trials). A study's
    slice: the study's plan, made by its first slice, in packs for STUDY_ROUNDS rounds of its slots."""
    cfg = job.cfg
    if cfg.resume and (cfg.experiment_dir / PLAN_FILE).exists():
        return load_plan(cfg.experiment_dir)
    if study is not None:
        if cfg.search == "optuna":
            return None
        with study.locked():
            study.ensure_plan(lambda: _new_plan(job, STUDY_ROUNDS))
        return None  # the slice's Tune trials are the packs it claims (`rayhpc.tune.slice_search`)
    packs = None if cfg.search == "optuna" else _new_plan(job)  # searchers propose
    save_plan(packs, cfg.experiment_dir)
    return packs


STUDY_ROUNDS = 4  # a study's packs fill a slice's slots this many times: a slice that joins later finds work


def _new_plan(job: Started[SweepConfig], rounds: int = 1) -> list[list[dict]]:
    """Every trial of a random or grid search, in packs that fill the cluster's slots `rounds` times."""
    cfg, task = job.cfg, job.task
    configs = cfg.configs(task.hp_model)
    first = len(cfg.points_to_evaluate or [])  # the points to evaluate: packs of their own, run first
    key = functools.partial(pack_key, task, job.info) if can_pack(cfg) else None
    gpus = trial_gpus(cfg, job.resources)
    size = pack_size(cfg, len(configs), slots(cfg, job.resources, gpus) * rounds)
    # some trials would share a pack: configurations of one key, or a configuration's repeated seeds
    shared = key is not None and (cfg.repeats > 1 or len(set(map(key, configs))) < len(configs))
    if shared and not trains_packed(job, configs[0], size, gpus):
        key = None
    packs = make_plan(configs[:first], size, key) + make_plan(configs[first:], size, key)
    return repeated(packs, cfg.repeats, key is not None)


MEASURED_MEMBERS = 8  # the most trials packed in the step that decides whether a sweep packs
# a packed step up to this much slower than its members' in turn still packs: the Tune trials a pack saves each
# cost a process's start (seconds), where 1 ms a step adds a second in 1,000 steps (a vmapped small model's
# packed step can measure a fraction of a millisecond slower at 2 members)
PACKED_SLACK_S = 0.001


def trains_packed(job: Started[SweepConfig], hp: dict, size: int, gpus: float) -> bool:
    """Whether trials like `hp` train packed, `size` to a pack: the task packs (`packing_problem`), and, where the
    sweep chose the size itself (no `--pack`), packs more than one and trains on CPUs, a step of the members packed
    is no slower than their steps in turn (`step_seconds`; `PACKED_SLACK_S`); one line says which and why. On
    GPUs, where packing is what fills the device, nothing is measured."""
    cfg = job.cfg
    if problem := packing_problem(job.task, hp, job.sample_batch):
        log.info(f"sweep {cfg.name}: {job.task.where()} cannot be packed ({problem}); its trials run unpacked")
        return False
    if cfg.pack is not None or gpus > 0 or size == 1:  # size 1: a repeated configuration's seeds still pack
        return True
    n = min(size, MEASURED_MEMBERS)
    packed, alone = step_seconds(job.task, hp, job.sample_batch, n, max(1, int(cfg.cpus_per_trial)))
    packs = packed <= alone + PACKED_SLACK_S
    log.info(f"sweep {cfg.name}: trials {'packed' if packs else 'unpacked'}: a training step of {n} took "
             f"{packed * 1e3:.1f} ms packed against {alone * 1e3:.1f} ms one after another (batch {hp['batch_size']}, "
             f"this node's CPU){'' if packs else '; --pack N packs them anyway'}")
    return packs


MAX_CONTEXTS_PER_GPU = 8  # trial processes sharing a GPU: each holds a CUDA context (~0.5 GiB) and its own memory


def check_resources(cfg: SweepConfig, res: cluster.Resources) -> None:
    """Reject requests the cluster cannot place (before Ray starts)."""
    if cfg.cpus_per_trial > res.node_cpus:
        raise ConfigError(f"cpus_per_trial (--cpus-per-trial) {cfg.cpus_per_trial:g}: larger than the "
                          f"{res.node_cpus:g} CPUs of the cluster's biggest node ({res.describe()})")
    if cfg.gpus_per_trial and res.gpus == 0:
        raise ConfigError(f"gpus_per_trial (--gpus-per-trial) {cfg.gpus_per_trial:g}: the cluster has no GPUs "
                          f"({res.describe()}); use 0")
    if cfg.gpus_per_trial and cfg.gpus_per_trial < 1 / MAX_CONTEXTS_PER_GPU:
        raise ConfigError(f"gpus_per_trial (--gpus-per-trial) {cfg.gpus_per_trial:g}: at most "
                          f"{MAX_CONTEXTS_PER_GPU} trial processes share a GPU (each holds a CUDA context); "
                          f"use at least {1 / MAX_CONTEXTS_PER_GPU:g} and larger packs (--pack)")
    if cfg.precision == "bf16" and trial_gpus(cfg, res) == 0:
        raise ConfigError(f"precision (--precision) bf16: autocast is for GPUs, and this sweep trains on CPUs "
                          f"({res.describe()}); use fp32 or tf32")
    if cfg.workers_per_trial > 1:
        cluster.check_workers(res, cfg.workers_per_trial, cfg.cpus_per_trial, trial_gpus(cfg, res) > 0,
                              key="workers_per_trial (--workers-per-trial)")


def trial_gpus(cfg: SweepConfig, res: cluster.Resources) -> float:
    """GPUs per trial process (per worker of a distributed trial): as given, else one where the cluster has
    GPUs: a pack per GPU, one CUDA context each."""
    if cfg.gpus_per_trial is None:
        return 1.0 if res.gpus > 0 else 0.0
    return cfg.gpus_per_trial


def tune_keeps_checkpoints(cfg: SweepConfig) -> bool:
    """Whether Ray Tune keeps the trials' checkpoints: the best by the objective (`keep_best`), or a distributed
    trial's; else each pack keeps its latest in its Tune trial's folder (`rayhpc.tune.trainable.train_pack`)."""
    return cfg.checkpoint.keep_best is not None or cfg.workers_per_trial > 1


def _settings(job: Started[SweepConfig], study=None) -> TrialSettings:
    cfg, pbt = job.cfg, None
    if cfg.scheduler == "pbt":
        p = cfg.pbt
        pbt = PbtRules(p.perturbation_interval, p.quantile_fraction, p.resample_probability, mutable(cfg.space),
                       *job.info.objective, cfg.seed)
    return TrialSettings.of(cfg, job.task, job.info.objective, data_keys=tuple(sorted(job.info.data_reads)), pbt=pbt,
                            study=None if study is None else str(study.path),
                            keep=None if tune_keeps_checkpoints(cfg) else cfg.checkpoint.keep,
                            measure=measured_names(objectives(job), cfg.constraint_list))


def _not_slow_warning(record: logging.LogRecord) -> bool:
    return "may be a performance bottleneck" not in record.getMessage()


def _not_incomplete_list(record: logging.LogRecord) -> bool:
    return "Trials did not complete" not in record.getMessage()


def _not_unreported(record: logging.LogRecord) -> bool:
    return "Failed to fetch metrics" not in record.getMessage()


def _tuner(job: Started[SweepConfig], packs, gpus: float, callbacks: tuple, study=None):
    cfg, (metric, mode) = job.cfg, job.info.objective
    # Tune's newer output engine prints its own tables even at verbose=0; the legacy
    # one honours it, and ProgressPrinter shows what matters. Both are read at fit().
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    # Trials checkpoint every epoch on purpose, which makes Tune snapshot the experiment
    # state often (good for --resume) and warn about it every few seconds.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    # Tune also warns when one of its own steps or callbacks takes over 0.5 s, which a loaded
    # node does now and then and the user cannot act on; its threshold is read at Tune's import
    logging.getLogger("ray.tune.utils.util").addFilter(_not_slow_warning)
    # A trial that fails in the task's code is one line at the sweep's end, its traceback in error.log:
    # not Tune's traceback of every attempt, nor its list of the trials that did not complete
    os.environ.setdefault("TUNE_PRINT_ALL_TRIAL_ERRORS", "0")
    logging.getLogger("ray.tune.tune").addFilter(_not_incomplete_list)
    # a diverged member's values (status "diverged" in the table) stay NaN or inf in each report of its pack:
    # tensorboardX, writing Tune's events, would warn of each one
    logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)

    optuna = packs is None and cfg.search == "optuna"
    proposed = optuna_pack(job, gpus, STUDY_ROUNDS if study else 2) if optuna else 0  # per Optuna trial
    keeper = _keeper(job, packs is not None or proposed > 1 or study is not None, study)
    trainable, max_concurrent = _trainable(job, packs, gpus, keeper, study)
    recorder = ResultsRecorder(cfg.experiment_dir, packs, cfg.epochs, columns(cfg), job.info, objectives(job),
                               cfg.constraint_list, cfg.repeats)
    planned, kept = range(len(packs or ())), 0  # the packs this run starts; configurations an Optuna resume keeps
    if cfg.resume and tune.Tuner.can_restore(str(cfg.experiment_dir)):
        searcher = BasicVariantGenerator() if packs is not None else SearchGenerator(_optuna(job, proposed)[1])
        cut = cut_short_state(cfg.experiment_dir, searcher)
        if cut is None:
            if tune_keeps_checkpoints(cfg):
                relink_pruned_checkpoints(cfg.experiment_dir)
            # Tune's restore reads every trial's results so far, and warns of each trial that was stopped before
            # it reported (its folder has no result.json yet): such a trial simply starts again
            logging.getLogger("ray.tune.analysis.experiment_analysis").addFilter(_not_unreported)
            # the callbacks, schedulers and searcher come back from the saved tuner state
            return tune.Tuner.restore(str(cfg.experiment_dir), trainable, resume_unfinished=True,
                                      resume_errored=True)
        if packs is not None:
            recorder.kept, planned = finished_packs(cfg.experiment_dir, len(packs))
            again = f"the other {len(planned)} pack(s) start again"
        else:
            recorder.kept = ended_rows(cfg.experiment_dir)
            kept = len(recorder.kept) // cfg.repeats
            again = f"Optuna is told them and proposes the other {cfg.num_samples - kept}"
        log.warning(f"sweep {cfg.name}: Ray Tune's saved state is cut short ({cut}), as a driver killed while Tune "
                    f"copied it leaves it: the {len(recorder.kept)} trial(s) that finished are kept, {again}")
    if study is not None:  # each Tune trial a pack claimed from the study, no more than run at once
        param_space, search_alg, num_samples = {}, _study_searcher(job, study, proposed), -1
        max_concurrent = slots(cfg, job.resources, gpus)
    elif packs is not None:
        # every pack kept (a resume of a sweep that had ended): Tune runs no trial, as it cannot grid-search nothing
        param_space = {"pack": tune.grid_search(list(planned))} if planned else {}
        search_alg, num_samples = None, 1 if planned else 0
    else:
        param_space, search_alg, num_samples = _optuna(job, proposed, kept)
    return tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            metric=metric, mode=mode, num_samples=num_samples, search_alg=search_alg,
            scheduler=_scheduler(cfg) if keeper is None else None, max_concurrent_trials=max_concurrent,
            # one process per slot for the whole sweep: torch is imported once, not once per trial
            reuse_actors=True,
        ),
        run_config=tune.RunConfig(
            name=cfg.name, storage_path=str(cfg.storage_path.resolve()), verbose=0,
            failure_config=tune.FailureConfig(max_failures=cfg.max_failures),
            # keeping few makes Tune save its experiment state after each checkpoint it keeps: a killed driver's
            # --resume re-runs no epoch (a pack keeps its own and gives Tune one, empty: `train_pack`)
            checkpoint_config=checkpoint.checkpoint_config(cfg.checkpoint, job.info.objective, tune.CheckpointConfig)
            if tune_keeps_checkpoints(cfg) else tune.CheckpointConfig(num_to_keep=1),
            callbacks=[recorder, ProgressPrinter(recorder), SweepMonitor(recorder, cfg.name), WatchStopSignals(),
                       MemberCurves(), *sweep_tracking(job, packs, recorder.columns), *callbacks],
        ),
    )


def columns(cfg: SweepConfig) -> list[str]:
    """The hyperparameters the table shows (`config.<name>`): those the space searches, and the seed of
    each run where the sweep repeats its configurations."""
    return searched(cfg.space) + (["seed"] if cfg.repeats > 1 and "seed" not in cfg.space else [])


def objectives(job: Started[SweepConfig]) -> list[tuple[str, str]]:
    """Every objective of the sweep, (name, mode), the first the one it ranks by."""
    return job.cfg.objectives or [job.info.objective]


class WatchStopSignals(Callback):
    """Tune installs its SIGINT and SIGUSR1 handlers when fit() starts, then sets up the callbacks: this
    one makes its SIGINT handler remember the signal first (`interrupt.watch_tune`), so that the job
    ends with the line and exit status of the signal that stopped it."""

    def setup(self, **info):
        interrupt.watch_tune()


def relink_pruned_checkpoints(exp_dir: Path) -> None:
    """Before a resume: give each trial's newest checkpoint the name of the one before it too (hard links).

    Tune deletes a trial's older checkpoint (num_to_keep) as it registers a new one, and snapshots the
    experiment state, which names the checkpoint to resume from, only afterwards: a driver killed in
    between leaves a snapshot naming a deleted folder, and Tune then fails that trial on every retry
    ("does not exist on storage anymore"), losing it. The newest complete checkpoint (`progress.json`,
    written last) is what that trial would resume from anyway; the trainables restore from what a
    folder holds, not from its name."""
    for trial_dir in (p for p in exp_dir.iterdir() if p.is_dir() and (p / "params.json").exists()):
        done = checkpoint.complete_checkpoints(trial_dir)
        if not done or done[-1].name == "checkpoint_000000":
            continue
        newest = done[-1]
        before = trial_dir / f"checkpoint_{int(newest.name.removeprefix('checkpoint_')) - 1:06d}"
        if not before.exists():
            shutil.copytree(newest, before, copy_function=os.link)


def cut_short_state(exp_dir: Path, searcher) -> str | None:
    """Why Ray Tune cannot restore the sweep in `exp_dir` (None: it can); `searcher`: a search algorithm of
    the kind the sweep ran (its saved state is loaded into it). Tune writes its state in a staging folder and
    copies it to the experiment folder file by file, not replacing each whole: a driver killed during the copy
    leaves a file cut short there. Tune's restore then fails, and Tune starts the experiment again from
    nothing ("Restarting experiment", exit 0: every trial's epochs lost), or runs only the trials its state
    names, dropping every pack it had not started."""
    try:
        # Tune's name for its experiment state (TuneController.CKPT_FILE_TMPL): no public API reads the state
        # without every trial's results; tests/ray/test_sweep.py fails where a Ray upgrade renames it
        json.loads(max(exp_dir.glob("experiment_state-*.json")).read_bytes())
        searcher.restore_from_dir(str(exp_dir))
    except Exception as exc:  # noqa: BLE001 -- whatever a cut file raises (ValueError, EOFError, UnpicklingError)
        return f"{type(exc).__name__}: {exc}"
    return None


def _pack_of(trial_dir: Path) -> int | None:
    """The pack a Tune trial's folder trained (its params.json, else its latest checkpoint), or None: not a
    trial's folder, or one of a trial that left neither (it starts again)."""
    try:
        return json.loads((trial_dir / "params.json").read_text())["pack"]
    except (OSError, ValueError, KeyError, TypeError):  # no file (another folder, or see below), or a cut one
        pass
    # Tune copies a trial's params.json into the experiment folder only as it saves its state, every 10 s or
    # more: a trial that started since has only the checkpoints its pack keeps there (`train_pack`)
    last = checkpoint.latest_checkpoint(pack_checkpoints(trial_dir))
    return None if last is None else ((checkpoint.load_extra(last) or {}).get("pack") or {}).get("pack")


def finished_packs(exp_dir: Path, n_packs: int) -> tuple[pd.DataFrame, list[int]]:
    """(the table rows of the packs whose every trial finished, the indices of the other packs): from the rows
    written while the sweep ran (`results.parts/`) and each Tune trial's pack (its folder's params.json)."""
    pack_of = {_trial_id(str(p)): pack for p in exp_dir.iterdir() if (pack := _pack_of(p)) is not None}
    kept = ended_rows(exp_dir, pack_of.keys())
    done = {pack_of[t.split("-")[0]] for t in kept["trial_id"]}
    return kept, [i for i in range(n_packs) if i not in done]


def ended_rows(exp_dir: Path, among=None) -> pd.DataFrame:
    """The table rows written while the sweep ran (`results.parts/`) of the Tune trials (packs) whose every
    member ended; only those of the Tune trial ids `among`, where given."""
    rows = read_results(exp_dir)
    if rows.empty:
        return rows
    tune_ids = rows["trial_id"].str.split("-").str[0]
    ended = rows["status"].isin(["finished", "early-stopped", "diverged"]).groupby(tune_ids).transform("all")
    return rows[ended & (True if among is None else tune_ids.isin(among))].reset_index(drop=True)


def _keeper(job: Started[SweepConfig], packed: bool, study=None):
    """ASHA over the members of packs (each a trial to Tune's ASHA math, `rayhpc.tune.adaptive`), or None:
    unpacked trials of a searcher, or distributed ones, are Tune trials that Tune's own ASHA stops. A
    study's slices share one keeper's state, in the study folder."""
    cfg = job.cfg
    if cfg.scheduler not in ("asha", "median") or not packed or cfg.workers_per_trial > 1:
        return None
    from rayhpc.tune.adaptive import start_keeper  # only ASHA and median-stopping sweeps of packs

    grace = cfg.median.grace_period if cfg.scheduler == "median" else cfg.asha.grace_period
    rule = dict(kind=cfg.scheduler, min_samples=cfg.median.min_samples)

    if study is not None:
        from rayhpc.study.folder import LOCK_FILE

        return start_keeper(study.path, job.info.objective, cfg.epochs, grace, cfg.asha.reduction_factor,
                            lock=study.path / LOCK_FILE, **rule)
    return start_keeper(cfg.experiment_dir, job.info.objective, cfg.epochs, grace, cfg.asha.reduction_factor, **rule)


def _study_searcher(job: Started[SweepConfig], study, size: int):
    """The slice's searcher (`rayhpc.tune.slice_search`): packs from the study's plan, or Optuna's from its journal."""
    from rayhpc.tune.results import value_columns
    from rayhpc.tune.slice_search import OptunaProposer, SliceRecorder, StudySearcher  # only a study's slices

    cfg, (metric, mode) = job.cfg, job.info.objective
    propose = None
    if cfg.search == "optuna":
        shared = shared_keys(job.task, job.info, cfg.defaults(job.task.hp_model))
        propose = OptunaProposer(study.path, tune_domains(cfg.space), sorted(shared), mode, cfg.seed, study.me)
    recorder = SliceRecorder(cfg.epochs, searched(cfg.space), value_columns(job.info.metric_names, job.info.objective),
                             metric)
    return StudySearcher(study, study.me, recorder, size, cfg.num_samples, propose, metric, mode)


def optuna_pack(job: Started[SweepConfig], gpus: float, per_slot: int = 2) -> int:
    """Members per Tune trial of an Optuna search: as given; else enough that each slot runs 2 batches
    (TPE learns from the first before it proposes the second; more, smaller batches learn more often
    but pay a pack's start each: 4 per slot measured 1.8x the packed random sweep's wall at 128 trials,
    2 per slot 1.3x), at most MAX_PACK; 1 for a task that cannot be packed or a distributed trial."""
    cfg = job.cfg
    spec = cfg.space.get("optimizer", cfg.defaults(job.task.hp_model)["optimizer"])
    optimizers = [spec] if isinstance(spec, str) else (spec.grid or spec.choice or [])
    if unpacked := sorted({o for o in optimizers if o.lower() not in PACKED}):
        log.info(f"sweep {cfg.name}: optimizer {', '.join(unpacked)}: packs step {', '.join(PACKED)}; its trials "
                 "run unpacked")
        return 1
    if cfg.pack is not None or not can_pack(cfg):
        return cfg.pack or 1
    n_slots = slots(cfg, job.resources, gpus)
    size = max(1, min(MAX_PACK, math.ceil(cfg.num_samples / (per_slot * n_slots))))
    return size if size > 1 and trains_packed(job, cfg.defaults(job.task.hp_model), size, gpus) else 1


def _optuna(job: Started[SweepConfig], pack: int, kept: int = 0):
    """(param_space, search_alg, Tune trials) of an Optuna search: Tune's OptunaSearch for trials of one
    under one objective, TPE, no constraints, conditions, points or warm start; else packs (of one or more)
    proposed in batches (`rayhpc.tune.adaptive.PackedOptunaSearch`, which also does all of those). `kept`:
    the configurations that ended in the sweep's folder before a resume whose Tune state was cut short,
    told to Optuna as a warm start's are, which then proposes only the others."""
    import optuna  # optional: only Optuna searches
    from ray.tune.search.optuna import OptunaSearch

    from rayhpc.tune.adaptive import PackedOptunaSearch  # only Optuna sweeps

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    cfg, (metric, mode) = job.cfg, job.info.objective
    plain = (len(objectives(job)) == 1 and not cfg.constraints and cfg.sampler == "tpe" and not conditional(cfg.space)
             and not cfg.points_to_evaluate and cfg.warm_start is None and cfg.repeats == 1
             and not log_quanta(cfg.space) and not kept)
    if pack == 1 and plain:
        return tune_domains(cfg.space), OptunaSearch(seed=cfg.seed), cfg.num_samples
    shared = shared_keys(job.task, job.info, cfg.defaults(job.task.hp_model))
    points = cfg.points_to_evaluate or []
    told = [str(f) for f in (cfg.warm_start, cfg.experiment_dir if kept else None) if f is not None]
    searcher = PackedOptunaSearch(tune_domains(cfg.space), pack, cfg.num_samples - kept + len(points),
                                  sorted(shared), metric, mode, cfg.seed, str(cfg.experiment_dir), objectives(job),
                                  cfg.constraint_list, cfg.sampler, conditional(cfg.space), points, told,
                                  cfg.repeats, log_quanta(cfg.space))
    # the points may take packs of their own (a pack's members share its batch size, optimizer, ...)
    return {}, searcher, math.ceil((cfg.num_samples - kept) / pack) + len(points)


def _trainable(job: Started[SweepConfig], packs, gpus: float, keeper=None, study=None):
    """The Tune trainable with its resources, and the most trials to run at once."""
    cfg, res = job.cfg, job.resources
    if cfg.workers_per_trial == 1:
        trainable = tune.with_parameters(train_pack, task=job.task, packs=packs, settings=_settings(job, study),
                                         keeper=keeper)
        return tune.with_resources(trainable, {"cpu": cfg.cpus_per_trial, "gpu": gpus}), cfg.max_concurrent
    from rayhpc.tune.warm import resources, train_warm_trial  # only sweeps of distributed trials

    kwargs = dict(task=job.task, packs=packs, sweep=cfg, defaults=cfg.defaults(job.task.hp_model), gpu=gpus > 0)
    # no more trials at once than their worker groups fit: Tune holds each slot's workers
    return tune.with_resources(tune.with_parameters(train_warm_trial, **kwargs),
                               resources(cfg, gpus > 0)), slots(cfg, res, gpus)


def _scheduler(cfg: SweepConfig):
    """Tune's own scheduler of unpacked (or distributed) trials."""
    if cfg.scheduler == "asha":
        return ASHAScheduler(time_attr="epoch", max_t=cfg.epochs, grace_period=cfg.asha.grace_period,
                             reduction_factor=cfg.asha.reduction_factor)
    if cfg.scheduler == "median":
        return MedianStoppingRule(time_attr="epoch", grace_period=cfg.median.grace_period,
                                  min_samples_required=cfg.median.min_samples, hard_stop=True)
    if cfg.scheduler == "hyperband":
        return HyperBandScheduler(time_attr="epoch", max_t=cfg.epochs,
                                  reduction_factor=cfg.hyperband.reduction_factor)
    return FIFOScheduler()


def _describe(cfg: SweepConfig, packs, gpus: float, study=None) -> None:
    if study is not None:
        n = sum(len(p) for p in study.plan) if study.plan is not None else cfg.num_samples
        trials = f"slice of study {study.path} ({n} trials, {cfg.search})"
    elif packs is None:
        trials = f"{cfg.num_samples} trials proposed by {cfg.search}{f' in packs of {cfg.pack}' if cfg.pack else ''}"
    else:
        n = sum(len(p) for p in packs)
        trials = f"{n} trials in {len(packs)} pack(s) of up to {max(len(p) for p in packs)}"
    each = "worker" if cfg.workers_per_trial > 1 else "trial process"
    where = f", {1 / gpus:g} per GPU" if 0 < gpus and cfg.workers_per_trial == 1 else ""
    length = f"{cfg.steps} steps" if cfg.steps else f"{cfg.epochs} epochs"
    log.info(f"sweep {cfg.name}: {trials}, {length} each, {cfg.precision}, scheduler {cfg.scheduler}, "
             f"{cfg.cpus_per_trial:g} CPU + {gpus:g} GPU per {each}{where} -> {cfg.experiment_dir}")
