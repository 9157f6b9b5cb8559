"""Hugging Face `transformers` models under model parallelism, used unchanged: tensor parallelism takes the
model's own plan, and a pipeline stage is the whole model with the decoder layers it does not hold made
pass-throughs, so transformers' own forward runs the stack's part on every stage.

A stage is split at decoder layers (`model.layers.8`, GPT-2's `transformer.h.8`): the first holds the
embeddings, the last the final norm and the head. A later stage takes the previous stage's hidden states
as `inputs_embeds` and hands them to its first layer (a forward pre-hook), so what the base model computes
before its layers (position embeddings, dropout) on that stage is discarded; the modules with weights there
are stand-ins without any. Parameter names stay the whole model's, as on every stage of every model.
"""

from __future__ import annotations

import functools
import re
from collections import OrderedDict

import torch
from torch import nn

from rayhpc.config import ConfigError


def is_transformers(model: nn.Module) -> bool:
    """A `transformers` model (a `PreTrainedModel`: a config, and its base model)."""
    return hasattr(model, "config") and isinstance(getattr(model, "base_model", None), nn.Module)


def decoder_stack(model: nn.Module) -> str | None:
    """The path of a transformers model's decoder stack: the ModuleList of its base model's
    `config.num_hidden_layers` blocks (Llama's and Qwen's `model.layers`, GPT-2's `transformer.h`); None for
    a model that has none."""
    count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if not is_transformers(model) or not isinstance(count, int):
        return None
    base = model.base_model
    prefix = next(path for path, module in model.named_modules() if module is base)
    for name, child in base.named_children():
        if isinstance(child, nn.ModuleList) and len(child) == count:
            return f"{prefix}.{name}" if prefix else name
    return None


def layer_units(model: nn.Module, stack: str) -> list[str]:
    """The decoder layers, where pipeline stages may begin."""
    return [f"{stack}.{i}" for i in range(len(model.get_submodule(stack)))]


class _Skip(nn.Module):
    """A module a stage does not hold: it passes its first argument through (a decoder layer's hidden
    states, a final norm's input)."""

    def forward(self, hidden_states, *_args, **_kwargs):
        return hidden_states


