"""The parameter server on a real local Ray: sync equals DDP (a plain-PyTorch two-rank reference), async
with K = 0 equals sync, bounded staleness holds and converges, and killed workers and servers recover."""

import math
import os
import signal
import subprocess
import sys
import time

import pytest
import ray
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from helpers import ROOT, run_job_warm, tensorboard_scalars
from rayhpc.config import validate
from rayhpc.data import synthetic_tensors
from rayhpc.engine.checkpoint import load_full_state_dict
from rayhpc.models import MLP
from rayhpc.ps.config import PSConfig
from rayhpc.ps.driver import run_ps

EPOCHS = 2
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
# the shipped example whose last worker sleeps in every training step, so that async workers drift apart
STRAGGLER = f"{ROOT / 'jobs' / 'tasks' / 'straggler.py'}:Straggler"
SLOW = {"hidden": 16, "straggler_ms": 30}
DROPOUT = f"{ROOT / 'tests' / 'tasks' / 'dropout.py'}:Dropout"


SGD = {"optimizer": "sgd", "lr": 0.05}  # Downpour's optimizer: async applies each worker's gradient as it comes


def ps_cfg(tmp_path, **kw) -> PSConfig:
    return validate(PSConfig, {"storage_path": str(tmp_path), "epochs": EPOCHS, "compute": {"num_workers": 2},
                               "batch_size_per_worker": 32, "hparams": {"hidden": 16}, **kw})


def warmup_cosine(step: int, total: int, warmup: int, decay: str = "cosine") -> float:
    """The lr factor: linear warm-up to 1 over `warmup` steps, then a cosine down to 0 at the last step
    (or constant)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - 1 - warmup))) if decay == "cosine" else 1.0


def two_ranks(cfg: PSConfig) -> dict:
    """DDP with 2 ranks in one plain process: each rank's DistributedSampler batch, the mean of the two
    gradients, one step of torch's own optimizer (the mlp task's rows without its 20% hold-out, split seed 0),
    for `steps` (the last epoch cut short) or `epochs`, the lr set by `warmup_cosine`."""
    x, y = synthetic_tensors(cfg.data.synthetic)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train = TensorDataset(x[order[round(0.2 * len(x)):]], y[order[round(0.2 * len(x)):]])
    torch.manual_seed(cfg.seed)
    model = MLP(6, 16, 2)
    o, schedule = cfg.optim, cfg.schedule
    assert schedule.decay in ("constant", "cosine") and not schedule.min_lr_ratio, schedule
    opt = {"sgd": lambda p: torch.optim.SGD(p, lr=o.lr, momentum=o.momentum),
           "adam": lambda p: torch.optim.Adam(p, lr=o.lr),
           "adamw": lambda p: torch.optim.AdamW(p, lr=o.lr, weight_decay=o.weight_decay)}[o.optimizer](
        model.parameters())
    samplers = [DistributedSampler(train, num_replicas=2, rank=r, shuffle=True, seed=cfg.seed) for r in (0, 1)]
    per_epoch = -(-len(samplers[0]) // 32)
    total, clipped = cfg.steps or cfg.epochs * per_epoch, []
    for step in range(total):
        if step % per_epoch == 0:
            for s in samplers:
                s.set_epoch(step // per_epoch)
            loaders = zip(*(DataLoader(train, batch_size=32, sampler=s) for s in samplers))
        opt.param_groups[0]["lr"] = o.lr * warmup_cosine(step, total, schedule.warmup_steps, schedule.decay)
        grads = []
        for bx, by in next(loaders):
            model.zero_grad()
            F.mse_loss(model(bx), by).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        if o.clip_grad_norm:
            clipped.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad_norm)) > o.clip_grad_norm)
        opt.step()
    assert not o.clip_grad_norm or 0 < sum(clipped) < total, f"clipping bit on {sum(clipped)} of {total} steps"
    return dict(model.named_parameters())


def assert_same_weights(got: dict, want: dict, **tol) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key].detach(), msg=lambda m: f"{key}: {m}", **tol)


def test_sync_with_adamw_warm_up_cosine_clipping_accumulation_and_steps_equals_ddp(ray_address, tmp_path):
    """Sync is DDP with the same data order: 40 steps of 26 an epoch (the second epoch cut short); accumulation 2
    leaves the step as it is; the mean gradient is clipped by its norm over both servers' shards on some steps,
    not all; every gradient is of the step's weights (staleness 0)."""
    cfg = ps_cfg(tmp_path, epochs=None, steps=40, accumulate=2, compute={"num_workers": 2, "num_servers": 2},
                 optim={"optimizer": "adamw", "lr": 0.01, "weight_decay": 0.1, "clip_grad_norm": 0.5},
                 schedule={"warmup_steps": 5, "decay": "cosine"})
    result = run_ps(cfg)
    want = two_ranks(cfg)
    assert_same_weights(result.weights, want)
    # the last checkpoint reads as the whole model, as every job's does (one flat shard per server)
    assert_same_weights(load_full_state_dict(result.checkpoint), want)
    # the parameters really are sharded: every server holds a part, the parts cover the model once
    sizes = result.layout.sizes()
    assert len(sizes) == 2 and all(s > 0 for s in sizes) and sum(sizes) == 6 * 16 + 16 + 16 * 2 + 2
    assert result.metrics["global_step"].tolist() == [26, 40] and len(result.steps) == 2 * 40
    assert (result.steps["staleness"] == 0).all()
    torch.testing.assert_close(result.metrics["lr"].tolist(), [0.01 * warmup_cosine(s, 40, 5) for s in (25, 39)])
    events = tensorboard_scalars(cfg.experiment_dir / "tensorboard")
    torch.testing.assert_close(events["epoch/val_loss"], result.metrics["val_loss"].tolist())
    # every job's manager: each server's shard a checkpoint of its own, the step's progress file written last
    assert sorted(p.name for p in result.checkpoint.iterdir()) == ["progress.json", "server_0", "server_1"]
    assert sorted(p.name for p in (result.checkpoint / "server_1").iterdir()) == [
        "extra.pt", "model.pt", "progress.json", "rng.pt"]


