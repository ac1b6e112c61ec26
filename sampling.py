# Sampling and lossless acceptance: probabilities after temperature / top-k / top-p, the
# exponential race keyed by (seed, position), the coupled acceptance (greedy, seeded) and the
# rejection sampler (unseeded, which draws by inverse CDF), log-probs, and the sampling of model
# drafts. It must never emit a token the target would not have produced with the same sampling
# (greedy: the same tokens).
import itertools

import torch

import controls
from sequence import SamplingParams, ScheduledSeq, Sequence


def logits_to_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """[R, V] logits of rows owned by seqs -> float32 probs. Greedy rows become one-hot argmax (a
    greedy draft model's draft probabilities; greedy verification itself takes accept_coupled)."""
    params = [s.params for s in seqs]
    if all(p.temperature == 0 for p in params):  # an all-greedy batch needs no softmax
        return one_hot_argmax(logits)
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    greedy = temperature == 0
    probs = torch.softmax(logits.float() / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
    # Only the rows with top-k or top-p are filtered and renormalised.
    filtered = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1]
    if filtered:
        probs[filtered] = top_k_top_p(probs[filtered], [params[i] for i in filtered])
    if greedy.any():
        probs[greedy] = one_hot_argmax(logits[greedy])
    return probs


def top_k_top_p(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    top_k = torch.tensor([p.top_k for p in params], device=probs.device)[:, None]
    top_p = torch.tensor([p.top_p for p in params], device=probs.device)[:, None]
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    drop = ((top_k > 0) & (rank >= top_k)) | ((top_p < 1) & (mass_before >= top_p))
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0))
    return probs / probs.sum(-1, keepdim=True)


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(logits.max(-1).indices, logits.shape[-1]).float()


def exp_noise(generator: torch.Generator, vocab: int, device) -> torch.Tensor:
    """[vocab] Exp(1) draws, -log(1 - U) of uniform U in [0, 1), never 0: U = 0 gives 0, and 0 / 0
    would win the argmax (the clamp). Not torch's exponential_, which took 1 ms for the default
    model's 49,152 draws on a 2-core CPU, 5x what the uniforms and a log1p take: a sampled
    token's noise was ~7% of a decode step (BENCHMARKS.md, session 28)."""
    noise = torch.rand(vocab, generator=generator, device=device).neg_().log1p_().neg_()
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def position_noise(seq: Sequence, position: int, vocab: int, device) -> torch.Tensor:
    """Exp(1) noise for the token at `position` of seq, from a generator keyed by (seed, position):
    plain decoding and every speculative step draw the same noise for the same token."""
    generator = torch.Generator(device=device).manual_seed(hash((seq.seed, position)) % 2**63)
    return exp_noise(generator, vocab, device)


def sample_at(probs: torch.Tensor, seq: Sequence, position: int) -> int:
    """The exponential race argmax(p / E) with the position's noise: an exact sample from p."""
    if seq.params.temperature == 0:
        return int(probs.argmax())
    return int((probs / position_noise(seq, position, probs.shape[-1], probs.device)).argmax())


def couples(seq: Sequence) -> bool:
    """Greedy and seeded requests take the coupled acceptance (accept_coupled): their tokens equal
    plain decoding's whatever K, proposer or batch. Unseeded sampling takes the rejection sampler,
    which accepts model drafts more often."""
    return seq.params.temperature == 0 or seq.params.seed is not None


def accept(sampling: list[ScheduledSeq], logits: torch.Tensor) -> list[tuple[list[int], int]]:
    """(accepted path of draft indices, next token) per sequence, from its rows of logits: the
    coupled acceptance for greedy and seeded requests, the rejection sampler for the others."""
    starts = [0, *itertools.accumulate(len(it.drafts) + 1 for it in sampling)]
    paths = [(it.seq, controls.row_paths(it.drafts, it.parents)) for it in sampling]
    logits = controls.apply(paths, logits)  # rows of requests with controls or a grammar
    # The step's one host sync where every row is greedy (a sampled row adds its own draws). The
    # argmax: on a CPU by numpy's argmax (SIMD; the first of equal maxima or the first NaN, as
    # torch's max), not torch's max(-1), a scalar loop: 5 us against 51 for a decode step's row of
    # the default model's 49,152 logits, 31 against 444 for a verify step's 8 rows, 2% of that step
    # (bf16 rows, widened first: 74 against 286 us; session 40).
    best = (logits.float().numpy().argmax(-1) if logits.is_cpu else logits.max(-1).indices).tolist()
    return [
        accept_coupled(it, logits[a:b], best[a:b])
        if couples(it.seq)
        else accept_by_rejection(it, logits[a:b])
        for it, a, b in zip(sampling, starts, starts[1:])
    ]


def accept_coupled(
    it: ScheduledSeq, logits: torch.Tensor, best: list[int]
) -> tuple[list[int], int]:
    """The token at each position is the target's own sample there: the argmax of the logits
    (greedy, `best` per row) or argmax(p / E) with the position's noise E. A draft is accepted
    iff it equals that token: from the last token down the tree, the child equal to the token its
    parent's row gives; the token after the last accepted draft is emitted (the recovered or the
    bonus token). An exact sample from the target; one-hot drafts are accepted with probability
    p(d), as rejection sampling does."""

    def target_token(node: int, depth: int) -> int:  # of node's row: the token at len(seq) + depth
        if it.seq.params.temperature == 0:
            return best[node + 1]
        probs = logits_to_probs(logits[node + 1][None], [it.seq])[0]
        return sample_at(probs, it.seq, len(it.seq) + depth)

    nodes = list(zip(it.drafts, it.parents))  # (token, parent) per draft node
    node, path, token = -1, [], target_token(-1, 0)
    while (token, node) in nodes:  # node's first child that is the target's token
        node = nodes.index((token, node))
        path.append(node)
        token = target_token(node, len(path))  # each row's token is computed once
    return path, token


