# Every request mix runs or fails clearly (issue 16): each test here failed before its fix. Output
# equals plain decoding, or the error is a ValueError (exit 2 at the CLI) naming the problem;
# nothing leaks.
import dataclasses
import json

import pytest
import tiny
import torch
from test_engine import GREEDY, prompts

from models import Tokenizer
from nanospec import LLM, EngineConfig, SamplingParams, main, parse_args


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tiny.write_checkpoint(path, tiny.llama_like())
    tiny.write_char_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def plain(target):
    return LLM(target, dtype="float32", block_size=4, num_blocks=128)


def test_mlp_proposer_after_a_one_token_last_prefill_chunk(target, plain, tmp_path):
    """A 9-token prompt with a budget of 8 ends its prefill with a one-token chunk: that step
    samples the first token, but no hidden state has sampled anything yet, so the MLP speculator
    must not run."""
    tiny.write_mlp_speculator(tmp_path, emb_dim=64, n_predict=4)
    llm = LLM(
        target,
        dtype="float32",
        block_size=4,
        num_blocks=128,
        max_num_batched_tokens=8,
        draft=f"mlp:{tmp_path}",
        num_spec_tokens=3,
    )
    prompt = list(range(10, 19))
    assert (
        llm.generate([prompt], GREEDY, use_progress=False)[0].token_ids
        == plain.generate([prompt], GREEDY, use_progress=False)[0].token_ids
    )


