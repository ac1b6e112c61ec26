# Sampling controls and structured output under speculation, end to end on tiny random models:
# greedy and seeded tokens, log-probs and finish reasons equal plain decoding's, bit for bit, for
# every proposer (n-gram, suffix, draft model, self-draft, MLP speculator; chains and trees), alone
# and in a batch of 8 where requests with and without controls and grammars run together, in fp32
# and bf16. Also: the unseeded rejection path stays within the grammar, and bad requests fail
# alone.
import dataclasses
import json
import re

import pytest
import tiny
from test_engine import drafts, target  # noqa: F401  (fixtures)

from nanospec import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "kind": {"enum": ["ab", "cd", "ef"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        "inner": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
    },
    "required": ["id", "kind", "tags", "inner"],
    "additionalProperties": False,
}
SEEDED = dict(temperature=0.9, max_tokens=32, ignore_eos=True)
GREEDY = dict(temperature=0, max_tokens=32, ignore_eos=True)
PARAMS = [  # one request each: every control alone, with others, with and without grammars
    SamplingParams(**GREEDY, repetition_penalty=1.5, presence_penalty=0.5, logprobs=2),
    SamplingParams(**SEEDED, seed=1, frequency_penalty=0.8, min_p=0.05),
    SamplingParams(**GREEDY, logit_bias={10: 2.0, 20: -5.0}, allowed_token_ids=list(range(3, 60))),
    SamplingParams(**SEEDED, seed=3, json_schema=SCHEMA, logprobs=1),
    SamplingParams(**GREEDY, regex=r"([a-e]{2,4} )+", frequency_penalty=0.3),
    SamplingParams(**SEEDED, seed=5, choice=["alpha beta gamma", "alpha beta delta", "omega"]),
    SamplingParams(**GREEDY),
    SamplingParams(
        **SEEDED,
        seed=7,
        grammar='start: ("ab" | "cd" | "abc")+ "!"',
        repetition_penalty=0.8,
        presence_penalty=-0.5,
        min_p=0.2,
        logit_bias={40: 1.5},
    ),
]
SPECS = {
    "ngram": dict(draft="ngram", num_spec_tokens=4),
    "suffix": dict(draft="suffix", num_spec_tokens=5),
    "ngram-tree": dict(draft="ngram", num_spec_tokens=4, spec_tree_nodes=8),
    "suffix-tree": dict(draft="suffix", num_spec_tokens=3, spec_tree_nodes=6),
    "draft": dict(draft="draft", num_spec_tokens=3),
    "self": dict(draft="self", num_spec_tokens=4),
    "mlp": dict(draft="mlp", num_spec_tokens=3),
}


def prompts():
    """Repetitive prompts (n-gram and suffix drafts find matches), one per request."""
    return [[3 + i, 40, 41, 42, 3 + i, 40, 41, 42, 3 + i, 40] for i in range(len(PARAMS))]


def run(llm, batch):
    """Outputs of the 8 requests in one batch (batch 8), or each alone (batch 1)."""
    if batch == 8:
        outs = llm.generate(prompts(), PARAMS, use_progress=False)
    else:
        outs = [llm.generate([p], s, use_progress=False)[0] for p, s in zip(prompts(), PARAMS)]
    assert llm.blocks.num_used_blocks == 0  # every block free or cached (prefix caching)
    return outs


def text(token_ids: list[int]) -> str:
    """The character tokenizer's text, without a final EOS ('!', which the grammar allows where
    the text may end)."""
    return "".join(chr(t + 31) for t in token_ids).removesuffix("!")


def results(outs):
    return [(o.token_ids, o.logprobs, o.finish_reason) for o in outs]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def plain(request, target):  # noqa: F811
    llm = LLM(target[0], dtype=request.param, block_size=2, num_blocks=256)
    return request.param, {batch: results(run(llm, batch)) for batch in (1, 8)}


