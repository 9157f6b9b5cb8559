"""Ray Train's process group (`rayhpc train`: DDP and FSDP2 under `TorchTrainer`), formed where no other user
reaches it, and the time each rank takes to join it.

Ray Train 2.60 forms the world through a TCPStore on rank 0, at a port it finds free and then hands to torch
(`get_address_and_port`, then `init_process_group("env://")`), for the whole run: another user on the node
can take that port in between, or connect to the store and list, read and set its keys (the ranks' addresses,
and the keys of process groups made later). `PrivateRendezvous` is Ray Train's `TorchConfig` with the
rendezvous of the platform's own worker groups instead (`rayhpc.workers.store`): a `FileStore` in a 0700
folder of rank 0's where every rank is on one node, an actor of the job's Ray (behind its token) across nodes.
No port is opened for it. Ray Train's backend does everything else as before (each rank's torch variables,
the shut-down of the group, the device).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from datetime import timedelta

import ray
from ray.train.torch import TorchConfig

# private: Ray Train's torch backend, of which only `on_start` (the world's forming) is replaced, and the
# function with which it sets each rank's torch variables (RANK, LOCAL_RANK, ...) first. A config names its
# backend through `backend_cls` (Ray Train's `BackendConfig`, a developer API)
from ray.train.torch.config import _set_torch_distributed_env_vars, _TorchBackend

from rayhpc.workers.store import close_store, new_rendezvous, new_store_path, open_store

_joined: dict = {}  # in a rank's process: when it began and ended joining its world


@dataclasses.dataclass
class PrivateRendezvous(TorchConfig):
    """`TorchConfig` whose process group forms without a TCPStore (see the module)."""

    @property
    def backend_cls(self):
        return _PrivateRendezvousBackend


class _PrivateRendezvousBackend(_TorchBackend):
    server = None  # the store's actor of a world across nodes (one backend per Ray Train controller process)

    def on_start(self, worker_group, backend_config: PrivateRendezvous) -> None:
        worker_group.execute(_set_torch_distributed_env_vars)
        nodes = worker_group.execute(_node_id)
        rendezvous, self.server = new_rendezvous(len(set(nodes)) == 1,
                                                 lambda: worker_group.execute_single(0, new_store_path))
        ray.get([worker_group.execute_single_async(rank, _join, backend_config.backend, rank, len(nodes), rendezvous,
                                                   backend_config.timeout_s) for rank in range(len(nodes))])

    def on_shutdown(self, worker_group, backend_config: PrivateRendezvous) -> None:
        super().on_shutdown(worker_group, backend_config)
        with contextlib.suppress(Exception):  # ranks that died take their part with them
            ray.get(worker_group.execute_async(close_store), timeout=30)
        if self.server is not None:
            ray.kill(self.server)
            self.server = None


def _node_id() -> str:
    return ray.get_runtime_context().get_node_id()


def _join(backend: str, rank: int, world_size: int, rendezvous: tuple, timeout_s: float) -> None:
    """In a rank: join the world through `rendezvous`, noting when it began and ended (`joined`)."""
    import torch.distributed as dist

    began = time.time()
    if backend == "nccl" and not {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT"} & set(os.environ):
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"  # as Ray Train's own set-up: a timed-out collective fails
    timeout = timedelta(seconds=timeout_s)
    store = open_store(rendezvous, world_size, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    _joined["times"] = (began, time.time())


def joined() -> tuple[float, float] | None:
    """When this process (a rank of a Ray Train run) began and ended joining its world, unix times; None where
    it has not (a warm group's rank, a process of its own)."""
    return _joined.get("times")
