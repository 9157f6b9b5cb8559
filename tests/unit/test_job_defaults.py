"""One set of defaults: every job that trains a task, a sweep's trials included, starts from the same
optimizer, schedule, batch and seed unless told otherwise (the same hyperparameters give the same run)."""

import pytest

from rayhpc.cli import derived_flags
from rayhpc.config import ConfigError, validate
from rayhpc.parallel.config import ParallelConfig
from rayhpc.ps.config import PSConfig
from rayhpc.task.config import Training
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


JOBS = [TrainConfig, ParallelConfig, PSConfig, SweepConfig]


@pytest.mark.parametrize("job", JOBS)
def test_every_job_has_one_length_batch_kept_checkpoints_and_retries(job):
    """One training section (`rayhpc.task.config.Training`): 10 epochs, a global batch of 32, the latest
    checkpoint kept, 2 restarts, in every job; and the fields are that section's, not re-declared."""
    cfg = job()
    assert (cfg.epochs, cfg.steps, cfg.global_batch_size, cfg.checkpoint.keep, cfg.max_failures) == (10, None, 32, 1, 2)
    assert repr(job.model_fields["epochs"]) == repr(Training.model_fields["epochs"])  # the section's field, described once
    assert {k: job.model_fields[k].default for k in Training.model_fields if k not in ("optim", "schedule")} == \
        {k: f.default for k, f in Training.model_fields.items() if k not in ("optim", "schedule")}


@pytest.mark.parametrize("job", [TrainConfig, PSConfig])
def test_the_batch_is_global_and_a_batch_per_worker_reloads_as_it_was(job):
    """Data-parallel jobs split the global 32 over their workers; a batch given per worker sets the global one,
    so the config a resumed run reloads (its dump) is the same run; disagreeing values are refused."""
    assert (job().per_worker_batch, job(compute={"num_workers": 4}).per_worker_batch) == (16, 8)
    given = job(batch_size_per_worker=32)
    assert (given.global_batch, given.per_worker_batch) == (64, 32)
    again = job(**given.model_dump())
    assert (again.global_batch, again.per_worker_batch) == (64, 32)
    with pytest.raises(ConfigError, match=r"^global_batch_size \(--global-batch-size\) 32 and batch_size_per_worker "
                                          r"\(--batch-size-per-worker\) 32, which is a global batch of 64 on 2 workers"):
        validate(job, {"global_batch_size": 32, "batch_size_per_worker": 32})
    with pytest.raises(ConfigError, match=r"32 \(the default\): not divisible by compute.num_workers"):
        validate(job, {"compute": {"num_workers": 3}})


@pytest.mark.parametrize("job", JOBS)
def test_every_training_flag_is_a_flag_of_every_job(job):
    """`rayhpc tune`, `train`, `parallel` and `ps` take the training section's every flag, for the same key
    (`--accumulate`, `--max-failures`, `--warmup-steps`, ...): the flags are derived from the one section."""
    training = derived_flags(Training)
    assert {"--accumulate", "--max-failures", "--global-batch-size", "--warmup-steps", "--clip-grad-norm",
            "--precision", "--steps", "--epochs", "--compile"} <= set(training)
    assert {flag: derived_flags(job).get(flag) for flag in training} == training


def test_a_batch_per_worker_given_as_a_flag_sets_the_global_batch():
    """Flags come as text: `--batch-size-per-worker 32 --num-workers 4` is a global batch of 128."""
    cfg = validate(TrainConfig, {"batch_size_per_worker": "32", "compute": {"num_workers": "4"}})
    assert (cfg.global_batch, cfg.per_worker_batch) == (128, 32)
