"""Run a sweep: validate everything, then start (or join) Ray and let Ray Tune execute the plan."""

from __future__ import annotations

import os

import pandas as pd

from rayhpc import cluster
from rayhpc.config import ConfigError, reconcile_resume
from rayhpc.data import load_dataset
from rayhpc.monitor.board import SweepMonitor
from rayhpc.tune.config import SweepConfig
from rayhpc.tune.plan import load_plan, make_plan, save_plan, slots
from rayhpc.tune.progress import ProgressPrinter
from rayhpc.tune.results import RESULTS_FILE, ResultsRecorder
from rayhpc.tune.space import searched, tune_domains
from rayhpc.tune.trainable import TrialSettings, train_pack

METRIC, MODE = "val_loss", "min"
DRIVER_MEMORY = 256 * 2**20  # bytes reserved for a Tune-over-Train trial's driver process


def run_sweep(cfg: SweepConfig, *, explicit: set[str] = frozenset(), callbacks: tuple = ()) -> pd.DataFrame:
    """Run (or resume) the sweep `cfg` and return its results table, one row per trial.

    Everything that can be wrong with the input is checked before Ray starts:
    the saved sweep on `--resume`, the data, and the resources asked of the cluster.
    `callbacks` are extra Ray Tune callbacks (tests use one to kill a trial).
    """
    cfg = reconcile_resume(cfg, set(explicit))
    exp_dir = cfg.experiment_dir
    dataset = load_dataset(cfg.data)
    address = cluster.resolve_address(cfg.address)
    resources = cluster.probe(address)
    gpus = check_resources(cfg, resources)
    resuming = cfg.resume and (exp_dir / "trials.json").exists()
    packs = load_plan(exp_dir) if resuming else make_plan(cfg, slots(cfg, resources.cpus))
    cluster.connect(address)
    if not resuming:
        save_plan(packs, exp_dir)
        cfg.save()
    _describe(cfg, packs, resources, gpus)
    tuner = _tuner(cfg, dataset, packs, gpus, resources, callbacks)
    tuner.fit()
    return pd.read_parquet(exp_dir / RESULTS_FILE)


def check_resources(cfg: SweepConfig, res: cluster.Resources) -> float:
    """GPUs per trial process; rejects requests the cluster cannot place."""
    if cfg.cpus_per_trial > res.node_cpus:
        raise ConfigError(f"cpus_per_trial (--cpus-per-trial) {cfg.cpus_per_trial:g}: larger than the "
                          f"{res.node_cpus:g} CPUs of the cluster's biggest node ({res.describe()})")
    if cfg.gpus_per_trial is not None and cfg.gpus_per_trial > 0 and res.gpus == 0:
        raise ConfigError(f"gpus_per_trial (--gpus-per-trial) {cfg.gpus_per_trial:g}: the cluster has no GPUs "
                          f"({res.describe()}); use 0")
    if cfg.gpus_per_trial is not None and cfg.gpus_per_trial > res.node_gpus:
        raise ConfigError(f"gpus_per_trial (--gpus-per-trial) {cfg.gpus_per_trial:g}: larger than the "
                          f"{res.node_gpus:g} GPUs of the cluster's biggest node")
    if cfg.workers_per_trial > 1:
        fits = res.placeable(cfg.cpus_per_trial, 1.0 if (cfg.gpus_per_trial or 0) > 0 else 0.0)
        if cfg.workers_per_trial > fits:
            raise ConfigError(f"workers_per_trial (--workers-per-trial) {cfg.workers_per_trial}: the cluster can "
                              f"place {fits} worker(s) of {cfg.cpus_per_trial:g} CPU each ({res.describe()})")
    if cfg.gpus_per_trial is None:
        # share the GPUs between the trials that fit by CPU count: fractional GPUs per trial
        return 0.0 if res.gpus == 0 else min(1.0, res.node_gpus / slots(cfg, res.node_cpus))
    return cfg.gpus_per_trial


