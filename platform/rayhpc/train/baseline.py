"""Plain DDP launched by torchrun: what users write by hand today, the baseline of `jobs/bench_train.py`.

    torchrun --nproc_per_node 2 -m rayhpc.train.baseline --out result.json --launch-time T [options]

Same model, data, sampler and optimizer as the platform's DDP loop, with
`init_process_group` from torchrun's environment and nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from rayhpc.data import DataConfig, SyntheticTask, load_dataset
from rayhpc.models import MLP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--launch-time", type=float, required=True, help="unix time the launcher was started")
    parser.add_argument("--in-features", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=30720)
    parser.add_argument("--batch", type=int, default=256, help="per worker")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    task = SyntheticTask(num_samples=args.samples, in_features=args.in_features, out_features=args.in_features)
    ds = load_dataset(DataConfig(synthetic=task))
    torch.manual_seed(0)
    model = DistributedDataParallel(MLP(args.in_features, args.hidden, args.in_features))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    train = TensorDataset(ds.x_train, ds.y_train)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch, sampler=sampler)
    first_step, per_epoch = None, []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        started, samples = time.perf_counter(), 0
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            first_step = first_step or time.time()
            samples += len(x) * world
        dist.barrier()
        per_epoch.append(samples / (time.perf_counter() - started))
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"first_step_s": first_step - args.launch_time, "samples_per_s": per_epoch}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
