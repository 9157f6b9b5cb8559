"""Named parallel degrees and the device mesh they make: (pp, dp, fsdp, tp), TP innermost.

TP innermost keeps each tensor-parallel group on consecutive ranks, which the
worker group packs onto one node where possible: TP exchanges activations at
every layer and needs the fastest links; FSDP gathers each unit's parameters in
forward and backward, so its groups come next; PP sends one activation per
microbatch and stage, and DP (replicas) one gradient reduction per step, which
is what slower links between nodes carry best (torchtitan's HSDP: dp_replicate
x dp_shard).
"""

from __future__ import annotations

from pydantic import Field

from rayhpc.config import ConfigError, StrictModel

DIMS = ("pp", "dp", "fsdp", "tp")


class Degrees(StrictModel):
    """How many ways each parallelism splits the work."""

    pp: int = Field(1, ge=1, description="pipeline stages (the model split by layer)")
    dp: int = Field(1, ge=1, description="data-parallel replicas, each a whole copy of the (TP/PP-split) "
                    "model; gradients all-reduced across them")
    fsdp: int = Field(1, ge=1, description="data-parallel ranks that shard the parameters, gradients and "
                      "optimizer state (FSDP2) within each replica; with dp: HSDP")
    tp: int = Field(1, ge=1, description="tensor-parallel ranks per layer")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.fsdp * self.tp

    @property
    def replicas(self) -> int:
        """How many ways each step's batch splits: every dp and fsdp rank trains on its own share."""
        return self.dp * self.fsdp

    @property
    def fsdp_applies(self) -> bool:
        """Whether FSDP2 wraps each rank's stages: wherever there are replicas to average gradients over
        (it then also owns bf16, by its mixed-precision policy)."""
        return self.replicas > 1

    def replica(self, coords: dict[str, int]) -> int:
        """The data share (0 .. replicas - 1) of the rank at `coords`."""
        return coords["dp"] * self.fsdp + coords["fsdp"]

    def check(self, world_size: int) -> None:
        """Reject degrees whose product is not the world size, naming every factor."""
        if self.world_size != world_size:
            factors = " * ".join(f"{d}({getattr(self, d)})" for d in sorted(DIMS))
            raise ConfigError(f"{factors} = {self.world_size} != world size {world_size}")

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of `rank` (row-major over (pp, dp, fsdp, tp))."""
        return {"pp": rank // (self.dp * self.fsdp * self.tp), "dp": rank // (self.fsdp * self.tp) % self.dp,
                "fsdp": rank // self.tp % self.fsdp, "tp": rank % self.tp}

    def describe(self, rank: int) -> str:
        return f"rank {rank} ({', '.join(f'{k}={v}' for k, v in self.coords(rank).items())})"


def build_mesh(degrees: Degrees, device_type: str):
    """The `DeviceMesh` over the initialised world: dims named pp, dp, fsdp, tp."""
    # torch: about 1.5 s to import, only where something trains
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, tuple(getattr(degrees, d) for d in DIMS), mesh_dim_names=DIMS)
