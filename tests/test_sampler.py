# Both samplers are lossless: emitted tokens follow the target distribution exactly, for stochastic
# and one-hot drafts, at the first position, at recovered positions and at the bonus. The rejection
# sampler (unseeded requests) and the coupled acceptance (seeded: accept_coupled, drafts from
# sample_drafts). Each test can fail: it compares sampled frequencies with the exact distribution
# (chi-square and total variation against random reference distributions).
from types import SimpleNamespace

import pytest
import torch

import sampling
from sampling import accept, inverse_cdf, logits_to_probs, rejection_sample, sample_drafts
from sequence import SamplingParams, ScheduledSeq, Sequence

V, LENGTH = 5, 3  # vocabulary, and how many tokens each simulated generation keeps


def simulate(target, draft, k, num_chains, one_hot_draft, seed, sampler=rejection_sample):
    """Run num_chains generations of LENGTH tokens in a synthetic world where the target's
    next-token distribution at position i is target[i] and the draft's is draft[i] (or the fixed
    token draft[i].argmax() for one-hot drafts). Steps repeat: draft k tokens, verify, accept,
    commit."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.arange(num_chains)
    pad = LENGTH + k + 1  # finished chains keep stepping (masked); positions stay below this
    target = torch.cat([target, target[-1:].expand(pad + k + 1 - len(target), V)])
    draft = torch.cat([draft, draft[-1:].expand(pad + k + 1 - len(draft), V)])
    out = torch.full((num_chains, pad), -1)
    pos = torch.zeros(num_chains, dtype=torch.long)
    while (pos < LENGTH).any():
        active = pos < LENGTH
        steps = pos.clamp(max=LENGTH)[:, None] + torch.arange(k + 1)
        q = draft[steps[:, :k]]
        if one_hot_draft:
            tokens, q = q.argmax(-1), None
        else:
            tokens = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(num_chains, k)
        uniform = torch.rand(num_chains, k, generator=g)
        uniform_next = torch.rand(num_chains, generator=g)
        n, nxt = sampler(
            target[steps], tokens, q, torch.full((num_chains,), k), uniform, uniform_next
        )
        emitted = torch.cat([tokens, torch.zeros(num_chains, 1, dtype=torch.long)], 1)
        emitted[rows, n] = nxt  # accepted drafts, then the recovered or bonus token
        write = (torch.arange(k + 1) <= n[:, None]) & active[:, None]
        cols = (pos[:, None] + torch.arange(k + 1)).clamp(max=pad - 1)
        out[rows[:, None].expand_as(cols)[write], cols[write]] = emitted[write]
        pos += (n + 1) * active
    return out[:, :LENGTH]


def joint_histogram(samples):
    index = sum(samples[:, i] * V ** (LENGTH - 1 - i) for i in range(LENGTH))
    return torch.bincount(index, minlength=V**LENGTH).double() / len(samples)


def joint_exact(target):
    joint = target[0]
    for i in range(1, LENGTH):
        joint = (joint[:, None] * target[i][None, :]).flatten()
    return joint.double()


def chi_square(freq, exact, n):
    keep = exact * n >= 5
    return (n * (freq[keep] - exact[keep]) ** 2 / exact[keep]).sum().item(), int(keep.sum()) - 1


def random_dists(g, rows, peaked=1.0):
    return torch.softmax(peaked * torch.randn(rows, V, generator=g), dim=-1)


@pytest.mark.parametrize("one_hot_draft", [False, True])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_emitted_tokens_follow_the_target(k, one_hot_draft):
    seed = torch.randint(10**6, ()).item()
    g = torch.Generator().manual_seed(seed)
    target, draft = random_dists(g, LENGTH, 1.5), random_dists(g, LENGTH, 1.5)
    exact = joint_exact(target)
    n = 40_000
    freq = joint_histogram(simulate(target, draft, k, n, one_hot_draft, seed))
    chi2, dof = chi_square(freq, exact, n)
    assert chi2 < dof + 6 * (2 * dof) ** 0.5, f"seed {seed}: chi2 {chi2:.1f} with {dof} dof"
    tv = 0.5 * (freq - exact).abs().sum().item()
    for _ in range(5):  # the sampled histogram is closer to the target than to random look-alikes
        other = joint_exact(random_dists(g, LENGTH, 1.5))
        assert tv < 0.5 * (freq - other).abs().sum().item()


def test_distance_shrinks_like_one_over_sqrt_n():
    g = torch.Generator().manual_seed(7)
    target, draft = random_dists(g, LENGTH, 1.5), random_dists(g, LENGTH, 1.5)
    exact = joint_exact(target)
    tv = {}
    for n in (2_000, 32_000):
        runs = [
            0.5
            * (joint_histogram(simulate(target, draft, 2, n, False, s)) - exact).abs().sum().item()
            for s in range(3)
        ]
        tv[n] = sum(runs) / len(runs)
    assert tv[32_000] < tv[2_000] / 2.5  # 1/sqrt(N) predicts a factor of 4


def test_broken_residual_or_bonus_is_detected():
    """The statistic above catches the two classic mistakes: resampling from p instead of the
    residual after a rejection, and taking the bonus token from the last draft's row."""
    g = torch.Generator().manual_seed(3)
    target, draft = random_dists(g, LENGTH, 2.0), random_dists(g, LENGTH, 2.0)
    exact, n = joint_exact(target), 40_000

    def broken_residual(p, d, q, nd, u, u_next):
        num_accepted, _ = rejection_sample(p, d, q, nd, u, u_next)
        return num_accepted, inverse_cdf(p[torch.arange(len(p)), num_accepted], u_next)

    def broken_bonus(p, d, q, nd, u, u_next):
        return rejection_sample(torch.cat([p[:, :-1], p[:, -2:-1]], 1), d, q, nd, u, u_next)

    for broken in (broken_residual, broken_bonus):
        freq = joint_histogram(simulate(target, draft, 2, n, False, 0, sampler=broken))
        chi2, dof = chi_square(freq, exact, n)
        assert chi2 > dof + 6 * (2 * dof) ** 0.5


