"""The rendezvous store of a worker group, where no other user can reach it.

`torch.distributed`'s TCPStore has no authentication: anyone on the node who finds its port (in
/proc/net/tcp) can list every key (`list_keys`), read the ranks' addresses and plant keys of their own,
including those of process groups made later, whose names are predictable. So:
- ranks that share a node rendezvous through a `FileStore` in a folder rank 0 makes with `mkdtemp`
  (0700, a random name, in its private TMPDIR): no port at all;
- ranks on several nodes rendezvous through `RayStore`: a `torch.distributed.Store` whose keys live in a
  `StoreServer` actor, reached only through the job's Ray, which asks for the cluster's token on every port.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from datetime import timedelta
from typing import Callable

import ray
import torch.distributed as dist


class StoreServer:
    """The keys of one worker group's rendezvous (an async Ray actor: a `get` waits without blocking the rest)."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.changed = asyncio.Condition()

    async def set(self, keys: list[str], values: list[bytes]) -> None:
        async with self.changed:
            self.data.update(zip(keys, values))
            self.changed.notify_all()

    async def get(self, keys: list[str], timeout_s: float) -> list[bytes] | None:
        """The values of `keys` once all exist; None after `timeout_s`."""
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(lambda: all(k in self.data for k in keys)), timeout_s)
            except asyncio.TimeoutError:
                return None
            return [self.data[k] for k in keys]

    async def add(self, key: str, amount: int) -> int:
        async with self.changed:
            value = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(value).encode()
            self.changed.notify_all()
            return value

    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """As TCPStore's: `desired` is stored where the key holds `expected` (or is missing and `expected` is
        empty); the value the key then holds (or `expected`, where it is missing)."""
        async with self.changed:
            current = self.data.get(key)
            if (current is None and not expected) or current == expected:
                self.data[key] = desired
                self.changed.notify_all()
                return desired
            return expected if current is None else current

    async def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    async def delete(self, key: str) -> bool:
        return self.data.pop(key, None) is not None

    async def num_keys(self) -> int:
        return len(self.data)


def _bytes(value) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


class RayStore(dist.Store):
    """A `torch.distributed.Store` on a `StoreServer` actor. The C++ side holds this object through a pointer that
    does not keep it alive: its owner (the rank) must."""

    def __init__(self, server, timeout: timedelta):
        super().__init__()
        self.server = server
        self.set_timeout(timeout)
        self.clones: list[RayStore] = []  # kept alive with this one

    def _wait(self, keys: list[str]) -> list[bytes]:
        seconds = self.timeout.total_seconds()
        values = ray.get(self.server.get.remote(keys, seconds))
        if values is None:
            raise dist.DistStoreError(f"wait timeout after {seconds:g} s for keys {keys} of the worker group's store")
        return values

    def set(self, key, value) -> None:
        ray.get(self.server.set.remote([key], [_bytes(value)]))

    def multi_set(self, keys, values) -> None:
        ray.get(self.server.set.remote(list(keys), [_bytes(v) for v in values]))

    def get(self, key) -> bytes:
        return self._wait([key])[0]

    def multi_get(self, keys) -> list[bytes]:
        return self._wait(list(keys))

    def wait(self, keys, timeout=None) -> None:
        if timeout is None:
            self._wait(list(keys))
            return
        before = self.timeout
        self.set_timeout(timeout)
        try:
            self._wait(list(keys))
        finally:
            self.set_timeout(before)

    def add(self, key, amount) -> int:
        return ray.get(self.server.add.remote(key, int(amount)))

    def compare_set(self, key, expected, desired) -> bytes:
        return ray.get(self.server.compare_set.remote(key, _bytes(expected), _bytes(desired)))

    def check(self, keys) -> bool:
        return ray.get(self.server.check.remote(list(keys)))

    def delete_key(self, key) -> bool:
        return ray.get(self.server.delete.remote(key))

    def num_keys(self) -> int:
        return ray.get(self.server.num_keys.remote())

    def clone(self) -> "RayStore":
        self.clones.append(RayStore(self.server, self.timeout))
        return self.clones[-1]


# in a rank's process: its store (the process group's C++ side does not keep a Python store alive) and, in rank
# 0 of a one-node world, the store's folder; both go when the rank leaves (`close_store`)
_own: dict = {}


def new_rendezvous(one_node: bool, store_path: Callable[[], str]) -> tuple[tuple, object | None]:
    """Where a world's ranks meet: ("file", the path `store_path` returns: `new_store_path` called in rank 0)
    where every rank is on one node; else ("ray", a new `StoreServer` actor of the job's Ray), no folder every
    node sees. Second, that actor (None for a file), which its owner kills once the world is gone."""
    if one_node:
        return ("file", store_path()), None
    server = ray.remote(StoreServer).options(num_cpus=0).remote()
    return ("ray", server), server


def new_store_path() -> str:
    """In rank 0: a one-node world's FileStore path, in a new folder (0700, a random name, in this process's
    private TMPDIR) that only this user's processes on this node reach; `close_store` removes it."""
    _own["folder"] = tempfile.mkdtemp(prefix="rayhpc-rendezvous-")
    return os.path.join(_own["folder"], "store")


def open_store(rendezvous: tuple, world_size: int, timeout: timedelta) -> dist.Store:
    """A rank's side of the rendezvous ("file", a `new_store_path`) or ("ray", a `StoreServer` actor), kept
    until `close_store`."""
    kind, where = rendezvous
    _own["store"] = dist.FileStore(where, world_size) if kind == "file" else RayStore(where, timeout)
    return _own["store"]


def close_store() -> None:
    """In a rank, once its process group is gone: its store, and rank 0's folder of a one-node world."""
    _own.pop("store", None)
    if "folder" in _own:
        shutil.rmtree(_own.pop("folder"), ignore_errors=True)
