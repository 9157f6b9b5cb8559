"""One trial trained the plain PyTorch way: `nn.Module` + `torch.optim`, one process.

This is what a Slurm array task does today, so it is the baseline of the
sweep benchmark, and the reference that a packed trial must equal (a test
checks each pack member against it with `assert_close`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from rayhpc.data import Dataset, epoch_order
from rayhpc.tune.trainable import init_member


def make_optimizer(hp: dict, params) -> torch.optim.Optimizer:
    if hp["optimizer"] == "sgd":
        return torch.optim.SGD(params, lr=hp["lr"], momentum=hp["momentum"], weight_decay=hp["weight_decay"])
    return torch.optim.Adam(params, lr=hp["lr"], weight_decay=hp["weight_decay"])


def train_single(hp: dict, dataset: Dataset, epochs: int, seed: int, on_epoch: Callable | None = None) -> dict:
    """Train one trial for `epochs`; returns its final model and losses.

    `on_epoch(epoch, val_loss, best_val_loss, model)` runs after each epoch
    (the plain Ray Tune baseline reports and checkpoints there).
    """
    entered = time.perf_counter()
    model = init_member(dataset.in_features, hp["hidden"], dataset.out_features, seed)
    opt = make_optimizer(hp, model.parameters())
    x, y = dataset.x_train, dataset.y_train
    best = float("inf")
    val = float("nan")
    for epoch in range(epochs):
        order = epoch_order(x.shape[0], seed, epoch)
        for start in range(0, x.shape[0], hp["batch_size"]):
            idx = order[start:start + hp["batch_size"]]
            loss = F.mse_loss(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            val = F.mse_loss(model(dataset.x_val), dataset.y_val).item()
        best = min(best, val)
        if on_epoch is not None:
            on_epoch(epoch + 1, val, best, model)
    return {"model": model, "val_loss": val, "best_val_loss": best, "iterations": epochs,
            "train_seconds": time.perf_counter() - entered}


def main(argv=None) -> int:
    """`python -m rayhpc.tune.single --config SWEEP.yaml --index I --out DIR`: one array task."""
    from rayhpc.config import load_yaml, validate
    from rayhpc.data import load_dataset
    from rayhpc.tune.config import SweepConfig
    from rayhpc.tune.space import sample_configs

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--config", required=True, help="sweep YAML (random or grid search)")
    parser.add_argument("--index", type=int, required=True, help="trial number, 0-based")
    parser.add_argument("--out", required=True, help="folder for the trial's JSON result")
    args = parser.parse_args(argv)
    # one thread per CPU the task was given (Slurm's --cpus-per-task); more threads than
    # cores makes small torch ops many times slower when tasks share a node
    torch.set_num_threads(int(os.environ.get("SLURM_CPUS_PER_TASK", "1")))
    cfg = validate(SweepConfig, load_yaml(args.config))
    configs = sample_configs(cfg.space, cfg.num_samples, cfg.search, cfg.seed)
    hp = configs[args.index]
    result = train_single(hp, load_dataset(cfg.data), cfg.epochs, cfg.seed)
    row = {"index": args.index, "config": hp, "node": socket.gethostname(),
           **{k: result[k] for k in ("val_loss", "best_val_loss", "iterations", "train_seconds")}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"trial_{args.index:05d}.json").write_text(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
