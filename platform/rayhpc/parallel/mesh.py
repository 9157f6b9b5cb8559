"""Named parallel degrees and the device mesh they make: (pp, dp, tp), TP innermost.

TP innermost keeps each tensor-parallel group on consecutive ranks, which the
worker group packs onto one node where possible: TP exchanges activations at
every layer and needs the fastest links; PP sends one activation per
microbatch and stage, and DP one gradient reduction per step.
"""

from __future__ import annotations

from pydantic import Field

from rayhpc.config import ConfigError, StrictModel

DIMS = ("pp", "dp", "tp")


class Degrees(StrictModel):
    """How many ways each parallelism splits the work."""

    pp: int = Field(1, ge=1, description="pipeline stages (the model split by layer)")
    dp: int = Field(1, ge=1, description="data-parallel replicas (FSDP2 over this dimension)")
    tp: int = Field(1, ge=1, description="tensor-parallel ranks per layer")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def check(self, world_size: int) -> None:
        """Reject degrees whose product is not the world size, naming every factor."""
        if self.world_size != world_size:
            factors = " * ".join(f"{d}({getattr(self, d)})" for d in sorted(DIMS))
            raise ConfigError(f"{factors} = {self.world_size} != world size {world_size}")

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of `rank` (row-major over (pp, dp, tp))."""
        return {"pp": rank // (self.dp * self.tp), "dp": rank // self.tp % self.dp, "tp": rank % self.tp}

    def describe(self, rank: int) -> str:
        return f"rank {rank} ({', '.join(f'{k}={v}' for k, v in self.coords(rank).items())})"


def build_mesh(degrees: Degrees, device_type: str):
    """The `DeviceMesh` over the initialised world: dims named pp, dp, tp."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (degrees.pp, degrees.dp, degrees.tp), mesh_dim_names=DIMS)
