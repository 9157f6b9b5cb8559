# Listing 4.9 of the seed handbook (mlp_ddp.py), run with `torchrun --nproc_per_node 2 mlp_ddp.py OUT`.
# Changed only where this machine differs, each marked "# CHANGED": gloo on CPU instead of NCCL on
# GPUs, torchrun's RANK/WORLD_SIZE instead of Slurm's variables, the model built under
# torch.manual_seed(0), no DataLoader worker processes, the final weights saved to OUT, and a barrier
# before the teardown.
import os
import sys

import torch
import torch.nn as nn
import torch.optim as optim
from random_dataset import RandomTensorDataset
from torch.distributed import barrier, destroy_process_group, init_process_group, is_initialized
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


class MLP(nn.Module):
  def __init__(self, in_feature, hidden_units, out_feature):
    super().__init__()

    self.hidden_layer = nn.Linear(in_feature, hidden_units)
    self.output_layer = nn.Linear(hidden_units, out_feature)
  
  def forward(self, x):
    x = self.hidden_layer(x)
    x = self.output_layer(x)
    return x

rank          = int(os.environ["RANK"])  # CHANGED: torchrun's
world_size    = int(os.environ["WORLD_SIZE"])

init_process_group(backend="gloo", rank=rank, world_size=world_size)  # CHANGED: gloo on CPU
if rank == 0: print(f"Group initialized? {is_initialized()}", flush=True)

# model construction
layer_1_units = 6
layer_2_units = 4
layer_3_units = 2
torch.manual_seed(0)  # CHANGED: the same initial weights on every rank, and as the platform's seed 0
model = MLP(
  in_feature=layer_1_units,
  hidden_units=layer_2_units,
  out_feature=layer_3_units
  )

model = DDP(model)  # CHANGED: CPU, no device_ids

loss_fn = nn.MSELoss()
optimizer = optim.SGD(model.parameters(),lr=0.01)

# dataset construction
num_samples = 1024
batch_size  = 32
dataset = RandomTensorDataset(
  num_samples=num_samples,
  in_shape=layer_1_units,
  out_shape=layer_3_units
  )

dataloader = DataLoader(
  dataset,
  batch_size=batch_size, # Global batch size is equal to batch_size multiply by the number of GPUs (world_size). batch_size=(batch_size//worldsize) to maintain the global batch size as batch_size
  shuffle=False,
  num_workers=0,  # CHANGED: no pin_memory, no worker processes
  sampler=DistributedSampler(dataset, num_replicas=world_size, rank=rank)
  )

max_epochs = 1
for i in range(max_epochs):
  print(f"[CPU{rank}] Epoch {i} | Batchsize: {len(next(iter(dataloader))[0])} | Steps: {len(dataloader)}")
  dataloader.sampler.set_epoch(i)
  for x, y in dataloader:
    # Forward Pass 
    out = model(x)

    # Calculate loss
    loss = loss_fn(out, y)

    # Zero grad
    optimizer.zero_grad(set_to_none=True)

    # Backward Pass
    loss.backward()

    # Update Model
    optimizer.step()

if rank == 0:  # CHANGED: keep the result
  torch.save(model.module.state_dict(), sys.argv[1])
barrier()  # CHANGED: no rank tears gloo down while the other may still use it
destroy_process_group()