def accept_by_rejection(it: ScheduledSeq, logits: torch.Tensor) -> tuple[list[int], int]:
    """Standard rejection sampling (unseeded requests) of one sequence's chain, from its logits
    [K+1, V]. Its K + 1 uniforms (one a draft, then one for the emitted token) come from the
    request's own generator."""
    k, device = len(it.drafts), logits.device
    target_probs = logits_to_probs(logits, [it.seq] * (k + 1))
    uniform = torch.rand(k + 1, generator=it.seq.generator, device=device)
    num_accepted, token = rejection_sample(
        target_probs[None],
        torch.tensor([it.drafts], dtype=torch.long, device=device),
        None if it.draft_probs is None else it.draft_probs[None],
        torch.tensor([k], device=device),
        uniform[None, :k],
        uniform[k:],
    )
    return list(range(int(num_accepted))), int(token)  # a chain: drafts 0..n-1


def rejection_sample(target_probs, draft_tokens, draft_probs, num_drafts, uniform, uniform_next):
    """Lossless speculative acceptance for a padded batch: target_probs [B, K+1, V]; draft_tokens
    [B, K]; draft_probs [B, K, V], or None for one-hot drafts (n-gram); num_drafts [B] (rows past
    it are padding); uniform [B, K] and uniform_next [B] in [0, 1). Returns (num_accepted [B],
    next_token [B]). Accept d_i with prob min(1, p(d_i) / q(d_i)) up to the first rejection;
    then emit one token: from norm(max(p - q, 0)) at a rejection (the "recovered" token) or from
    p at row K_b when every draft was accepted (the "bonus" token), drawn by inverse_cdf, which
    needs no normalisation."""
    num_seqs, max_k = draft_tokens.shape
    batch = torch.arange(num_seqs, device=target_probs.device)
    if max_k == 0:
        return torch.zeros_like(num_drafts), inverse_cdf(target_probs[:, 0], uniform_next)
    p_draft = target_probs[:, :max_k].gather(2, draft_tokens[..., None]).squeeze(-1)
    q_draft = (
        1.0 if draft_probs is None else draft_probs.gather(2, draft_tokens[..., None]).squeeze(-1)
    )
    drafted = torch.arange(max_k, device=batch.device) < num_drafts[:, None]
    accepted = (uniform * q_draft < p_draft) & drafted
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    p_next = target_probs[batch, num_accepted]
    at = num_accepted.clamp(max=max_k - 1)  # the rejected position (clamped when all were accepted)
    if draft_probs is None:  # one-hot q: max(p - q, 0) is p with the rejected token zeroed
        residual = p_next.scatter(1, draft_tokens[batch, at][:, None], 0.0)
    else:
        residual = (p_next - draft_probs[batch, at]).clamp_min(0)
    # A residual that rounds to all-zero can only come from p == q, where rejection had probability
    # 0.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
    dist = torch.where((num_accepted < num_drafts)[:, None], residual, p_next)
    return num_accepted, inverse_cdf(dist, uniform_next)


def inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One draw per row of weights [B, V] (>= 0, not normalised) from uniform [B] in [0, 1): the
    first token whose cumulative weight reaches 1 - u of the row's total. 1 - u is in (0, 1], so
    the token found always has a weight > 0, and the last such token is found at u = 0. Unseeded
    requests need no coupling between positions, so one uniform a token does, where the
    exponential race (sample_at) draws one a vocabulary entry: 49,152 for the default model,
    0.3-0.45 ms of a CPU step. The sums in fp64: an fp32 running total near 1 rounds away any
    weight below 3e-8, and a 49,152-token tail holds many."""
    cdf = weights.double().cumsum(-1)
    threshold = (1 - uniform.double())[:, None] * cdf[:, -1:]
    # (clamped: a NaN weight, from a broken model, still gives a token id)
    return torch.searchsorted(cdf, threshold).squeeze(-1).clamp(max=cdf.shape[-1] - 1)


def token_logprobs(logits: torch.Tensor, token: int, top_n: int) -> dict[int, float]:
    """vLLM's logprobs: log_softmax of the raw logits (before temperature, top-k, top-p) for the
    sampled token and the top_n most likely ones."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return {i: logprobs[i].item() for i in [token] + logprobs.topk(top_n).indices.tolist()}


def sample_drafts(items: list[ScheduledSeq], logits: torch.Tensor) -> torch.Tensor:
    """Sample one draft token per item from the draft's probabilities (same temperature, top-k and
    top-p as the target, and the same controls and grammar: a draft the grammar forbids would be
    cut, which the rejection sampler does not allow for) and keep those probabilities for it."""
    logits = controls.apply([(item.seq, [item.drafts]) for item in items], logits)
    probs = logits_to_probs(logits, [item.seq for item in items])
    for item, p in zip(items, probs):
        # The noise of the position the draft is for: where the target samples with the same noise
        # (accept_coupled), the draft agrees with it as often as it can.
        # A chain: each draft's parent is the previous draft, or -1 for the first.
        item.parents.append(len(item.drafts) - 1)
        item.drafts.append(sample_at(p, item.seq, len(item.seq) + len(item.drafts)))
        item.draft_probs = (
            p[None] if item.draft_probs is None else torch.cat([item.draft_probs, p[None]])
        )
    return torch.tensor([item.drafts[-1] for item in items], device=logits.device)
