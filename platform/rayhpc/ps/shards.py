"""Which server holds which parameters: balanced by size, a parameter split only when it is larger than
a shard. Each server keeps its pieces as one flat fp32 tensor (one object to pull, one to push); the
optimisers the platform offers (SGD, Adam) act element by element, so stepping a flat shard equals
stepping the parameters it was cut from."""

from __future__ import annotations

import dataclasses
import math

import torch

from rayhpc.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of the flattened parameter `name`."""

    name: str
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class Layout:
    """`servers[j]`: the pieces server j holds, in the order of its flat tensor."""

    servers: tuple[tuple[Piece, ...], ...]
    shapes: dict[str, tuple[int, ...]]

    def sizes(self) -> list[int]:
        return [sum(p.size for p in pieces) for pieces in self.servers]

    def flatten(self, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """One flat tensor per server from whole parameters (or their gradients) by name."""
        return [torch.cat([tensors[p.name].reshape(-1)[p.start:p.stop] for p in pieces]) for pieces in self.servers]

    def scatter(self, flats: list[torch.Tensor], into: dict[str, torch.Tensor]) -> None:
        """Copy each server's flat tensor into the whole parameters `into` (by name), in place."""
        for pieces, flat in zip(self.servers, flats):
            offset = 0
            for p in pieces:
                into[p.name].view(-1)[p.start:p.stop].copy_(flat[offset:offset + p.size])
                offset += p.size

    def gather(self, flats: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole parameters, new tensors, from the servers' flat tensors."""
        out = {name: torch.empty(shape, dtype=flats[0].dtype) for name, shape in self.shapes.items()}
        self.scatter(flats, out)
        return out


def plan(shapes: dict[str, tuple[int, ...]], num_servers: int) -> Layout:
    """Balance the parameters (name -> shape) over `num_servers`: largest first onto the least-loaded
    server; a parameter larger than a shard (ceil(total / servers) elements) is first cut into
    contiguous pieces of at most a shard."""
    total = sum(math.prod(s) for s in shapes.values())
    if num_servers > total:
        raise ConfigError(f"compute.num_servers (--num-servers) {num_servers}: more than the model's {total} "
                          "parameter elements")
    shard = math.ceil(total / num_servers)
    pieces = []
    for name, shape in shapes.items():
        n = math.prod(shape)
        cuts = math.ceil(n / shard)
        bounds = [round(i * n / cuts) for i in range(cuts + 1)]
        pieces += [Piece(name, a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    servers: list[list[Piece]] = [[] for _ in range(num_servers)]
    loads = [0] * num_servers
    for piece in sorted(pieces, key=lambda p: -p.size):  # stable: equal sizes keep the model's order
        j = loads.index(min(loads))
        servers[j].append(piece)
        loads[j] += piece.size
    return Layout(tuple(tuple(s) for s in servers), {k: tuple(v) for k, v in shapes.items()})
