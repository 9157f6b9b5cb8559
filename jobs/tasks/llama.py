"""A Llama-style model from Hugging Face `transformers`, used as transformers builds it: random weights
from a `LlamaConfig` (nothing is downloaded), next-byte prediction on the standard-library source the
GPT example reads (`rayhpc.examples.gpt`). Needs `pip install 'rayhpc[hf]'`.

    python jobs/train_mlp.py --task jobs/tasks/llama.py:Llama --epochs 1 --num-workers 2
    python jobs/tune_mlp.py --task jobs/tasks/llama.py:Llama --num-samples 4 --epochs 2
    python jobs/train_parallel.py --task jobs/tasks/llama.py:Llama --tp 2 --steps 20

The task is only model, data and loss: tensor parallelism takes the model's own plan (transformers ships
one per architecture: attention q/k/v column-wise, o row-wise, the MLP's gate and up column-wise, down
row-wise), and checks that the heads and key-value heads divide by `--tp`.
"""

import math

import torch
import torch.nn.functional as F
from rayhpc.examples.gpt import VAL_SHARE, Windows, corpus


class Llama:
    """A small Llama on bytes (a vocabulary of 256); reports bits per byte beside the loss."""

    hparams = {"block": 64, "dim": 64, "heads": 4, "kv_heads": 2, "layers": 2, "corpus_bytes": 1_000_000}
    space = {"lr": {"loguniform": [3e-4, 3e-3]}}

    def data(self, hp):
        text = torch.frombuffer(bytearray(corpus()[:hp["corpus_bytes"]]), dtype=torch.uint8)
        cut = int(len(text) * (1 - VAL_SHARE))
        return Windows(text[:cut], hp["block"]), Windows(text[cut:], hp["block"])

    def model(self, hp):
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=256, hidden_size=hp["dim"], intermediate_size=4 * hp["dim"],
                             num_hidden_layers=hp["layers"], num_attention_heads=hp["heads"],
                             num_key_value_heads=hp["kv_heads"], max_position_embeddings=hp["block"],
                             bos_token_id=None, eos_token_id=None, use_cache=False,  # training: no KV cache
                             # eager attention: a packed sweep runs the members under torch.func.vmap, which has
                             # no batching rule for SDPA's fused kernels and falls back to a loop over members
                             attn_implementation="eager")
        return LlamaForCausalLM(config)

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())

    def metrics(self, model, batch):
        return {"bits_per_byte": self.loss(model, batch) / math.log(2)}

    def tokens_per_sample(self, hp) -> int:
        """Each sample predicts `block` next bytes: the jobs report tokens/s from it."""
        return hp["block"]