class _Zeros(nn.Module):
    """An embedding a later stage does not hold (GPT-2's positions): zeros of its shape, which the stage's
    first layer replaces with the hidden states it received."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.dim, device=ids.device)


def keep_stage(model: nn.Module, stack: str, starts: list[str], stage: int) -> nn.Module:
    """`model` as pipeline stage `stage` of `len(starts) + 1`, in place: the layers from `starts[stage - 1]` up
    to `starts[stage]`, the embeddings on the first stage, the final norm and head on the last; its forward
    takes the stage's input (input ids on the first stage, else hidden states) and returns the next stage's
    (hidden states; on the last, the model output's first field: the logits)."""
    if starts:
        check_untied(model)
    layers, base = model.get_submodule(stack), model.base_model
    bounds = [0, *(int(s.rpartition(".")[2]) for s in starts), len(layers)]
    held = range(bounds[stage], bounds[stage + 1])
    first, last = stage == 0, stage == len(starts)
    for i in range(len(layers)):
        if i not in held:
            layers[i] = _Skip()
    children = list(base.named_children())
    at = [child for _, child in children].index(layers)
    for i, (name, child) in enumerate(children):  # before the stack on later stages, after it on earlier ones
        if i != at and any(True for _ in child.parameters()) and ((i < at and not first) or (i > at and not last)):
            setattr(base, name, _Zeros(child.embedding_dim) if isinstance(child, nn.Embedding) else _Skip())
    if not last:  # the head (the model's other children) on the last stage only
        for name, child in list(model.named_children()):
            if child is not base:
                setattr(model, name, None)
    received: dict[str, torch.Tensor] = {}  # the stage's input, while its forward runs
    if held and not first:
        # the stage's first layer takes the received hidden states as they are: what the base model added before
        # its layers (GPT-2's position embeddings and dropout) was added on the first stage already. One hook for
        # the stage's life: a compiled block would recompile for a hook registered per call
        layers[held.start].register_forward_pre_hook(lambda _m, args: (received["x"], *args[1:]), prepend=True)
    # an instance attribute, not a wrapper module: the names stay the model's and FSDP sees the model itself
    model.forward = functools.partial(_stage_forward, model, received, first, last)
    return model


def _stage_forward(model: nn.Module, received: dict, first: bool, last: bool, x: torch.Tensor):
    received["x"] = x
    inputs = {"input_ids": x} if first else {"inputs_embeds": x}
    if last:  # the class's forward: the instance's is this function
        return type(model).forward(model, **inputs, use_cache=False)[0]
    return model.base_model(**inputs, use_cache=False)[0]


def check_untied(model: nn.Module) -> None:
    """The input and output embeddings are separate weights: the first and the last stage hold one each."""
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if outputs is not None and inputs.weight is outputs.weight:
        raise ConfigError(f"parallelism.pp (--pp): {type(model).__name__} ties its output embedding to its input "
                          "embedding (config.tie_word_embeddings), and the first and the last pipeline stage hold "
                          "one each; build it with tie_word_embeddings=False")


def output_field(output) -> tuple[type, str] | None:
    """A transformers `ModelOutput`'s class and first field (`logits`): what a pipeline's last stage returns
    (a tensor) is given to the task's loss as that class again. None for any other output."""
    if not (isinstance(output, OrderedDict) and hasattr(output, "to_tuple") and output.keys()):
        return None
    return type(output), next(iter(output.keys()))


def is_conv1d(module: nn.Module) -> bool:
    """transformers' `Conv1D` (GPT-2's projections): a Linear whose weight is stored transposed, (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _hf_style(name: str, conv1d: bool = False):
    """Hugging Face's TP style `name` (a `_tp_plan` value) as torch's own style, the layouts transformers
    registers for it (`transformers.distributed.tensor_parallel`), for a `Conv1D` where `conv1d`; None for
    one without a torch equivalent."""
    from torch.distributed.tensor import Replicate  # DTensor: only where a run shards

    col, row = _conv1d_styles() if conv1d else _linear_styles()
    return {"colwise": col, "rowwise": row,
            "colwise_rep": lambda: col(output_layouts=Replicate()),
            "colwise_gather_output": lambda: col(output_layouts=Replicate()),
            "rowwise_rep": lambda: row(input_layouts=Replicate()),
            "rowwise_split_input": lambda: row(input_layouts=Replicate()),
            "embedding_rowwise": lambda: row(input_layouts=Replicate()),
            GRAD_SUM: _grad_sum}.get(name, lambda: None)()


def _linear_styles():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return ColwiseParallel, RowwiseParallel


@functools.cache
def _conv1d_styles():
    """torch's column- and row-wise styles for a `Conv1D`: the same layouts of inputs and outputs, its
    (in, out) weight sharded on the other dimension than a Linear's (out, in)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    def apply(style, module: nn.Module, mesh, shards: dict):
        def partition(_name, mod, mesh):
            for key, placement in shards.items():
                param = getattr(mod, key)
                mod.register_parameter(key, nn.Parameter(distribute_tensor(
                    param, mesh, [placement], src_data_rank=style.src_data_rank), requires_grad=param.requires_grad))

        # torch's styles bind their layouts into these two functions in `_apply` the same way
        return distribute_module(module, mesh, partition,
                                 functools.partial(style._prepare_input_fn, style.input_layouts,
                                                   style.desired_input_layouts),
                                 functools.partial(style._prepare_output_fn, style.output_layouts,
                                                   style.use_local_output))

    class Conv1DColwise(ColwiseParallel):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            return apply(self, module, device_mesh, {"weight": Shard(1), "bias": Shard(0)})

    class Conv1DRowwise(RowwiseParallel):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            self.desired_input_layouts = (Shard(-1),)  # as torch's for a Linear: each rank its input features
            return apply(self, module, device_mesh, {"weight": Shard(0), "bias": Replicate()})

    return Conv1DColwise, Conv1DRowwise


# Plans for transformers models that ship none, as their base model's (`base_model_tp_plan`). GPT-2 fuses
# q, k and v into one Conv1D and splits its output by the full width, so that output is gathered and every
# TP rank runs attention over all heads; the projections' weights and the MLP are split.
SHIPPED_PLANS = {"gpt2": {"h.*.attn.c_attn": "colwise_rep", "h.*.attn.c_proj": "rowwise_rep",
                          "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"}}


GRAD_SUM = "replicated_with_grad_allreduce"  # Qwen3's per-head query and key norms


def _grad_sum():
    """transformers' `replicated_with_grad_allreduce`: the weights stay whole on every TP rank, each rank
    uses them on its own heads, so a weight's gradient is the sum of the TP ranks' (a gradient hook)."""
    from torch.distributed.tensor.parallel import ParallelStyle

    class GradSum(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:  # the one method of torch's style contract
            # hooked at the first forward: the stage is planned on the meta device, and `to_empty` then makes
            # new parameters, without the hooks of the old
            module.register_forward_pre_hook(functools.partial(_hook_grads, group=device_mesh.get_group()))
            return module

    return GradSum()


def _hook_grads(module: nn.Module, _args, group) -> None:
    for param in module.parameters():
        if not getattr(param, "_rayhpc_summed", False):
            param.register_hook(functools.partial(_summed, group=group))
            param._rayhpc_summed = True


def _summed(grad: torch.Tensor, group) -> torch.Tensor:
    grad = grad.clone()
    torch.distributed.all_reduce(grad, group=group)
    return grad


def hf_tp_plan(model: nn.Module, replicas: int = 1) -> dict | None:
    """A `transformers` model's own TP plan, for a task that writes none: its config's `base_model_tp_plan`
    (under the base model's prefix) and the model's `_tp_plan` (the head's, and in transformers 5 the whole
    plan), or the plan rayhpc ships for its `model_type` (`SHIPPED_PLANS`); each wildcard
    (`layers.*.mlp.up_proj`) expanded over the modules `model` holds (a pipeline stage holds some). None for
    a model without one."""
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or SHIPPED_PLANS.get(getattr(config, "model_type", None), {})
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):  # a head model around its base model
        base = {f"{prefix}.{path}": style for path, style in base.items()}
    plan = {**base, **(getattr(model, "_tp_plan", None) or {})}
    if not plan:
        return None
    if replicas > 1 and GRAD_SUM in plan.values():  # FSDP2 makes new parameters: the gradient hooks would be lost
        raise ConfigError(f"tp_plan: {type(model).__name__}'s own plan keeps weights whole on every TP rank ({GRAD_SUM}: "
                          f"{', '.join(k for k, v in plan.items() if v == GRAD_SUM)}), which runs without data-parallel "
                          f"replicas only (dp x fsdp {replicas}); give the task a tp_plan(model)")
    # the modules with weights of their own (a stage's stand-ins for what it does not hold have none)
    modules, found = [path for path, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))], {}
    for pattern, name in plan.items():
        if _hf_style(name) is None:
            raise ConfigError(f"tp_plan: {type(model).__name__}'s own plan shards {pattern} as {name!r}, which has "
                              "no torch style here; give the task a tp_plan(model)")
        regex = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))
        found.update({path: _hf_style(name, is_conv1d(model.get_submodule(path)))
                      for path in modules if regex.fullmatch(path)})
    return found


def check_hf_heads(model: nn.Module, tp: int) -> None:
    """A `transformers` model's attention heads and key-value heads: tensor parallelism splits q, k and v by
    whole heads."""
    config = getattr(model, "config", None)
    heads = {name: getattr(config, name, None) for name in ("num_attention_heads", "num_key_value_heads")}
    for name, count in heads.items():
        if isinstance(count, int) and count % tp:
            have = ", ".join(f"{n} {c}" for n, c in heads.items() if c is not None)
            raise ConfigError(f"parallelism.tp (--tp) {tp}: the model's {name} {count} is not divisible by it "
                              f"({type(config).__name__}: {have})")


