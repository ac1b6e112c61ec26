# Every architecture's logits through the paged cache match transformers (the oracle) in float32: a
# prefill chunk, several single-token decode steps and a verify-shaped multi-token step, block size
# 4.
import gc
import itertools
import os

import pytest
import tiny
import torch

from nanospec import LLM, SamplingParams
from sequence import Sequence

CASES = {
    "llama": lambda: tiny.llama_like(),
    "llama-tied": lambda: tiny.llama_like(tie_word_embeddings=True),
    "llama3-rope": lambda: tiny.llama_like(
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        )
    ),
    "llama-bias": lambda: tiny.llama_like(attention_bias=True, mlp_bias=True),
    "mistral": lambda: tiny.llama_like("MistralForCausalLM", sliding_window=None),
    "qwen2": lambda: tiny.llama_like("Qwen2ForCausalLM"),
    "qwen3": lambda: tiny.llama_like("Qwen3ForCausalLM", head_dim=32),
    "opt": lambda: tiny.opt(),
    "opt-project-in-out": lambda: tiny.opt(word_embed_proj_dim=32),
    "opt-post-norm": lambda: tiny.opt(do_layer_norm_before=False),
}


def paged_logits(llm, batch_chunks):
    """Feed each sequence's tokens chunk by chunk (all sequences in one forward per step) and
    collect the logits of every fed position."""
    seqs = [Sequence(tokens, SamplingParams(), "cpu") for tokens, _ in batch_chunks]
    logits = [[] for _ in seqs]
    for step in range(max(len(chunks) for _, chunks in batch_chunks)):
        batch = []
        for seq, (tokens, chunks) in zip(seqs, batch_chunks):
            if step < len(chunks):
                start = sum(chunks[:step])
                assert llm.blocks.ensure_slots(seq, start + chunks[step])
                batch.append((seq, tokens[start : start + chunks[step]], start))
        with torch.inference_mode():
            out = llm.model.lm_head(llm.forward(llm.model, batch))
        query_start = [0, *itertools.accumulate(len(tokens) for _, tokens, _ in batch)]
        for (seq, _, _), lo, hi in zip(batch, query_start[:-1], query_start[1:]):
            logits[seqs.index(seq)].append(out[lo:hi])
    return [torch.cat(parts) for parts in logits]


@pytest.mark.parametrize("name", CASES)
def test_logits_match_transformers(name, tmp_path):
    hf = tiny.write_checkpoint(tmp_path, CASES[name]())
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_blocks=32)
    g = torch.Generator().manual_seed(1)
    a = torch.randint(3, tiny.VOCAB, (17,), generator=g).tolist()
    b = torch.randint(3, tiny.VOCAB, (9,), generator=g).tolist()
    # a: prefill 7, four decode steps, a verify-shaped step of 3, then 3 more; b: prefill 5,
    # decodes.
    ours = paged_logits(llm, [(a, [7, 1, 1, 1, 1, 3, 3]), (b, [5, 1, 1, 1, 1])])
    for tokens, got in zip((a, b), ours):
        with torch.no_grad():
            ref = hf(torch.tensor([tokens])).logits[0]
        assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["llama", "qwen3", "opt", "opt-post-norm"])
def test_forward_of_kept_rows_equals_those_rows_of_all(name, tmp_path):
    """The step finishes only the rows it samples from (keep): the same bits as those rows of
    the whole forward; and every row's K/V is still written: a decode step after a forward that
    kept no row gives the logits a whole prefill gives."""
    tiny.write_checkpoint(tmp_path, CASES[name]())
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_blocks=32)
    tokens = list(range(3, 14))
    whole_seq, kept_seq = (Sequence(tokens + [20], SamplingParams(), "cpu") for _ in range(2))
    assert llm.blocks.ensure_slots(whole_seq, 12) and llm.blocks.ensure_slots(kept_seq, 12)
    with torch.inference_mode():
        whole = llm.forward(llm.model, [(whole_seq, tokens, 0)])
        kept = llm.forward(llm.model, [(whole_seq, tokens, 0)], keep=torch.tensor([3, 10]))
        nothing = torch.tensor([], dtype=torch.long)
        none = llm.forward(llm.model, [(kept_seq, tokens, 0)], keep=nothing)
        after = llm.model.lm_head(llm.forward(llm.model, [(kept_seq, [20], 11)]))
    assert torch.equal(kept, whole[[3, 10]]) and none.shape == (0, whole.shape[1])
    assert torch.equal(after[0], paged_logits(llm, [(tokens + [20], [12])])[0][-1])


def test_sharded_checkpoint_loads(tmp_path):
    hf = tiny.write_checkpoint(tmp_path, tiny.llama_like(), max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_blocks=16)
    tokens = list(range(3, 14))
    got = paged_logits(llm, [(tokens, [11])])[0]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc")
def test_a_cpu_model_keeps_no_view_of_its_checkpoint_file(tmp_path):
    """safetensors' tensors are views of the file's memory mapping, resident for as long as one of
    them lives (the default model: 0.5 GB more memory than its weights need). After loading,
    the file must be unmapped, and the model still compute the same logits."""
    hf = tiny.write_checkpoint(tmp_path, tiny.llama_like())
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_blocks=16)
    gc.collect()
    assert str(tmp_path / "model.safetensors") not in open("/proc/self/maps").read()
    tokens = list(range(3, 14))
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert (paged_logits(llm, [(tokens, [11])])[0] - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_dtypes_track_float32(dtype, tmp_path):
    tiny.write_checkpoint(tmp_path, tiny.llama_like())
    tokens = list(range(3, 20))
    ref = paged_logits(
        LLM(str(tmp_path), dtype="float32", block_size=4, num_blocks=16), [(tokens, [10, 1, 6])]
    )[0]
    got = paged_logits(
        LLM(str(tmp_path), dtype=dtype, block_size=4, num_blocks=16), [(tokens, [10, 1, 6])]
    )[0]
    assert got.dtype == dtype
    assert (got.float() - ref).abs().max().item() < 0.1 * ref.abs().max().item()


def test_sliding_window_caps_the_context(tmp_path):
    """Sliding-window attention is not implemented, so the context stops at the window (where full
    attention is exact) instead of silently attending past it; asking for more is an error."""
    tiny.write_checkpoint(tmp_path, tiny.llama_like("MistralForCausalLM", sliding_window=8))
    with pytest.raises(ValueError, match="max_model_len 16 exceeds 8.*sliding-window"):
        LLM(str(tmp_path), dtype="float32", block_size=4, num_blocks=16, max_model_len=16)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_blocks=16)
    assert llm.max_model_len == 8
    with pytest.raises(ValueError, match="the context is 8"):
        llm.generate([list(range(3, 11))], SamplingParams(max_tokens=2))
    out = llm.generate(
        [list(range(3, 8))], SamplingParams(max_tokens=10, ignore_eos=True), use_progress=False
    )[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
