"""The per-worker training loop that Ray Train's TorchTrainer runs on every rank."""

from __future__ import annotations

import dataclasses
import socket
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from rayhpc.data import Dataset
from rayhpc.models import MLP
from rayhpc.monitor.metrics import WorkerMetrics
from rayhpc.train import checkpoint
from rayhpc.train.config import TrainConfig
from rayhpc.train.parallelize import parallelize


def build_model(cfg: TrainConfig, dataset: Dataset) -> MLP:
    """The same initial weights on every rank (and in a single-process reference run)."""
    torch.manual_seed(cfg.seed)
    return MLP(dataset.in_features, cfg.model.hidden, dataset.out_features, cfg.model.depth)


def make_optimizer(cfg: TrainConfig, params) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.effective_lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.effective_lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def make_sampler(dataset: Dataset, cfg: TrainConfig, rank: int, world: int) -> DistributedSampler:
    """Rank `rank`'s shard of a permutation drawn from (seed, epoch): reshuffled by `set_epoch`.

    Built here rather than by `prepare_data_loader` so that `--seed` reaches it
    (Ray's own sampler always uses seed 0); a single worker gets one too, so
    its order is the same function of the epoch.
    """
    train = TensorDataset(dataset.x_train, dataset.y_train)
    return DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)


@dataclasses.dataclass
class Worker:
    """One rank's training state."""

    cfg: TrainConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sampler: DistributedSampler
    loader: DataLoader
    val: tuple[torch.Tensor, torch.Tensor]
    device: torch.device
    rank: int
    world: int
    progress: checkpoint.Progress
    first_step_time: float | None = None  # unix time

    def __post_init__(self):
        self.gauges = WorkerMetrics(self.cfg.name, self.rank)  # this rank's Prometheus gauges

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        autocast = self.cfg.use_bf16 and self.cfg.strategy == "ddp" and self.device.type == "cuda"
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = self.model(x)
        return F.mse_loss(out.float(), y)  # FSDP's bf16 policy returns bf16 outputs

    @torch.no_grad()
    def val_loss(self) -> float:
        # every rank evaluates the whole split: FSDP's forward is collective anyway
        return self.loss(*self.val).item()

    def report(self, metrics: dict, with_checkpoint: bool) -> None:
        self.gauges.record(metrics["loss"], metrics["worker_samples_per_s"], metrics["step_ms"] / 1000, self.device)
        if with_checkpoint:
            checkpoint.report(metrics, strategy=self.cfg.strategy, model=self.model, optimizer=self.optimizer,
                              progress=self.progress, rank=self.rank)
        else:
            import ray.train

            ray.train.report(metrics)


def train_loop_per_worker(config: dict) -> None:
    """Entry point for `TorchTrainer(train_loop_per_worker, train_loop_config={"cfg": ..., "dataset": ...})`."""
    import ray
    import ray.train
    from ray.train.torch import get_device, prepare_data_loader

    _quiet_report_logs()
    cfg = TrainConfig.model_validate(config["cfg"])
    dataset: Dataset = config["dataset"] if isinstance(config["dataset"], Dataset) else ray.get(config["dataset"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))
    device = get_device()
    model = parallelize(build_model(cfg, dataset), cfg.strategy, device, cfg.use_bf16)
    optimizer = make_optimizer(cfg, model.parameters())
    progress = checkpoint.restore(ray.train.get_checkpoint(), strategy=cfg.strategy, model=model,
                                  optimizer=optimizer, device=device) or checkpoint.Progress()
    sampler = make_sampler(dataset, cfg, rank, world)
    loader = DataLoader(sampler.dataset, batch_size=cfg.per_worker_batch, sampler=sampler)
    # keeps our DistributedSampler; moves each batch to the worker's device
    loader = prepare_data_loader(loader)
    val = (dataset.x_val.to(device), dataset.y_val.to(device))
    worker = Worker(cfg, model, optimizer, sampler, loader, val, device, rank, world, progress)
    for epoch in range(progress.epoch, cfg.epochs):
        run_epoch(worker, epoch)


def _quiet_report_logs() -> None:
    """Silence Ray Train's per-report INFO line on workers (one per rank per report).

    Ray 2.60 names that logger after its file path (`logging.getLogger(__file__)`),
    so `LoggingConfig(log_level=...)`, which filters `ray.train.*`, misses it.
    """
    import logging
    import os

    import ray.train

    path = os.path.join(os.path.dirname(ray.train.__file__), "v2", "_internal", "execution", "context.py")
    logging.getLogger(path).setLevel(logging.WARNING)


def run_epoch(w: Worker, epoch: int) -> None:
    """Train one epoch (or its remainder after a restore) and report it with a checkpoint."""
    cfg, p = w.cfg, w.progress
    w.sampler.set_epoch(epoch)
    skip = p.step_in_epoch  # steps of this epoch done before a restore: same order, so skip them
    totals = torch.zeros(2, device=w.device)  # summed batch losses, samples
    steps, started = 0, time.perf_counter()
    for i, (x, y) in enumerate(w.loader):
        if i < skip:
            continue
        loss = w.loss(x, y)
        w.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        w.optimizer.step()
        if w.first_step_time is None:  # when training really began in this worker group (start-up benchmarks)
            w.first_step_time = time.time()
        totals += torch.stack([loss.detach() * len(x), torch.tensor(float(len(x)), device=w.device)])
        steps += 1
        p.step_in_epoch, p.global_step = i + 1, p.global_step + 1
        ckpt = cfg.checkpoint_every_steps and p.global_step % cfg.checkpoint_every_steps == 0
        rows = cfg.metrics_every_steps and p.global_step % cfg.metrics_every_steps == 0
        if (ckpt or rows) and i + 1 < len(w.loader):
            p.train_seconds += time.perf_counter() - started
            w.report({"kind": "step", **_rates(w, totals, steps, time.perf_counter() - started, epoch)}, bool(ckpt))
            started, totals, steps = time.perf_counter(), torch.zeros_like(totals), 0
    if w.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    p.train_seconds += seconds
    metrics = _rates(w, totals, steps, seconds, epoch)
    val = w.val_loss()
    p.epoch, p.step_in_epoch, p.best_val_loss = epoch + 1, 0, min(p.best_val_loss, val)
    w.report({"kind": "epoch", **metrics, "epoch": epoch + 1, "val_loss": val, "best_val_loss": p.best_val_loss},
             with_checkpoint=True)


def _rates(w: Worker, totals: torch.Tensor, steps: int, seconds: float, epoch: int) -> dict:
    """Loss and throughput over all ranks since the last report."""
    own_samples = float(totals[1])
    if dist.is_initialized() and w.world > 1:
        totals = totals.clone()
        dist.all_reduce(totals)
    loss_sum, samples = totals.tolist()
    return {
        "epoch": epoch + 1,  # the (1-based) epoch this row belongs to
        "global_step": w.progress.global_step,
        "loss": loss_sum / max(samples, 1),
        "samples_per_s": samples / seconds if seconds > 0 else 0.0,
        "worker_samples_per_s": own_samples / seconds if seconds > 0 else 0.0,  # this rank's
        "step_ms": 1000 * seconds / max(steps, 1),
        "train_seconds": w.progress.train_seconds,
        "world_size": w.world,
        "global_batch_size": w.cfg.global_batch,
        "batch_size_per_worker": w.cfg.per_worker_batch,
        "lr": w.cfg.effective_lr,
        "node": socket.gethostname(),
        "first_step_time": w.first_step_time,
    }