@pytest.mark.parametrize("spec", SPECS)
def test_controls_and_grammars_keep_plain_output(spec, target, drafts, plain):  # noqa: F811
    dtype, want = plain
    settings = SPECS[spec] | dict(draft=drafts.get(SPECS[spec]["draft"], SPECS[spec]["draft"]))
    llm = LLM(target[0], dtype=dtype, block_size=2, num_blocks=256, **settings)
    for batch in (8, 1):
        outs = run(llm, batch)
        assert results(outs) == want[batch]
        assert sum(o.num_draft_tokens for o in outs) > 0
    if spec == "self":  # the target drafting for itself through the same controls: all accepted
        assert all(o.num_accepted_tokens == o.num_draft_tokens for o in outs)


def test_grammar_output_is_valid_and_ends_the_request(plain, target):  # noqa: F811
    dtype, want = plain
    for batch in (1, 8):
        choice_out, grammar_out = want[batch][5], want[batch][7]
        assert choice_out[2] == "stop" and text(choice_out[0]) in PARAMS[5].choice
        assert grammar_out[2] == "stop" and re.fullmatch("(ab|cd|abc)+", text(grammar_out[0]))
    # The schema's request ends by length within 32 characters (its shortest JSON has 46); given
    # room, its JSON completes, the request stops and the record validates.
    llm = LLM(target[0], dtype=dtype, block_size=2, num_blocks=256)
    params = dataclasses.replace(PARAMS[3], max_tokens=160)
    out = llm.generate([prompts()[3]], params, use_progress=False)[0]
    assert out.finish_reason == "stop"
    record = json.loads(text(out.token_ids))
    assert set(record) == set(SCHEMA["properties"]) and record["kind"] in ("ab", "cd", "ef")
    assert isinstance(record["id"], int) and "x" in record["inner"] and len(record["tags"]) <= 3


def test_grammar_cuts_are_counted_apart_from_verified_drafts(target):  # noqa: F811
    """A prompt whose n-gram continuation the grammar forbids: drafts are cut, not verified."""
    llm = LLM(target[0], dtype="float32", block_size=2, draft="ngram", num_spec_tokens=4)
    prompt = [66, 67, 68, 69, 66, 67, 68, 69, 66]  # "abcdabcda": n-gram proposes "bcda"
    out = llm.generate([prompt], SamplingParams(**GREEDY, regex="[a-c]+"), use_progress=False)[0]
    assert out.num_draft_tokens_pruned > 0
    assert set(text(out.token_ids)) <= set("abc")


def test_unseeded_sampling_stays_in_the_grammar(target, drafts):  # noqa: F811
    """The rejection sampler's residual and bonus tokens come from the masked distribution; a
    draft model drafts from it too, so no draft is cut (the pattern cannot end within 40 tokens:
    drafts after an EOS would be cut, as they can never be emitted)."""
    for draft in ("ngram", "draft"):
        llm = LLM(target[0], dtype="float32", draft=drafts[draft], num_spec_tokens=3)
        params = SamplingParams(temperature=1.0, max_tokens=40, regex="([a-c]{2}[0-9] ){20}")
        outs = llm.generate(prompts(), params, use_progress=False)
        for o in outs:
            assert set(text(o.token_ids)) <= set("abc0123456789 "), text(o.token_ids)
        if draft == "draft":
            assert sum(o.num_draft_tokens_pruned for o in outs) == 0


def test_bad_requests_fail_alone(target):  # noqa: F811
    llm = LLM(target[0], dtype="float32", draft="ngram", num_spec_tokens=3)
    good = llm.add_request(prompts()[0], SamplingParams(**GREEDY, regex="[a-c]+"))
    llm.step()
    bad = [
        (
            dict(json_schema={"type": "array", "uniqueItems": True}),
            "json_schema cannot be compiled",
        ),
        (dict(regex="a(b"), "regex cannot be compiled"),
        (dict(logit_bias={tiny.VOCAB: 1.0}), "logit_bias has token ids outside"),
        (dict(allowed_token_ids=[-1]), "allowed_token_ids has token ids outside"),
    ]
    for fields, problem in bad:
        with pytest.raises(ValueError, match=problem):
            llm.add_request(prompts()[1], SamplingParams(**GREEDY, **fields))
    while llm.has_unfinished():
        llm.step()
    assert good.finish_reason == "length" and len(good.output_ids) == 32
    assert llm.blocks.num_used_blocks == 0  # every block free or cached (prefix caching)