def _tuner(cfg: SweepConfig, dataset, packs, gpus: float, resources: cluster.Resources, callbacks: tuple):
    from ray import tune

    # Tune's newer output engine prints its own tables even at verbose=0; the legacy
    # one honours it, and ProgressPrinter shows what matters. Both are read at fit().
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    # Trials checkpoint every epoch on purpose, which makes Tune snapshot the experiment
    # state often (good for --resume) and warn about it every few seconds.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")

    trainable, max_concurrent = _trainable(cfg, dataset, packs, gpus, resources)
    recorder = ResultsRecorder(cfg.experiment_dir, packs, cfg.epochs, searched(cfg.space))
    if cfg.resume and tune.Tuner.can_restore(str(cfg.experiment_dir)):
        # the callbacks, schedulers and searcher come back from the saved tuner state
        return tune.Tuner.restore(str(cfg.experiment_dir), trainable, resume_unfinished=True, resume_errored=True)
    if packs is not None:
        param_space = {"pack": tune.grid_search(list(range(len(packs))))}
        search_alg, num_samples = None, 1
    else:
        import optuna
        from ray.tune.search.optuna import OptunaSearch

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        param_space = tune_domains(cfg.space)
        search_alg, num_samples = OptunaSearch(seed=cfg.seed), cfg.num_samples
    return tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            metric=METRIC, mode=MODE, num_samples=num_samples, search_alg=search_alg,
            scheduler=_scheduler(cfg), max_concurrent_trials=max_concurrent,
            # one process per slot for the whole sweep: torch is imported once, not once per trial
            reuse_actors=True,
        ),
        run_config=tune.RunConfig(
            name=cfg.name, storage_path=str(cfg.storage_path.resolve()), verbose=0,
            failure_config=tune.FailureConfig(max_failures=cfg.max_failures),
            # keeping one checkpoint makes Tune save the experiment state after every trial
            # checkpoint, so a killed driver's --resume never re-runs an epoch already done
            checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
            callbacks=[recorder, ProgressPrinter(recorder), SweepMonitor(recorder, cfg.name), *callbacks],
        ),
    )


def _trainable(cfg: SweepConfig, dataset, packs, gpus: float, resources: cluster.Resources):
    """The Tune trainable with its resources, and the most trials to run at once."""
    from ray import tune

    if cfg.workers_per_trial == 1:
        settings = TrialSettings(epochs=cfg.epochs, seed=cfg.seed, threads=max(1, int(cfg.cpus_per_trial)))
        trainable = tune.with_parameters(train_pack, dataset=dataset, packs=packs, settings=settings)
        return tune.with_resources(trainable, {"cpu": cfg.cpus_per_trial, "gpu": gpus}), cfg.max_concurrent
    from rayhpc.tune.distributed import train_distributed_trial

    trainable = tune.with_parameters(train_distributed_trial, dataset=dataset, packs=packs, sweep=cfg, gpu=gpus > 0)
    # The trial process only drives a TorchTrainer whose workers hold the CPUs and GPUs, so it
    # reserves memory alone (Ray refuses an empty request). Start no more trials than their
    # worker groups fit, or the extra ones wait for workers until Ray Train gives up on them.
    fit = max(1, resources.placeable(cfg.cpus_per_trial, 1.0 if gpus > 0 else 0.0) // cfg.workers_per_trial)
    driver = {"cpu": 0, "memory": DRIVER_MEMORY}
    return tune.with_resources(trainable, driver), min(fit, cfg.max_concurrent or fit)


def _scheduler(cfg: SweepConfig):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if cfg.scheduler == "asha":
        return ASHAScheduler(time_attr="epoch", max_t=cfg.epochs, grace_period=cfg.asha.grace_period,
                             reduction_factor=cfg.asha.reduction_factor)
    return FIFOScheduler()


def _describe(cfg: SweepConfig, packs, res: cluster.Resources, gpus: float) -> None:
    if packs is None:
        trials = f"{cfg.num_samples} trials proposed by {cfg.search}"
    else:
        n = sum(len(p) for p in packs)
        trials = f"{n} trials in {len(packs)} pack(s) of up to {max(len(p) for p in packs)}"
    print(f"sweep {cfg.name}: {trials}, {cfg.epochs} epochs each, scheduler {cfg.scheduler}, "
          f"{cfg.cpus_per_trial:g} CPU + {gpus:g} GPU per trial process -> {cfg.experiment_dir}", flush=True)
