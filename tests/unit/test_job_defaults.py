"""One set of defaults: every job that trains a task, a sweep's trials included, starts from the same
optimizer, schedule, batch and seed unless told otherwise (the same hyperparameters give the same run)."""

import pytest

from rayhpc.parallel.config import ParallelConfig
from rayhpc.ps.config import PSConfig
from rayhpc.task.hparams import PlatformHParams
from rayhpc.train.config import TrainConfig
from rayhpc.tune.config import SweepConfig


@pytest.mark.parametrize("job", [TrainConfig, ParallelConfig, PSConfig, SweepConfig])
def test_every_job_defaults_to_adam_at_lr_0_01_with_no_schedule(job):
    cfg = job()
    assert (cfg.optim.optimizer, cfg.optim.lr, cfg.optim.momentum, cfg.optim.clip_grad_norm) == ("adam", 0.01, 0.0, None)
    assert (cfg.schedule.warmup_steps, cfg.schedule.decay) == (0, "constant")
    assert cfg.optim.model_dump() == TrainConfig().optim.model_dump()


def test_a_sweep_trials_default_hyperparameters_are_the_training_jobs():
    trial, run = PlatformHParams(), TrainConfig()
    assert {k: getattr(trial, k) for k in run.optim.model_dump()} == run.optim.model_dump()
    assert (trial.batch_size, trial.seed, trial.accumulate) == (32, run.seed, run.accumulate)


@pytest.mark.parametrize("job", [TrainConfig, PSConfig, SweepConfig])
def test_every_job_that_recovers_retries_twice(job):
    assert job().max_failures == 2
