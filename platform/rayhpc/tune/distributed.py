"""Trials that are themselves distributed: each Tune trial runs a Ray Train TorchTrainer (DDP).

Ray's Tune-over-Train pattern: the Tune trial is a small driver process that
fits a TorchTrainer named after the trial, whose `TuneReportCallback`
forwards rank 0's per-epoch metrics to Tune. Schedulers (ASHA) and searchers
see an ordinary trial. A retried or resumed trial fits the same run name
again, and Ray Train continues it from its latest checkpoint.
"""

from __future__ import annotations

import logging

from rayhpc.config import Compute, Optim, Schedule
from rayhpc.task.hparams import PLATFORM_KEYS
from rayhpc.task.load import LoadedTask
from rayhpc.train.config import TrainConfig
from rayhpc.train.trainer import make_trainer
from rayhpc.tune.config import SweepConfig
from rayhpc.tune.trainable import members_of


def trial_train_config(sweep: SweepConfig, hp: dict, trial_id: str, gpu: bool) -> TrainConfig:
    """The training run of one trial: its hyperparameters, the sweep's task, shape and data."""
    return TrainConfig(
        name=f"train-trial_id={trial_id}", storage_path=sweep.experiment_dir, task=sweep.task, strategy=sweep.strategy,
        compute=Compute(num_workers=sweep.workers_per_trial, cpus_per_worker=sweep.cpus_per_trial, gpu=gpu),
        epochs=sweep.epochs, steps=sweep.steps, global_batch_size=hp["batch_size"], seed=hp["seed"],
        optim=Optim(**{k: hp[k] for k in Optim.model_fields}),
        schedule=Schedule(**{k: hp[k] for k in Schedule.model_fields}),
        accumulate=hp["accumulate"],
        max_failures=sweep.max_failures, data=sweep.data, precision=sweep.precision, compile=sweep.compile,
        activation_checkpointing=sweep.activation_checkpointing,
        hparams={k: v for k, v in hp.items() if k not in PLATFORM_KEYS},
    )


def train_distributed_trial(config: dict, *, task: LoadedTask, packs, sweep: SweepConfig, defaults: dict,
                            gpu: bool) -> None:
    from ray import tune  # Ray: only where a cluster is used (config checks and --help stay fast)
    from ray.tune.integration.ray_train import TuneReportCallback

    (member,) = members_of(config, packs)
    hp = {**defaults, **member}
    cfg = trial_train_config(sweep, hp, tune.get_context().get_trial_id(), gpu)
    make_trainer(cfg, task, hp, callbacks=(TuneReportCallback(),), log_level=logging.DEBUG).fit()