def test_draft_with_a_shorter_context_caps_max_model_len(target, tmp_path):
    tiny.write_checkpoint(
        tmp_path, tiny.llama_like(num_hidden_layers=1, max_position_embeddings=32), seed=1
    )
    llm = LLM(
        target, dtype="float32", block_size=4, num_blocks=64, draft=str(tmp_path), num_spec_tokens=3
    )
    assert llm.max_model_len == 32
    short = LLM(target, dtype="float32", block_size=4, num_blocks=64, max_model_len=32)
    prompt = list(range(10, 30))
    out = llm.generate([prompt], GREEDY, use_progress=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    assert out.token_ids == short.generate([prompt], GREEDY, use_progress=False)[0].token_ids
    with pytest.raises(ValueError, match="max_model_len 64 exceeds 32"):
        LLM(
            target,
            dtype="float32",
            num_blocks=64,
            draft=str(tmp_path),
            num_spec_tokens=3,
            max_model_len=64,
        )


BAD_ENGINE_ARGS = [
    (dict(block_size=0), "block_size"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(kv_cache_gib=0), "kv_cache_gib"),
    (dict(num_blocks=0), "num_blocks"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(draft="ngram", num_spec_tokens=4, max_num_batched_tokens=4), "max_num_batched_tokens"),
    (dict(draft="ngram", num_spec_tokens="3"), "num_spec_tokens"),
    (dict(draft="ngram", num_spec_tokens=-1), "num_spec_tokens"),
    (dict(draft="ngram", num_spec_tokens=1.5), "num_spec_tokens"),
    (dict(num_spec_tokens=2), "needs a draft"),
    (dict(draft="ngram", ngram_min=0), "ngram_min"),
    (dict(draft="ngram", ngram_min=3, ngram_max=2), "ngram_min <= ngram_max"),
]


@pytest.mark.parametrize("kwargs, message", BAD_ENGINE_ARGS)
def test_bad_engine_args_fail_before_any_model_loads(kwargs, message):
    with pytest.raises(ValueError, match=message):  # the folder does not exist: nothing was loaded
        LLM("/no/such/model", **kwargs)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--block-size", "0"], "block_size"),
        (["--max-num-seqs", "0"], "max_num_seqs"),
        (["--num-spec-tokens", "x", "--draft", "ngram"], "num_spec_tokens"),
        (["--ngram-max", "0", "--draft", "ngram"], "ngram_min <= ngram_max"),
        (["--seed", str(2**70)], "SamplingParams.seed"),
        (["--kv-cache-gib", "0"], "kv_cache_gib"),
        (["--chat", "--json", "out.json"], "--json needs prompts"),
        (["--suffix-max-requests", "-1", "--draft", "suffix"], "suffix_max_requests"),
    ],
)
def test_cli_rejects_bad_engine_args_with_exit_2(args, message, capsys):
    assert main(["--model", "/no/such/model", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nanospec: error:") and message in err and "Traceback" not in err


def test_cli_has_a_flag_per_engine_setting():
    # EngineConfig's promise, and what makes "raise kv_cache_gib" advice usable from the CLI
    flags = vars(parse_args([]))
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= flags.keys()


def test_request_k_is_a_cap_not_a_switch(target):
    """Two requests asking for K = 2 never speculate while the batch is above
    spec_disable_batch_size, nor when the engine's own K is 0."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, num_spec_tokens=2)
    for engine_args in (
        dict(num_spec_tokens=3, spec_disable_batch_size=1),
        dict(num_spec_tokens=0),
    ):
        llm = LLM(
            target, dtype="float32", block_size=4, num_blocks=64, draft="ngram", **engine_args
        )
        outs = llm.generate([[5, 6, 7] * 3, [8, 9] * 4], params, use_progress=False)
        assert [o.num_draft_tokens for o in outs] == [0, 0]
    alone = llm.generate(
        [[5, 6, 7] * 3],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_progress=False,
    )[0]
    assert alone.num_draft_tokens == 0


@pytest.mark.parametrize("seed", [2**70, -1, 1.5])
def test_seed_torch_cannot_take_is_a_value_error(seed):
    with pytest.raises(ValueError, match=f"SamplingParams.seed has an invalid value: {seed}"):
        SamplingParams(seed=seed)


def test_a_failing_step_leaves_the_engine_clean(target, plain):
    llm = LLM(
        target, dtype="float32", block_size=4, num_blocks=128, draft="ngram", num_spec_tokens=3
    )
    real_forward, calls = llm.forward, []

    def failing_forward(model, batch, *parents):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return real_forward(model, batch, *parents)

    llm.forward = failing_forward
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(prompts(4), GREEDY, use_progress=False)
    assert not llm.has_unfinished() and llm.blocks.num_used_blocks == 0
    llm.forward = real_forward
    expected = [o.token_ids for o in plain.generate(prompts(4), GREEDY, use_progress=False)]
    assert [o.token_ids for o in llm.generate(prompts(4), GREEDY, use_progress=False)] == expected


def test_stop_strings_decode_incrementally(plain, monkeypatch):
    """A long request with stop strings decodes each token a bounded number of times, not the whole
    output again per token (which was quadratic)."""
    decoded = []
    real_decode = plain.tokenizer.decode
    monkeypatch.setattr(
        plain.tokenizer, "decode", lambda ids: decoded.append(len(ids)) or real_decode(ids)
    )
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, stop=["~~~~~~~~"])
    out = plain.generate("hello world", params, use_progress=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 200
    assert sum(decoded) < 10 * 200


def test_stop_string_spanning_tokens_inside_an_accepted_run(target, plain):
    """The char tokenizer makes every stop string span several tokens; with speculation several
    tokens arrive in one step and the output still ends exactly where plain decoding's does."""
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = plain.generate("hello world", free, use_progress=False)[0]
    stop = full.text[20:23]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["~~~~", stop])
    expected = plain.generate("hello world", params, use_progress=False)[0]
    assert expected.text == full.text[: full.text.find(stop)] and expected.finish_reason == "stop"
    spec = LLM(
        target, dtype="float32", block_size=4, num_blocks=128, draft=target, num_spec_tokens=5
    )
    out = spec.generate("hello world", params, use_progress=False)[0]
    assert (out.text, out.token_ids) == (
        expected.text,
        expected.token_ids,
    ) and out.num_accepted_tokens > 0


def test_step_reads_row_ends_without_a_host_sync_per_sequence(plain, monkeypatch):
    for p in prompts(3):
        plain.add_request(p, GREEDY)
    plain.step()  # prefill

    def no_item(self):
        raise AssertionError("Tensor.item() in step")

    monkeypatch.setattr(torch.Tensor, "item", no_item)
    assert len(plain.scheduler.running) == 3 and plain.step() == []
    monkeypatch.undo()
    while plain.has_unfinished():
        plain.step()


def test_samples_is_decided_at_schedule_time(target, plain):
    """A prefill chunk scheduled before a sampling sequence must not be mistaken for one after
    the step moved its num_cached (the chunk here is half the prompt: num_cached + num_tokens
    then equals len)."""
    llm = LLM(target, dtype="float32", block_size=4, num_blocks=128, max_num_batched_tokens=5)
    schedule = llm.scheduler.schedule
    llm.scheduler.schedule = lambda: schedule()[::-1]  # chunks first
    first = llm.add_request([5, 6, 7], GREEDY)
    llm.step()
    second = llm.add_request(list(range(10, 18)), GREEDY)
    while llm.has_unfinished():
        llm.step()
    expected = plain.generate([[5, 6, 7], list(range(10, 18))], GREEDY, use_progress=False)
    assert [first.output_ids, second.output_ids] == [o.token_ids for o in expected]


def test_chat_templates_render_in_a_sandbox(tmp_path):
    tiny.write_char_tokenizer(tmp_path)
    config = tmp_path / "tokenizer_config.json"
    config.write_text(
        json.dumps({"chat_template": "{% for m in messages %}<{{ m.content }}>{% endfor %}"})
    )
    tokenizer = Tokenizer(str(tmp_path))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<hi>"
    assert tokenizer.apply_chat_template("hi") == "<hi>"  # (one user message)
    for escape in (
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.popen('echo pwned').read() }}",
        "{{ messages.append(1) }}",
    ):
        config.write_text(json.dumps({"chat_template": escape}))
        with pytest.raises(ValueError, match="chat template failed"):
            Tokenizer(str(tmp_path)).apply_chat_template([{"role": "user", "content": "hi"}])


