"""Tensor parallelism: Megatron-style plans as plain dicts, applied with `parallelize_module`.

A column-parallel linear splits its output features over the TP ranks and a
following row-parallel linear splits its input features and sums the partial
results: one all-reduce per column/row pair, nothing in between (the ReLU or
the attention heads work on local shards).
"""

from __future__ import annotations

from torch import nn


def mlp_plan(stage: nn.Module) -> dict:
    """Alternate column- and row-parallel over the stage's Linear layers; a final column-parallel
    layer (odd count) gathers its output so the stage hands on a whole tensor."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    names = [name for name, m in stage.named_modules() if isinstance(m, nn.Linear)]
    plan = {}
    for i, name in enumerate(names):
        if i % 2:
            plan[name] = RowwiseParallel()
        elif i == len(names) - 1:
            plan[name] = ColwiseParallel(output_layouts=Replicate())
        else:
            plan[name] = ColwiseParallel()
    return plan


def transformer_plan(stage: nn.Module) -> dict:
    """Per block: q, k, v column-parallel (each rank gets heads / tp whole heads), the output
    projection row-parallel; the feed-forward as a column/row pair. Norms stay replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for name, m in stage.named_modules():
        if m.__class__.__name__ == "TransformerBlock":
            for proj in ("attn.wq", "attn.wk", "attn.wv", "ffn.w1"):
                plan[f"{name}.{proj}"] = ColwiseParallel()
            for proj in ("attn.wo", "ffn.w2"):
                plan[f"{name}.{proj}"] = RowwiseParallel()
    return plan
