"""Model FLOPs utilisation (MFU): achieved model FLOP/s over the device's dense peak, as torchtitan reports it.

The model FLOPs of a training step are counted, not estimated from a formula, so any task's model
works: `torch.utils.flop_counter.FlopCounterMode` counts the matmuls, convolutions and attention
of one real step's forward and backward (optimizer and elementwise work are not model FLOPs).
Peaks are the vendors' dense (no sparsity) figures per GPU.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.flop_counter import FlopCounterMode

# (name fragment, bf16/fp16 peak, TF32 peak, plain fp32 peak) in FLOP/s; first match wins, so the
# specific names come before the generic ones
PEAKS = (
    ("H100 PCIe", 756e12, 378e12, 51e12),
    ("H100 NVL", 835e12, 418e12, 60e12),
    ("H100", 989.4e12, 494.7e12, 66.9e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989.4e12, 494.7e12, 66.9e12),
    ("GH200", 989.4e12, 494.7e12, 66.9e12),
    ("A100", 312e12, 156e12, 19.5e12),
    ("L40S", 362e12, 183e12, 91.6e12),
    ("A10", 125e12, 62.5e12, 31.2e12),
)


def peak_flops(device: torch.device, bf16: bool) -> float | None:
    """The dense peak FLOP/s of `device` at the precision its matmuls run in; None off GPUs or for a GPU
    not in the table."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, half, tf32, fp32 in PEAKS:
        if fragment in name:
            if bf16:
                return half
            return tf32 if torch.backends.cuda.matmul.allow_tf32 else fp32
    return None


class StepFlops:
    """Counts the model FLOPs of the first step it wraps (`with counter.once(): step()`), then steps freely.
    `enabled=False` for a compiled model: torch.compile does not compile under the counter's dispatch mode,
    and then runs the code eagerly from there on (no FLOPs, no MFU for compiled runs)."""

    def __init__(self, enabled: bool = True):
        self.flops: int | None = None if enabled else 0

    @contextlib.contextmanager
    def once(self):
        if self.flops is not None:
            yield
            return

        mode = FlopCounterMode(display=False)
        with mode:
            yield
        self.flops = mode.get_total_flops()


def mfu(flops_per_s: float, device: torch.device, bf16: bool) -> float | None:
    """Achieved model FLOP/s of one device over its peak (0..1), or None where the peak is unknown."""
    peak = peak_flops(device, bf16)
    return flops_per_s / peak if peak else None