def simulate_coupled(target, draft, k, num_chains, one_hot_draft, seed, accept=accept):
    """The same synthetic world through the engine's seeded path: chain c is a Sequence seeded
    seed * num_chains + c; its drafts are the fixed tokens draft[i].argmax() (one-hot) or are
    sampled from draft[i] by sample_drafts with the noise of the position they are for;
    accept_coupled checks them against logits log(target[i]). Returns the LENGTH tokens of each
    chain and (drafted, accepted)."""
    pad = LENGTH + k + 1
    target = torch.cat([target, target[-1:].expand(pad - len(target), V)]).log()
    draft = torch.cat([draft, draft[-1:].expand(pad - len(draft), V)])
    out, counts = [], torch.zeros(2, dtype=torch.long)
    for chain in range(num_chains):
        seq = Sequence([0], SamplingParams(temperature=1.0, seed=seed * num_chains + chain), "cpu")
        while len(seq.output_ids) < LENGTH:
            pos = len(seq.output_ids)
            item = ScheduledSeq(seq, num_tokens=1, num_spec=k, samples=True)
            if one_hot_draft:
                item.drafts = draft[pos : pos + k].argmax(-1).tolist()
            for i in range(0 if one_hot_draft else k):
                sample_drafts([item], draft[pos + i].log()[None])
            item.parents = list(range(-1, len(item.drafts) - 1))  # a chain
            [(path, token)] = accept([item], target[pos : pos + k + 1])
            n = len(path)
            seq.token_ids += item.drafts[:n] + [token]
            counts += torch.tensor([k, n])
        out.append(seq.output_ids[:LENGTH])
    return torch.tensor(out), counts.tolist()


def assert_follows_the_target(samples, target, g, context):
    """Chi-square of the joint histogram of the LENGTH positions against the exact product
    distribution, and closer to it (total variation) than to random look-alike targets."""
    exact, freq, n = joint_exact(target), joint_histogram(samples), len(samples)
    chi2, dof = chi_square(freq, exact, n)
    assert chi2 < dof + 6 * (2 * dof) ** 0.5, f"{context}: chi2 {chi2:.1f} with {dof} dof"
    tv = 0.5 * (freq - exact).abs().sum().item()
    for _ in range(5):
        assert tv < 0.5 * (freq - joint_exact(random_dists(g, LENGTH, 1.5))).abs().sum().item(), (
            context
        )


