# The suffix proposer (SuffixDecoding): latest or frequency-scored continuations, adaptive length, a
# bounded memory of finished requests across generate() calls, and greedy output identical to plain
# decoding.
import numpy as np
import pytest
import tiny
from test_engine import GREEDY, plain_outputs, prompts, target  # noqa: F401 (fixtures)

from nanospec import LLM, SamplingParams
from proposers import SuffixProposer, draft_tree


def test_draft_tree_scores_by_frequency_and_stops_below_min_prob():
    rows = np.array([[5, 6, 7], [5, 6, 8], [5, 6, 7], [9, -1, -1]])
    # 5 follows 3 of 4 rows (0.75), then 6 (0.75), then 7 (2 of 3: 0.5)
    assert draft_tree(rows, 8, 1, 0.1) == ([5, 6, 7], [-1, 0, 1])
    assert draft_tree(rows, 8, 1, 0.6) == ([5, 6], [-1, 0])  # 0.5 < 0.6: the path stops
    assert draft_tree(rows, 2, 1, 0.0) == ([5, 6], [-1, 0])  # the budget caps it
    # Trees: every branch, best first by path probability; 9 (0.25) comes after 5 6 7 (0.5), 8
    # (0.25) last.
    assert draft_tree(rows, 8, 4, 0.0) == ([5, 6, 7, 9, 8], [-1, 0, 1, -1, 1])


def test_suffix_proposes_the_latest_repetition_in_the_request_and_the_most_frequent_elsewhere():
    proposer = SuffixProposer(max_match=4, max_spec_factor=1.0)
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 9, 4, 2, 3, 8, 7, 2, 3])
    # "2 3" (the longer "1 2 3" does not occur at the end) was last followed by 8 7, most often by
    # 9.
    assert proposer.tree(tokens, 1, 1, 1)[0] == [8]
    # match length 2 caps it at 2 tokens (factor 1)
    assert proposer.tree(tokens, 8, 8, 1)[0] == [8, 7]
    assert SuffixProposer(max_spec_factor=2.0).tree(tokens, 8, 8, 1)[0] == [8, 7, 2, 3]
    # a tree: the latest first, then by frequency
    assert proposer.tree(tokens, 2, 1, 2)[0] == [8, 9]
    assert proposer.tree(np.array([1, 2, 3]), 4, 4, 1) == ([], [])
    # finished requests: the most frequent continuation
    for finished in ([5, 6, 1], [5, 6, 2], [5, 6, 1]):
        proposer.remember(finished)
    assert proposer.tree(np.array([4, 5, 6]), 1, 1, 1)[0] == [1]


def test_memory_spans_requests_and_evicts_the_oldest():
    proposer = SuffixProposer(max_requests=2)
    proposer.remember([10, 11, 12, 13, 14, 15])
    # from a finished request
    assert proposer.tree(np.array([7, 10, 11, 12]), 3, 3, 1)[0] == [13, 14, 15]
    proposer.remember([20, 21, 22])
    proposer.remember([30, 31, 32])
    # the first request was evicted
    assert proposer.tree(np.array([7, 10, 11, 12]), 3, 3, 1)[0] == []
    assert proposer.tree(np.array([7, 30, 31]), 3, 3, 1)[0] == [32]  # never past a request's end
    assert len(proposer.finished) == 2


@pytest.mark.parametrize("k", [3, "auto"])
def test_suffix_keeps_greedy_output(k, target, plain_outputs):  # noqa: F811
    for num_blocks, batch in ((256, 1), (40, 8)):
        llm = LLM(
            target[0],
            dtype="float32",
            block_size=2,
            num_blocks=num_blocks,
            draft="suffix",
            num_spec_tokens=k,
        )
        if k == "auto":
            tiny.cheap_verification(llm)
        for _ in range(2):  # the second round proposes from the first round's outputs
            outs = llm.generate(prompts(10)[:batch], GREEDY, use_progress=False)
            assert [o.token_ids for o in outs] == plain_outputs[:batch]
        assert llm.blocks.num_used_blocks == 0
        assert sum(o.num_accepted_tokens for o in outs) > 0


def mean_accepted_length(outs) -> float:
    return 1 + sum(o.num_accepted_tokens for o in outs) / max(
        sum(o.num_spec_steps for o in outs), 1
    )


def test_repeated_requests_accept_more_than_ngram(target):  # noqa: F811
    lengths = {}
    for draft in ("ngram", "suffix"):
        llm = LLM(
            target[0], dtype="float32", block_size=4, num_blocks=256, draft=draft, num_spec_tokens=4
        )
        llm.generate(prompts(6), GREEDY, use_progress=False)
        lengths[draft] = mean_accepted_length(llm.generate(prompts(6), GREEDY, use_progress=False))
    assert lengths["suffix"] >= 1.5 * lengths["ngram"]


# Auto K's cases get a node budget above its largest K (8): with verification made cheap it
# drafts 8 deep, and a budget of 8 or less would then be a single chain.
CASES = {
    "suffix chain": ("suffix", 3, 0),
    "suffix tree": ("suffix", 3, 6),
    "ngram tree": ("ngram", 3, 6),
    "suffix tree auto": ("suffix", "auto", 12),
    "ngram tree auto": ("ngram", "auto", 12),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block_size", [1, 16])
def test_trees_keep_greedy_output(case, block_size, target, plain_outputs):  # noqa: F811
    draft, k, nodes = CASES[case]
    # 160 cached tokens: batch 8 shrinks trees and preempts
    for batch, tokens in ((1, 4096), (8, 160)):
        llm = LLM(
            target[0],
            dtype="float32",
            block_size=block_size,
            num_blocks=tokens // block_size,
            draft=draft,
            num_spec_tokens=k,
            spec_tree_nodes=nodes,
        )
        if k == "auto":
            tiny.cheap_verification(llm)
        for _ in range(2):  # the second round: the suffix proposer remembers the first
            outs = llm.generate(prompts(10)[:batch], GREEDY, use_progress=False)
            assert [o.token_ids for o in outs] == plain_outputs[:batch]
        assert llm.blocks.num_used_blocks == 0
        assert sum(o.num_accepted_tokens for o in outs) > 0
        if batch == 8:  # with trees, paths off the first branch were accepted (K/V moved)
            assert (llm.stats["kv_moves"] > 0) == (nodes > 0) and llm.stats["preemptions"] > 0


def test_seeded_sampling_and_logprobs_with_trees_equal_plain(target):  # noqa: F811
    # (at 0.3 the tiny model follows its prompts' patterns often enough for off-first-branch
    # accepts); an unseeded request rides along: it gets chains and the rejection sampler
    params = [
        SamplingParams(temperature=0.3, max_tokens=24, ignore_eos=True, seed=i, logprobs=1)
        for i in range(8)
    ]
    params[7] = SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True)
    plain = LLM(target[0], dtype="float32", block_size=4, num_blocks=256)
    want = [
        (o.token_ids, o.logprobs) for o in plain.generate(prompts(8), params, use_progress=False)
    ][:7]
    for draft in ("suffix", "ngram"):
        llm = LLM(
            target[0],
            dtype="float32",
            block_size=4,
            num_blocks=256,
            draft=draft,
            num_spec_tokens=4,
            spec_tree_nodes=8,
        )
        for _ in range(2):
            outs = llm.generate(prompts(8), params, use_progress=False)
            assert [(o.token_ids, o.logprobs) for o in outs[:7]] == want and len(
                outs[7].token_ids
            ) == 24
        assert llm.stats["kv_moves"] > 0
