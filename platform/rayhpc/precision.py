"""One precision vocabulary for every job's `precision:` (`rayhpc.config.Precision`):

- `fp32`: fp32 throughout;
- `tf32`: fp32 weights and activations, matmuls and convolutions in TF32 on GPUs that have it
  (7-8x the plain fp32 peak on an H100); the same as fp32 on CPUs;
- `bf16`: mixed precision: weights, gradients and the optimizer in fp32, compute in bf16
  (FSDP's `MixedPrecisionPolicy` where FSDP shards the model, `torch.autocast` elsewhere).
"""

from __future__ import annotations

import contextlib

import torch


def set_matmul_precision(precision: str) -> None:
    """TF32 matmuls and convolutions for `tf32` and `bf16` (their fp32 parts), IEEE fp32 for `fp32`;
    process-wide. The `fp32_precision` settings replace the `allow_tf32` flags torch deprecated in 2.9
    (mixing the two is an error in torch); cuDNN's own default is TF32 convolutions, so `fp32` sets both."""
    fp32 = "ieee" if precision == "fp32" else "tf32"
    torch.backends.cuda.matmul.fp32_precision = fp32
    torch.backends.cudnn.conv.fp32_precision = fp32


def autocast(precision: str, device: torch.device, fsdp: bool = False):
    """The forward's context: bf16 autocast on `device` for `bf16`, else nothing. Nothing under FSDP
    (`fsdp`) either: its mixed-precision policy casts the sharded model itself, the one rule of every job."""
    if precision != "bf16" or fsdp:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)