def test_draft_catch_up_stays_within_the_token_budget(target, plain):
    """Issue 16 item 9: the draft model's first forward feeds every token it lacks (the whole
    prompt the first time); that forward is chunked within max_num_batched_tokens, like the
    target's prefill."""
    llm = LLM(
        target,
        dtype="float32",
        block_size=4,
        num_blocks=128,
        max_num_batched_tokens=12,
        draft=target,
        num_spec_tokens=3,
    )
    forward, draft_sizes = llm.forward, []

    def spy(model, batch, *tree):
        if model is llm.proposer.model:
            draft_sizes.append(sum(len(tokens) for _, tokens, _ in batch))
        return forward(model, batch, *tree)

    llm.forward = spy
    # 37 and 25 tokens: more than the budget
    long_prompts = [list(range(3, 40)), list(range(50, 75))]
    outs = llm.generate(long_prompts, GREEDY, use_progress=False)
    expected = plain.generate(long_prompts, GREEDY, use_progress=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert max(draft_sizes) <= 12 and sum(o.num_accepted_tokens for o in outs) > 0


def test_cli_draft_without_k_means_auto_and_names_dtype_and_kernels(target, monkeypatch, capsys):
    import nanospec

    choosers = []
    real = nanospec.GoodputChooser
    monkeypatch.setattr(
        nanospec, "GoodputChooser", lambda *a: choosers.append(real(*a)) or choosers[-1]
    )
    args = [
        "--model",
        target,
        "--draft",
        "ngram",
        "--prompt",
        "abcabc",
        "--max-tokens",
        "6",
        "--dtype",
        "float32",
    ]
    assert main(args) == 0 and len(choosers) == 1
    out = capsys.readouterr().out
    assert "dtype, kernels" in out and "float32" in out


def test_exponential_noise_is_clamped_away_from_zero(monkeypatch):
    """Item 8: uniforms of exactly 0 (noise -log(1 - 0) = 0) must not let 0 / 0 = NaN win the race
    (torch.argmax takes NaN as the maximum): the token drawn always has probability > 0."""
    import sampling
    from sequence import Sequence

    monkeypatch.setattr(torch, "rand", lambda n, **kwargs: torch.zeros(n))
    probs = torch.tensor([0.0, 0.0, 0.7, 0.3])
    seq = Sequence([1], SamplingParams(temperature=1.0, seed=3), "cpu")
    assert sampling.sample_at(probs, seq, 5) == 2
    assert bool((sampling.exp_noise(seq.generator, 4, "cpu") > 0).all())


def test_c_attention_over_a_long_context():
    """Item 11: the C kernel keeps no stack arrays sized by the context (it overflowed near 50k
    tokens)."""
    import kernels

    if kernels.cpu_kernels() is None:
        pytest.skip("cpu_kernels.c did not build here (no C compiler?)")
    context, block_size, num_kv_heads, group, head_dim = 70_000, 16, 1, 4, 64
    k_cache = torch.randn(context // block_size, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(2, num_kv_heads * group, head_dim)
    tables, seq_lens = torch.arange(context // block_size)[None], torch.tensor([context])
    ctx = kernels.AttentionContext(None, tables, seq_lens, torch.tensor([0, 2]), 2)
    args = (q, k_cache, v_cache, head_dim**-0.5, ctx)
    assert torch.allclose(
        kernels.c_paged_attention(*args), kernels.torch_paged_attention(*args), atol=1e-5
    )
