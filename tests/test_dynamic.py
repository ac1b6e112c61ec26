# Dynamic speculation: the goodput chooser on synthetic numbers, and greedy equality while
# speculation switches off and back on mid-generation (the draft model's lagging cache must catch up
# correctly).
from types import SimpleNamespace

import pytest
import tiny
from test_engine import GREEDY, prompts

import goodput
from goodput import GoodputChooser, acceptance_estimate, interpolate, profile_step_costs
from nanospec import LLM
from proposers import NgramProposer
from sequence import SamplingParams, Sequence


def test_interpolate():
    table = {1: 1.0, 4: 2.0, 8: 6.0}
    assert interpolate(table, 1) == 1.0 and interpolate(table, 2) == pytest.approx(4 / 3)
    assert interpolate(table, 6) == 4.0 and interpolate(table, 16) == 12.0


def test_acceptance_estimate_is_per_request_cautious_first_and_hopeful_deeper():
    seq = Sequence([1, 2, 3], SamplingParams(), "cpu")
    # Nothing seen yet: 1/3 for the first draft, then each prior halfway from the one before to 1.
    assert acceptance_estimate(seq, 3) == pytest.approx([1 / 3, 2 / 3, 5 / 6])
    # (keyed by the step's n-gram match strength and position: None, no n-gram proposer)
    seq.recent_reached.update([(None, 0)] * 4 + [(None, 1)])  # 4 reached position 0, 1 reached 1
    seq.recent_accepted.update([(None, 0)] * 4)  # all four accepted it; position 1 failed
    a0 = (4 + 1) / (4 + 3)
    a1 = (0 + 3 * (1 + a0) / 2) / (1 + 3)  # one failure pulls its prior down
    # Position 2, never reached, is worth more than position 1: given positions 0 and 1 matched,
    # a third match is likelier (a request stuck at K = 2 would otherwise never try deeper).
    assert acceptance_estimate(seq, 3) == pytest.approx([a0, a1, (1 + a1) / 2])
    assert acceptance_estimate(seq, 3)[2] > acceptance_estimate(seq, 3)[1]


def test_acceptance_estimate_follows_the_requests_recent_steps():
    """A request that copied (every draft accepted) and now writes text of its own (every first
    draft rejected) soon stops looking like a copier: each step counts 0.8 times the next."""
    seq = Sequence([1, 2, 3], SamplingParams(), "cpu")
    for _ in range(20):
        seq.count_spec_step(3, 3, 3)
    assert acceptance_estimate(seq, 3)[0] == pytest.approx(0.75, abs=0.01)  # 5 steps' memory
    for _ in range(5):
        seq.count_spec_step(3, 0, 3)
    # All 25 steps alike would read (20 + 1) / (25 + 3) = 0.75; the last five weigh most.
    assert acceptance_estimate(seq, 3)[0] == pytest.approx(0.33, abs=0.01)
    # What the request reports still counts every step.
    assert seq.accepted_per_position[0] == 20 and seq.drafted_per_position[0] == 25


def test_acceptance_estimate_keeps_strong_and_weak_ngram_matches_apart():
    """Under n-gram lookup, a request's steps after a 1-token match (weak) and after a longer one
    (strong) keep separate records, each from its own prior: copying does not make the weak
    guesses between copied passages look good, nor they the copying bad."""
    proposer = NgramProposer(1, 4)
    seq = Sequence([5, 6, 7, 5, 6], SamplingParams(), "cpu")
    assert proposer.strong_match(seq)  # "5 6" came before
    seq.token_ids[-2] = 8
    assert not proposer.strong_match(seq)  # "6" came before, "8 6" did not
    for seq.strong_match, first in ((None, 1 / 3), (False, 1 / 4), (True, 2 / 3)):
        assert acceptance_estimate(seq, 1) == pytest.approx([first])
    for _ in range(10):  # strong matches copy, weak ones fail at once
        seq.strong_match = True
        seq.count_spec_step(3, 3, 3)
        seq.strong_match = False
        seq.count_spec_step(2, 0, 2)
    seq.strong_match = True
    assert acceptance_estimate(seq, 3)[0] > 0.8
    seq.strong_match = False
    assert acceptance_estimate(seq, 3)[0] < 0.15


