"""A task's own `optimizer(params, hp)` and `scheduler(optimizer, hp)`: every runner steps them (the
scheduler once per optimizer step), and a resumed run continues the schedule where it was. The task
(tests/tasks/own_optim.py) uses RMSprop and StepLR; each reference here is torch's RMSprop and StepLR
in one plain process on the whole batch."""

from __future__ import annotations

import itertools
import logging
import shutil

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from helpers import ROOT, KillWorkerOnce, assert_same_weights, run_job_warm
from rayhpc.config import validate
from rayhpc.data import DataConfig
from rayhpc.engine import train_step
from rayhpc.engine.checkpoint import load_full_state_dict
from rayhpc.engine.step import batch_size_of
from rayhpc.parallel import ParallelConfig, run_parallel
from rayhpc.task import task_for
from rayhpc.train.config import TrainConfig
from rayhpc.train.trainer import run_training
from rayhpc.tune.packing import SinglePack, packing_problem
from rayhpc.tune.trainable import trained_pack

OWN = f"{ROOT}/tests/tasks/own_optim.py:OwnOptim"
LR = 0.01


def plain(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.RMSprop(model.parameters(), lr=LR, alpha=0.9)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


def dataset():
    return task_for(OWN, DataConfig()).obj.data({})[0]


def plain_step(model, optimizer, scheduler, x, y) -> None:
    optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    scheduler.step()


def test_ddp_with_the_tasks_optimizer_and_scheduler_killed_and_resumed_equals_one_plain_process(ray_address,
                                                                                                 tmp_path):
    """A worker killed after the checkpoint of step 12 (of 8 per epoch, 24 in all): the group resumes from it,
    its new StepLR replayed to step 12 (the lr halved four times on the way)."""
    cfg = validate(TrainConfig, {"storage_path": str(tmp_path), "task": OWN, "epochs": 3, "optim": {"lr": LR},
                                 "compute": {"num_workers": 2}, "batch_size_per_worker": 16,
                                 "checkpoint": {"every": 4}})
    run = run_training(cfg, callbacks=(KillWorkerOnce(step=12, log=str(tmp_path / "reports.jsonl")),))
    assert '"kill": true' in (tmp_path / "reports.jsonl").read_text()
    train = dataset()
    model, optimizer, scheduler = plain()
    sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=0)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(train, batch_size=32, sampler=sampler):
            plain_step(model, optimizer, scheduler, x, y)
    assert_same_weights(load_full_state_dict(run.checkpoint_dir), model.state_dict())


def test_the_model_parallel_job_steps_them_and_resumes_them(ray_address, tmp_path):
    """FSDP2 over 2 ranks, 8 steps, resumed from the step-4 checkpoint."""
    cfg = ParallelConfig(task=OWN, parallelism={"fsdp": 2}, optim={"lr": LR}, steps=8, global_batch_size=32,
                         checkpoint={"every": 4, "keep": 2}, storage_path=tmp_path)
    full = run_parallel(cfg, log_level=logging.DEBUG)
    shutil.rmtree(full.checkpoint)
    resumed = run_parallel(cfg.model_copy(update={"resume": True}), log_level=logging.DEBUG)
    assert len(resumed.step_seconds) == 4, "the resumed run did not start from step 4"
    model, optimizer, scheduler = plain()
    sampler = DistributedSampler(dataset(), num_replicas=1, rank=0, shuffle=True, seed=0)
    for x, y in itertools.islice(DataLoader(dataset(), batch_size=32, sampler=sampler), 8):  # epoch 0: 10 batches
        plain_step(model, optimizer, scheduler, x, y)
    assert_same_weights(resumed.weights, dict(model.named_parameters()))


def test_an_unpacked_trial_steps_them_and_a_restored_one_replays_the_schedule():
    """A sweep trains such a task's trials one at a time (a pack steps only the platform's optimizers): 10
    steps, the process replaced after 5 by one that restores the model and the optimizer's state."""
    task = task_for(OWN, DataConfig())
    hp = {"lr": LR, "seed": 0, "batch_size": 32, "accumulate": 1, "width": 8}
    assert packing_problem(task, hp, None) == "it brings its own optimizer() and scheduler()"
    x, y = (torch.stack(t) for t in zip(*dataset()))
    batches = [(x[i:i + 32], y[i:i + 32]) for i in range(0, 320, 32)][:8] * 2
    pack = SinglePack(task, task.initial_model(hp))
    opt = pack.optimizer([hp])
    trained = trained_pack(pack, opt, [hp], 0)
    for step in range(5):
        train_step(trained, batches[step], 1, step, 10)
    again = SinglePack(task, task.initial_model(hp))
    again.load_state_dict(pack.state_dict())
    opt_again = again.optimizer([hp])
    opt_again.load_state_dict(opt.state_dict())
    trained = trained_pack(again, opt_again, [hp], 5)  # its scheduler made at the step it resumes at
    for step in range(5, 10):
        train_step(trained, batches[step], 1, step, 10)
    model, optimizer, scheduler = plain()
    for step in range(10):
        plain_step(model, optimizer, scheduler, *batches[step])
    assert batch_size_of(batches[0]) == 32 and optimizer.param_groups[0]["lr"] == LR / 8  # halved at 3, 6, 9
    assert_same_weights(again.state_dict(), model.state_dict())


def test_the_parameter_server_refuses_a_task_with_its_own_optimizer(tmp_path):
    out = run_job_warm("train_ps.py", "--task", OWN, "--storage-path", str(tmp_path))
    assert out.returncode == 2 and out.stderr.startswith(
        f"error: task (--task) {OWN}: brings its own optimizer() and scheduler(); the parameter server"), out.stderr