def test_async_without_staleness_equals_sync(ray_address, tmp_path):
    """With K = 0 every worker pulls the weights after every gradient of the step before; each gradient,
    a worker's share of the batch, is applied as it arrives: with plain SGD that is sync's mean step."""
    cfg = ps_cfg(tmp_path, mode="async", staleness=0, compute={"num_workers": 2, "num_servers": 2}, optim=SGD)
    result = run_ps(cfg)
    assert_same_weights(result.weights, two_ranks(cfg))
    assert (result.steps["staleness"] == 0).all()


@pytest.fixture(scope="module")
def sync_slow(ray_address, tmp_path_factory):
    return run_ps(ps_cfg(tmp_path_factory.mktemp("sync"), task=STRAGGLER, epochs=4, hparams=SLOW, optim=SGD))


@pytest.mark.parametrize("staleness", [2, None])
def test_async_staleness_stays_within_its_bound_and_converges_near_sync(sync_slow, tmp_path, staleness):
    cfg = ps_cfg(tmp_path, task=STRAGGLER, epochs=4, mode="async", staleness=staleness, hparams=SLOW, optim=SGD)
    result = run_ps(cfg)
    seen = int(result.steps["staleness"].max())
    if staleness is None:
        assert seen > 2, "unbounded async never ran ahead: the slow worker did not slow it"
    else:
        assert 0 < seen <= staleness, seen
    assert result.metrics["staleness_max"].max() == seen
    sync_val, async_val = sync_slow.metrics["val_loss"].iloc[-1], result.metrics["val_loss"].iloc[-1]
    assert async_val <= 1.10 * sync_val, (async_val, sync_val)


