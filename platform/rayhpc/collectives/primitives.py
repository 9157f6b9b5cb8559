"""The primitives, each as (run once on a rank, check its result), and their bus-bandwidth factors.

Sizes follow nccl-tests: `size` is the whole buffer one rank sees (for the chunked primitives,
n chunks of size/n), algbw = size / time, busbw = algbw * factor(n), where the factor turns
algbw into the bandwidth each link must carry, comparable with the hardware's peak
(see nccl-tests' doc/PERFORMANCE.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

# nccl-tests' bus-bandwidth factors, by primitive, for n ranks
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "broadcast": lambda n: 1.0,
    "scatter": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce": lambda n: 1.0,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
}
PRIMITIVES = tuple(BUS_FACTOR)
CHUNKED = {"scatter", "gather", "all_gather", "reduce_scatter", "all_to_all"}  # size = n chunks
# torch 2.13 renamed the tensor forms (the old names warn); torch 2.6-2.12 have only the old ones
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def bandwidths(name: str, size_bytes: int, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s."""
    algbw = size_bytes / seconds
    return algbw, algbw * BUS_FACTOR[name](n)


def value(rank: int, k: int, offset: int = 0, device="cpu") -> torch.Tensor:
    """Rank `rank`'s k float32 values; distinct per rank and position, exact in float32 sums."""
    return (torch.arange(k, dtype=torch.float32, device=device) % 4096) + 10_000 * rank + offset


@dataclass
class Case:
    """One primitive at one size on one rank: `run()` performs it, `check()` says what is wrong (or None)."""

    run: Callable[[], None]
    check: Callable[[], str | None]
    size_bytes: int  # the nccl-tests size actually moved (chunked sizes are rounded down to n chunks)
    refill: Callable[[], None] = lambda: None  # restore inputs `run` overwrites: before each run, never timed


def make_case(name: str, size_bytes: int, rank: int, n: int, device) -> Case:
    """The buffers and the call for `name`; the expected results follow from `value`."""
    if name not in BUS_FACTOR:
        raise ValueError(f"primitive {name!r}: expected one of {', '.join(PRIMITIVES)}")
    k = max(1, size_bytes // 4 // (n if name in CHUNKED else 1))  # elements per rank (per chunk if chunked)
    moved = 4 * k * (n if name in CHUNKED else 1)
    run, check, *refill = _BUILDERS[name](rank, n, k, device)
    return Case(run, check, moved, *refill)


def _refilled(t: torch.Tensor, rank: int, k: int, device, reduce: Callable[[], None]):
    """(run, refill) of a reduction that overwrites its input `t` with the result."""
    source = value(rank, k, device=device)
    refill = lambda: t.copy_(source)  # noqa: E731
    refill()
    return reduce, refill


def _mismatch(what: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    if torch.equal(got, want):
        return None
    bad = (got != want).nonzero()[0].tolist()
    return f"{what}: element {bad} is {got[tuple(bad)].item()}, expected {want[tuple(bad)].item()}"


def _broadcast(rank, n, k, device):
    t = value(rank, k, device=device)
    return (lambda: dist.broadcast(t, src=0)), (lambda: _mismatch("broadcast", t, value(0, k, device=device)))


def _scatter(rank, n, k, device):
    out = torch.empty(k, device=device)
    chunks = [value(0, k, offset=i, device=device) for i in range(n)] if rank == 0 else None
    return ((lambda: dist.scatter(out, chunks, src=0)),
            (lambda: _mismatch("scatter", out, value(0, k, offset=rank, device=device))))


def _gather(rank, n, k, device):
    t = value(rank, k, device=device)
    into = [torch.empty(k, device=device) for _ in range(n)] if rank == 0 else None
    want = lambda: torch.stack([value(r, k, device=device) for r in range(n)])  # noqa: E731
    return ((lambda: dist.gather(t, into, dst=0)),
            (lambda: _mismatch("gather", torch.stack(into), want()) if rank == 0 else None))


def _all_gather(rank, n, k, device):
    t, out = value(rank, k, device=device), torch.empty(n * k, device=device)
    want = torch.cat([value(r, k, device=device) for r in range(n)])
    return (lambda: _ALL_GATHER(out, t)), (lambda: _mismatch("all_gather", out, want))


def _reduce(rank, n, k, device):
    t = torch.empty(k, device=device)
    want = sum(value(r, k, device=device) for r in range(n))
    run, refill = _refilled(t, rank, k, device, lambda: dist.reduce(t, dst=0))
    return run, (lambda: _mismatch("reduce", t, want) if rank == 0 else None), refill


def _all_reduce(rank, n, k, device):
    t = torch.empty(k, device=device)
    want = sum(value(r, k, device=device) for r in range(n))
    run, refill = _refilled(t, rank, k, device, lambda: dist.all_reduce(t))
    return run, (lambda: _mismatch("all_reduce", t, want)), refill


def _reduce_scatter(rank, n, k, device):
    t = torch.cat([value(rank, k, offset=c, device=device) for c in range(n)])
    out = torch.empty(k, device=device)
    want = sum(value(r, k, offset=rank, device=device) for r in range(n))
    return (lambda: _REDUCE_SCATTER(out, t)), (lambda: _mismatch("reduce_scatter", out, want))


def _all_to_all(rank, n, k, device):
    # chunk c of rank r goes to rank c; rank r receives chunk r of every rank, in rank order
    t = torch.cat([value(rank, k, offset=c, device=device) for c in range(n)])
    out = torch.empty(n * k, device=device)
    want = torch.cat([value(r, k, offset=rank, device=device) for r in range(n)])
    return (lambda: dist.all_to_all_single(out, t)), (lambda: _mismatch("all_to_all", out, want))


def _send_recv(rank, n, k, device):
    # a ring: every rank sends to the next and receives from the previous, at once
    t, out = value(rank, k, device=device), torch.empty(k, device=device)

    def run():
        ops = [dist.P2POp(dist.isend, t, (rank + 1) % n), dist.P2POp(dist.irecv, out, (rank - 1) % n)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return run, (lambda: _mismatch("send_recv", out, value((rank - 1) % n, k, device=device)))


_BUILDERS = {"broadcast": _broadcast, "scatter": _scatter, "gather": _gather, "all_gather": _all_gather,
             "reduce": _reduce, "all_reduce": _all_reduce, "reduce_scatter": _reduce_scatter,
             "all_to_all": _all_to_all, "send_recv": _send_recv}