@pytest.mark.parametrize("one_hot_draft", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_coupled_tokens_follow_the_target(k, one_hot_draft):
    seed = torch.randint(10**6, ()).item()
    g = torch.Generator().manual_seed(seed)
    target, draft = random_dists(g, LENGTH, 1.5), random_dists(g, LENGTH, 1.5)
    # 12,000 chains (96 a cell of the joint histogram on average): a broken coupling's
    # chi-square came out 58-100x the threshold with 5,000 (test_broken_coupling_is_detected).
    # 20,000 took 104 s of CI for the four cases, 12,000 about 62.
    samples, (drafted, accepted) = simulate_coupled(target, draft, k, 12_000, one_hot_draft, seed)
    assert 0 < accepted < drafted  # accepted drafts, recovered tokens and bonus tokens all occurred
    assert_follows_the_target(samples, target, g, f"seed {seed}")


def test_broken_coupling_is_detected(monkeypatch):
    """The same statistic catches a coupling gone wrong: one noise for every position (tokens then
    correlate across positions), and emitting the rejected draft instead of the target's token."""
    g = torch.Generator().manual_seed(5)
    target, draft = random_dists(g, LENGTH, 2.0), random_dists(g, LENGTH, 2.0)
    # (5,000 chains: each broken coupling's chi-square came out 58x and 100x the threshold)
    exact, n = joint_exact(target), 5_000

    def draft_on_rejection(items, logits):
        return [
            (a, it.drafts[len(a)] if len(a) < len(it.drafts) else t)
            for it, (a, t) in zip(items, accept(items, logits))
        ]

    broken = simulate_coupled(target, draft, 2, n, False, 0, accept=draft_on_rejection)[0]
    with monkeypatch.context() as patch:
        noise = sampling.position_noise
        patch.setattr(
            sampling, "position_noise", lambda seq, _, vocab, device: noise(seq, 0, vocab, device)
        )
        shared_noise = simulate_coupled(target, draft, 2, n, True, 0)[0]
    for samples in (broken, shared_noise):
        chi2, dof = chi_square(joint_histogram(samples), exact, n)
        assert chi2 > dof + 6 * (2 * dof) ** 0.5


def test_inverse_cdf_draws_weighted_tokens_only_and_keeps_tiny_ones():
    def draw(weights, u):
        return inverse_cdf(torch.tensor([weights]), torch.tensor([u], dtype=torch.float64)).item()

    # u near 1 takes the first weighted token, u = 0 the last; a zero weight never comes out
    assert [draw([0.0, 2.0, 0.0, 1.0, 0.0], u) for u in (0.999, 0.5, 0.3, 0.0)] == [1, 1, 3, 3]
    # 999 weights of 1e-9 between two of 1: each still owns its own sliver (an fp32 running sum
    # stays at 1 through them, rounding each 1e-9 away: this draw gave token 0)
    weights = [1.0] + [1e-9] * 999 + [1.0]
    assert draw(weights, 1 - (1 + 5.5e-9) / sum(weights)) == 6


def test_greedy_reduces_to_argmax_matching():
    p = torch.tensor([[[0.1, 0.6, 0.3], [0.5, 0.2, 0.3], [0.2, 0.2, 0.6]]])
    greedy = torch.nn.functional.one_hot(p.argmax(-1), 3).float()
    for drafts, expected in (([1, 0], (2, 2)), ([1, 2], (1, 0)), ([0, 0], (0, 1))):
        n, tok = rejection_sample(
            greedy,
            torch.tensor([drafts]),
            None,
            torch.tensor([2]),
            torch.rand(1, 2),
            torch.rand(1),
        )
        assert (n.item(), tok.item()) == expected
    # The engine's greedy shortcut gives the same answers, for a batch whose rows have different K.
    cases = (([1, 0], (2, 2)), ([1, 2], (1, 0)), ([0, 0], (0, 1)), ([1], (1, 0)), ([], (0, 1)))
    greedy_seq = Sequence([1], SamplingParams(temperature=0), "cpu")
    items = [
        SimpleNamespace(drafts=drafts, parents=list(range(-1, len(drafts) - 1)), seq=greedy_seq)
        for drafts, _ in cases
    ]
    logits = torch.cat([p[0, : len(drafts) + 1].log() for drafts, _ in cases])
    paths, next_tokens = zip(*accept(items, logits))
    assert [(len(path), token) for path, token in zip(paths, next_tokens)] == [
        want for _, want in cases
    ]
    assert all(path == list(range(len(path))) for path in paths)


def test_coupled_acceptance_walks_the_tree():
    """Drafts 0, 1 under the last token, 2 under 1, 0 under 2; rows (last token, then one per
    draft) whose argmax is 1, -, 2, 1: the walk takes 1 (not 0, the first child), then 2, then
    stops at 0."""
    greedy_seq = Sequence([1], SamplingParams(temperature=0), "cpu")
    tree = SimpleNamespace(drafts=[0, 1, 2, 0], parents=[-1, -1, 1, 2], seq=greedy_seq)
    logits = torch.nn.functional.one_hot(torch.tensor([1, 0, 2, 1, 0]), 3).float()
    assert accept([tree], logits) == [([1, 2], 1)]


def test_top_k_top_p_and_temperature_masks():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]] * 4))
    seqs = [
        Sequence([1], SamplingParams(**kw), "cpu")
        for kw in (dict(temperature=1.0), dict(top_k=2), dict(top_p=0.7), dict(temperature=0))
    ]
    probs = logits_to_probs(logits, seqs)
    assert torch.allclose(probs[0], torch.tensor([0.5, 0.25, 0.15, 0.1]))
    assert torch.allclose(probs[1], torch.tensor([2 / 3, 1 / 3, 0, 0]))
    # 0.5 < 0.7 needs the second token
    assert torch.allclose(probs[2], torch.tensor([2 / 3, 1 / 3, 0, 0]))
    assert torch.equal(probs[3], torch.tensor([1.0, 0, 0, 0]))
    hot = logits_to_probs(logits[:1], [Sequence([1], SamplingParams(temperature=0.5), "cpu")])
    assert torch.allclose(hot[0], torch.softmax(logits[0] / 0.5, -1))


