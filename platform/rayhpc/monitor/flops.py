"""Model FLOPs utilisation (MFU): achieved model FLOP/s over the device's dense peak, as torchtitan reports it.

What is counted: the matmuls, convolutions and attention of one real training step, forward and backward as
they run, by torch's own counter (`torch.utils.flop_counter.FlopCounterMode` and its FLOP formulas). For a
dense model that is the 6 x parameters x tokens convention, less the first layer's input gradient, which
autograd skips because the data needs none (5.6% of the anchor MLP), and less the bias adds. Elementwise
work and the optimizer are not model FLOPs. Peaks are the vendors' dense (no sparsity) figures per GPU, for
the precision each counted FLOP ran in.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.flop_counter import FlopCounterMode

# (name fragment, bf16/fp16 peak, TF32 peak, plain fp32 peak) in FLOP/s; first match wins, so the
# specific names come before the generic ones ("H200 NVL" before "H200", "GH200" before "H200")
PEAKS = (
    ("H100 PCIe", 756e12, 378e12, 51e12),
    ("H100 NVL", 835e12, 418e12, 60e12),
    ("H100", 989.4e12, 494.7e12, 66.9e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("GH200", 989.4e12, 494.7e12, 66.9e12),
    ("H200 NVL", 835e12, 418e12, 60e12),
    ("H200", 989.4e12, 494.7e12, 66.9e12),  # SXM ("NVIDIA H200")
    ("A100", 312e12, 156e12, 19.5e12),
    ("L40S", 362e12, 183e12, 91.6e12),
    ("A10", 125e12, 62.5e12, 31.2e12),
)
CONVOLUTIONS = {torch.ops.aten.convolution, torch.ops.aten._convolution, torch.ops.aten.cudnn_convolution,
                torch.ops.aten.convolution_backward}


class StepFlops:
    """Counts the model FLOPs of the first step it wraps (`with counter.once(): step()`), then steps freely:
    `flops` in all, `conv_flops` of them convolutions (their TF32 peak is their own). `enabled=False` for a
    compiled model: torch.compile does not compile under a dispatch mode, and then runs the code eagerly from
    there on (no FLOPs, no MFU for compiled runs)."""

    def __init__(self, enabled: bool = True):
        self.flops: int | None = None if enabled else 0
        self.conv_flops = 0

    @contextlib.contextmanager
    def once(self):
        if self.flops is not None:
            yield
            return
        with FlopCounterMode(display=False) as counted:
            yield
        by_op = counted.get_flop_counts().get("Global", {})
        self.flops = counted.get_total_flops()
        self.conv_flops = sum(n for op, n in by_op.items() if op in CONVOLUTIONS)


def tf32_matmuls() -> bool:
    return torch.backends.cuda.matmul.fp32_precision == "tf32"


def tf32_convolutions() -> bool:
    """cuDNN runs fp32 convolutions in TF32 unless told otherwise (its default, unlike matmuls)."""
    return torch.backends.cudnn.conv.fp32_precision == "tf32"


def peak_flops(device: torch.device, bf16: bool, conv_share: float = 0.0) -> float | None:
    """The dense peak FLOP/s of `device` for a step whose model FLOPs are `conv_share` convolutions and the
    rest matmuls, each at the precision it runs in; None off GPUs or for a GPU not in the table. A step
    whose matmuls run in fp32 and convolutions in TF32 gets the peak that does both at their own rates."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, half, tf32, fp32 in PEAKS:
        if fragment in name:
            if bf16:
                return half
            matmul, conv = (tf32 if tf32_matmuls() else fp32), (tf32 if tf32_convolutions() else fp32)
            return 1.0 / ((1 - conv_share) / matmul + conv_share / conv)
    return None


def mfu(flops_per_s: float, device: torch.device, bf16: bool, conv_share: float = 0.0) -> float | None:
    """Achieved model FLOP/s of one device over its peak (0..1), or None where the peak is unknown."""
    peak = peak_flops(device, bf16, conv_share)
    return flops_per_s / peak if peak else None
