"""Plain PyTorch training, the baselines of `jobs/bench_train.py`: what users write by hand today.

    torchrun --nproc_per_node 2 jobs/bench/train_baseline.py --out result.json --launch-time T [options]
    torchrun --nproc_per_node 2 jobs/bench/train_baseline.py ... --task jobs/tasks/llama.py:Llama
    python jobs/bench/train_baseline.py --out result.json --launch-time T --device cuda --bf16 [options]
    python jobs/bench/train_baseline.py --out result.json --launch-time T --ray-train 2 [options]

Same model, data, sampler and optimizer as the platform's loop: the MLP of the options, or with `--task` a
task file's own model, data and loss, used as a plain script would use that file. Under torchrun
(RANK in the environment): DDP with `init_process_group` from torchrun's
environment and nothing else. Run directly: one process, no process group, no
wrapper ("raw PyTorch"), on `--device`, with bf16 autocast if `--bf16`; on a GPU the
training rows sit on the GPU and batches are index gathers there, as a careful user
writes it (a DataLoader collating samples one by one and copying pageable memory keeps a
GPU waiting). With `--ray-train N`: plain Ray Train, as its docs write it: `ray.init()` with its defaults (a
local Ray of its own), a `TorchTrainer` of N CPU workers (gloo), the same loop in each, DDP by
`ray.train.torch.prepare_model`. Each epoch's share of time spent waiting for its next batch is recorded.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from rayhpc.data import SyntheticTask, synthetic_tensors
from rayhpc.models import MLP
from rayhpc.task.batches import holdout
from rayhpc.task.mlp import MLPTask


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--launch-time", type=float, required=True, help="unix time the launcher was started")
    parser.add_argument("--in-features", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--samples", type=int, default=30720)
    parser.add_argument("--batch", type=int, default=256, help="per worker")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="single process only")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (cuda), as the platform's DDP")
    parser.add_argument("--task", help="FILE:CLASS: that task's model, data and loss instead of the MLP")
    parser.add_argument("--corpus-bytes", type=int, default=200_000, help="with --task: its corpus_bytes")
    parser.add_argument("--ray-train", type=int, metavar="N", help="plain Ray Train: a TorchTrainer of N workers")
    return parser.parse_args()


def epoch_batches(train, rows: list[torch.Tensor] | None, sampler, batch: int, device: torch.device):
    """One epoch's (x, y) batches on `device`: index gathers out of `rows` (the training rows, already on the
    GPU), else what a DataLoader collates."""
    if rows is None:
        for x, y in DataLoader(train, batch_size=batch, sampler=sampler):
            yield x.to(device), y.to(device)
        return
    order = torch.tensor(list(sampler), device=device)
    for start in range(0, len(order), batch):
        index = order[start:start + batch]
        yield tuple(t[index] for t in rows)


def mse(model, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def build(args, device: torch.device):
    """The training rows, the model on `device`, its loss(model, batch), and tokens per sample (1: the MLP's
    samples): the MLP of the options, or `--task`'s own model, data and loss."""
    if args.task:
        path, _, name = args.task.rpartition(":")
        spec = importlib.util.spec_from_file_location("bench_task", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        task = getattr(module, name)()
        hp = {**task.hparams, "corpus_bytes": args.corpus_bytes}
        train, _ = task.data(hp)
        torch.manual_seed(0)
        return train, task.model(hp).to(device), task.loss, task.tokens_per_sample(hp)
    task = SyntheticTask(num_samples=args.samples, in_features=args.in_features, out_features=args.in_features)
    # the platform's mlp task: every row, then its 20% validation hold-out (split seed 0)
    train, _ = holdout(TensorDataset(*synthetic_tensors(task)), None, MLPTask.val_fraction, 0)
    torch.manual_seed(0)
    return train, MLP(args.in_features, args.hidden, args.in_features, args.depth).to(device), mse, 1


def main() -> None:
    args = parse_args()
    if args.ray_train:
        return ray_train(args)
    distributed = "RANK" in os.environ  # launched by torchrun
    if distributed:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    loop(args, distributed)


def ray_train(args) -> None:
    """Plain Ray Train: its own local Ray (`ray.init()`'s defaults), a TorchTrainer of `args.ray_train` workers."""
    import ray
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init()
    with tempfile.TemporaryDirectory() as storage:
        TorchTrainer(lambda: loop(args, True, prepare=True), scaling_config=ScalingConfig(num_workers=args.ray_train),
                     run_config=ray.train.RunConfig(storage_path=storage)).fit()
    ray.shutdown()


def loop(args, distributed: bool, prepare: bool = False) -> None:
    """The training loop; `prepare`: under Ray Train (its process group, DDP by its `prepare_model`)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device("cpu" if distributed else args.device)
    train, model, loss_of, tokens = build(args, device)
    if prepare:
        import ray.train.torch

        model = ray.train.torch.prepare_model(model)
    else:
        model = DistributedDataParallel(model) if distributed else model
    opt = torch.optim.Adam(model.parameters(), lr=0.01)  # every job's default optimizer
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
    # on a GPU the MLP's training rows (a Subset of a TensorDataset) go there once
    rows = [t[train.indices].to(device) for t in train.dataset.tensors] \
        if device.type == "cuda" and not args.task else None
    first_step, per_epoch, waits = None, [], []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        started, units, waited = time.perf_counter(), 0, 0.0  # units: samples, or the task's tokens
        batches = iter(epoch_batches(train, rows, sampler, args.batch, device))
        while True:
            asked = time.perf_counter()
            x, y = next(batches, (None, None))
            waited += time.perf_counter() - asked
            if x is None:
                break
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16 and device.type == "cuda"):
                loss = loss_of(model, (x, y))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            first_step = first_step or time.time()
            units += len(x) * world * tokens
        if distributed:
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        per_epoch.append(units / seconds)
        waits.append(waited / seconds)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"first_step_s": first_step - args.launch_time, "samples_per_s": per_epoch,
                       "data_wait_share": waits}, f)
    if distributed and not prepare:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
