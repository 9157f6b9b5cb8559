"""A group of Ray actors that form one `torch.distributed` world.

What it does, and the traps it avoids:
- one placement group, one bundle per rank, packed per node; `pg.ready()` is
  awaited with a timeout, because an unsatisfiable group waits forever;
- ranks sorted by (node, GPU id), so they are the same whatever order the
  actors start in; local ranks count within a node;
- a rendezvous no other user can reach (`rayhpc.workers.store`): a `FileStore` in
  a private folder of rank 0's where every rank is on one node, a store served by
  a Ray actor (behind the cluster's token) across nodes; never a TCPStore, which
  answers anyone who finds its port (no port is opened, so none can be raced);
- every call waits with a timeout: a rank that fails is reported with its
  traceback, ranks that do not answer are named, and the group is torn down
  instead of leaving survivors blocked in a collective.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

FAILURE_GRACE_S = 2.0  # after a rank fails, how long the others get to report their own outcome


class WorkerGroupError(RuntimeError):
    """Some ranks failed (`failed`: rank -> traceback) or did not answer in time (`silent`)."""

    def __init__(self, message: str, failed: dict[int, str] | None = None, silent: list[int] | None = None,
                 what: str = "", describe: Callable[[int], str] = lambda rank: f"rank {rank}"):
        super().__init__(message)
        self.failed, self.silent, self.what, self.describe = failed or {}, silent or [], what, describe


@dataclasses.dataclass
class WorkerContext:
    """What a function run on the group receives first: its place in the world, and a scratch dict
    that persists across calls on the same rank (a model set up by one call is trained by the next)."""

    rank: int
    world_size: int
    local_rank: int
    device: Any  # torch.device
    state: dict = dataclasses.field(default_factory=dict)


def gpu_key(gpu_id: str) -> tuple:
    """Sort key of a GPU id as Ray reports it: by number ("2" before "10"), else by name (UUIDs)."""
    return (0, int(gpu_id), "") if gpu_id.isdigit() else (1, 0, gpu_id)


def gpu_order(gpu_ids: list[str]) -> list[tuple]:
    return [gpu_key(g) for g in gpu_ids]


class RankWorker:
    """The actor behind one rank (created by `WorkerGroup`; not used directly)."""

    def __init__(self, threads: int):
        import torch  # torch: about 1.5 s to import, only where something trains

        torch.set_num_threads(threads)
        self.ctx: WorkerContext | None = None

    def info(self) -> dict:
        return {"node_ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def new_store_path(self) -> str:
        """Rank 0 of a one-node group: its FileStore's path (`rayhpc.workers.store.new_store_path`)."""
        from rayhpc.workers.store import new_store_path

        return new_store_path()

    def init(self, rank: int, local_rank: int, world_size: int, master_addr: str, rendezvous: tuple,
             backend: str, timeout_s: float, visible_gpus: str | None, device_index: int | None) -> None:
        """Join the group's world. `rendezvous`: ("file", the FileStore's path) or ("ray", a `StoreServer`)."""
        import torch  # torch: about 1.5 s to import, only where something trains
        import torch.distributed as dist

        from rayhpc.devices import cuda_device
        from rayhpc.workers.store import open_store

        env = {"RANK": rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": world_size, "MASTER_ADDR": master_addr}
        os.environ.update({k: str(v) for k, v in env.items()})
        if master_addr == "127.0.0.1":  # one node: gloo's own sockets on loopback too, off the network
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if visible_gpus is not None:
            # every rank on a node sees the node's GPUs (NCCL's peer-to-peer paths need that)
            # and uses its own by index
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpus
            device = cuda_device(f"rank {rank} (GPU {device_index} of {visible_gpus})", device_index)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        timeout = timedelta(seconds=timeout_s)
        store = open_store(rendezvous, world_size, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        self.ctx = WorkerContext(rank, world_size, local_rank, device)

    def execute(self, fn: Callable, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        """(True, result), or (False, traceback) so that the driver can report it by rank."""
        try:
            return True, fn(self.ctx, *args, **kwargs)
        except BaseException:  # noqa: BLE001 - every failure must reach the driver
            return False, traceback.format_exc()

    def shutdown(self) -> None:
        import torch.distributed as dist  # torch: about 1.5 s to import, only where something trains

        from rayhpc.workers.store import close_store

        if dist.is_initialized():
            dist.destroy_process_group()
        close_store()


class WorkerGroup:
    """`num_workers` ranks of one `torch.distributed` world (gloo on CPUs, NCCL on GPUs).

        with WorkerGroup(4, cpus_per_worker=0.5) as group:
            losses = group.run(train_step, batch)      # on every rank, results by rank
            group.run_on(0, save, path)                # on one rank
    """

    def __init__(self, num_workers: int, *, cpus_per_worker: float = 1.0, gpus_per_worker: float = 0.0,
                 timeout_s: float = 120.0, start: bool = True, placement_group=None):
        """`placement_group`: one that already holds a bundle of `cpus_per_worker` (+ `gpus_per_worker`)
        per rank at indices 0..num_workers-1 (a Tune trial's), used and left in place at shutdown;
        else the group reserves its own."""
        if gpus_per_worker not in (0, 1):
            # NCCL runs one rank per GPU: two ranks sharing one fail later with "Duplicate GPU detected"
            raise ValueError(f"gpus_per_worker {gpus_per_worker:g}: a rank of a worker group takes no GPU (gloo) "
                             "or one whole GPU (NCCL, one rank per GPU)")
        self.num_workers, self.timeout_s = num_workers, timeout_s
        self.cpus_per_worker, self.gpus_per_worker = cpus_per_worker, gpus_per_worker
        self.backend = "nccl" if gpus_per_worker > 0 else "gloo"
        self.actors: list = []  # by rank
        self.pg, self.own_pg = placement_group, placement_group is None
        self.rendezvous: tuple | None = None  # ("file", the FileStore's path) or ("ray", its StoreServer actor)
        self.store_server = None  # the rendezvous store's actor, for a group across nodes
        self.describe_rank: Callable[[int], str] = lambda rank: f"rank {rank}"
        if start:
            self.start()

    def start(self) -> "WorkerGroup":
        bundle = {"CPU": self.cpus_per_worker, **({"GPU": self.gpus_per_worker} if self.gpus_per_worker else {})}
        if self.own_pg:
            self.pg = placement_group([bundle] * self.num_workers, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise WorkerGroupError(f"cannot place {self.num_workers} workers of {bundle} within {self.timeout_s:g} s; "
                                   f"the cluster has {ray.cluster_resources()}") from None
        try:
            self._start_actors(bundle)
            self._rendezvous()
        except BaseException:
            self.shutdown(graceful=False)
            raise
        return self

    def _start_actors(self, bundle: dict) -> None:
        actor_cls = ray.remote(RankWorker)
        actors = [actor_cls.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
        ).remote(max(1, int(self.cpus_per_worker))) for i in range(self.num_workers)]
        infos = self._wait([a.info.remote() for a in actors], "start", list(range(len(actors))))
        # ranks by (node, first GPU id), creation order breaking ties: stable across restarts
        order = sorted(range(len(actors)), key=lambda i: (infos[i]["node_ip"], gpu_order(infos[i]["gpu_ids"]), i))
        self.actors = [actors[i] for i in order]
        self.infos = [infos[i] for i in order]

    def one_node(self) -> bool:
        """Whether every rank runs on one node (one filesystem, loopback between them)."""
        return len({info["node_id"] for info in self.infos}) == 1

    def _rendezvous(self) -> None:
        nodes = [info["node_id"] for info in self.infos]
        single_node = self.one_node()
        master_addr = "127.0.0.1" if single_node else self.infos[0]["node_ip"]
        from rayhpc.workers.store import new_rendezvous  # torch: only where a group forms

        self.rendezvous, self.store_server = new_rendezvous(
            single_node, lambda: self._wait([self.actors[0].new_store_path.remote()], "new_store_path", [0])[0])
        calls = []
        for rank, (actor, info) in enumerate(zip(self.actors, self.infos)):
            local_rank = nodes[:rank].count(info["node_id"])
            node_gpus = sorted({g for i in self.infos if i["node_id"] == info["node_id"] for g in i["gpu_ids"]},
                               key=gpu_key)
            visible = ",".join(node_gpus) if info["gpu_ids"] else None
            index = node_gpus.index(info["gpu_ids"][0]) if info["gpu_ids"] else None
            calls.append(actor.init.remote(rank, local_rank, self.num_workers, master_addr, self.rendezvous,
                                           self.backend, self.timeout_s, visible, index))
        self._wait(calls, "init_process_group", list(range(self.num_workers)))

    def run(self, fn: Callable, *args, timeout_s: float | None = None, **kwargs) -> list:
        """`fn(ctx, *args, **kwargs)` on every rank; the results in rank order."""
        refs = [a.execute.remote(fn, args, kwargs) for a in self.actors]
        return self._wait(refs, _name(fn), list(range(self.num_workers)), timeout_s, outcomes=True)

    def run_on(self, rank: int, fn: Callable, *args, timeout_s: float | None = None, **kwargs) -> Any:
        """`fn(ctx, ...)` on one rank (it must not enter a collective: the others are not in it)."""
        ref = self.actors[rank].execute.remote(fn, args, kwargs)
        return self._wait([ref], _name(fn), [rank], timeout_s, outcomes=True)[0]

    def _wait(self, refs: list, what: str, ranks: list[int], timeout_s: float | None = None,
              outcomes: bool = False) -> list:
        """Results of `refs` (one per rank in `ranks`), or a `WorkerGroupError` that ends the group.

        A rank fails when its actor dies or (with `outcomes`) its function raises. Then the
        others get `FAILURE_GRACE_S` to report their own failures, since survivors are often
        blocked in a collective with the failed rank and would otherwise wait for its timeout.
        """
        timeout_s = timeout_s or self.timeout_s
        deadline, grace_end = time.monotonic() + timeout_s, None
        pending, results, failed = dict(zip(refs, ranks)), {}, {}
        while pending:
            end = deadline if grace_end is None else min(deadline, grace_end)
            done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, end - time.monotonic()))
            if not done:
                break
            for ref in done:
                rank = pending.pop(ref)
                try:
                    value = ray.get(ref)
                except ray.exceptions.RayError as exc:  # the actor died (killed, out of memory...) or init raised
                    cause = getattr(exc, "cause", None) or exc  # a RayTaskError's first line is only its header
                    failed[rank] = f"{type(cause).__name__}: {str(cause).splitlines()[0]}"
                    continue
                if outcomes and not value[0]:
                    failed[rank] = value[1]
                else:
                    results[rank] = value[1] if outcomes else value
            if failed and grace_end is None:
                grace_end = time.monotonic() + FAILURE_GRACE_S
        if failed or pending:
            silent = sorted(pending.values())
            self.shutdown(graceful=False)
            raise WorkerGroupError(_failure_message(what, failed, silent, self.describe_rank, timeout_s),
                                   failed=failed, silent=silent, what=what, describe=self.describe_rank)
        return [results[rank] for rank in ranks]

    def shutdown(self, graceful: bool = True) -> None:
        """Destroy the process groups (unless after a failure: ranks stuck in a collective would not
        answer), kill the actors, remove the placement group (idempotent)."""
        if self.actors:
            try:
                if graceful:
                    ray.wait([a.shutdown.remote() for a in self.actors], num_returns=len(self.actors), timeout=5)
            finally:
                for actor in self.actors:
                    ray.kill(actor)
                self.actors = []
        if self.store_server is not None:
            ray.kill(self.store_server)
            self.store_server = None
        if self.pg is not None and self.own_pg:
            remove_placement_group(self.pg)
            self.pg = None

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, exc_type, *_) -> None:
        # after an error or Ctrl-C, ranks may be mid-step or in a collective: kill them at once
        self.shutdown(graceful=exc_type is None)


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", repr(fn))


def _failure_message(what: str, failed: dict[int, str], silent: list[int], describe: Callable[[int], str],
                     timeout_s: float) -> str:
    """One summary line naming the failed and the silent ranks, then each failed rank's traceback."""
    names = lambda ranks: ", ".join(describe(r) for r in ranks)  # noqa: E731
    parts = [f"{names(sorted(failed))} failed in {what}"] if failed else []
    if silent and failed:
        parts.append(f"{names(silent)} still running (likely waiting for the failed ranks in a collective)")
    elif silent:
        parts.append(f"{names(silent)} did not answer {what} within {timeout_s:g} s")
    details = "".join(f"\n--- {describe(r)} ---\n{tb.rstrip()}" for r, tb in sorted(failed.items()))
    return "; ".join(parts) + details
