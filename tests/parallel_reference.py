"""The same training as a model-parallel run, in one process on the unsharded model: what
tests compare every parallel layout against."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from rayhpc.parallel.config import ParallelConfig
from rayhpc.parallel.trainer import make_recipe


def reference_run(cfg: ParallelConfig) -> tuple[list[float], dict[str, torch.Tensor], dict[str, float] | None]:
    """(loss per step, final weights by name, final validation loss and task metrics or None): same seed,
    the same optimizer, schedule and clipping from torch's own classes, the whole global batch at once
    (what `accumulate` micro-batches must add up to), the batches of a plain script's
    `DataLoader(sampler=DistributedSampler(shuffle=True, seed=seed))` with `set_epoch`, the last partial
    (for data-parallel layouts, tests use training data that the replicas divide evenly)."""
    recipe, data = make_recipe(cfg)
    cfg = recipe.cfg  # its steps resolved
    # with the ranks' torch threads (`rayhpc.workers`): a reduction split over other threads rounds otherwise
    # (oneDNN's convolution backward on AVX-512 CPUs: 2e-4 in the traced ResNet's first convolution after 7
    # steps, 1 thread against 2, which BatchNorm's backward amplifies), past fp32's tolerance
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, int(cfg.compute.cpus_per_worker or 1)))
    try:
        return _reference_run(cfg, recipe, data)
    finally:
        torch.set_num_threads(before)


def _reference_run(cfg: ParallelConfig, recipe, data) -> tuple[list[float], dict[str, torch.Tensor], dict | None]:
    torch.manual_seed(cfg.seed)
    model = recipe.build()
    optimizer = plain_optimizer(cfg, model.parameters())
    schedule = plain_schedule(cfg, optimizer)
    losses = []
    for x, y in batches(TensorDataset(*data["train"]), cfg.global_batch_size, cfg.seed, cfg.steps):
        optimizer.zero_grad()
        loss = recipe.loss(model(x), y)
        loss.backward()
        if cfg.optim.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad_norm)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return losses, weights, validation(recipe, model, data["val"])


def batches(dataset, batch_size: int, seed: int, steps: int):
    """The first `steps` batches of a plain epoch loop over `dataset`."""
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for batch in DataLoader(dataset, batch_size=batch_size, sampler=sampler):
            if steps == 0:
                return
            steps -= 1
            yield batch
        epoch += 1


def plain_optimizer(cfg: ParallelConfig, params) -> torch.optim.Optimizer:
    """The optimizer the user chose, made here from the config itself (not from the run's recipe), so a
    run that trained with another optimizer, or without its state, differs from this reference."""
    o = cfg.optim
    if o.optimizer == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[o.optimizer]
    return cls(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)


def plain_schedule(cfg: ParallelConfig, optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """torch's own schedulers: a linear warm-up from lr / (warmup + 1), then a cosine or linear decay to
    min_lr_ratio x lr at the last step, or the constant peak."""
    sched, s = torch.optim.lr_scheduler, cfg.schedule
    warmup = round(s.warmup_fraction * cfg.steps) if s.warmup_fraction is not None else s.warmup_steps
    decay_steps = max(1, cfg.steps - 1 - warmup)
    decay = {"constant": lambda: sched.ConstantLR(optimizer, factor=1.0, total_iters=0),
             "cosine": lambda: sched.CosineAnnealingLR(optimizer, T_max=decay_steps, eta_min=s.min_lr_ratio * cfg.optim.lr),
             "linear": lambda: sched.LinearLR(optimizer, 1.0, s.min_lr_ratio, total_iters=decay_steps)}[s.decay]()
    if not warmup:
        return decay
    rise = sched.LinearLR(optimizer, start_factor=1 / (warmup + 1), end_factor=1.0, total_iters=warmup)
    return sched.SequentialLR(optimizer, [rise, decay], milestones=[warmup])


@torch.no_grad()
def validation(recipe, model, val) -> dict[str, float] | None:
    """Mean loss and task metrics over every validation sample (all at once: the loss is a mean), in eval mode
    (BatchNorm's running statistics)."""
    if val is None:
        return None
    xv, yv = val
    with torch.no_grad():
        output = model.eval()(xv)
    scores = {"val_loss": recipe.loss(output, yv), **{f"val_{k}": v for k, v in recipe.metrics(output, yv).items()}}
    return {name: float(value) for name, value in scores.items()}
