"""Trials that are themselves distributed: each Tune trial runs a Ray Train TorchTrainer (DDP).

Ray's Tune-over-Train pattern: the Tune trial is a small driver process that
fits a TorchTrainer named after the trial, whose `TuneReportCallback`
forwards rank 0's per-epoch metrics to Tune. Schedulers (ASHA) and searchers
see an ordinary trial. A retried or resumed trial fits the same run name
again, and Ray Train continues it from its latest checkpoint.
"""

from __future__ import annotations

from rayhpc.data import Dataset
from rayhpc.train.config import ModelConfig, TrainConfig
from rayhpc.tune.config import SweepConfig
from rayhpc.tune.trainable import members_of


def trial_train_config(sweep: SweepConfig, hp: dict, trial_id: str, gpu: bool) -> TrainConfig:
    """The training run of one trial: its hyperparameters, the sweep's shape and data."""
    return TrainConfig(
        name=f"train-trial_id={trial_id}", storage_path=sweep.experiment_dir, strategy="ddp",
        num_workers=sweep.workers_per_trial, cpus_per_worker=sweep.cpus_per_trial, gpu=gpu,
        epochs=sweep.epochs, global_batch_size=hp["batch_size"], lr=hp["lr"], optimizer=hp["optimizer"],
        momentum=hp["momentum"], weight_decay=hp["weight_decay"], seed=sweep.seed,
        max_failures=sweep.max_failures, model=ModelConfig(hidden=hp["hidden"]), data=sweep.data,
    )


def train_distributed_trial(config: dict, *, dataset: Dataset, packs, sweep: SweepConfig, gpu: bool) -> None:
    import ray
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from rayhpc.train.trainer import make_trainer

    (hp,) = members_of(config, packs)
    cfg = trial_train_config(sweep, hp, tune.get_context().get_trial_id(), gpu)
    loop_config = {"cfg": cfg.model_dump(mode="json"), "dataset": ray.put(dataset)}
    make_trainer(cfg, loop_config, callbacks=(TuneReportCallback(),), verbose=False).fit()
