# Tiny random checkpoints written by transformers (the oracle) into a folder, for model and engine tests.
import json
import os

import torch

VOCAB = 96


def llama_like(arch="LlamaForCausalLM", **overrides):
    import transformers
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    config_cls = {"LlamaForCausalLM": transformers.LlamaConfig, "MistralForCausalLM": transformers.MistralConfig,
                  "Qwen2ForCausalLM": transformers.Qwen2Config, "Qwen3ForCausalLM": transformers.Qwen3Config}[arch]
    return config_cls(**common), getattr(transformers, arch)


def opt(**overrides):
    import transformers
    common = dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=256, word_embed_proj_dim=64, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    common.update(overrides)
    return transformers.OPTConfig(**common), transformers.OPTForCausalLM


def write_checkpoint(path, config_and_cls, seed=0, max_shard_size=None):
    """Save a random transformers model to `path` and return the model (float32, eval)."""
    config, cls = config_and_cls
    torch.manual_seed(seed)
    model = cls(config).eval()
    # Random init leaves logits nearly flat; larger weights give peaked, realistic distributions.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model
