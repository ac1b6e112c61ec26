# The sampling controls (controls.py) against vLLM's definitions written out token by token, their
# validation, and the grammar wrapper: masks per draft path, cut drafts, rollback to the committed
# state.
import math

import pytest
import tiny
import torch

import controls
from nanospec import SamplingParams
from sequence import ScheduledSeq, Sequence

V = tiny.VOCAB


def reference(logits, history, num_prompt, p: SamplingParams):
    """vLLM's controls, one token at a time: allowed tokens, bias, repetition penalty (prompt and
    output), frequency and presence penalties (output), then min_p on softmax(logits / T)."""
    out = logits.double().tolist()
    output = history[num_prompt:]
    for t in range(V):
        if p.allowed_token_ids is not None and t not in p.allowed_token_ids:
            out[t] = -math.inf
        out[t] += (p.logit_bias or {}).get(t, 0.0)
        if t in history:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        out[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty * (t in output)
    if p.min_p > 0 and p.temperature > 0:
        probs = torch.softmax(torch.tensor(out) / p.temperature, dim=0)
        out = [x if q >= p.min_p * probs.max() else -math.inf for x, q in zip(out, probs)]
    return torch.tensor(out)


CASES = [
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.7),
    dict(presence_penalty=0.5),
    dict(frequency_penalty=-1.5),
    dict(presence_penalty=-0.4, frequency_penalty=0.9),
    dict(min_p=0.1),
    dict(min_p=1.0),
    dict(logit_bias={3: 5.0, 7: -100.0, 50: 0.25}),
    dict(allowed_token_ids=[4, 9, 17, 60]),
    dict(
        repetition_penalty=1.2,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        min_p=0.05,
        logit_bias={5: 2.0},
        allowed_token_ids=list(range(0, V, 2)),
    ),
]


@pytest.mark.parametrize("case", CASES)
def test_controls_follow_vllm_definitions(case):
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        logits = torch.randn(V, generator=gen) * 3
        history = torch.randint(V, (30,), generator=gen).tolist()
        params = SamplingParams(temperature=0.7, **case)
        got = controls.process_logits(logits, history, 12, params)
        want = reference(logits, history, 12, params)
        assert controls.has_controls(params)
        assert torch.equal(got.isinf(), want.isinf())
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-6)


def test_penalties_see_only_the_history_given():
    """The prompt counts for the repetition penalty only; a token absent from the history keeps
    its logit, so a verify row's history must be exactly plain decoding's."""
    logits = torch.full((V,), 2.0)
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = controls.process_logits(logits, [5, 6, 6, 6, 7, 7], 3, params)  # prompt [5, 6, 6]
    assert got[5] == 1.0  # in the prompt only: repetition
    assert got[6] == 1.0 - 0.5 - 0.25  # and once in the output
    assert got[7] == 1.0 - 2 * 0.5 - 0.25  # twice in the output
    assert got[8] == 2.0


def test_no_controls_change_nothing():
    logits = torch.randn(V).bfloat16()
    params = SamplingParams(temperature=0.5)
    assert not controls.has_controls(params)
    assert torch.equal(controls.process_logits(logits, [1, 2, 3], 1, params), logits.float())


def test_greedy_min_p_keeps_the_argmax():
    # min_p filters sampled rows only (as vLLM's): a greedy row is left as it was, not only its
    # argmax (which any min_p keeps)
    logits = torch.randn(V)
    got = controls.process_logits(logits, [], 0, SamplingParams(temperature=0, min_p=0.9))
    assert torch.equal(got, logits)


@pytest.mark.parametrize(
    "field, value",
    [
        ("repetition_penalty", 0.0),
        ("repetition_penalty", math.inf),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("frequency_penalty", math.nan),
        ("min_p", 1.5),
        ("logit_bias", {3: 101.0}),
        ("logit_bias", {"3": 1.0}),
        ("allowed_token_ids", []),
        ("choice", []),
        ("choice", ["yes", ""]),
    ],
)
def test_out_of_range_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} has an invalid value"):
        SamplingParams(**{field: value})


def test_token_ids_outside_the_vocabulary_name_the_field():
    for field, value in [("logit_bias", {V: 1.0}), ("allowed_token_ids", [0, -1])]:
        with pytest.raises(ValueError, match=f"SamplingParams.{field} has token ids outside"):
            controls.check_vocab(SamplingParams(**{field: value}), V)
    controls.check_vocab(SamplingParams(logit_bias={V - 1: 1.0}, allowed_token_ids=[0]), V)


def test_one_structured_output_at_most():
    with pytest.raises(ValueError, match="regex and choice given"):
        SamplingParams(regex="a+", choice=["a"])


# ---------------------------------------------------------------------------------------------
# Grammars, on the tiny character tokenizer (token = ASCII code - 31; id 2, '!', is EOS)
def ids(text: str) -> list[int]:
    return [ord(c) - 31 for c in text]


@pytest.fixture(scope="module")
def ll_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("chars")
    tiny.write_char_tokenizer(path)
    return controls.grammar_tokenizer((path / "tokenizer.json").read_text(), V, (2,))


