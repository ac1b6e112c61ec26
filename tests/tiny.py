# Tiny random checkpoints written by transformers (the oracle) into a folder, for model and engine
# tests.
import json
import os

import torch

VOCAB = 96


def llama_like(arch="LlamaForCausalLM", **overrides):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    config_cls = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
    }[arch]
    return config_cls(**common), getattr(transformers, arch)


def opt(**overrides):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        ffn_dim=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        word_embed_proj_dim=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    common.update(overrides)
    return transformers.OPTConfig(**common), transformers.OPTForCausalLM


def write_checkpoint(path, config_and_cls, seed=0, max_shard_size=None):
    """Save a random transformers model to `path` and return the model (float32, eval)."""
    config, cls = config_and_cls
    torch.manual_seed(seed)
    model = cls(config).eval()
    # Random init leaves logits nearly flat; larger weights give peaked, realistic distributions.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model


def write_mlp_speculator(
    path,
    emb_dim,
    vocab=VOCAB,
    n_predict=4,
    inner_dim=0,
    tie_weights=False,
    scale_input=True,
    seed=0,
):
    """A random speculator in the ibm-fms accelerator layout (config.json + `speculator.*`
    tensors)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    inner = inner_dim or emb_dim
    tensors = {}
    for i in range(n_predict):
        # tied: one emb/head/ln for all heads, one proj for heads >= 1
        if tie_weights and i > (1 if i else 0):
            continue
        tensors[f"speculator.proj.{i}.weight"] = (
            torch.randn(inner, emb_dim if i == 0 else inner, generator=g) * 0.1
        )
        if tie_weights and i > 0:
            continue
        tensors[f"speculator.emb.{i}.weight"] = torch.randn(vocab, inner, generator=g) * 0.1
        tensors[f"speculator.head.{i}.weight"] = torch.randn(vocab, inner, generator=g) * 0.1
        tensors[f"speculator.ln.{i}.weight"] = 1 + 0.1 * torch.randn(inner, generator=g)
        tensors[f"speculator.ln.{i}.bias"] = 0.1 * torch.randn(inner, generator=g)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    config = dict(
        model_type="mlp_speculator",
        architectures=["MLPSpeculatorPreTrainedModel"],
        emb_dim=emb_dim,
        inner_dim=inner_dim,
        n_predict=n_predict,
        vocab_size=vocab,
        tie_weights=tie_weights,
        scale_input=scale_input,
        torch_dtype="float32",
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


# UTF-8 bytes of é (C3 A9), € (E2 82 AC) and 😀 (F0 9F 98 80): with them, write_char_tokenizer's
# multibyte variant spells these characters over 2-4 tokens.
BYTE_TOKENS = [0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98, 0x80]


def write_char_tokenizer(path, multibyte=False, chat_template=None):
    """A 96-token character tokenizer (id 0 = <unk>, then printable ASCII), so text-level
    features (stop strings, prompts as text) can be tested on tiny random models. Id 2 is '!',
    the tiny EOS. multibyte: the last 9 ids ('v' .. '~') are UTF-8 bytes instead (BYTE_TOKENS,
    byte fallback), so random output splits characters across tokens. chat_template: written
    to tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models

    chars = [chr(c) for c in range(32, 127)]
    if multibyte:
        chars[-len(BYTE_TOKENS) :] = [f"<0x{b:02X}>" for b in BYTE_TOKENS]
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    model = models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=multibyte)
    tokenizer = Tokenizer(model)
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    if chat_template:
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump({"chat_template": chat_template}, f)


def cheap_verification(llm):
    """Make an auto-K engine's chooser see verification as costing the same at every size, so it
    drafts whenever a request's drafts get accepted. What auto K decides otherwise follows this
    machine's timings (a noisy profile can make it keep K = 0 throughout); tests of exactness
    under changing K need drafts."""
    chooser = llm.scheduler.chooser
    chooser.verify_time, chooser.key_time = {size: 1.0 for size in chooser.verify_time}, 0.0
    return llm
