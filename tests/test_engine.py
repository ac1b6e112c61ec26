# End-to-end engine behaviour on tiny random models: greedy output equals transformers, speculation
# never changes greedy output (every proposer, K, batch size, block size, preemption), stops, seeds.
import math
from types import SimpleNamespace

import numpy as np
import pytest
import tiny
import torch

from nanospec import LLM, SamplingParams
from proposers import NgramProposer

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(n, seed=0):
    """Mixed-length prompts; half of them repeat a pattern so n-gram lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(
            3, tiny.VOCAB, (int(torch.randint(2, 9, (), generator=g)),), generator=g
        ).tolist()
        out.append(
            base * 3 if i % 2 else base + torch.randint(3, tiny.VOCAB, (i,), generator=g).tolist()
        )
    return out


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    hf = tiny.write_checkpoint(path, tiny.llama_like())
    tiny.write_char_tokenizer(path)
    return str(path), hf


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, target):
    small = tmp_path_factory.mktemp("draft")
    tiny.write_checkpoint(
        small, tiny.llama_like(num_hidden_layers=1, hidden_size=32, intermediate_size=48), seed=1
    )
    mlp = tmp_path_factory.mktemp("mlp")
    tiny.write_mlp_speculator(mlp, emb_dim=64, n_predict=8)
    return {"ngram": "ngram", "draft": str(small), "self": target[0], "mlp": f"mlp:{mlp}"}


@pytest.fixture(scope="module")
def plain_outputs(target):
    llm = LLM(target[0], dtype="float32", block_size=4, num_blocks=256)
    return [o.token_ids for o in llm.generate(prompts(10), GREEDY, use_progress=False)]


def test_greedy_matches_transformers(target, plain_outputs):
    _, hf = target
    for p, ours in zip(prompts(10), plain_outputs):
        ref = hf.generate(
            torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert ours == ref[0, len(p) :].tolist()


def test_greedy_with_preemption_and_chunked_prefill(target, plain_outputs):
    llm = LLM(target[0], dtype="float32", block_size=4, num_blocks=24, max_num_batched_tokens=16)
    outs = llm.generate(prompts(10), GREEDY, use_progress=False)
    assert [o.token_ids for o in outs] == plain_outputs
    assert llm.stats["preemptions"] > 0
    assert llm.blocks.num_used_blocks == 0


@pytest.mark.parametrize("proposer", ["ngram", "draft", "self", "mlp"])
@pytest.mark.parametrize("k", range(1, 9))
def test_speculation_keeps_greedy_output(proposer, k, target, drafts, plain_outputs):
    # Block size 2 makes lookahead cross block boundaries; the small pool forces K shrinking and
    # preemption; batch 1 runs the first prompt alone, then the whole mixed batch runs together.
    for num_blocks, batch in ((256, 1), (26, 10)):
        llm = LLM(
            target[0],
            dtype="float32",
            block_size=2,
            num_blocks=num_blocks,
            draft=drafts[proposer],
            num_spec_tokens=k,
        )
        outs = llm.generate(prompts(10)[:batch], GREEDY, use_progress=False)
        assert [o.token_ids for o in outs] == plain_outputs[:batch]
        assert llm.blocks.num_used_blocks == 0
        drafted, accepted = (
            sum(o.num_draft_tokens for o in outs),
            sum(o.num_accepted_tokens for o in outs),
        )
        assert drafted > 0
        if proposer == "self":  # the target drafting for itself must be accepted every time
            assert accepted == drafted
    if proposer == "ngram":
        assert accepted > 0


def test_ngram_lookup_takes_longest_suffix_first_occurrence():
    proposer = NgramProposer(1, 3)
    # The suffix "4 2" occurs at 0 and at 4: the first occurrence's continuation is proposed, up to
    # k.
    lookup = lambda tokens, k: proposer.tree(np.array(tokens), k, k, 1)[0]  # noqa: E731  (a chain)
    assert lookup([4, 2, 9, 9, 4, 2, 7, 4, 2], 3) == [9, 9, 4]
    # A longer match wins over an earlier shorter one: "8 4 2" only at 3 (plain "4 2" first at 0).
    assert lookup([4, 2, 5, 8, 4, 2, 6, 8, 4, 2], 2) == [6, 8]
    # The proposal stops where the text ends; no match at all proposes nothing.
    assert lookup([3, 4, 9, 3, 4], 5) == [9, 3, 4]
    assert lookup([1, 2, 3], 4) == []
    # A match of the last token alone drafts 3 deep at most; a 2-token match goes the whole K.
    assert lookup([7, 1, 2, 3, 4, 5, 6, 7], 6) == [1, 2, 3]
    assert lookup([6, 7, 1, 2, 3, 4, 5, 6, 7], 6) == [1, 2, 3, 4, 5, 6]


def test_ngram_chain_resumes_copying_at_its_cursor():
    """After a draft copied from the middle of the text, a short match that also occurs earlier
    drafts from the occurrence past where the copying was, not from the first."""
    proposer, seq = NgramProposer(1, 3), SimpleNamespace(copy_offset=-math.inf)
    prompt = [1, 2, 5, 6, 1, 3, 5, 7, 1, 4, 6, 6, 0]
    # "3" occurs once, at 5: the chain copies what follows it
    assert proposer.tree(np.array(prompt + [3]), 3, 3, 1, seq)[0] == [5, 7, 1]
    # The model wrote 9 and 1 instead. "1" occurs at 0, 4 and 8: the cursor (5, moved on by the
    # 2 tokens since, less 2) picks 8; without one, the first occurrence
    tokens = np.array(prompt + [3, 9, 1])
    assert proposer.tree(tokens, 3, 3, 1, seq)[0] == [4, 6, 6]
    assert proposer.tree(tokens, 3, 3, 1)[0] == [2, 5, 6]
    # A tree keeps every occurrence's continuation: the cursor (that of the first chain) is not
    # used, nor moved
    seq.copy_offset = -11
    assert proposer.tree(tokens, 3, 1, 3, seq)[0] == [2, 3, 4] and seq.copy_offset == -11


def test_mixed_per_request_k(target, drafts, plain_outputs):
    llm = LLM(
        target[0],
        dtype="float32",
        block_size=2,
        num_blocks=64,
        draft=drafts["draft"],
        num_spec_tokens=3,
    )
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, num_spec_tokens=i % 5)
        for i in range(10)
    ]
    outs = llm.generate(prompts(10), params, use_progress=False)
    assert [o.token_ids for o in outs] == plain_outputs
    # each request drafts to its own K (capped at the engine's 3), never deeper: K=0 none at all
    for i, out in enumerate(outs):
        assert set(out.drafted_per_position) == set(range(min(i % 5, 3))), (i, out)


def test_seed_gives_same_text_with_or_without_batch_partners(target):
    llm = LLM(target[0], dtype="float32", block_size=4, num_blocks=128)
    params = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=20, max_tokens=16, seed=1234, ignore_eos=True
    )
    alone = llm.generate([prompts(3)[0]], params, use_progress=False)[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)
    together = llm.generate(prompts(3), [params, others, others], use_progress=False)[0].token_ids
    assert alone == together
    different_seed = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=20, max_tokens=16, seed=99, ignore_eos=True
    )
    assert llm.generate([prompts(3)[0]], different_seed, use_progress=False)[0].token_ids != alone


def test_text_prompt_and_stop_string(target):
    llm = LLM(target[0], dtype="float32", block_size=4, num_blocks=128)
    full = llm.generate(
        "hello world",
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        use_progress=False,
    )[0]
    assert len(full.token_ids) == 30 and full.finish_reason == "length"
    stop = full.text[5:7]
    out = llm.generate(
        "hello world",
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
        use_progress=False,
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.find(stop)]
    assert full.token_ids[: len(out.token_ids)] == out.token_ids


@pytest.mark.parametrize("draft_k", [("none", 0), ("self", 4)])
def test_stops_inside_multi_token_accept(target, drafts, plain_outputs, draft_k):
    """A stop token or max_tokens reached in the middle of an accepted run ends the output
    exactly there."""
    draft, k = draft_k
    llm = LLM(
        target[0],
        dtype="float32",
        block_size=2,
        num_blocks=128,
        draft=drafts.get(draft),
        num_spec_tokens=k,
    )
    expected = plain_outputs[1]
    stop_id = expected[7]
    out = llm.generate(
        [prompts(10)[1]],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id]),
        use_progress=False,
    )[0]
    assert out.token_ids == expected[: expected.index(stop_id) + 1] and out.finish_reason == "stop"
    out = llm.generate(
        [prompts(10)[1]],
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        use_progress=False,
    )[0]
    assert out.token_ids == expected[:5] and out.finish_reason == "length"
    eos = LLM(
        target[0],
        dtype="float32",
        block_size=2,
        num_blocks=128,
        draft=drafts.get(draft),
        num_spec_tokens=k,
    )
    eos.eos_ids = {stop_id}
    out = eos.generate(
        [prompts(10)[1]], SamplingParams(temperature=0, max_tokens=24), use_progress=False
    )[0]
    assert out.token_ids[-1] == stop_id and len(out.token_ids) == expected.index(stop_id) + 1


def test_abort_frees_blocks(target):
    llm = LLM(target[0], dtype="float32", block_size=4, num_blocks=64)
    a = llm.add_request([5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
    b = llm.add_request([8, 9], SamplingParams(max_tokens=20, ignore_eos=True))
    llm.step()
    llm.step()
    llm.abort(a)
    assert a.finish_reason == "abort" and a.block_table == []
    while llm.has_unfinished():
        llm.step()
    assert b.finish_reason == "length" and len(b.output_ids) == 20
    assert llm.blocks.num_used_blocks == 0


def test_acceptance_per_position_pools_requests(target, drafts):
    """The run-level rate weights each request by how many tokens it drafted at that position."""
    from nanospec import spec_metrics

    llm = LLM(
        target[0],
        dtype="float32",
        block_size=4,
        num_blocks=128,
        draft=drafts["ngram"],
        num_spec_tokens=3,
    )
    outs = llm.generate(prompts(6), GREEDY, use_progress=False)
    pooled = spec_metrics(outs)["acceptance_per_position"]
    for pos, rate in enumerate(pooled):
        drafted = sum(o.drafted_per_position.get(pos, 0) for o in outs)
        accepted = sum(
            o.accepted_per_position.get(pos, 0) * o.drafted_per_position.get(pos, 0) for o in outs
        )
        assert rate == pytest.approx(accepted / drafted)
    steps = sum(o.num_spec_steps for o in outs)
    assert pooled and sum(o.drafted_per_position.get(0, 0) for o in outs) <= steps
    # Apart from the rates' own arithmetic: in chains, the drafts counted at each position add up
    # to the requests' drafts, and the pooled rates times them to their accepted tokens
    drafted_at = [sum(o.drafted_per_position.get(pos, 0) for o in outs) for pos in range(3)]
    assert sum(drafted_at) == sum(o.num_draft_tokens for o in outs)
    accepted = sum(rate * n for rate, n in zip(pooled, drafted_at))
    assert accepted == pytest.approx(sum(o.num_accepted_tokens for o in outs))
    assert 0 < min(pooled) < 1  # (some drafts were rejected, some accepted: a rate means something)


@pytest.mark.parametrize("draft", ["none", "ngram", "self"])
def test_no_kernel_reads_a_kv_slot_before_it_is_written(target, drafts, plain_outputs, draft):
    """The KV pool is allocated uninitialized (paged_kv.allocate_kv_cache), so no kernel may read
    a slot that has not been written, not even one it then weighs by zero: 0 x NaN is NaN. A
    pool full of NaN must give plain decoding's tokens, with speculation (whose rejected slots
    are written, then rolled back) and chunked prefill. Blocks of 16 slots: the C attention reads
    a chunk of keys that lies in one block as one run of slots."""
    spec = {} if draft == "none" else dict(draft=drafts[draft], num_spec_tokens=3)
    settings = dict(dtype="float32", block_size=16, num_blocks=64, max_num_batched_tokens=24)
    llm = LLM(target[0], **settings, **spec)
    for cache in llm.kv_caches:
        cache.fill_(float("nan"))
    outs = llm.generate(prompts(10), GREEDY, use_progress=False)
    assert [o.token_ids for o in outs] == plain_outputs


@pytest.mark.parametrize("draft", ["none", "ngram", "self"])
def test_bf16_c_kernels_give_the_torch_paths_greedy_output(target, drafts, monkeypatch, draft):
    """In bf16 on the CPU the engine runs cpu_kernels.c's RMSNorm, rotary and decode attention;
    greedy tokens must equal the torch path's, with and without speculation, with preemption and
    chunked prefill."""
    import kernels

    if kernels.cpu_kernels() is None:
        pytest.skip("cpu_kernels.c did not build here (no C compiler?)")
    spec = {} if draft == "none" else dict(draft=drafts[draft], num_spec_tokens=3)
    make = lambda: LLM(
        target[0], dtype="bfloat16", block_size=4, num_blocks=40, max_num_batched_tokens=24, **spec
    )
    with_c = [o.token_ids for o in make().generate(prompts(8), GREEDY, use_progress=False)]
    monkeypatch.setattr(kernels, "cpu_kernels", lambda: None)
    without_c = [o.token_ids for o in make().generate(prompts(8), GREEDY, use_progress=False)]
    assert with_c == without_c


@pytest.mark.parametrize("isa", ["avx2", "amx"])
@pytest.mark.parametrize("draft", ["ngram", "draft"])
def test_auto_dtype_is_fp32_with_fp16_weights(target, drafts, monkeypatch, draft, isa):
    """--dtype auto on a CPU: fp32 activations with every linear's weights packed in fp16, and an
    fp16 KV cache, on the AVX2 build (FMAs) and the AMX build (tiles over bf16 halves of x and
    of the weights). Speculation keeps its greedy output, bit for bit, with lookahead across
    blocks, preemption and chunked prefill (which takes the blocked path)."""
    from test_kernels import rebuild_cpu_kernels

    import kernels

    if not set(kernels.ISA_NEEDS[isa]) <= kernels.cpu_flags():
        pytest.skip(f"this CPU cannot run the {isa} build")
    rebuild_cpu_kernels(monkeypatch, isa)
    if kernels.cpu_kernels() is None:
        pytest.skip(f"the C kernels' {isa} build did not build or load here")

    def run(**spec):
        llm = LLM(target[0], block_size=2, num_blocks=40, max_num_batched_tokens=24, **spec)
        outs = llm.generate(prompts(8), GREEDY, use_progress=False)
        return llm, [o.token_ids for o in outs]

    plain, plain_ids = run()
    packed = {
        m.packed.dtype for m in plain.model.modules() if getattr(m, "packed", None) is not None
    }
    assert plain.dtype == torch.float32 and packed == {torch.float16}
    assert plain.kv_dtype == torch.float16 and plain.kv_caches[0].dtype == torch.float16
    spec, spec_ids = run(draft=drafts[draft], num_spec_tokens=3)
    assert spec_ids == plain_ids and spec.stats["preemptions"] > 0