def test_chooser_turns_speculation_off_when_verification_is_expensive():
    # every verified token costs the same
    linear = {t: 0.01 * t for t in (1, 2, 4, 8, 16, 32, 64, 128)}
    chooser = GoodputChooser(8, linear, 0.0)
    assert (
        chooser.choose([[0.6] * 8], [0]) == [0]
        and chooser.choose([[0.6] * 8] * 16, [0] * 16) == [0] * 16
    )


def test_chooser_speculates_when_verification_is_cheap_and_acceptance_high():
    # memory-bound: tokens nearly free
    flat = {t: 0.02 + 0.0001 * t for t in (1, 2, 4, 8, 16, 32, 64, 128)}
    chooser = GoodputChooser(8, flat, 0.0)
    assert chooser.choose([[0.9] * 8], [0]) == [8]
    assert 0 < chooser.choose([[0.3] * 8], [0])[0] < 8
    # a sequence's K never exceeds its cap (its list's length)
    assert chooser.choose([[0.9] * 3], [0]) == [3]
    # A cautious new request (prior 1/3) beside one with a proven record: the proven one drafts
    # longer.
    new, proven = chooser.choose([[1 / 3] * 8, [0.9] * 8], [0, 0])
    assert 0 < new < proven
    # A batch large enough that verification becomes compute-bound makes speculation lose again.
    steep = {1: 0.02, 16: 0.03, 32: 0.06, 64: 0.12, 128: 0.24}
    chooser = GoodputChooser(8, steep, 0.0)
    assert (
        chooser.choose([[0.6] * 8], [0])[0] > 0
        and chooser.choose([[0.6] * 8] * 64, [0] * 64) == [0] * 64
    )


def test_chooser_keeps_the_shorter_draft_near_break_even():
    """A draft more that promises less than 2% more goodput is not taken: the profile's noise
    (a few percent) must not flip K from run to run."""
    costs = {1: 0.0100, 2: 0.0105, 4: 0.0111, 8: 0.0135}
    # draft 1 nearly doubles the tokens a step; draft 2 at 9% acceptance adds 1.6% more
    assert GoodputChooser(8, costs, 0.0).choose([[0.999, 0.09]], [0]) == [1]
    # at 25% it adds 9%: taken
    assert GoodputChooser(8, costs, 0.0).choose([[0.999, 0.25]], [0]) == [2]
    # The first draft answers to the margin over plain decoding alone (5%), not margin and tie:
    # at 11.5% acceptance it promises 6.2% more than plain.
    assert GoodputChooser(8, costs, 0.0).choose([[0.115]], [0]) == [1]


def test_chooser_counts_draft_cost():
    chooser = GoodputChooser(8, {t: 0.02 for t in (1, 2, 4, 8, 16)}, 0.0)
    cheap = chooser.choose([[0.5] * 8], [0])[0]
    chooser.draft_time = {1: 0.05}  # each draft step costs more than a whole verification
    assert chooser.choose([[0.5] * 8], [0])[0] < cheap


def test_real_steps_rescale_the_profile_not_one_size():
    """Real steps carry per-sequence work the start-up profile lacks. Observed at the one size a
    batch runs, they must raise every size's cost alike: a draft's relative cost keeps the
    profile's shape."""
    steep = {1: 0.02, 16: 0.03, 32: 0.06, 64: 0.12, 128: 0.24}
    chooser = GoodputChooser(8, steep, 0.0)
    for _ in range(100):
        chooser.observe_verify(64, 0, 0.24)  # a batch of 64 at K = 0, twice the profile's time
    assert chooser.step_time(64, 0, 0, 0) == pytest.approx(0.24, rel=1e-3)
    assert chooser.step_time(96, 0, 0, 0) == pytest.approx(0.36, rel=1e-3)  # not the profile's 0.18
    assert chooser.choose([[0.6] * 8] * 64, [0] * 64) == [0] * 64


