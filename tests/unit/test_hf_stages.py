"""A transformers model's pipeline stages (`rayhpc.parallel.hf`): split at any decoder layer, the stages run
one after another give the whole model's output and gradients (a plain forward and backward of the model, here),
and together hold each of its parameters once."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from rayhpc.config import ConfigError
from rayhpc.parallel.plan import choose_stage_starts, keep_stage, units

transformers = pytest.importorskip("transformers", reason="the hf extra (pip install 'rayhpc[hf]')")
SMALL = {"vocab_size": 64, "use_cache": False, "bos_token_id": None, "eos_token_id": None,
         "attn_implementation": "eager"}


def build(name: str, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt2":  # embedding dropout 1: a later stage that dropped its input again would zero it
        config = transformers.GPT2Config(n_embd=32, n_layer=4, n_head=4, n_positions=16, resid_pdrop=0.0,
                                         attn_pdrop=0.0, embd_pdrop=1.0,
                                         **SMALL | {"tie_word_embeddings": False} | extra)
        return transformers.GPT2LMHeadModel(config)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[name]
    return cls[1](cls[0](hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, **SMALL | extra))


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen3"])
def test_the_stages_in_turn_are_the_whole_model(name, stages):
    model = build(name)
    x, y = torch.randint(0, 64, (3, 16)), torch.randint(0, 64, (3, 16))
    F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten()).backward()
    layers = units(model)
    assert layers == [f"{'transformer.h' if name == 'gpt2' else 'model.layers'}.{i}" for i in range(4)]
    parts = [keep_stage(copy.deepcopy(model), choose_stage_starts(model, layers[1:], stages), s) for s in range(stages)]
    for part in parts:
        part.zero_grad()
    inputs, outputs = [x], []
    for part in parts:  # each stage's input a leaf, as a pipeline stage receives it; its gradient sent back
        outputs.append(part(inputs[-1]))
        inputs.append(outputs[-1].detach().requires_grad_())
    F.cross_entropy(outputs[-1].flatten(0, 1), y.flatten()).backward()  # the last stage returns the logits
    for output, received in zip(reversed(outputs[:-1]), reversed(inputs[1:-1])):
        output.backward(received.grad)
    whole = dict(model.named_parameters())
    held = [dict(part.named_parameters()) for part in parts]
    assert sorted(n for h in held for n in h) == sorted(whole), "each parameter on exactly one stage"
    for h in held:
        for n, p in h.items():
            want = whole[n].grad if whole[n].grad is not None else torch.zeros_like(whole[n])
            torch.testing.assert_close(p.grad if p.grad is not None else torch.zeros_like(p), want, msg=n)


def test_a_split_names_decoder_layers_in_order():
    model = build("llama")
    with pytest.raises(ConfigError, match=r"pipeline_split: 'model.layer.2' is not a module of the model; close: "
                                          r"model.layers.2"):
        choose_stage_starts(model, ["model.layer.2"], 2)
    assert choose_stage_starts(model, ["model.norm"], 2) == ["model.norm"]  # not a decoder layer: traced
    with pytest.raises(ConfigError, match="model.layers.3, model.layers.1: not in the model's order"):
        choose_stage_starts(model, ["model.layers.3", "model.layers.1"], 3)


def test_tied_embeddings_cannot_sit_on_two_stages():
    model = build("gpt2", tie_word_embeddings=True)
    with pytest.raises(ConfigError, match="GPT2LMHeadModel ties its output embedding to its input embedding"):
        keep_stage(model, ["transformer.h.2"], 0)


def test_qwen3s_plan_keeps_its_norms_whole_and_so_runs_without_replicas():
    from rayhpc.parallel.hf import hf_tp_plan

    model = build("qwen3")
    plan = hf_tp_plan(model)
    assert type(plan["model.layers.3.self_attn.q_norm"]).__name__ == "GradSum"
    assert type(plan["model.layers.3.self_attn.q_proj"]).__name__ == "ColwiseParallel"
    with pytest.raises(ConfigError, match=r"keeps weights whole on every TP rank \(replicated_with_grad_allreduce: "
                                          r"model.layers.\*.self_attn.q_norm, model.layers.\*.self_attn.k_norm\), which runs "
                                          r"without data-parallel replicas only \(dp x fsdp 2\)"):
        hf_tp_plan(model, replicas=2)


def test_a_tied_head_stays_one_parameter_under_tp_or_is_one_error():
    """Sharding modules and `to_empty` give each module its own copy of a shared parameter: `retie` makes
    the copies one again where they are sharded alike, and names both paths where they are not."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from rayhpc.parallel.plan import tied
    from rayhpc.parallel.worker import retie

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank, no socket
    try:
        mesh = init_device_mesh("cpu", (1,))
        for head, same in ((ColwiseParallel, True), (RowwiseParallel, False)):  # Shard(0) as the embedding's, or not
            with torch.device("meta"):
                model = build("llama", tie_word_embeddings=True)
            ties = tied(model)
            assert ties == [["model.embed_tokens.weight", "lm_head.weight"]]
            parallelize_module(model, mesh, {"model.embed_tokens": RowwiseParallel(), "lm_head": head()})
            model.to_empty(device="cpu")
            assert model.lm_head.weight is not model.model.embed_tokens.weight
            if same:
                retie(model, ties)
                assert model.lm_head.weight is model.model.embed_tokens.weight
            else:
                with pytest.raises(ConfigError, match=r"tp_plan: lm_head.weight is tied to model.embed_tokens.weight, "
                                                      r"and the plan shards them differently \(\(Shard\(dim=1\),\) vs "
                                                      r"\(Shard\(dim=0\),\)\)"):
                    retie(model, ties)
    finally:
        dist.destroy_process_group()


def test_gpt2s_shipped_plan_splits_its_conv1d_layers_and_checks_their_widths():
    """transformers ships no plan for GPT-2: rayhpc's shards its Conv1D projections (weights stored (in, out))."""
    from rayhpc.parallel.hf import hf_tp_plan
    from rayhpc.parallel.plan import check_tp_plan

    model = build("gpt2", n_inner=66)
    plan = hf_tp_plan(model)
    assert {path: type(style).__name__ for path, style in plan.items() if ".3." in path} == {
        "transformer.h.3.attn.c_attn": "Conv1DColwise", "transformer.h.3.attn.c_proj": "Conv1DRowwise",
        "transformer.h.3.mlp.c_fc": "Conv1DColwise", "transformer.h.3.mlp.c_proj": "Conv1DRowwise"}
    check_tp_plan(model, plan, 2)
    with pytest.raises(ConfigError, match=r"tp_plan: transformer.h.0.mlp.c_fc \(Conv1D, Conv1DColwise\) splits nf 66, "
                                          r"not divisible by tp \(--tp\) 4"):
        check_tp_plan(model, plan, 4)
    row = "transformer.h.0.mlp.c_proj"
    with pytest.raises(ConfigError, match=rf"tp_plan: {row} \(Conv1D, Conv1DRowwise\) splits nx 66, not divisible"):
        check_tp_plan(model, {row: plan[row]}, 4)