def kill_pid(actor) -> int:
    pid = ray.get(actor.info.remote())["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def kill_once(which: str, index: int):
    """on_epoch hook: SIGKILL `which` (a worker or server) `index` when worker 0 finishes epoch 1; a worker
    when it finishes its own epoch 1, a few steps into the epoch it was just given (an async worker may have
    ended every epoch by the time worker 0 ends its first, on a loaded machine: killed idle, nothing fails)."""
    killed = []
    when = index if which == "worker" else 0

    def hook(worker, epoch, fleet):
        if not killed and worker == when and epoch == 0:
            if which == "worker":  # a sync worker may wait for worker 0's next epoch, which this hook holds
                pushed = lambda: ray.get(fleet.servers[0].info.remote())["pushed"][index]  # noqa: E731
                start, deadline = pushed(), time.monotonic() + 5
                while pushed() < start + 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
            killed.append(kill_pid((fleet.workers if which == "worker" else fleet.servers)[index]))
    return hook, killed


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_killed_worker_is_replaced_and_the_run_finishes(ray_address, tmp_path, mode):
    cfg = ps_cfg(tmp_path, mode=mode, epochs=3, optim={"lr": 0.05, "momentum": 0.9})
    hook, killed = kill_once("worker", 1)
    result = run_ps(cfg, on_epoch=hook)
    assert killed and len(result.failures) == 1 and result.failures[0].startswith("worker 1 failed")
    assert result.metrics["epoch"].tolist() == [1, 2, 3]
    steps = result.metrics["global_step"].iloc[-1]
    assert sorted(zip(result.steps["worker"], result.steps["step"])) == [(w, s) for w in (0, 1) for s in range(steps)]
    # killed mid-epoch: the steps it pushed but never reported are rows marked lost, not holes
    assert set(result.steps.loc[result.steps["lost"], "worker"]) <= {1} and result.metrics["loss"].notna().all()
    if mode == "sync":  # the step the dead worker left half-done was redone: as if nothing happened
        assert_same_weights(result.weights, two_ranks(cfg))


def test_a_killed_server_restarts_everything_from_the_checkpoint(ray_address, tmp_path):
    """Killed after the first epoch (26 steps), restarted from a checkpoint inside the 40-step warm-up."""
    cfg = ps_cfg(tmp_path, epochs=3, compute={"num_workers": 2, "num_servers": 2}, checkpoint={"every": 10},
                 optim={"optimizer": "adam", "lr": 0.01}, schedule={"warmup_steps": 40, "decay": "cosine"})
    hook, killed = kill_once("server", 1)
    result = run_ps(cfg, on_epoch=hook)
    assert killed and len(result.failures) == 1, result.failures
    assert result.failures[0].startswith("server(s) [1] died") and "checkpoint_0000" in result.failures[0]
    assert result.metrics["epoch"].tolist() == [1, 2, 3]
    assert_same_weights(result.weights, two_ranks(cfg))  # sync from a checkpoint with Adam's state: no difference


@pytest.mark.newest  # CI: beside the Slurm tests (pyproject's markers)
def test_resume_writes_the_row_of_an_epoch_that_ended_in_the_checkpoint(ray_address, tmp_path):
    """A driver killed after the servers' epoch-end checkpoint but before the epoch's row: the resumed
    run validates that checkpoint and writes the row (here: the row cut from a finished run)."""
    cfg = ps_cfg(tmp_path, compute={"num_workers": 2, "num_servers": 2})
    first = run_ps(cfg)
    path = cfg.experiment_dir / "metrics.parquet"
    first.metrics[first.metrics["epoch"] == 1].to_parquet(path, index=False)
    again = run_ps(cfg.model_copy(update={"resume": True}))
    assert again.metrics["epoch"].tolist() == [1, 2]
    assert again.metrics["val_loss"].iloc[-1] == pytest.approx(first.metrics["val_loss"].iloc[-1], rel=1e-6)
    assert_same_weights(again.weights, first.weights)


def test_pulled_shards_are_object_store_views(ray_address, tmp_path):
    """A shard above Ray's inline limit (100 KiB) reaches the worker as a read-only view of the object
    store: no copy besides the one into the model."""
    result = run_ps(ps_cfg(tmp_path, epochs=1, hparams={"hidden": 256, "depth": 3}))
    assert result.steps["zero_copy"].all()
    assert result.steps["bytes"].iloc[0] == 2 * 4 * sum(p.numel() for p in result.weights.values())


def test_workers_and_servers_export_their_series(ray_cluster, tmp_path):
    from helpers import scrape

    job = subprocess.Popen([sys.executable, str(ROOT / "jobs" / "train_ps.py"), "--address", ray_cluster["gcs_address"],
                            "--task", STRAGGLER, "--hp", "straggler_ms=30", "--name", "watched-ps", "--mode", "async", "--staleness", "3",
                            "--num-servers", "2", "--epochs", "1000", "--storage-path", str(tmp_path)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    names = {"worker": ("rayhpc_ps_pull_seconds", "rayhpc_ps_push_seconds", "rayhpc_ps_staleness_steps"),
             "server": ("rayhpc_ps_server_wait_seconds", "rayhpc_ps_server_apply_seconds", "rayhpc_ps_server_updates")}
    try:
        deadline, seen = time.monotonic() + 120, {}
        # every series of both workers and both servers, and updates applied (a series appears before its first)
        while any(len(seen.get(n, {})) < 2 for role in names.values() for n in role) or \
                not all(v > 0 for v in seen["rayhpc_ps_server_updates"].values()):
            assert job.poll() is None and time.monotonic() < deadline, f"series missing after 120 s: {seen}"
            time.sleep(2)
            samples = scrape(ray_cluster)
            seen = {name: {s.labels.get("worker") or s.labels.get("server"): s.value for s in samples.get(name, [])
                           if s.labels["run"] == "watched-ps"} for role in names.values() for name in role}
    finally:
        job.send_signal(signal.SIGINT)
        job.wait(timeout=60)
    assert all(set(seen[n]) == {"0", "1"} for role in names.values() for n in role), seen
    assert all(v > 0 for v in seen["rayhpc_ps_pull_seconds"].values()) and \
        all(v > 0 for v in seen["rayhpc_ps_server_updates"].values())
    assert max(seen["rayhpc_ps_staleness_steps"].values()) <= 3


@pytest.mark.parametrize("args, expected", [
    (["--staleness", "2"], "error: staleness (--staleness) 2: only for mode async (--mode async)"),
    (["--num-servers", "1000000"], "error: compute.num_servers (--num-servers) 1000000: more than the model's"),
    (["--mode", "downpour"], "error: mode (--mode): Input should be 'sync' or 'async' (got 'downpour')"),
    (["--hp", "lr=0.1"], "error: hparams.lr (--hp): a platform hyperparameter; set it with --lr"),
    (["--clip-grad-norm", "1", "--mode", "async"],
     "error: optim.clip_grad_norm (--clip-grad-norm) 1.0: only for mode sync, which clips each step's mean gradient"),
])
def test_bad_input_exits_2_before_ray_starts(args, expected, tmp_path):
    proc = run_job_warm("train_ps.py", "--storage-path", str(tmp_path), *args)
    assert proc.returncode == 2 and proc.stderr.startswith(expected), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "ray: started" not in proc.stdout