def test_chooser_counts_attention_over_the_context():
    """Each token of a step attends to its sequence's cached keys: a long context makes drafts
    dearer."""
    flat = {t: 0.010 + 0.0002 * t for t in (1, 2, 4, 8, 16)}
    # 1 us per token per key: 0.6 ms per token at 600
    chooser = GoodputChooser(8, flat, key_time=1e-6)
    short, long = chooser.choose([[0.6] * 8], [10])[0], chooser.choose([[0.6] * 8], [600])[0]
    assert 0 < long < short
    assert chooser.step_time(5, 5 * 600, 4, 1) == pytest.approx(0.011 + 0.003)  # (drafts free here)
    # real steps twice the profile's: both terms scale
    chooser.observe_verify(5, 5 * 600, 2 * 0.014)
    assert chooser.verify_scale == pytest.approx(1.1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = tmp_path_factory.mktemp("target")
    tiny.write_checkpoint(target, tiny.llama_like())
    draft = tmp_path_factory.mktemp("draft")
    tiny.write_checkpoint(draft, tiny.llama_like(num_hidden_layers=1), seed=1)
    plain = LLM(str(target), dtype="float32", block_size=4, num_blocks=256)
    return str(target), str(draft), plain


@pytest.mark.parametrize("draft", ["self", "other", "ngram"])
def test_speculation_switches_off_and_on_keeping_greedy_output(models, draft):
    target, other, plain = models
    # Requests of different lengths: 6 run at first (> 3: no speculation), then as they finish the
    # batch drops to 3 or fewer and speculation resumes; the draft's cache has lagged and catches
    # up.
    params = [
        SamplingParams(temperature=0, max_tokens=8 + 4 * i, ignore_eos=True) for i in range(6)
    ]
    expected = [o.token_ids for o in plain.generate(prompts(6), params, use_progress=False)]
    draft_arg = {"self": target, "other": other, "ngram": "ngram"}[draft]
    llm = LLM(
        target,
        dtype="float32",
        block_size=2,
        num_blocks=256,
        draft=draft_arg,
        num_spec_tokens=3,
        spec_disable_batch_size=3,
    )
    outs = llm.generate(prompts(6), params, use_progress=False)
    assert [o.token_ids for o in outs] == expected
    assert llm.k_histogram[0] > 1 and llm.k_histogram[3] > 0
    if draft == "self":
        assert all(o.num_accepted_tokens == o.num_draft_tokens for o in outs)


def test_auto_k_keeps_greedy_output(models):
    target, other, plain = models
    expected = [o.token_ids for o in plain.generate(prompts(6), GREEDY, use_progress=False)]
    for draft in (target, "ngram"):
        llm = LLM(
            target,
            dtype="float32",
            block_size=2,
            num_blocks=256,
            draft=draft,
            num_spec_tokens="auto",
        )
        assert llm.scheduler.chooser is not None and llm.scheduler.chooser.verify_time
        tiny.cheap_verification(llm)  # (else a noisy profile may keep K = 0: nothing to test)
        outs = llm.generate(prompts(6), GREEDY, use_progress=False)
        assert [o.token_ids for o in outs] == expected
        assert sum(llm.k_histogram.values()) == llm.stats["steps"]
        assert any(n for k, n in llm.k_histogram.items() if k >= 2), llm.k_histogram
        # A model's drafts are timed per draft step; a lookup's count as free (LLMEngine.step).
        draft_time = llm.scheduler.chooser.draft_time
        assert (max(draft_time.values()) > 0) == (draft != "ngram"), draft_time
        # Only n-gram lookup has matches whose strength auto K keeps apart.
        assert (llm.scheduler.strong_match is not None) == (draft == "ngram")


def test_new_requests_try_drafts_before_the_chooser_may_refuse(models):
    """Verification priced so high that the chooser never drafts (as a busy machine at start-up
    can make the profile look): each request still drafts (K = 1) in its first 2 decode steps,
    one request a step, or it would keep K = 0 for good without ever learning its acceptance.
    Then the chooser decides."""
    target, _, plain = models
    llm = LLM(
        target, dtype="float32", block_size=2, num_blocks=256, draft="ngram", num_spec_tokens="auto"
    )
    chooser = llm.scheduler.chooser
    chooser.verify_time, chooser.key_time = {t: 0.01 * t for t in chooser.verify_time}, 0.0
    # the chooser alone would never draft
    assert chooser.choose([[1 / 3] * 8] * 3, [10] * 3) == [0] * 3
    seqs = [llm.add_request(p, GREEDY) for p in prompts(3)]
    while llm.has_unfinished():
        ks = llm.scheduler.choose_k()
        assert all(isinstance(s.strong_match, bool) for s in ks)  # asked before choosing
        # one request a step, if any is untried
        probes = 1 if any(s.num_spec_steps < 2 for s in ks) else 0
        assert sorted(ks.values()) == [0] * (len(ks) - probes) + [1] * probes
        assert all(ks[s] == 0 for s in ks if s.num_spec_steps >= 2)
        llm.step()
    assert all(seq.num_spec_steps == 2 for seq in seqs) and sum(s.num_drafted for s in seqs) > 0
    assert [s.output_ids for s in seqs] == [
        o.token_ids for o in plain.generate(prompts(3), GREEDY, use_progress=False)
    ]


def test_profile_keeps_each_sizes_best_pass_and_frees_its_blocks(models, monkeypatch):
    """Sizes up to 64 tokens are timed in three passes and the fastest kept (a burst of other
    work spoils one pass, not the table); larger ones once. The probe's KV blocks go back to the
    pool."""
    target, _, _ = models
    llm = LLM(
        target, dtype="float32", block_size=2, num_blocks=512, draft="ngram", num_spec_tokens="auto"
    )
    calls, free_before = [], llm.blocks.num_free_blocks

    def fake_time(engine, probe, num_tokens, start):
        """1 ms per token; pass 1 a burst (x10); size 2 spoilt in every pass (x100)."""
        calls.append((num_tokens, start))
        burst = (10 if calls.count((num_tokens, start)) == 2 else 1) * (
            100 if num_tokens == 2 else 1
        )
        return 1e-3 * num_tokens * burst + 1e-5 * start

    monkeypatch.setattr(goodput, "time_forward", fake_time)
    table, key_time, steady = profile_step_costs(llm, 128)
    assert steady  # one burst spoils one pass; the best two passes of every size agree
    # size 2 costs at most what size 3 measured; every size a verify step can have is timed
    assert table == pytest.approx(
        {t: 1e-3 * max(t, 3 * (t == 2)) for t in (*range(1, 10), 16, 32, 64, 128)}
    )
    assert key_time == pytest.approx(1e-5 / 8)  # the context's extra time, per token per cached key
    # the sizes verification uses: 5 passes; up to 64: 3; larger: 1
    assert [calls.count((t, 0)) for t in (1, 8, 9, 16, 64, 128)] == [5, 5, 5, 3, 3, 1]
    # 8 tokens after a cached context, every pass
    with_context = [call for call in calls if call[1] > 0]
    assert len(with_context) == 5 and len(set(with_context)) == 1 and with_context[0][0] == 8
    assert llm.blocks.num_free_blocks == free_before
    # on a CPU, sizes past 128 tokens are not timed: interpolate() extends the table in proportion
    calls.clear()
    table, _, _ = profile_step_costs(llm, 512)
    assert max(table) == 128 and max(num_tokens for num_tokens, _ in calls) == 128
    assert interpolate(table, 512) == pytest.approx(4 * table[128])
    # Steady while a size's two best passes agree within 25%: 20% apart yes, 30% apart no (the
    # machine was busy: step_costs() does not keep such a profile).
    for gap, steady in ((1.2, True), (1.3, False)):
        size_1 = iter([1.0] + [gap] * 4)  # its five passes

        def time_size_1(engine, probe, num_tokens, start, size_1=size_1):
            return 1e-3 * num_tokens * (next(size_1) if (num_tokens, start) == (1, 0) else 1)

        monkeypatch.setattr(goodput, "time_forward", time_size_1)
        assert profile_step_costs(llm, 128)[2] == steady


def test_step_costs_are_keyed_by_the_c_library_s_bytes(models, monkeypatch, tmp_path):
    """A build of C whose code did not change (a comment did) has a new name, the same bytes: it
    keeps its profile, and so decides K as before. Other bytes profile again."""
    profiled = []  # the library each profile was taken for
    monkeypatch.setattr(goodput, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(goodput, "cpu_kernels", lambda: SimpleNamespace(_name=str(library)))
    profile = lambda engine, max_tokens: profiled.append(library) or ({1: 0.5}, 0.0, True)
    monkeypatch.setattr(goodput, "profile_step_costs", profile)
    for name, content in (("a", b"built"), ("b", b"built"), ("c", b"built other")):
        library = tmp_path / f"cpu_kernels-avx2-{name}.so"
        library.write_bytes(content)
        LLM(models[0], dtype="float32", draft="ngram", num_spec_tokens="auto")
    assert [path.name for path in profiled] == ["cpu_kernels-avx2-a.so", "cpu_kernels-avx2-c.so"]


def test_step_costs_are_profiled_once_per_machine_and_setting(models, monkeypatch, tmp_path):
    """The start-up profile is kept in the cache dir: a second engine of the same setting reads
    it, so it prices steps exactly as the first did (two runs decide K alike) and times no forward.
    Another setting (here a different KV pool) profiles its own; a profile whose passes disagreed
    (a busy machine), a half-written file, a file that holds no table or an unwritable cache dir
    mean profiling again, never an error."""
    target, _, _ = models
    profiled = []

    def fake_profile(engine, max_tokens):
        """The first profile ran beside other work (not steady); every later one is steady."""
        profiled.append(max_tokens)
        return {1: 0.5, 2: 0.75 + len(profiled)}, 1e-6, len(profiled) > 1

    monkeypatch.setattr(goodput, "profile_step_costs", fake_profile)
    monkeypatch.setattr(goodput, "cache_dir", lambda: tmp_path)

    def chooser(**settings):
        settings = dict(dtype="float32", block_size=2, num_blocks=512, draft="ngram") | settings
        chooser = LLM(target, num_spec_tokens="auto", **settings).scheduler.chooser
        return chooser.verify_time, chooser.key_time

    assert chooser() == ({1: 0.5, 2: 1.75}, 1e-6) and not list(tmp_path.iterdir())  # busy
    assert chooser() == ({1: 0.5, 2: 2.75}, 1e-6) and len(profiled) == 2
    (saved,) = tmp_path.glob("step-costs-*.json")
    assert chooser() == ({1: 0.5, 2: 2.75}, 1e-6) and len(profiled) == 2  # read, not timed
    assert chooser(num_blocks=256) == ({1: 0.5, 2: 3.75}, 1e-6) and len(profiled) == 3
    saved.write_text('[{"1": 0.5, "2"')  # another start-up caught writing it
    assert chooser() == ({1: 0.5, 2: 4.75}, 1e-6) and len(profiled) == 4
    assert chooser() == ({1: 0.5, 2: 4.75}, 1e-6) and len(profiled) == 4
    for not_a_table in ("[[1, 2], 3]", '[{"1": "fast"}, 1]', '[{"1": 0.5}, null]', "{}"):
        saved.write_text(not_a_table)
        chooser()
    assert len(profiled) == 8 and chooser() == ({1: 0.5, 2: 8.75}, 1e-6) and len(profiled) == 8
    monkeypatch.setattr(goodput, "cache_dir", lambda: saved / "not-a-dir")
    assert chooser()[0][2] == 9.75 and chooser()[0][2] == 10.75 and len(profiled) == 10
