"""One parameter-server worker: an actor that pulls the shards, computes its gradient on its
`DistributedSampler` share of each step's batch (DDP's order; over `accumulate` micro-batches, as every
training job does), and pushes one flat gradient per server.

Its random draws (dropout) are a DDP rank's: seeded alike, one stream through the run, a DataLoader's seed
drawn where a rank's validation pass draws it. Server 0 keeps the state each step leaves, so a worker that
replaces a dead one, and a run resumed from a checkpoint, draw what the uninterrupted run did."""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import ray
import torch

from rayhpc.devices import cuda_device
from rayhpc.engine import Module, train_step
from rayhpc.engine.loop import Plan, Runner, fit
from rayhpc.engine.parallelize import apply_options
from rayhpc.engine.step import batch_size_of
from rayhpc.monitor.metrics import PSMetrics
from rayhpc.precision import autocast, set_matmul_precision
from rayhpc.ps.server import as_tensor
from rayhpc.ps.shards import Layout
from rayhpc.task.batches import Batches, draw_as_a_loader, epoch_steps, eval_batch, evaluate, loader_workers


class PSWorker(Runner):
    def __init__(self, index: int, num_workers: int, cfg, task, hp: dict, layout: Layout, servers: list,
                 device: str):
        # the torchrun variables a task may read (Ray Train's workers have them too); no process group
        os.environ.update({"RANK": str(index), "WORLD_SIZE": str(num_workers)})
        torch.set_num_threads(max(1, int(cfg.compute.cpus_per_worker)))
        self.index, self.n, self.cfg, self.task, self.hp = index, num_workers, cfg, task, hp
        self.layout, self.servers = layout, servers
        self.device = cuda_device(f"parameter-server worker {index}") if device == "cuda" else torch.device(device)
        train, val = task.split_data(hp, cfg.data)
        self.validates = val is not None  # every rank's validation pass draws a DataLoader's seed
        self.model = task.initial_model(hp).to(self.device)  # its values come from the servers at each pull
        apply_options(self.model, task.obj, cfg)
        set_matmul_precision(cfg.precision)
        self.params = {name: p for name, p in self.model.named_parameters()}
        self.trained = Module(self.model, None, self.loss)  # a gradient sink: the servers clip and step
        self.train = Batches(train, self.device, loader_workers(self.device, cfg.compute.cpus_per_worker))
        self.gauges = PSMetrics(cfg.name, "worker", index)

    def info(self) -> dict:
        return {"pid": os.getpid(), "node": socket.gethostname()}

    def steps_per_epoch(self) -> int:
        return epoch_steps(len(self.train), self.cfg.per_worker_batch, self.n)

    def run_epoch(self, epoch: int, first_step: int, end_step: int) -> dict:
        """Steps `first_step` .. `end_step` - 1 (global step numbers, within `epoch`: a run of `steps`
        cuts its last epoch short), by `rayhpc.engine.fit`; one record per step."""
        self.records = []
        self.end_step = end_step
        rng = ray.get(self.servers[0].rng_of.remote(self.index, first_step))
        if rng is not None:  # a replaced worker, or a resumed run: the stream where the step before left it
            torch.set_rng_state(rng)
        fit(Plan(self.steps_per_epoch(), end_step), self, first_step)
        return {"worker": self.index, "epoch": epoch, "records": self.records}

    # `rayhpc.engine.fit`'s runner: this worker's share of each step's batch; the servers validate and
    # checkpoint (the driver asks them), so an epoch's end is nothing to a worker

    def batches(self, epoch: int, steps: range):
        return self.train.steps(self.cfg.seed, epoch, steps, self.steps_per_epoch(), self.cfg.per_worker_batch,
                                self.index, self.n)

    def step(self, step: int, batch) -> tuple[float, int]:
        self.records.append(record := self._step(step, batch))
        return record["loss"], record["samples"]

    def loss(self, batch) -> torch.Tensor:
        """The task's loss on `batch`, under autocast for bf16 (as in every job without FSDP)."""
        with autocast(self.cfg.precision, self.device):
            return self.task.loss(self.model, batch)

    def _pull(self, step: int) -> tuple[list[torch.Tensor], list[dict]]:
        answers = ray.get([s.pull.remote(self.index, step, self.cfg.timeout_s) for s in self.servers])
        arrays = ray.get([ref for ref, _ in answers])  # read-only views of the object store: no copy
        for info, array in zip((info for _, info in answers), arrays):
            info["zero_copy"] = not array.flags.writeable  # Ray hands out a copy as a writable array
        return [as_tensor(a) for a in arrays], [info for _, info in answers]

    def _step(self, step: int, batch) -> dict:
        started = time.perf_counter()
        shards, infos = self._pull(step)
        with torch.no_grad():
            self.layout.scatter([s.to(self.device, non_blocking=True) for s in shards], self.params)
        pulled = time.perf_counter()
        loss = train_step(self.trained, batch, self.cfg.accumulate, step, 0)
        grads = [g.cpu().numpy() for g in self.layout.flatten(
            {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in self.params.items()})]
        computed, loss, samples = time.perf_counter(), float(loss.detach()), batch_size_of(batch)
        if step + 1 == self.end_step and self.validates:
            draw_as_a_loader()  # where a DDP rank's validation pass, after the epoch's last step, draws
        rng = torch.get_rng_state()
        ray.get([s.push.remote(self.index, step, g, *(() if j else ((loss, samples), rng)))
                 for j, (s, g) in enumerate(zip(self.servers, grads))])
        done = time.perf_counter()
        staleness = max(info["staleness"] for info in infos)
        self.gauges.set_worker(pulled - started, done - computed, staleness)
        return {"worker": self.index, "step": step, "loss": loss, "samples": samples,
                "staleness": staleness, "versions": [info["version"] for info in infos],
                "pull_s": pulled - started, "compute_s": computed - pulled, "push_s": done - computed, "wait_s": max(info["wait_s"] for info in infos),
                "bytes": sum(s.nbytes for s in shards) + sum(g.nbytes for g in grads),
                "zero_copy": all(info["zero_copy"] for info in infos), "lost": False, "time": time.time()}



class PSEvaluator:
    """Validates the weights at each epoch's end (the servers keep a copy of their shard from the moment
    every worker finished the epoch: in sync mode exactly the weights after its last step), off the
    workers' path, so that async workers never wait for validation."""

    def __init__(self, cfg, task, hp: dict, layout: Layout, servers: list, device: str):
        torch.set_num_threads(1)
        self.cfg, self.task, self.layout, self.servers = cfg, task, layout, servers
        self.device = cuda_device("parameter-server evaluator") if device == "cuda" else torch.device(device)
        _, val = task.split_data(hp, cfg.data)
        self.model = task.initial_model(hp).to(self.device)
        self.params = dict(self.model.named_parameters())
        self.val = Batches(val, self.device)

    def evaluate(self, epoch: int, step: int) -> dict:
        refs = ray.get([s.shard_at.remote(step, self.cfg.timeout_s * 10) for s in self.servers])
        with torch.no_grad():
            self.layout.scatter([as_tensor(a).to(self.device) for a in ray.get(refs)], self.params)
        return {"epoch": epoch, "val": evaluate(self.task, self.model, self.val.all(eval_batch(self.cfg.per_worker_batch)))}


def weights(layout: Layout, servers: list) -> dict[str, torch.Tensor]:
    """The whole model's parameters, from every server's shard (a copy)."""
    return layout.gather([torch.tensor(np.asarray(a)) for a in ray.get([s.weights.remote() for s in servers])])
