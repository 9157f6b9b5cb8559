"""Hugging Face `transformers` models other than the example Llama, as a user writes them: only the model
differs (the Llama task's data and loss), for tests/ray/test_hf.py and tests/unit/test_packed.py."""

from rayhpc.examples.llama import Llama


class GPT2(Llama):
    """GPT-2's blocks (learned positions, Conv1D layers, LayerNorm), its own untied head: a pipeline's first stage
    holds the token embedding, its last the head."""

    def model(self, hp):
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=hp["dim"], n_layer=hp["layers"], n_head=hp["heads"],
                                          n_positions=hp["block"], tie_word_embeddings=False, use_cache=False,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # as Llama: no dropout
                                          bos_token_id=None, eos_token_id=None, attn_implementation="eager"))


def tie(model):
    """The model as transformers builds it by default for GPT-2 and many small models: its head is its
    token embedding."""
    model.config.tie_word_embeddings = True
    model.tie_weights()
    return model


class GPT2Tied(GPT2):
    """Tied, tensor parallelism shards neither the embedding nor the head."""

    def model(self, hp):
        return tie(super().model(hp))


class LlamaTied(Llama):
    """Tied, tensor parallelism shards both by their vocabulary rows."""

    def model(self, hp):
        return tie(super().model(hp))


class Qwen3(Llama):
    """Qwen3's blocks (RMSNorm on queries and keys per head: their weights replicated on every TP rank)."""

    def model(self, hp):
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config(vocab_size=256, hidden_size=hp["dim"], intermediate_size=2 * hp["dim"],
                                            num_hidden_layers=hp["layers"], num_attention_heads=hp["heads"],
                                            num_key_value_heads=hp["kv_heads"], head_dim=hp["dim"] // hp["heads"],
                                            use_cache=False, bos_token_id=None, eos_token_id=None,
                                            attn_implementation="eager"))
