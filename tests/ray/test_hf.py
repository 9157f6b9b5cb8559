"""A Hugging Face `transformers` model, used unchanged (the example task: a `LlamaForCausalLM` from its config,
its loss `model(input_ids=x).logits`): tensor parallelism takes the model's own plan and equals one plain
process; data parallelism equals the plain loop; what model parallelism cannot serve is one line before Ray."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from helpers import ROOT, run_job_warm
from rayhpc.config import validate
from rayhpc.data import DataConfig
from rayhpc.engine.checkpoint import load_full_state_dict
from rayhpc.parallel import ParallelConfig, run_parallel
from rayhpc.task import task_for
from rayhpc.train import TrainConfig, run_training

pytest.importorskip("transformers", reason="the hf extra (pip install 'rayhpc[hf]')")

LLAMA = f"{ROOT}/jobs/tasks/llama.py:Llama"
HP = {"block": 16, "dim": 32, "heads": 4, "kv_heads": 2, "layers": 2, "corpus_bytes": 6000}
SEED, LR, BATCH = 5, 3e-3, 8
SGD_LR = 0.2


# GPT-2 and Qwen3 as tasks, beside the example Llama
MODELS = {"llama": LLAMA, "gpt2": f"{ROOT}/tests/tasks/hf_models.py:GPT2",
          "gpt2 tied": f"{ROOT}/tests/tasks/hf_models.py:GPT2Tied", "llama tied": f"{ROOT}/tests/tasks/hf_models.py:LlamaTied",
          "qwen3": f"{ROOT}/tests/tasks/hf_models.py:Qwen3"}


def plain_loop(steps: int, task_path: str = LLAMA, hp: dict = HP, optimizer=torch.optim.Adam, lr: float = LR):
    """One process, the model itself (no stand-in, no plan): torch's `optimizer`, the batches of a plain
    `DataLoader(sampler=DistributedSampler(shuffle=True, seed))` with `set_epoch`, the task's loss."""
    task = task_for(task_path, DataConfig())
    hp = {**hp, "seed": SEED}
    train, _ = task.obj.data(hp)
    torch.manual_seed(SEED)
    model = task.obj.model(hp)
    optimizer = optimizer(model.parameters(), lr=lr)
    sampler, losses, epoch = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=SEED), [], 0
    while len(losses) < steps:
        sampler.set_epoch(epoch)
        for x, y in DataLoader(train, batch_size=BATCH, sampler=sampler):
            if len(losses) == steps:
                break
            loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        epoch += 1
    return losses, {name: p.detach() for name, p in model.named_parameters()}