CONTROLS = dict(  # strong penalties: repeating the first token is rare (and checked below)
    repetition_penalty=2.0,
    presence_penalty=1.5,
    frequency_penalty=1.0,
    min_p=0.02,
    logit_bias={7: 2.0, 11: -1.0, 30: 1.0},
)


@pytest.mark.parametrize("controls", [{}, CONTROLS], ids=["raw", "controls"])
@pytest.mark.parametrize("seeded", [True, False], ids=["seeded-coupled", "unseeded-rejection"])
def test_engine_sampling_with_speculation_matches_the_target(tmp_path, seeded, controls):
    """End to end at temperature 1: the first two tokens generated with a draft model (the second
    one comes from a speculative step: accepted draft or recovered token) follow the target's
    exact joint distribution, computed with transformers (and, with controls on, processed by
    controls.process_logits with each token's history: penalties, min_p, logit_bias), through
    the coupled acceptance (seeded requests) and the rejection sampler (unseeded); and the same
    seeds give the same tokens again."""
    import tiny

    import controls as sampling_controls
    from nanospec import LLM

    def dist(logits, histories):
        rows = [sampling_controls.process_logits(r, h, 4, rule) for r, h in zip(logits, histories)]
        return torch.softmax(torch.stack(rows).double(), -1)

    rule = SamplingParams(temperature=1.0, **controls)

    hf = tiny.write_checkpoint(tmp_path / "target", tiny.llama_like())
    tiny.write_checkpoint(tmp_path / "draft", tiny.llama_like(num_hidden_layers=1), seed=1)
    prompt, n = [5, 9, 14, 23], 3000
    with torch.no_grad():
        p1 = dist(hf(torch.tensor([prompt])).logits[0, -1:], [prompt])[0]
        histories = [prompt + [t] for t in range(tiny.VOCAB)]
        p2 = dist(hf(torch.tensor(histories)).logits[:, -1], histories)
    exact = (p1[:, None] * p2).flatten()
    llm = LLM(
        str(tmp_path / "target"),
        dtype="float32",
        block_size=4,
        num_blocks=1024,
        max_num_seqs=256,
        draft=str(tmp_path / "draft"),
        num_spec_tokens=2,
    )
    params = [
        SamplingParams(
            temperature=1.0, max_tokens=3, ignore_eos=True, seed=i if seeded else None, **controls
        )
        for i in range(n)
    ]
    outs = llm.generate([prompt] * n, params, use_progress=False)
    drafted, accepted = (
        sum(o.num_draft_tokens for o in outs),
        sum(o.num_accepted_tokens for o in outs),
    )
    assert 0 < accepted < drafted  # both accepted drafts and recovered tokens occurred
    pairs = torch.tensor([o.token_ids[0] * tiny.VOCAB + o.token_ids[1] for o in outs])
    freq = torch.bincount(pairs, minlength=tiny.VOCAB**2).double() / n
    # The joint over both tokens, and (with far more samples per cell, so more power) the marginal
    # of the speculated second token. Cells expected to hold fewer than 5 samples are pooled into
    # one.
    for f, e in (
        (freq, exact),
        (freq.view(tiny.VOCAB, -1).sum(0), exact.view(tiny.VOCAB, -1).sum(0)),
    ):
        small = e * n < 5
        pooled_f, pooled_e = (
            torch.cat([f[~small], f[small].sum()[None]]),
            torch.cat([e[~small], e[small].sum()[None]]),
        )
        chi2, dof = chi_square(pooled_f, pooled_e, n)
        assert chi2 < dof + 6 * (2 * dof) ** 0.5, f"chi2 {chi2:.1f} with {dof} dof"
    # The third token repeating the second: a verify row after an accepted draft must see that
    # draft in its history (penalised with controls on)
    repeats = sum(o.token_ids[1] == o.token_ids[2] for o in outs) / n
    with torch.no_grad():
        histories = [prompt + [a, b] for a in range(tiny.VOCAB) for b in range(tiny.VOCAB)]
        p3 = dist(hf(torch.tensor(histories)).logits[:, -1], histories)
    p3 = p3.view(tiny.VOCAB, tiny.VOCAB, tiny.VOCAB).diagonal(dim1=1, dim2=2)  # [t1, t2 = t3]
    want = (p1[:, None] * p2 * p3).sum().item()
    assert abs(repeats - want) < 5 * (want / n) ** 0.5 + 2 / n, (repeats, want)
    if seeded:
        again = llm.generate([prompt] * 50, params[:50], use_progress=False)
        assert [o.token_ids for o in again] == [o.token_ids for o in outs[:50]]
