"""One parameter server: an async Ray actor holding one flat shard of the parameters and its optimiser.

Workers call `pull(worker, step)` before computing step `step` and `push(worker, step, grad)` after.
- sync: the shard's version is the number of optimizer steps taken; a pull for step s waits for version s;
  the N gradients of a step are summed in worker order, divided by N, and applied once (= DDP's mean).
  With `clip_grad_norm`, that mean is clipped by its total norm over every server's shard (each server
  sends its shard's norm, `torch.nn.utils.get_total_norm`, to every other; torch's `clip_grads_with_norm_`
  then scales the shard by their total, as `clip_grad_norm_` scales a whole model's gradient).
- async (Downpour): each gradient, divided by N (a worker's share of the global batch, so lr means the
  same in both modes), is applied when it arrives; a pull for step s waits until every worker has pushed
  s - K steps (K = staleness; no wait when unbounded).
A push a server already has (a replaced worker redoing a step) is ignored, so redoing is safe.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from rayhpc.config import Optim, Schedule
from rayhpc.engine import checkpoint
from rayhpc.engine.checkpoint import SERVER_DIR
from rayhpc.monitor.metrics import PSMetrics
from rayhpc.optim import make_optimizer, set_lr


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over `array` without a copy. Arrays from Ray's object store are read-only views of its
    shared memory; torch warns that writing to them is undefined, and nothing here writes to them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


class ParameterServer:
    def __init__(self, index: int, flat: np.ndarray, holds: dict, optim: Optim, schedule: Schedule,
                 num_workers: int, mode: str,
                 staleness: int | None, run: str, total_steps: int, checkpoints: list[int], epoch_ends: list[int],
                 run_dir: str, restore: str | None = None, steps_per_epoch: int = 0):
        """`flat`: the initial values of the pieces of parameters it `holds` ({"pieces": [(name, start, stop)],
        "shapes": {name: shape}}, written into its checkpoints so they read as the whole model). Server 0 also
        sums the workers' losses of each step, kept in its checkpoints from the epoch's start (a driver killed
        mid-epoch loses the step records it held; its resume reports the whole epoch from these)."""
        torch.set_num_threads(1)
        self.index, self.n, self.mode, self.staleness, self.holds = index, num_workers, mode, staleness, holds
        self.param = torch.nn.Parameter(torch.tensor(flat, dtype=torch.float32))
        self.shard = torch.nn.ParameterDict({"param": self.param})  # the module its checkpoints save whole
        self.optimizer = make_optimizer(optim, [self.param])
        self.optim, self.schedule, self.total_steps = optim, schedule, total_steps
        self.pushed = [0] * num_workers  # steps each worker has pushed here
        self.version = 0  # optimizer steps applied
        self.pending: dict[int, dict[int, torch.Tensor]] = {}  # sync: step -> worker -> gradient
        self.checkpoints, self.run_dir = set(checkpoints), Path(run_dir)
        self.epoch_ends, self.at_epoch_end = set(epoch_ends), {}  # step -> object ref, until validated
        self.changed = asyncio.Condition()
        self.gauges = PSMetrics(run, "server", index)
        self.apply_seconds = 0.0
        self.snapshot = None  # (version, object ref)
        self.saved_step = 0
        self.peers: list = []  # every server of the run (sync clipping); `set_peers` after they all exist
        self.norm_parts: dict[int, dict[int, torch.Tensor]] = {}  # step -> server -> its shard's gradient norm
        self.per_epoch, self.losses = steps_per_epoch, {}  # step -> [loss x samples, samples] over the workers
        # server 0: each worker's torch RNG state to begin a step with (worker -> step -> state), as it pushed it
        # with the step before; the ones a checkpoint or a replaced worker may still need
        self.rng: dict[int, dict[int, torch.Tensor]] = {}
        if restore is not None:
            self._load(restore)
        self._reached()

    def info(self) -> dict:
        return {"pid": os.getpid(), "node": socket.gethostname(), "elements": self.param.numel(),
                "pushed": list(self.pushed), "version": self.version}

    def global_step(self) -> int:
        """Steps every worker has completed here (sync: the optimizer steps)."""
        return self.version if self.mode == "sync" else min(self.pushed)

    async def pull(self, worker: int, step: int, timeout_s: float) -> tuple:
        """(a reference to the shard, once step `step` may start; how far `worker` then is ahead of the
        slowest worker, the shard's version and how long the pull waited)."""
        asked = time.perf_counter()
        if self.mode == "sync":
            ready = lambda: self.version >= step  # noqa: E731
        elif self.staleness is None:
            ready = lambda: True  # noqa: E731
        else:
            ready = lambda: step - min(self.pushed) <= self.staleness  # noqa: E731
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(ready), timeout_s)
        waited = time.perf_counter() - asked
        self.gauges.set_server(waited, self.apply_seconds, self.version)
        shard = self.snapshot[1] if self.lockstep else self._snapshot(self.version)
        return shard, {"staleness": step - min(self.pushed), "version": self.version, "wait_s": waited}

    @property
    def lockstep(self) -> bool:
        """async with K = 0: a pull for step s reads the shard as it was when the slowest worker finished
        step s - 1 (the read of stale-synchronous-parallel at its clock), not the freshest shard, which may
        already hold a faster worker's step-s gradient. So K = 0 is sync with each gradient applied alone."""
        return self.mode == "async" and self.staleness == 0

    def _snapshot(self, key: int):
        """A copy of the shard in the object store, made once per `key` (sync: per version) and shared
        by every worker that pulls it (in sync mode all N); each worker maps it read-only without a copy
        of its own. The copy makes the snapshot independent of the shard, which the next push changes,
        whichever store Ray keeps it in (small objects stay in memory)."""
        import ray  # Ray: only where a cluster is used (config checks and --help stay fast)

        if self.snapshot is None or self.snapshot[0] != key:
            self.snapshot = (key, ray.put(self.param.detach().numpy().copy()))
        return self.snapshot[1]

    async def push(self, worker: int, step: int, grad: np.ndarray, loss: tuple[float, int] | None = None,
                   rng: torch.Tensor | None = None) -> None:
        """`loss`: the worker's (mean loss, samples) of the step, and `rng`, its RNG state after it, to server 0."""
        if step < self.pushed[worker]:
            return  # a redone step this server already has
        if step != self.pushed[worker]:
            raise RuntimeError(f"server {self.index}: worker {worker} pushed step {step}, expected "
                               f"{self.pushed[worker]}")
        started, before = time.perf_counter(), self.global_step()
        # the schedule's lr of the step the gradient belongs to (sync: the optimizer step it makes; async:
        # each worker's gradients of step s are applied at step s's lr): a pure function of the step, so a
        # restored server needs no scheduler state
        set_lr(self.optimizer, self.optim.lr, self.schedule, step, self.total_steps)
        if self.mode == "sync":
            self.pending.setdefault(step, {})[worker] = as_tensor(grad)  # holds the object-store buffer
            if len(self.pending[step]) == self.n:
                grads = self.pending.pop(step)
                mean = sum(grads[w] for w in range(self.n)) / self.n
                self._apply(mean, await self._total_norm(step, mean) if self.optim.clip_grad_norm else None)
        else:
            self._apply(as_tensor(grad) / self.n)
        if loss is not None:
            kept = self.losses.setdefault(step, [0.0, 0])
            kept[0], kept[1] = kept[0] + loss[0] * loss[1], kept[1] + loss[1]
        if rng is not None:
            self.rng.setdefault(worker, {})[step + 1] = rng
        self.pushed[worker] = step + 1
        self.apply_seconds = time.perf_counter() - started
        if self.global_step() > before:
            self._reached()
            for states in self.rng.values():  # no checkpoint (nor worker: none is behind) begins before it
                for old in [s for s in states if s < self.global_step()]:
                    del states[old]
        async with self.changed:
            self.changed.notify_all()

    def rng_of(self, worker: int, step: int) -> torch.Tensor | None:
        """Worker `worker`'s RNG state to begin step `step` with (None: a fresh start, its own)."""
        return self.rng.get(worker, {}).get(step)

    def set_peers(self, servers: list) -> None:
        self.peers = servers

    async def norm_part(self, step: int, index: int, norm: torch.Tensor) -> None:
        """Server `index`'s norm of step `step`'s mean gradient on its shard."""
        self.norm_parts.setdefault(step, {})[index] = norm
        async with self.changed:
            self.changed.notify_all()

    async def _total_norm(self, step: int, grad: torch.Tensor) -> torch.Tensor:
        """The norm of step `step`'s whole mean gradient: torch's total of every server's shard norm. No pull
        of the next step can come before this step is applied, so every server waits here for the same step."""
        for peer in self.peers:
            peer.norm_part.remote(step, self.index, torch.nn.utils.get_total_norm([grad]))
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.norm_parts.get(step, {})) == len(self.peers))
        parts = self.norm_parts.pop(step)
        return torch.nn.utils.get_total_norm([parts[j] for j in sorted(parts)])

    def _reached(self) -> None:
        """Every worker has now finished `global_step()` steps here: the lockstep snapshot, the epoch-end
        copy for validation and the checkpoint of that step, each where due."""
        step = self.global_step()
        if self.lockstep:
            self._snapshot(step)
        if step in self.epoch_ends and step not in self.at_epoch_end:
            import ray  # Ray: only where a cluster is used (config checks and --help stay fast)

            self.at_epoch_end[step] = ray.put(self.param.detach().numpy().copy())
        if step in self.checkpoints and step > self.saved_step:
            self._save(step)

    async def shard_at(self, step: int, timeout_s: float):
        """The shard as it was when every worker had finished `step` steps (an epoch's end), once."""
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: step in self.at_epoch_end), timeout_s)
        return self.at_epoch_end.pop(step)

    def _apply(self, grad: torch.Tensor, total_norm: torch.Tensor | None = None) -> None:
        """One optimizer step on `grad`, clipped as `clip_grad_norm_` would clip it where `total_norm` (the
        whole gradient's) is given."""
        self.param.grad = grad
        if total_norm is not None:
            torch.nn.utils.clip_grads_with_norm_([self.param], self.optim.clip_grad_norm, total_norm)
        self.optimizer.step()
        self.param.grad = None
        self.version += 1

    def _save(self, step: int) -> None:
        """The shard and its optimizer, as every job's checkpoint (`checkpoint.save`, into `checkpoint_<step>/
        server_<index>/`), what it holds, the push counts, the epoch's losses so far and the workers' RNG states
        its extra state (the driver marks the step's folder complete once every server's is)."""
        begins = (step - 1) // self.per_epoch * self.per_epoch if self.per_epoch else step  # the epoch of step - 1
        self.losses = {s: kept for s, kept in self.losses.items() if s >= begins}  # later checkpoints start there too
        extra = {**self.holds, "pushed": [min(p, step) for p in self.pushed], "version": self.version,
                 "losses": [[s, *kept] for s, kept in sorted(self.losses.items()) if s < step],
                 "rng": {w: states[step] for w, states in self.rng.items() if step in states}}
        checkpoint.save(self.run_dir / f"checkpoint_{step:06d}" / SERVER_DIR.format(index=self.index),
                        [(self.shard, self.optimizer)], checkpoint.Progress(global_step=step), sharded=False,
                        device=torch.device("cpu"), extra=extra)
        self.saved_step = step

    def _load(self, folder: str) -> None:
        progress, extra = checkpoint.load(Path(folder) / SERVER_DIR.format(index=self.index),
                                          [(self.shard, self.optimizer)], sharded=False, device=torch.device("cpu"))
        self.pushed, self.version, self.saved_step = extra["pushed"], extra["version"], progress.global_step
        self.losses = {int(s): [total, int(n)] for s, total, n in extra["losses"]}
        self.rng = {int(w): {self.saved_step: rng} for w, rng in extra["rng"].items()}

    def weights(self) -> np.ndarray:
        return self.param.detach().numpy()