# 4 layers: pipeline stages split at a decoder layer deep in the model (`model.layers.2`, `transformer.h.2`)
DEEP = {**HP, "layers": 4}
LAYOUTS = {
    "llama tied tp2": ("llama tied", HP, {"tp": 2}),
    "llama pp2": ("llama", DEEP, {"pp": 2, "microbatches": 2, "schedule": "1f1b"}),
    "llama tp2 x pp2": ("llama", DEEP, {"tp": 2, "pp": 2, "microbatches": 2, "schedule": "1f1b"}),
    "gpt2 pp2": ("gpt2", DEEP, {"pp": 2, "microbatches": 2, "schedule": "gpipe"}),
    "gpt2 tied tp2": ("gpt2 tied", HP, {"tp": 2}),
    "gpt2 tp2 x pp2": ("gpt2", DEEP, {"tp": 2, "pp": 2, "microbatches": 2, "schedule": "gpipe"}),
    "qwen3 tp2 x pp2": ("qwen3", DEEP, {"tp": 2, "pp": 2, "microbatches": 2, "schedule": "1f1b"}),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_transformers_model_under_model_parallelism_equals_one_process(layout, ray_address, tmp_path, caplog):
    """No tp_plan and no pipeline_split in the task: the model's own TP plan (q/k/v/gate/up column-wise, o/down
    row-wise, the embedding's rows and the head's columns), stages split at its decoder layers, its RoPE buffers
    (not in its state dict) on every rank as the model made them; the loss calls `model(input_ids=x).logits`.
    SGD: Adam turns the float rounding of microbatches' summed gradients into lr-sized steps where a gradient
    is near zero."""
    model, hp, parallelism = LAYOUTS[layout]
    cfg = ParallelConfig(task=MODELS[model], hparams=hp, parallelism=parallelism, seed=SEED, steps=4,
                         optim={"optimizer": "sgd", "lr": SGD_LR}, global_batch_size=BATCH, storage_path=tmp_path,
                         name="hf", compute={"cpus_per_worker": 0.5})
    caplog.set_level(logging.DEBUG, logger="rayhpc.parallel.trainer")
    result = run_parallel(cfg, log_level=logging.DEBUG)
    losses, weights = plain_loop(4, MODELS[model], hp, torch.optim.SGD, SGD_LR)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(losses))
    assert sorted(result.weights) == sorted(weights)
    # the start-up line counts the model's parameters, each tied weight once and no buffer (RoPE's inv_freq)
    assert f"{sum(w.numel() for w in weights.values()):,} parameters, " in caplog.text, caplog.text
    for name, want in weights.items():  # a few float roundings apart: TP sums partial products in another order
        torch.testing.assert_close(result.weights[name], want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")


# a row every step: sent at once (metrics_send_s 0), and held back to the epoch's end (the default's 30 s); GPT-2
# as transformers builds it, its head tied to its token embedding (FSDP2 refuses a weight that two of its groups hold)
@pytest.mark.parametrize("strategy, send_s, model", [("ddp", 0, "llama"), ("fsdp", 30, "llama"),
                                                     ("fsdp", 0, "gpt2 tied")])
def test_a_transformers_model_under_ddp_and_fsdp2_on_two_workers_equals_the_plain_loop(strategy, send_s, model,
                                                                                      ray_address, tmp_path):
    cfg = validate(TrainConfig, {"task": MODELS[model], "hparams": HP, "seed": SEED, "steps": 4, "strategy": strategy,
                                 "storage_path": str(tmp_path), "name": strategy, "compute": {"num_workers": 2},
                                 "batch_size_per_worker": BATCH // 2, "optim": {"optimizer": "adam", "lr": LR},
                                 "metrics_every_steps": 1, "metrics_send_s": send_s})
    run = run_training(cfg)
    losses, weights = plain_loop(4, MODELS[model])
    rows = run.metrics.sort_values("global_step")
    steps, epoch = rows[rows["kind"] == "step"], rows[rows["kind"] == "epoch"]  # the run's last step ends its epoch
    assert steps["global_step"].tolist() == [1, 2, 3] and epoch["global_step"].tolist() == [4], rows
    torch.testing.assert_close(torch.tensor([*steps["loss"], *epoch["loss"]]),
                               torch.tensor([*losses[:3], sum(losses) / 4]), check_dtype=False)
    got = load_full_state_dict(run.checkpoint_dir)
    # the tied weight's gradient sums the embedding's and the head's parts, which FSDP2 adds in another order
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if "tied" in model else {}
    for name, want in weights.items():
        torch.testing.assert_close(got[name], want, **tolerance, msg=lambda m: f"{name}: {m}")


ODD_LOSSES = '''
import torch.nn.functional as F
from rayhpc.examples.llama import Llama


class Flipped(Llama):
    def loss(self, model, batch):  # the model called on something made of the inputs: no rank has them
        x, y = batch
        return F.cross_entropy(model(input_ids=x.flip(1)).logits.flatten(0, 1), y.flatten())


class OnTargets(Llama):
    def loss(self, model, batch):  # the model called on other inputs than the batch's: no rank computes that
        x, y = batch
        return F.cross_entropy(model(input_ids=y).logits.flatten(0, 1), y.flatten())


class BadSplit(Llama):
    def pipeline_split(self, model):
        return ["model.layer.1"]


class Tied(Llama):
    def model(self, hp):
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=hp["dim"], n_layer=hp["layers"], n_head=hp["heads"],
                                          n_positions=hp["block"], bos_token_id=None, eos_token_id=None))


class NoPlan(Llama):  # OPT: neither transformers nor rayhpc ships a tensor-parallel plan for it
    def model(self, hp):
        from transformers import OPTConfig, OPTForCausalLM

        return OPTForCausalLM(OPTConfig(vocab_size=256, hidden_size=hp["dim"], num_hidden_layers=hp["layers"],
                                        num_attention_heads=hp["heads"], ffn_dim=4 * hp["dim"],
                                        max_position_embeddings=hp["block"], word_embed_proj_dim=hp["dim"]))
'''
FAILS_ON_THE_OUTPUT = ("loss(model, batch) fails on the model's output for the batch's inputs, as model parallelism "
                       "gives it (AttributeError: 'NoneType' object has no attribute 'flip'); the loss must call the "
                       "model once, on batch[0], and score what it returns")


@pytest.mark.parametrize("case, expected", [
    ("heads", "error: parallelism.tp (--tp) 4: the model's num_key_value_heads 2 is not divisible by it "
              "(LlamaConfig: num_attention_heads 4, num_key_value_heads 2)"),
    ("Flipped", "error: task (--task) {task}: " + FAILS_ON_THE_OUTPUT),
    ("OnTargets", "error: task (--task) {task}: loss(model, batch) is "),  # then its two values
    ("BadSplit", "error: pipeline_split: 'model.layer.1' is not a module of the model; close: model.layers.1"),
    ("Tied", "error: parallelism.pp (--pp): GPT2LMHeadModel ties its output embedding to its input embedding"),
    ("NoPlan", "error: task (--task) {task}: OPTForCausalLM has no tensor-parallel plan in transformers or "
               "rayhpc, and the task no tp_plan(model), which tensor parallelism (--tp 2) needs"),
])
def test_what_model_parallelism_cannot_serve_is_one_line_before_ray_starts(case, expected, tmp_path):
    task = tmp_path / "odd_losses.py"
    task.write_text(ODD_LOSSES)
    args = ["--task", LLAMA, "--tp", "4", "--cpus-per-worker", "0.5"] if case == "heads" else \
        ["--task", f"{task}:{case}", *(("--pp", "2", "--steps", "2") if case in ("BadSplit", "Tied") else ("--tp", "2"))]
    proc = run_job_warm("train_parallel.py", "--storage-path", str(tmp_path), *args,
                        "--hp", ",".join(f"{k}={v}" for k, v in HP.items()), env={"RAY_TMPDIR": str(tmp_path / "ray")})
    assert proc.returncode == 2 and proc.stderr.startswith(expected.format(task=f"{task}:{case}")), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "ray").exists(), "Ray was started before the input was rejected"