def allowed_after(ll_tokenizer, params, path: list[int]) -> torch.Tensor:
    fresh = controls.Grammar(ll_tokenizer, params)
    for t in path:
        fresh.commit(t)
    return ~fresh.forbidden_after([[]])[0]


SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "tag": {"enum": ["ab", "ac"]}},
    "required": ["n", "tag"],
}


def test_prune_cuts_forbidden_drafts_and_masks_follow_each_path(ll_tokenizer):
    params = SamplingParams(json_schema=SCHEMA)
    grammar = controls.Grammar(ll_tokenizer, params)
    committed = ids('{"n": 1')
    for t in committed:
        assert not grammar.commit(t)
    before = grammar.forbidden_after([[]])
    # a tree: "2" -> {",", "x" (forbidden) -> "3"}, "," -> " " -> '"', then "5", and "}" (forbidden:
    # "tag" is required)
    drafts, parents = ids("2,x3 ") + ids('"') + ids("5}"), [-1, 0, 0, 2, 1, 4, -1, -1]
    kept, kept_parents = grammar.prune(drafts, parents)
    assert kept == ids('2, "5')
    assert kept_parents == [-1, 0, 1, 2, -1]
    paths = [[], ids("2"), ids("2,"), ids('2, "'), ids("5")]
    for path, forbidden in zip(paths, grammar.forbidden_after(paths)):  # one row per path
        assert torch.equal(~forbidden, allowed_after(ll_tokenizer, params, committed + path))
    assert torch.equal(grammar.forbidden_after([[]]), before)  # still at the committed tokens


def test_grammar_end_stops_the_request(ll_tokenizer):
    grammar = controls.Grammar(ll_tokenizer, grammar_params())
    kept, _ = grammar.prune(ids("yes") + [2] + ids("s"), [-1, 0, 1, 2, 3])
    assert kept == ids("yes") + [2]  # only EOS may follow "yes"
    # past the end nothing is fed (the row is never used), and the matcher stays as it was
    for allowed in ~grammar.forbidden_after([ids("yes"), ids("yes") + [2, 2]]):
        assert allowed.nonzero().flatten().tolist() == [2]
    assert torch.equal(
        ~grammar.forbidden_after([[]])[0], allowed_after(ll_tokenizer, grammar_params(), [])
    )
    assert [grammar.commit(t) for t in ids("yes")] == [False, False, True]


def grammar_params():
    return SamplingParams(choice=["yes", "no"])


def test_a_path_through_the_grammars_end_leaves_the_committed_state(ll_tokenizer):
    """A path that ends the grammar on the EOS token's own text ('!', the grammar's last literal)
    must leave the matcher at the committed tokens: rolling llguidance back over that end
    restored one token too few, and the target's next row was masked as if a draft's "b" had
    been committed (a self-drafting run emitted "a!", which the grammar forbids)."""
    params = SamplingParams(grammar='start: ("ab" | "cd")+ "!"')
    grammar = controls.Grammar(ll_tokenizer, params)
    assert not grammar.commit(ids("a")[0])
    for path in (ids("b!"), ids("b!!")):
        grammar.forbidden_after([path])
        after_a = allowed_after(ll_tokenizer, params, ids("a"))
        assert torch.equal(~grammar.forbidden_after([[]])[0], after_a)
        assert after_a.nonzero().flatten().tolist() == ids("b")


@pytest.mark.parametrize(
    "field, value, problem",
    [
        ("json_schema", {"type": "array", "uniqueItems": True}, "uniqueItems"),
        ("json_schema", "{not json", "json_schema cannot be compiled"),
        ("json_schema", {"type": "nonsense"}, "nonsense"),
        ("regex", "a(b", "unclosed group"),
        ("grammar", "start: foo", "unknown name"),
    ],
)
def test_uncompilable_grammars_name_the_field(ll_tokenizer, field, value, problem):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} cannot be compiled") as error:
        controls.Grammar(ll_tokenizer, SamplingParams(**{field: value}))
    assert problem in str(error.value)


def test_forced_tokens_replace_shallower_one_hot_drafts(ll_tokenizer):
    seq = Sequence([1, 2], SamplingParams(json_schema=SCHEMA), torch.device("cpu"))
    seq.grammar = controls.Grammar(ll_tokenizer, seq.params)
    cut = ScheduledSeq(seq, 1, 4, True, max_depth=4, drafts=ids("{x"), parents=[-1, 0])
    controls.prune_drafts([cut])
    # '{"n": ' is forced: its first 4 tokens (max_depth) replace the 1 draft the grammar left
    assert cut.drafts == ids('{"n"') and cut.parents == [-1, 0, 1, 2]
    assert seq.num_pruned == 1  # the cut draft is counted; the forced ones are verified drafts
    deeper = ScheduledSeq(seq, 1, 4, True, max_depth=2, drafts=ids('{"n'), parents=[-1, 0, 1])
    controls.prune_drafts([deeper])  # the forced tokens (2 at most here) do not reach deeper
    assert deeper.drafts == ids('{"n')
