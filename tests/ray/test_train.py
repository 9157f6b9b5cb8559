"""Data-parallel training on a real local Ray with gloo: DDP and FSDP proven equal to one process."""

import sys
import time

import pytest
import ray
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from helpers import (
    CPUS,
    EPOCHS,
    assert_same_weights,
    run_job_warm,
    tensorboard_scalars,
    too_many_gpu_workers,
)
from rayhpc.config import Optim, validate
from rayhpc.data import synthetic_tensors
from rayhpc.engine.checkpoint import load_full_state_dict
from rayhpc.models import MLP
from rayhpc.task.batches import epoch_indices
from rayhpc.train.config import TrainConfig
from rayhpc.train.trainer import run_training

# Ray Train runs callbacks in its controller process, which cannot import this test module:
# ship the module's classes by value instead of by reference.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def train_cfg(tmp_path, **kw) -> TrainConfig:
    return validate(TrainConfig, {"storage_path": str(tmp_path), "epochs": EPOCHS, "compute": {"num_workers": 2},
                                  "batch_size_per_worker": 32, "hparams": {"hidden": 16}, **kw})


def one_process(cfg: TrainConfig, batch: int) -> dict:
    """The same model, optimizer and data order in one plain process, `batch` samples per step: the
    mlp task's rows without its 20% hold-out (split by a permutation seeded with split_seed 0)."""
    x, y = synthetic_tensors(cfg.data.synthetic)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    keep = order[round(0.2 * len(x)):]
    torch.manual_seed(cfg.seed)
    model = MLP(6, 16, 2)
    assert cfg.optim == Optim()  # the run takes every job's default optimizer: Adam, lr 0.01
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train = TensorDataset(x[keep], y[keep])
    sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=cfg.seed)
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(train, batch_size=batch, sampler=sampler):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.state_dict()




@pytest.fixture(scope="module")
def ddp_run(ray_address, tmp_path_factory):
    cfg = train_cfg(tmp_path_factory.mktemp("ddp"), name="ddp")
    return run_training(cfg)


def test_ddp_equals_one_process_with_the_global_batch(ddp_run):
    assert_same_weights(load_full_state_dict(ddp_run.checkpoint_dir), one_process(ddp_run.cfg, batch=64))
    epochs = ddp_run.metrics[ddp_run.metrics["kind"] == "epoch"]
    assert epochs["epoch"].tolist() == [1, 2, 3] and set(epochs["world_size"]) == {2}
    assert set(epochs["global_batch_size"]) == {64} and set(epochs["batch_size_per_worker"]) == {32}
    assert (epochs["samples_per_s"] > 0).all() and (epochs["step_ms"] > 0).all()
    assert epochs["loss"].iloc[-1] < 0.8 * epochs["loss"].iloc[0]  # the loss went down
    events = tensorboard_scalars(ddp_run.cfg.experiment_dir / "tensorboard")  # `tensorboard --logdir` reads these
    torch.testing.assert_close(events["epoch/loss"], epochs["loss"].tolist())






def test_shards_partition_the_data_and_reshuffle_every_epoch():
    """Every rank's order is torch's DistributedSampler's (seed, epoch): the shards partition the data."""
    n, world = 41, 2
    for epoch in (0, 1):
        shards = [epoch_indices(n, 5, epoch, rank, world) for rank in range(world)]
        for rank, shard in enumerate(shards):
            sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=5)
            sampler.set_epoch(epoch)
            assert shard == list(sampler)
        assert len(shards[0]) == len(shards[1]) == 21 and set(shards[0] + shards[1]) == set(range(n))
    assert epoch_indices(n, 5, 0, 0, world) != epoch_indices(n, 5, 1, 0, world), "no reshuffle between epochs"


@pytest.mark.parametrize("args, expected", [
    (["--num-workers", str(CPUS + 1), "--cpus-per-worker", "1", "--batch-size-per-worker", "16"],
     f"error: compute.num_workers (--num-workers) {CPUS + 1}: the cluster can place {CPUS} worker(s) of 1 CPU each"),
    too_many_gpu_workers("--num-workers", "--batch-size-per-worker", "16"),
    (["--global-batch-size", "65"], "error: global_batch_size (--global-batch-size) 65: not divisible by "
                                    "compute.num_workers (--num-workers) 2"),
    (["--hp", "hidden=wide"], "error: hparams.hidden (--hp): Input should be a valid integer"),
    (["--hp", "lr=0.1"], "error: hparams.lr (--hp): a platform hyperparameter; set it with --lr"),
    (["--strategy", "zero3"], "error: strategy (--strategy): Input should be 'ddp' or 'fsdp' (got 'zero3')"),
    (["--global-batch-size", "64", "--batch-size-per-worker", "16"], "error: global_batch_size (--global-batch-size) "
                                                                    "64 and batch_size_per_worker"),
    (["--init-from", "/"], "error: init_from (--init-from) /: / is not a sweep's folder (it has no sweep.yaml)"),
])
def test_bad_input_exits_2_within_seconds(args, expected, tmp_path):
    started = time.monotonic()
    proc = run_job_warm("train_mlp.py", "--storage-path", str(tmp_path), *args,
                        env={"RAY_TMPDIR": str(tmp_path / "ray")})
    assert proc.returncode == 2 and proc.stderr.strip().startswith(expected), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert time.monotonic() - started < 30 and not (tmp_path / "ray").exists()


def test_a_run_started_from_a_sweep_trial_begins_with_its_weights(ray_address, tmp_path):
    """`--init-from SWEEP_DIR[:TRIAL_ID]`: a FuncPack member named by id (the padded pack's members:
    tests/unit/test_packed.py) starts the run with its weights and its own task hyperparameters. Proof
    independent of the extraction: at lr 1e-12 the run's first val_loss is the one the sweep's pack
    computed for that member. `SWEEP_DIR` alone names the best trial. Checked: the member index off by
    one, the weights not loaded, or the best taken by the wrong order fail here."""
    from rayhpc.tune.config import SweepConfig
    from rayhpc.tune.sweep import run_sweep
    from rayhpc.tune.weights import trial_weights

    space = {"depth": {"choice": [2, 3]}, "hidden": {"choice": [8, 16]}, "lr": {"loguniform": [0.01, 0.1]}}
    table = run_sweep(validate(SweepConfig, {"storage_path": str(tmp_path), "name": "s", "num_samples": 8,
                                             "epochs": 2, "space": space}))
    best = table.sort_values("best_val_loss").iloc[0]["trial_id"]
    assert trial_weights(str(tmp_path / "s"), ("val_loss", "min")).trial_id == best
    row = table[(table["config.depth"] == 3) & (table["pack_size"] > 1)].iloc[-1]
    cfg = validate(TrainConfig, {"storage_path": str(tmp_path), "name": "t", "epochs": 1, "compute": {"num_workers": 1},
                                 "init_from": f"{tmp_path / 's'}:{row['trial_id']}", "optim": {"lr": 1e-12}})
    result = run_training(cfg, weights=trial_weights(cfg.init_from))
    assert result.cfg.hparams == {"depth": 3, "hidden": row["config.hidden"]}
    torch.testing.assert_close(float(result.metrics["val_loss"].iloc[0]), float(row["val_loss"]), rtol=1e-5, atol=0)
