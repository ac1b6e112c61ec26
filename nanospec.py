# nanospec: the engine. Requests, proposers (n-gram, suffix, draft model, MLP speculator), the
# scheduler (continuous batching, lookahead slots, preemption, dynamic speculation), lossless
# acceptance, the LLM API and the CLI. Every step (plain decoding: K = 0) is schedule -> propose ->
# verify -> accept -> commit. It must never emit a token the target would not have produced with the
# same sampling (greedy: the same tokens).
import argparse
import bisect
import heapq
import inspect
import itertools
import json
import math
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np
import torch

import kernels
from kernels import AttentionContext
from models import eos_token_ids, load_model, load_tokenizer, require
from paged_kv import BlockManager, allocate_kv_cache, bytes_per_block


# ---------------------------------------------------------------------------------------------
# Requests
@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    num_spec_tokens: int | None = None  # per-request K (0: this request never speculates)
    # per token: the sampled token's and the N most likely tokens' log-probs
    logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = {
            "temperature": self.temperature >= 0 and math.isfinite(self.temperature),
            "top_p": 0 < self.top_p <= 1,
            "top_k": self.top_k >= 0,
            "max_tokens": self.max_tokens >= 1,
            "stop": all(isinstance(s, str) and s for s in self.stop or []),
            "num_spec_tokens": self.num_spec_tokens is None or self.num_spec_tokens >= 0,
            "logprobs": self.logprobs is None or self.logprobs >= 0,
            # torch takes
            "seed": self.seed is None or isinstance(self.seed, int) and 0 <= self.seed < 2**64,
        }
        for name, ok in checks.items():
            require(ok, f"SamplingParams.{name} has an invalid value: {getattr(self, name)!r}")


class Sequence:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, device):
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.num_cached = 0  # positions whose target K/V are in the cache
        self.num_draft_cached = 0  # the same for the draft model (may lag)
        self.block_table: list[int] = []
        self.last_hidden = None  # target hidden state that produced the last token (MLP proposer)
        # The seed keys the noise of each position (position_noise); unseeded requests also draw
        # the rejection sampler's uniforms and noise from the generator.
        self.seed = params.seed if params.seed is not None else torch.randint(2**62, ()).item()
        self.generator = torch.Generator(device=device).manual_seed(self.seed)
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.text: str | None = None  # set at finish; truncated at a stop string
        # the output decoded token by token (stop strings, streaming), and per character whether
        # an accepted draft produced it
        self.decoded, self.decode_offsets = "", (self.num_prompt_tokens,) * 2
        self.drafted_chars: list[bool] = []
        self.num_cached_tokens: int | None = None  # prompt tokens found cached when first admitted
        self.num_drafted = self.num_accepted = self.num_spec_steps = 0
        self.accepted_per_position, self.drafted_per_position = Counter(), Counter()
        # steps that drafted a token there after accepting all before
        self.reached_per_position = Counter()
        self.arrival_time, self.first_token_time, self.finish_time = time.perf_counter(), None, None

    def __len__(self):
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def phase(self) -> str:
        """finished; decoding: it has sampled, and only its last token lacks K/V (a step may
        speculate: the MLP proposer needs the hidden state that sampled it); else prefilling
        (prompt or recompute)."""
        if self.finish_reason is not None:
            return "finished"
        decoding = self.num_cached == len(self) - 1 and len(self) > self.num_prompt_tokens
        return "decoding" if decoding else "prefilling"


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    num_draft_tokens: int
    num_accepted_tokens: int
    num_spec_steps: int
    logprobs: list[dict[int, float]] | None  # per output token (SamplingParams.logprobs), else None
    accepted_per_position: dict  # position -> share of steps whose drafts were accepted through it
    drafted_per_position: dict  # position -> steps that drafted a token there
    ttft: float
    tpot: float
    latency: float
    num_cached_tokens: int = 0  # prompt tokens whose K/V a prefix-cache hit supplied


@dataclass
class StreamUpdate:
    """What one step added to one request (LLM.generate(..., stream=True))."""

    index: int  # the prompt it answers
    delta: str  # new text: never half a character, never any part of a stop string
    token_ids: list[int]
    drafted: list[bool]  # per character of delta: produced by an accepted draft
    finished: bool
    output: RequestOutput | None = None  # with the last update


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens of seq.token_ids fed this step (prefill chunk, or 1)
    num_spec: int  # lookahead slots reserved for drafts this step: the node budget
    samples: bool  # this step reaches the end of the sequence, so it emits tokens
    max_depth: int = 0  # K: the longest draft path (a chain: num_spec)
    branches: int = 1  # children a draft node may have (1: a chain)
    drafts: list[int] = field(default_factory=list)
    # per draft: its parent draft, -1 = the last token
    parents: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [len(drafts), V]; None = one-hot drafts (n-gram)


def tree_layout(
    batch, parents: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor, dict[int, list[int]]]:
    """AttentionContext.tree_pos and tree_keys of a forward, and each draft node's root-to-node
    path in cache positions, keyed by the node's index in the forward. Tokens fill consecutive
    cache positions from their start; a node at depth d takes the root's position + d, where
    plain decoding puts it."""
    positions, paths = [], {}
    for (_, tokens, start), nodes in zip(batch, parents):
        root = start + len(tokens) - len(nodes) - 1  # the last token before the drafts
        positions += range(start, root + 1)
        node_paths = []
        for i, p in enumerate(nodes):
            node_paths.append((node_paths[p] if p >= 0 else [root]) + [root + 1 + i])
            paths[len(positions)] = node_paths[-1]
            positions.append(root + len(node_paths[-1]) - 1)
    positions, width = torch.tensor(positions), max(map(len, paths.values()))
    # [T, W]; a token off the tree reads its own
    keys = positions[:, None] - width + 1 + torch.arange(width)
    for t, path in paths.items():
        keys[t, width - len(path) :] = torch.tensor(path)
    return positions, keys, paths


# ---------------------------------------------------------------------------------------------
# Sampling: probabilities after temperature / top-k / top-p, and the exponential race.
def logits_to_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """[R, V] logits of rows owned by seqs -> float32 probs. Greedy rows become one-hot argmax,
    which makes the rejection sampler reduce exactly to "accept while draft == argmax"."""
    params = [s.params for s in seqs]
    if all(p.temperature == 0 for p in params):  # an all-greedy batch needs no softmax
        return one_hot_argmax(logits)
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    greedy = temperature == 0
    probs = torch.softmax(logits.float() / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
    # only these are renormalised
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
    """[vocab] Exp(1) draws, never 0: some devices draw exact zeros, and 0 / 0 would win the
    argmax."""
    noise = torch.empty(vocab, device=device).exponential_(generator=generator)
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
    # the step's one host sync; max: 2x faster than bf16 argmax
    best = logits.max(-1).indices.tolist()
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

    path, token = [], target_token(-1, 0)
    while (
        child := next(
            (
                i
                for i, (d, p) in enumerate(zip(it.drafts, it.parents))
                if d == token and p == (path[-1] if path else -1)
            ),
            None,
        )
    ) is not None:
        path.append(child)
        token = target_token(child, len(path))  # each row's token is computed once
    return path, token


def accept_by_rejection(it: ScheduledSeq, logits: torch.Tensor) -> tuple[list[int], int]:
    """Standard rejection sampling (unseeded requests) of one sequence's chain, from its logits
    [K+1, V]. Its uniforms, then its noise, come from the request's own generator."""
    k, device = len(it.drafts), logits.device
    target_probs = logits_to_probs(logits, [it.seq] * (k + 1))
    uniform = torch.rand(k, generator=it.seq.generator, device=device)
    num_accepted, token = rejection_sample(
        target_probs[None],
        torch.tensor([it.drafts], dtype=torch.long, device=device),
        None if it.draft_probs is None else it.draft_probs[None],
        torch.tensor([k], device=device),
        uniform[None],
        exp_noise(it.seq.generator, logits.shape[-1], device)[None],
    )
    return list(range(int(num_accepted))), int(token)  # a chain: drafts 0..n-1


def rejection_sample(target_probs, draft_tokens, draft_probs, num_drafts, uniform, exp_noise):
    """Lossless speculative acceptance for a padded batch: target_probs [B, K+1, V]; draft_tokens
    [B, K]; draft_probs [B, K, V], or None for one-hot drafts (n-gram); num_drafts [B] (rows past
    it are padding); uniform [B, K] in [0, 1); exp_noise [B, V] Exp(1). Returns (num_accepted
    [B], next_token [B]). Accept d_i with prob min(1, p(d_i) / q(d_i)) up to the first rejection;
    then emit one token: from norm(max(p - q, 0)) at a rejection (the "recovered" token) or from
    p at row K_b when every draft was accepted (the "bonus" token), sampled as argmax(dist /
    Exp(1)), which needs no normalisation."""
    num_seqs, max_k = draft_tokens.shape
    batch = torch.arange(num_seqs, device=target_probs.device)
    if max_k == 0:
        return torch.zeros_like(num_drafts), (target_probs[:, 0] / exp_noise).argmax(-1)
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
    return num_accepted, (dist / exp_noise).argmax(-1)


def token_logprobs(logits: torch.Tensor, token: int, top_n: int) -> dict[int, float]:
    """vLLM's logprobs: log_softmax of the raw logits (before temperature, top-k, top-p) for the
    sampled token and the top_n most likely ones."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return {i: logprobs[i].item() for i in [token] + logprobs.topk(top_n).indices.tolist()}


# ---------------------------------------------------------------------------------------------
# Proposers: each fills item.drafts and item.parents (per draft, its parent draft: a chain's is the
# one before), a tree of <= num_spec nodes and max_depth levels, parents before children; model
# drafts also fill item.draft_probs.
class NgramProposer:
    """Prompt lookup: find the first occurrence of the longest suffix n-gram (n in [min_n,
    max_n]) in prompt + output and propose the tokens that followed it: usually in the prompt,
    the text being quoted or edited (later ones are often the model's own repetitions)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, engine, items: list[ScheduledSeq]):
        for item in items:
            tokens = np.asarray(item.seq.token_ids)
            item.drafts, item.parents = self.tree(
                tokens, item.num_spec, item.max_depth, item.branches
            )

    def tree(
        self, tokens: np.ndarray, budget: int, depth: int, branches: int
    ) -> tuple[list[int], list[int]]:
        """A chain (branches = 1): the first occurrence's continuation. A tree: those of every
        occurrence, the most frequent first."""
        n, ends = suffix_matches(tokens, tokens, self.max_n)
        if n < self.min_n:
            return [], []
        rows = continuations(tokens, ends[:1] if branches == 1 else ends, depth)
        return draft_tree(rows, budget, branches, 0.0)


def suffix_matches(hay: np.ndarray, context: np.ndarray, max_len: int) -> tuple[int, np.ndarray]:
    """(m, ends): the longest m <= max_len for which context's last m tokens occur in hay with a
    token after them, and where each occurrence ends. Vectorized: each longer match filters the
    shorter's hits."""
    ends = np.flatnonzero(hay[:-1] == context[-1])
    m = int(len(ends) > 0)
    while len(ends) and m < min(max_len, len(context)):
        ends_in = ends[ends >= m]
        longer = ends_in[hay[ends_in - m] == context[-m - 1]]
        if not len(longer):
            break
        ends, m = longer, m + 1
    return m, ends


def continuations(hay: np.ndarray, ends: np.ndarray, depth: int) -> np.ndarray:
    """[len(ends), depth]: the tokens after each occurrence; -1 past the end or a request
    separator."""
    at = ends[:, None] + 1 + np.arange(depth)
    rows = np.where(at < len(hay), hay[np.minimum(at, len(hay) - 1)], -1)
    rows[np.maximum.accumulate(rows < 0, axis=1)] = -1
    return rows


def draft_tree(
    rows: np.ndarray, budget: int, branches: int, min_prob: float
) -> tuple[list[int], list[int]]:
    """Grow a token tree (tokens, parent index per node, -1 = root) of <= budget nodes from
    continuation rows [n, depth], best first by path probability: the share of rows that follow
    the path, each step counted among the rows that followed its parent (rows that end there
    included). A node tries its `branches` most frequent next tokens (ties: the earliest row);
    branches = 1 grows a chain."""
    tokens, parents, frontier, serial = [], [], [], itertools.count()

    def push_children(node: int, depth: int, members: np.ndarray, prob: float):
        if depth == rows.shape[1]:
            return
        column = rows[members, depth]
        values, first, counts = np.unique(column, return_index=True, return_counts=True)
        best = [i for i in np.lexsort((first, -counts)) if values[i] >= 0][:branches]
        for i in best:
            p = prob * counts[i] / len(members)
            if p >= min_prob:
                follow = members[column == values[i]]
                heapq.heappush(frontier, (-p, next(serial), node, depth, int(values[i]), follow))

    push_children(-1, 0, np.arange(len(rows)), 1.0)
    while frontier and len(tokens) < budget:
        neg_prob, _, parent, depth, token, members = heapq.heappop(frontier)
        tokens.append(token)
        parents.append(parent)
        push_children(len(tokens) - 1, depth + 1, members, -neg_prob)
    return tokens, parents


class SuffixProposer:
    """SuffixDecoding (arXiv 2411.04975): match the longest suffix (<= max_match tokens) of the
    context in this request's prompt + output and in those of the last max_requests finished
    requests (kept across generate() calls); the continuations that followed the matches form a
    frequency-weighted trie, and its most probable path is proposed while the path probability
    stays >= min_prob, at most max_spec_factor x the match length. Where the longest match is in
    the request itself, its latest occurrence (the text being repeated now) weighs as much as all
    the others together: a chain follows it, a tree tries it first (BENCHMARKS.md, session 9). A
    plain numpy scan per step, no index: O(remembered tokens)."""

    def __init__(self, max_requests=256, max_match=24, max_spec_factor=8.0, min_prob=0.1):
        self.finished = deque(maxlen=max_requests)  # the oldest request drops out first
        self.corpus = np.zeros(0, dtype=np.int64)  # the finished requests, each followed by -1
        self.max_match, self.max_spec_factor, self.min_prob = max_match, max_spec_factor, min_prob

    def remember(self, token_ids: list[int]):
        self.finished.append(np.append(token_ids, -1))
        self.corpus = np.concatenate(self.finished)

    propose = NgramProposer.propose  # the same loop, over this class's tree()

    def tree(
        self, tokens: np.ndarray, budget: int, depth: int, branches: int
    ) -> tuple[list[int], list[int]]:
        found = [
            (hay, *suffix_matches(hay, tokens, self.max_match)) for hay in (self.corpus, tokens)
        ]
        m = max(length for _, length, _ in found)
        depth = min(depth, int(self.max_spec_factor * m))
        rows = [continuations(hay, ends, depth) for hay, length, ends in found if length == m > 0]
        if not rows:
            return [], []
        # rows[-1] are the request's own, the latest last: it outweighs all others
        if found[1][1] == m:
            rows.insert(0, np.repeat(rows[-1][-1:], sum(map(len, rows)), axis=0))
        return draft_tree(np.concatenate(rows), budget, branches, self.min_prob)


@dataclass
class DraftModelProposer:
    """A small model with the target's vocabulary, sharing the target's block tables and slots.
    It reaches into the engine for one thing: its varlen forward."""

    model: torch.nn.Module
    # max_num_batched_tokens: > 2 x the sequences drafting, so each chunk makes progress
    budget: int

    def propose(self, engine, items: list[ScheduledSeq]):
        seqs = [item.seq for item in items]
        # First forward: every token the draft has not cached yet (1 normally, 2 after a bonus
        # token, the whole prompt the first time, more after speculation was off for a while).
        self.catch_up(engine, seqs)
        batch = [(s, s.token_ids[s.num_draft_cached :], s.num_draft_cached) for s in seqs]
        for i in range(max(item.num_spec for item in items)):
            if i > 0:  # then one token per step: the draft's own previous guess
                items = [item for item in items if item.num_spec > i]
                batch = [(item.seq, item.drafts[-1:], len(item.seq) + i - 1) for item in items]
            hidden, query_start = self.feed(engine, batch)
            sample_drafts(items, self.model.lm_head(hidden[query_start[1:] - 1]))

    def catch_up(self, engine, seqs: list[Sequence]):
        """While the tokens the draft lacks exceed the step's token budget, feed them (all but each
        sequence's last) in forwards within the budget, as the target's prefill is chunked."""
        while sum(len(s) - s.num_draft_cached for s in seqs) > self.budget:
            chunk, room = [], self.budget
            for s in seqs:
                start = s.num_draft_cached
                n = min(len(s) - start - 1, room)
                if n > 0:
                    chunk.append((s, s.token_ids[start : start + n], start))
                    room -= n
            self.feed(engine, chunk)

    def feed(self, engine, batch: list[tuple[Sequence, list[int], int]]):
        """One draft forward; its tokens' K/V are now in the draft's cache."""
        hidden, query_start = engine.forward(self.model, batch)
        for seq, tokens, start in batch:
            seq.num_draft_cached = start + len(tokens)
        return hidden, query_start


@dataclass
class MLPProposer:
    """Heads i = 0..K-1 read the target's last hidden state and the last token; no KV cache."""

    model: torch.nn.Module

    def propose(self, engine, items: list[ScheduledSeq]):
        state = self.model.first_state(torch.stack([item.seq.last_hidden for item in items]))
        tokens = torch.tensor([item.seq.token_ids[-1] for item in items], device=state.device)
        for i in range(max(item.num_spec for item in items)):
            state, logits = self.model.step(i, state, tokens)
            tokens = sample_drafts(items, logits)
        for item in items:  # every head ran for the whole batch; keep each request's own K
            del item.drafts[item.num_spec :], item.parents[item.num_spec :]
            item.draft_probs = item.draft_probs[: item.num_spec]


def sample_drafts(items: list[ScheduledSeq], logits: torch.Tensor) -> torch.Tensor:
    """Sample one draft token per item from the draft's probabilities (same temperature, top-k and
    top-p as the target) and keep those probabilities for the rejection sampler."""
    probs = logits_to_probs(logits, [item.seq for item in items])
    for item, p in zip(items, probs):
        # The noise of the position the draft is for: where the target samples with the same noise
        # (accept_coupled), the draft agrees with it as often as it can.
        # a chain: the previous draft, or -1 for the first
        item.parents.append(len(item.drafts) - 1)
        item.drafts.append(sample_at(p, item.seq, len(item.seq) + len(item.drafts)))
        item.draft_probs = (
            p[None] if item.draft_probs is None else torch.cat([item.draft_probs, p[None]])
        )
    return torch.tensor([item.drafts[-1] for item in items], device=logits.device)


# ---------------------------------------------------------------------------------------------
# Dynamic speculation: --num-spec-tokens auto
def interpolate(table: dict[int, float], x: int) -> float:
    """Piecewise-linear lookup in a {size: seconds} table from size 1 (x >= 1); proportional
    beyond the largest size. Plain Python: the chooser calls it for every draft it weighs."""
    sizes = sorted(table)
    i = bisect.bisect_right(sizes, x)
    if i == len(sizes):
        return table[sizes[-1]] * x / sizes[-1]
    lo, hi = sizes[i - 1], sizes[i]
    return table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo)


class GoodputChooser:
    """Pick each sequence's K for a step to maximise expected tokens per second (goodput). With
    a_i the rate at which a sequence's draft position i is accepted given that every earlier one
    was, its step emits 1 + a_0 + a_0*a_1 + ... + a_0*...*a_{K-1} tokens in expectation (the
    recovered or bonus token always comes): each draft is worth the chance that it and every
    draft before it are accepted. A step costs verify(sum of K+1 over the batch) + key_time *
    (the cached keys those tokens attend to) + max K * draft_step(sequences drafting); K = 0 is
    plain decoding. The costs are measured seconds, seeded by a short profile at start-up and
    scaled (EMA) to real steps; the a_i are each request's own (acceptance_estimate). Drafting
    must promise `margin` more goodput than plain decoding: real drafts cost work the model lacks
    (accepting, committing, Python); at batch 16 on chat even bets lost 12%."""

    def __init__(
        self,
        k_max: int,
        verify_time: dict[int, float],
        key_time: float,
        ema: float = 0.1,
        margin: float = 0.05,
    ):
        self.k_max, self.ema, self.margin = k_max, ema, margin
        # tokens in the target forward -> seconds (start-up profile)
        self.verify_time = dict(verify_time)
        self.key_time = key_time  # seconds per token per cached key it attends to (profile)
        self.verify_scale = 1.0  # real verification / the profile's, as measured
        self.draft_time = {1: 0.0}  # sequences drafting -> seconds per draft step

    def choose(self, acceptances: list[list[float]], contexts: list[int]) -> list[int]:
        """K per sequence, from each one's a_i (as many as its K may reach) and its length (every
        token of its step attends to about that many keys): take drafts from the most to the
        least valuable, and keep the prefix of that order with the highest goodput."""
        drafts = sorted(
            (-math.prod(a[: j + 1]), j, i) for i, a in enumerate(acceptances) for j in range(len(a))
        )
        ks, num_tokens, keys, max_k, drafting = (
            [0] * len(acceptances),
            len(acceptances),
            sum(contexts),
            0,
            0,
        )
        expected = float(num_tokens)
        best, best_ks = (
            (1 + self.margin) * expected / self.step_time(num_tokens, keys, 0, 0),
            list(ks),
        )
        for minus_value, _, i in drafts:
            ks[i] += 1
            num_tokens, keys, expected = num_tokens + 1, keys + contexts[i], expected - minus_value
            max_k, drafting = max(max_k, ks[i]), drafting + (ks[i] == 1)
            goodput = expected / self.step_time(num_tokens, keys, max_k, drafting)
            if goodput > best:
                best, best_ks = goodput, list(ks)
        return best_ks

    def verify_cost(self, num_tokens: int, keys: int) -> float:
        """The profile's seconds for a target forward of num_tokens attending to keys cached keys
        in all."""
        return interpolate(self.verify_time, num_tokens) + self.key_time * keys

    def step_time(self, num_tokens: int, keys: int, max_k: int, drafting: int) -> float:
        draft_step = interpolate(self.draft_time, max(drafting, 1))
        return self.verify_scale * self.verify_cost(num_tokens, keys) + max_k * draft_step

    def observe_verify(self, num_tokens: int, keys: int, seconds: float):
        """A real step rescales the whole profile: what a token more costs relative to a step
        comes from the profile; the level from real steps, with the per-sequence work (accept,
        commit) the profile lacks. (Real steps stored by size made the sizes above a batch's look
        cheap: BENCHMARKS.md.)"""
        self.verify_scale += self.ema * (
            seconds / self.verify_cost(num_tokens, keys) - self.verify_scale
        )

    def observe_draft(self, drafting: int, seconds: float):
        old = self.draft_time.get(drafting, seconds)
        self.draft_time[drafting] = old + self.ema * (seconds - old)


def acceptance_estimate(seq: Sequence, k: int) -> list[float]:
    """The request's own acceptance rate at draft positions 0..k-1 (given every earlier draft
    accepted). Each position's rate is shrunk toward the one before it, as if 3 earlier tries had
    gone that way; the first toward a cautious 1/3. A new request bets on long drafts only after
    it has seen drafts accepted, and a position it has not reached yet inherits its predecessor's
    rate (else K could never grow)."""
    estimates, prior = [], 1 / 3
    for i in range(k):
        prior = (seq.accepted_per_position[i] + 3 * prior) / (seq.reached_per_position[i] + 3)
        estimates.append(prior)
    return estimates


# ---------------------------------------------------------------------------------------------
# The scheduler: what each step computes. It never runs a model.
@dataclass
class Scheduler:
    """Admission (waiting prompts in chunks, while blocks and the token budget allow), K per
    decoding request (fixed, or the GoodputChooser's for auto), its lookahead slots, and
    preemption: out of blocks, K shrinks first, then the newest sequence is preempted. The oldest
    always makes progress."""

    blocks: BlockManager
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_spec_tokens: int | str  # K for every request, or "auto": the chooser's
    spec_disable_batch_size: int | None  # K = 0 while more sequences than this run
    spec_tree_nodes: int  # > 0: coupled requests verify trees of up to this many nodes
    stats: Counter  # the engine's counters (preemptions)
    chooser: GoodputChooser | None = None
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)

    def choose_k(self) -> dict[Sequence, int]:
        """K per decoding sequence this step (sequence -> K; absent: 0). A request's own
        num_spec_tokens caps it; it never turns speculation on while the engine has it off."""
        limit = self.spec_disable_batch_size
        if not self.num_spec_tokens or (limit is not None and len(self.running) > limit):
            return {}
        k_max = self.chooser.k_max if self.chooser else self.num_spec_tokens
        decoding = [s for s in self.running if s.phase == "decoding"]
        caps = [
            k_max if s.params.num_spec_tokens is None else min(k_max, s.params.num_spec_tokens)
            for s in decoding
        ]
        ks = (
            self.chooser.choose(
                [acceptance_estimate(s, cap) for s, cap in zip(decoding, caps)],
                [len(s) for s in decoding],
            )
            if self.chooser and decoding
            else caps
        )
        ks = dict(zip(decoding, ks))
        # One request a step that has drafted in fewer than 2 steps drafts anyway (all of a batch at
        # once cost 5%): a cautious prior against a dear-looking profile (a busy start-up) would
        # never try, nor learn.
        untried = [
            s for s, cap in zip(decoding, caps) if cap and not ks[s] and s.num_spec_steps < 2
        ]
        return ks | {s: 1 for s in untried[:1]}

    def schedule(self) -> list[ScheduledSeq]:
        budget, scheduled, ks = self.max_num_batched_tokens, [], self.choose_k()
        for seq in list(self.running):  # oldest first: the oldest always makes progress
            if seq not in self.running or budget == 0:
                continue  # preempted earlier in this loop, or no token budget left
            num_tokens = min(len(seq) - seq.num_cached, budget)
            k = min(ks.get(seq, 0), budget - num_tokens, self.max_model_len - len(seq))
            # Trees for coupled requests only: unseeded sampling's rejection sampler takes chains.
            tree = k and self.spec_tree_nodes > 0 and couples(seq)
            # the node budget
            nodes = min(max(k, self.spec_tree_nodes), budget - num_tokens) if tree else k
            while not self.blocks.ensure_slots(seq, seq.num_cached + num_tokens + nodes):
                if nodes > 0:
                    nodes -= 1  # shrink the lookahead before preempting anyone
                    continue
                self.preempt(self.running[-1])
                if seq not in self.running:
                    break
            if seq in self.running:
                scheduled.append(
                    ScheduledSeq(
                        seq,
                        num_tokens,
                        nodes,
                        seq.num_cached + num_tokens == len(seq),
                        max_depth=min(k, nodes),
                        branches=nodes if tree else 1,
                    )
                )
                budget -= num_tokens + nodes
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.blocks.allocate(seq)  # a prefix-cache hit: both models' K/V are there
            num_tokens = min(len(seq) - cached, budget)
            if not self.blocks.ensure_slots(seq, cached + num_tokens):
                self.blocks.free(seq)
                break
            seq.num_cached = seq.num_draft_cached = cached
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = cached
            self.running.append(self.waiting.popleft())
            scheduled.append(ScheduledSeq(seq, num_tokens, 0, cached + num_tokens == len(seq)))
            budget -= num_tokens
        return scheduled

    def preempt(self, seq: Sequence):
        """Free the newest sequence's blocks; it is recomputed from its tokens when readmitted."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_cached = seq.num_draft_cached = 0
        self.waiting.appendleft(seq)
        self.stats["preemptions"] += 1

    def remove(self, seq: Sequence):
        """A finished or aborted sequence leaves the queues and returns every block."""
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)
        self.blocks.free(seq)


# ---------------------------------------------------------------------------------------------
# The engine: one step is schedule -> propose -> verify -> accept -> commit
class LLMEngine:
    def __init__(
        self,
        model: str | None = None,
        dtype="auto",
        device="cpu",
        block_size=16,
        num_blocks: int | None = None,
        kv_cache_gib: float = 1.0,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        max_model_len: int | None = None,
        draft: str | None = None,
        num_spec_tokens=None,
        ngram_min=1,
        ngram_max=4,
        spec_disable_batch_size: int | None = None,
        suffix_max_requests=256,
        spec_tree_nodes=0,
        enable_prefix_caching=True,
    ):
        draft = None if draft in ("", "none") else draft
        if num_spec_tokens is None:  # a draft without a K: auto
            num_spec_tokens = "auto" if draft else 0
        k = num_spec_tokens if isinstance(num_spec_tokens, int) else 8  # 8: auto's largest K
        # Checked before any model loads.
        require(block_size >= 1, f"block_size must be >= 1, got {block_size}")
        require(max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {max_num_seqs}")
        require(kv_cache_gib > 0, f"kv_cache_gib must be > 0, got {kv_cache_gib}")
        require(num_blocks is None or num_blocks >= 1, f"num_blocks must be >= 1, got {num_blocks}")
        require(
            num_spec_tokens == "auto" or isinstance(num_spec_tokens, int) and num_spec_tokens >= 0,
            f"num_spec_tokens must be an int >= 0 or 'auto', got {num_spec_tokens!r}",
        )
        require(
            not num_spec_tokens or draft,
            "num_spec_tokens > 0 needs a draft: 'ngram', 'suffix', a model folder or 'mlp:PATH'",
        )
        require(
            max_num_batched_tokens >= 1 + max(k, 0),
            f"max_num_batched_tokens must leave room for one "
            f"token plus {k} drafts, got {max_num_batched_tokens}",
        )
        require(
            1 <= ngram_min <= ngram_max,
            f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}",
        )
        require(
            not spec_tree_nodes or draft in ("ngram", "suffix"),
            f"spec_tree_nodes needs draft 'ngram' or 'suffix', got {draft!r}",
        )
        if model is None:
            from models.gguf import default_model_path

            model = default_model_path()
        self.model_path, self.device, self.block_size = model, torch.device(device), block_size
        self.model, self.config = load_model(model, dtype, self.device)
        self.dtype = next(self.model.parameters()).dtype
        self.tokenizer = load_tokenizer(model)
        self.eos_ids = eos_token_ids(self.config, self.tokenizer)
        self.proposer = self.make_proposer(
            draft,
            num_spec_tokens,
            ngram_min,
            ngram_max,
            suffix_max_requests,
            max_num_batched_tokens,
        )
        has_draft_model = isinstance(self.proposer, DraftModelProposer)
        cache_models = [self.model] + ([self.proposer.model] if has_draft_model else [])
        # The context is the shortest any model can position: the target's, a draft model's, and a
        # sliding-window model's window (models/llama.py). Asking for more is an error, not a silent
        # cap.
        limit = min(m.max_position_embeddings for m in cache_models)
        require(
            (max_model_len or 0) <= limit,
            f"max_model_len {max_model_len} exceeds {limit}, the longest "
            "context the models can position (a sliding-window model stops at its window)",
        )
        self.max_model_len = max_model_len or limit
        if num_blocks is None:  # one pool: a block id costs its K/V in the target and in the draft
            num_blocks = int(kv_cache_gib * 2**30) // bytes_per_block(
                cache_models, block_size, self.dtype
            )
        require(num_blocks >= 1, f"kv_cache_gib {kv_cache_gib} is too small for one KV block")
        self.kv_caches = [
            allocate_kv_cache(m, num_blocks, block_size, self.dtype, self.device)
            for m in cache_models
        ]
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.stats = Counter()  # engine-wide: steps, preemptions, kv_moves
        self.k_histogram = Counter()  # K chosen per step
        self.scheduler = Scheduler(
            self.blocks,
            max_num_seqs,
            max_num_batched_tokens,
            self.max_model_len,
            num_spec_tokens,
            spec_disable_batch_size,
            spec_tree_nodes,
            self.stats,
        )
        if num_spec_tokens == "auto":
            k_max = self.proposer.model.n_predict if isinstance(self.proposer, MLPProposer) else 8
            self.scheduler.chooser = GoodputChooser(
                k_max, *self.profile_verify(max_num_seqs * (k_max + 1))
            )

    def make_proposer(
        self, draft, num_spec_tokens, ngram_min, ngram_max, suffix_max_requests, token_budget
    ):
        if draft is None:
            return None
        if draft == "ngram":
            return NgramProposer(ngram_min, ngram_max)
        if draft == "suffix":
            return SuffixProposer(suffix_max_requests)
        if draft.startswith("mlp:"):
            from models.mlp_speculator import load_speculator

            speculator = load_speculator(draft[4:], self.dtype, self.device)
            shape = (speculator.emb_dim, speculator.vocab_size)
            target = (self.model.hidden_size, self.model.vocab_size)
            require(
                shape == target,
                f"{draft}: speculator (emb_dim, vocab) {shape} does not fit the "
                f"target's (hidden, vocab) {target}",
            )
            require(
                num_spec_tokens == "auto" or num_spec_tokens <= speculator.n_predict,
                f"num_spec_tokens "
                f"{num_spec_tokens} exceeds the speculator's n_predict {speculator.n_predict}",
            )
            return MLPProposer(speculator)
        draft_model, _ = load_model(draft, self.dtype, self.device)
        require(
            draft_model.vocab_size == self.model.vocab_size,
            f"{draft}: draft vocabulary "
            f"({draft_model.vocab_size}) differs from the target's ({self.model.vocab_size})",
        )
        return DraftModelProposer(draft_model, token_budget)

    # -- requests -----------------------------------------------------------------------------
    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> Sequence:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            require(
                self.tokenizer is not None,
                "this model folder has no tokenizer.json: pass token ids instead of text",
            )
            prompt = self.tokenizer.encode(prompt)
        vocab, context = self.model.vocab_size, self.max_model_len
        require(prompt, "prompt is empty")
        require(
            all(isinstance(t, int) and 0 <= t < vocab for t in prompt),
            f"prompt token ids must be ints in [0, {vocab})",
        )
        require(
            len(prompt) < context,
            f"prompt has {len(prompt)} tokens but the context is {context} "
            "(max_model_len): it must leave room for at least one new token",
        )
        require(
            not params.stop or self.tokenizer is not None,
            "stop strings need a tokenizer; use stop_token_ids",
        )
        needed = self.blocks.blocks_for(min(len(prompt) + params.max_tokens, context))
        require(
            needed <= self.blocks.num_blocks,
            f"request needs {needed} KV blocks but the pool has "
            f"{self.blocks.num_blocks}: raise num_blocks / kv_cache_gib or lower max_tokens",
        )
        seq = Sequence(prompt, params, self.device)
        self.scheduler.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence):
        self.scheduler.remove(seq)
        seq.finish_reason = seq.finish_reason or "abort"

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # -- costs, for the chooser -----------------------------------------------------------------
    @torch.inference_mode()
    def hidden_states(self, token_ids: list[int]) -> torch.Tensor:
        """Final-norm hidden states [T, H] of one token sequence, outside any request (borrows
        blocks)."""
        probe = Sequence(token_ids, SamplingParams(), self.device)
        require(
            self.blocks.ensure_slots(probe, len(token_ids)),
            f"{len(token_ids)} tokens do not fit in the free KV blocks",
        )
        try:
            return self.forward(self.model, [(probe, token_ids, 0)])[0]
        finally:
            self.blocks.free(probe)

    def profile_verify(self, max_tokens: int) -> tuple[dict[int, float], float]:
        """The chooser's first costs: seconds per forward with logits of 1, 2, 4, ... tokens from
        position 0, and per token per cached key (a verify-sized forward after up to 512 tokens;
        0 if none fit)."""
        capacity = min(self.blocks.num_blocks * self.block_size, self.max_model_len)
        sizes = [2**i for i in range(10) if 2**i <= min(max_tokens, capacity)]
        n = max(size for size in sizes if size <= 8)
        context = min(512, capacity - n) if capacity - n >= 64 else 0
        # blocks borrowed
        probe = Sequence([0] * max(context + n, sizes[-1]), SamplingParams(), self.device)
        require(self.blocks.ensure_slots(probe, len(probe)), "the KV pool is too small to profile")
        try:
            if context:  # cached once: the forwards from position 0 rewrite the same tokens' K/V
                self.forward(self.model, [(probe, probe.token_ids[:context], 0)])
            # Three passes, each size's best kept: a burst of other work on the machine spoils a
            # pass, not a size (a spoilt size or context bent the costs: drafting looked too dear to
            # try, K stayed 0). Sizes past 64 take long enough that a burst hardly moves them: one
            # pass (a second saved).
            passes = [
                [
                    self.time_forward(probe, size, 0) if p == 0 or size <= 64 else math.inf
                    for size in sizes
                ]
                + [self.time_forward(probe, n, context)]
                for p in range(3)
            ]
        finally:
            self.blocks.free(probe)
        *best, with_context = map(min, zip(*passes))
        table = dict(zip(sizes, best))
        return table, max(with_context - table[n], 0.0) / (n * context) if context else 0.0

    def time_forward(self, probe: Sequence, num_tokens: int, start: int) -> float:
        """Seconds for the forward and logits (all rows, as in a verify) of num_tokens of probe
        at start."""
        started, tokens = self.clock(), probe.token_ids[start : start + num_tokens]
        self.model.lm_head(self.forward(self.model, [(probe, tokens, start)])[0])
        return self.clock() - started

    def clock(self) -> float:
        """time.perf_counter() once the device has finished its work (CUDA runs asynchronously)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    # -- one forward over a varlen batch --------------------------------------------------------
    def forward(self, model, batch: list[tuple[Sequence, list[int], int]], parents=None):
        """batch: (seq, tokens, start position); parents[b]: the parent of each of batch b's last
        tokens when they are a draft tree (ScheduledSeq.parents). Returns hidden [T, H] and host
        query_start_loc [B+1]."""
        q_lens = [len(tokens) for _, tokens, _ in batch]
        seq_lens = [start + len(tokens) for _, tokens, start in batch]
        input_ids = torch.tensor([t for _, tokens, _ in batch for t in tokens])
        positions = torch.cat(
            [torch.arange(start, start + len(tokens)) for _, tokens, start in batch]
        )
        width = max(len(seq.block_table) for seq, _, _ in batch)
        block_tables = torch.tensor(
            [s.block_table + [-1] * (width - len(s.block_table)) for s, _, _ in batch]
        )
        seq_of_token = torch.repeat_interleave(torch.arange(len(batch)), torch.tensor(q_lens))
        slot_mapping = (
            block_tables[seq_of_token, positions // self.block_size] * self.block_size
            + positions % self.block_size
        )
        query_start_loc = torch.tensor([0] + list(itertools.accumulate(q_lens)))
        dev = self.device
        ctx = AttentionContext(
            slot_mapping.to(dev),
            block_tables.to(dev),
            torch.tensor(seq_lens, device=dev),
            query_start_loc.to(dev),
            max(q_lens),
        )
        # not all chains
        if parents and any(nodes != list(range(-1, len(nodes) - 1)) for nodes in parents):
            # A tree node's logical position (its depth past the last token) differs from its cache
            # slot.
            positions, keys, _ = tree_layout(batch, parents)
            ctx.tree_pos, ctx.tree_keys = positions.to(dev), keys.to(dev)
        kernels.context = ctx
        try:
            hidden = model(input_ids.to(dev), positions.to(dev))
        finally:
            kernels.context = None
        # on the host: reading row ends from it never syncs the device
        return hidden, query_start_loc

    # -- the step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """One engine step; returns the sequences that finished in it."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        self.stats["steps"] += 1
        self.k_histogram[max(it.max_depth for it in scheduled)] += 1
        # Propose: drafts (and their tree's parents) for every sequence with lookahead slots.
        speculating = [it for it in scheduled if it.num_spec > 0]
        started = time.perf_counter()
        if speculating:
            self.proposer.propose(self, speculating)
        proposed = time.perf_counter()
        # Verify: one target forward over every sequence's new tokens plus its drafts.
        batch = [
            (
                it.seq,
                it.seq.token_ids[it.seq.num_cached : it.seq.num_cached + it.num_tokens] + it.drafts,
                it.seq.num_cached,
            )
            for it in scheduled
        ]
        hidden, query_start = self.forward(self.model, batch, [it.parents for it in scheduled])
        for it in scheduled:
            if not it.samples:
                it.seq.num_cached += it.num_tokens  # a prefill chunk that does not reach the end
                self.register_blocks(it.seq)
        sampling = [it for it in scheduled if it.samples]
        if not sampling:
            return []
        ends = [end for it, end in zip(scheduled, query_start[1:].tolist()) if it.samples]
        rows = [r for it, end in zip(sampling, ends) for r in range(end - len(it.drafts) - 1, end)]
        logits = self.model.lm_head(hidden[torch.tensor(rows, device=self.device)])
        # Accept, then commit: the accepted drafts and one more token per sampling sequence.
        starts = itertools.accumulate((len(it.drafts) + 1 for it in sampling), initial=0)
        for it, start, (path, token) in zip(sampling, starts, accept(sampling, logits)):
            own = [start] + [start + 1 + node for node in path]  # the rows that produced the tokens
            self.commit(it, path, token, hidden[rows[own[-1]]], logits[own])
        chooser = self.scheduler.chooser
        if chooser and all(it.num_tokens == 1 for it in scheduled):  # time decode-shaped steps only
            # Verification is all the rest of the step: each draft also costs a logits row, its
            # share of accepting and committing.
            keys = sum(len(tokens) * (start + 1) for _, tokens, start in batch)
            chooser.observe_verify(int(query_start[-1]), keys, self.clock() - proposed)
            if speculating:
                k = max(it.max_depth for it in scheduled)
                chooser.observe_draft(len(speculating), (proposed - started) / k)
        return [it.seq for it in sampling if it.seq.finish_reason is not None]

    # -- commit -----------------------------------------------------------------------------
    def commit(
        self,
        it: ScheduledSeq,
        path: list[int],
        token: int,
        hidden_row: torch.Tensor,
        logits: torch.Tensor,
    ):
        """path: the accepted drafts (indices, root to leaf); logits: the rows that produced them
        and the next token, one per token."""
        # each draft's depth (1: a child of the last token), parents first
        seq, depths = it.seq, [0]
        for p in it.parents:
            depths.append(depths[p + 1] + 1)
        depth = max(depths)
        # off the first branch: move the path's K/V to its positions
        if path != list(range(len(path))):
            self.move_kv(
                seq, [len(seq) + node for node in path], range(len(seq), len(seq) + len(path))
            )
            self.stats["kv_moves"] += 1
        # The last token and the accepted drafts now have valid K/V; rejected slots get overwritten
        # later.
        seq.num_cached = len(seq) + len(path)
        seq.num_draft_cached = min(seq.num_draft_cached, seq.num_cached)
        seq.last_hidden = hidden_row
        if it.num_spec:
            seq.reached_per_position.update(range(min(len(path) + 1, depth)))
            seq.num_spec_steps += 1
            seq.num_drafted += len(it.drafts)  # nodes verified
            seq.num_accepted += len(path)
            seq.drafted_per_position.update(range(depth))  # per depth
            seq.accepted_per_position.update(range(len(path)))
        seq.first_token_time = seq.first_token_time or time.perf_counter()
        for i, (t, row) in enumerate(zip([it.drafts[node] for node in path] + [token], logits)):
            seq.token_ids.append(t)
            if seq.logprobs is not None:
                seq.logprobs.append(token_logprobs(row, t, seq.params.logprobs))
            new_text = self.detokenize(seq, i < len(path)) if self.tokenizer is not None else ""
            if self.check_stop(seq, len(new_text)):
                break
        self.register_blocks(seq)  # before a finished sequence frees them: they stay cached
        if seq.finish_reason is None:
            self.blocks.trim(seq, len(seq))  # give back lookahead blocks that rejected drafts used
        else:
            self.finish(seq)

    def register_blocks(self, seq: Sequence):
        """Key seq's full blocks for prefix caching once every cache holds their K/V (a draft
        model's may lag: then its count decides)."""
        drafts_cache = isinstance(self.proposer, DraftModelProposer)
        computed = min(seq.num_cached, seq.num_draft_cached) if drafts_cache else seq.num_cached
        self.blocks.register_full_blocks(seq, computed)

    def detokenize(self, seq: Sequence, from_draft: bool, final: bool = False):
        """Decode the text the last token completes (an incomplete character waits, until the
        final call)."""
        new_text, seq.decode_offsets = self.tokenizer.decode_next(
            seq.token_ids, *seq.decode_offsets, final=final
        )
        seq.decoded += new_text
        seq.drafted_chars += [from_draft] * len(new_text)
        return new_text

    def move_kv(self, seq: Sequence, sources, destinations):
        """Copy K/V between positions of seq in every cache ([2, layers, blocks, block_size,
        heads, dim])."""
        src, dst = (
            [self.blocks.slot(seq, p) for p in positions] for positions in (sources, destinations)
        )
        for cache in self.kv_caches:
            by_slot = cache.flatten(2, 3)
            by_slot[:, :, dst] = by_slot[:, :, src]

    def check_stop(self, seq: Sequence, num_new_chars: int) -> bool:
        p, last = seq.params, seq.token_ids[-1]
        if (not p.ignore_eos and last in self.eos_ids) or last in (p.stop_token_ids or ()):
            seq.finish_reason = "stop"
        # match on the decoded output, searching only where the new text could complete a stop
        elif p.stop:  # search only where the last token's text could complete a stop string
            search_from = max(len(seq.decoded) - num_new_chars - max(map(len, p.stop)) + 1, 0)
            hits = [i for i in (seq.decoded.find(s, search_from) for s in p.stop) if i >= 0]
            if hits:
                seq.finish_reason, seq.text = "stop", seq.decoded[: min(hits)]
        at_limit = len(seq.output_ids) >= p.max_tokens or len(seq) >= self.max_model_len
        if seq.finish_reason is None and at_limit:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def finish(self, seq: Sequence):
        self.scheduler.remove(seq)
        seq.finish_time = time.perf_counter()
        # finished requests feed later ones' proposals
        if isinstance(self.proposer, SuffixProposer):
            self.proposer.remember(seq.token_ids)
        if seq.text is None and self.tokenizer is not None:  # no stop string cut it short
            self.detokenize(seq, from_draft=False, final=True)
            seq.text = seq.decoded

    def output(self, seq: Sequence) -> RequestOutput:
        first = seq.first_token_time or seq.finish_time
        return RequestOutput(
            seq.token_ids[: seq.num_prompt_tokens],
            seq.output_ids,
            seq.text,
            seq.finish_reason,
            seq.num_drafted,
            seq.num_accepted,
            seq.num_spec_steps,
            seq.logprobs,
            {
                i: seq.accepted_per_position[i] / n
                for i, n in sorted(seq.drafted_per_position.items())
            },
            dict(seq.drafted_per_position),
            ttft=first - seq.arrival_time,
            tpot=(seq.finish_time - first) / max(len(seq.output_ids) - 1, 1),
            latency=seq.finish_time - seq.arrival_time,
            num_cached_tokens=seq.num_cached_tokens or 0,
        )


class LLM(LLMEngine):
    """The offline API: LLM(model).generate(prompts, sampling_params)."""

    def generate(
        self, prompts, sampling_params=None, use_progress: bool = True, stream: bool = False
    ):
        """The outputs, one per prompt; with stream=True an iterator of StreamUpdate instead, each
        step one per request that committed tokens (abandoning it aborts the requests)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        require(
            len(sampling_params) == len(prompts),
            f"{len(prompts)} prompts but {len(sampling_params)} sampling params",
        )
        from rich.progress import Progress

        seqs = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                seqs.append(self.add_request(prompt, params))
        except BaseException:  # a bad request: leave none of them behind
            for seq in seqs:
                self.abort(seq)
            raise
        updates = self.stream(seqs)
        if stream:
            return updates
        with Progress(transient=True, disable=not use_progress) as progress:
            task = progress.add_task("generating", total=len(seqs))
            for update in updates:
                progress.advance(task, update.finished)
        return [self.output(seq) for seq in seqs]

    def stream(self, seqs: list[Sequence]):
        sent = [(0, 0)] * len(seqs)  # tokens and characters each request has sent; None: done
        try:
            while any(sent):
                self.step()
                for i, (seq, done) in enumerate(zip(seqs, sent)):
                    finished = seq.finish_reason is not None
                    if done is None or done[0] == len(seq.output_ids) and not finished:
                        continue
                    text = seq.text if finished else seq.decoded[: shown_length(seq)]
                    text = text or ""  # no tokenizer: token ids only
                    yield StreamUpdate(
                        i,
                        text[done[1] :],
                        seq.output_ids[done[0] :],
                        seq.drafted_chars[done[1] : len(text)],
                        finished,
                        self.output(seq) if finished else None,
                    )
                    sent[i] = None if finished else (len(seq.output_ids), len(text))
        # a failed step, Ctrl-C, an abandoned stream: leave no request and no block behind
        except BaseException:
            for seq in seqs:
                self.abort(seq)
            raise


def shown_length(seq: Sequence) -> int:
    """How much of a running request's decoded text a stream may show: all but the longest tail
    that could still begin a stop string (stop strings are never shown, not even in part)."""
    stops = seq.params.stop or []
    for n in range(min(len(seq.decoded), max(map(len, stops), default=1) - 1), 0, -1):
        if any(s.startswith(seq.decoded[-n:]) for s in stops):
            return len(seq.decoded) - n
    return len(seq.decoded)


# ---------------------------------------------------------------------------------------------
# CLI
def parse_args(argv=None):
    p = argparse.ArgumentParser(description="nanospec: generate with (speculative) decoding")
    p.add_argument(
        "--model", help="Hugging Face model folder (default: the embedded SmolLM2-135M-Instruct)"
    )
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="JSONL with a 'prompt' field, or MT-bench style 'turns'")
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt in the model's chat template; without prompts, a conversation",
    )
    p.add_argument("--no-color", action="store_true", help="no colours (accepted drafts: cyan)")
    p.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        default=None,
        help="compute every prompt in full, sharing no cached K/V blocks",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "--logprobs", type=int, help="log-probs of each token and the N most likely, in --json"
    )
    p.add_argument("--json", help="write one JSON object per request to this file")
    # The engine's settings: a flag left out keeps LLMEngine's default.
    p.add_argument("--dtype", help="auto (the default), float32, bfloat16 or float16")
    p.add_argument("--device", help="cpu (the default) or cuda")
    p.add_argument(
        "--draft", help="'ngram', 'suffix', a draft model folder or 'mlp:PATH' (MLP speculator)"
    )
    p.add_argument(
        "--num-spec-tokens",
        type=lambda k: int(k) if k.isdigit() else k,
        help="K drafts per step, or 'auto' (the default with --draft)",
    )
    p.add_argument(
        "--spec-tree-nodes", type=int, help="verify a tree of up to N drafts (ngram, suffix)"
    )
    p.add_argument(
        "--spec-disable-batch-size",
        type=int,
        help="run without speculation while more than this many sequences are running",
    )
    for name in (
        "block-size",
        "num-blocks",
        "max-num-seqs",
        "max-num-batched-tokens",
        "max-model-len",
        "ngram-min",
        "ngram-max",
    ):
        p.add_argument(f"--{name}", type=int)
    return p.parse_args(argv)


def read_prompts_file(path: str) -> list[str]:
    """One prompt per JSONL row: its 'prompt', or the first of its MT-bench style 'turns'."""
    prompts = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                row = json.loads(line)
                require(
                    "prompt" in row or "turns" in row,
                    f"{path}:{i}: needs a 'prompt' or 'turns' field",
                )
                prompts.append(row["prompt"] if "prompt" in row else row["turns"][0])
    return prompts


def spec_metrics(outputs: list[RequestOutput]) -> dict:
    """A run's speculation: totals, tokens per step, and acceptance per draft position pooled over
    requests (each drafted token counts once)."""
    drafted, accepted = Counter(), Counter()
    for o in outputs:
        for pos, rate in o.accepted_per_position.items():
            drafted[pos] += o.drafted_per_position[pos]
            accepted[pos] += rate * o.drafted_per_position[pos]
    num_drafted = sum(o.num_draft_tokens for o in outputs)
    num_accepted, steps = (
        sum(o.num_accepted_tokens for o in outputs),
        sum(o.num_spec_steps for o in outputs),
    )
    return {
        "drafted": num_drafted,
        "accepted": num_accepted,
        "mean_accepted_length": 1 + num_accepted / steps if steps else None,
        "nodes_per_step": num_drafted / steps if steps else None,
        "acceptance_per_position": [accepted[i] / drafted[i] for i in sorted(drafted)],
    }


def summary_table(outputs: list[RequestOutput], elapsed: float, llm: LLMEngine):
    from rich.table import Column, Table

    num_tokens = sum(len(o.token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    # noqa: E731
    median_ms = lambda name: f"{1000 * np.median([getattr(o, name) for o in outputs]):.1f}"
    rows = {
        "requests": len(outputs),
        "output tokens": num_tokens,
        "elapsed (s)": f"{elapsed:.2f}",
        "output tok/s": f"{num_tokens / elapsed:.1f}",
        "TTFT median (ms)": median_ms("ttft"),
        "TPOT median (ms)": median_ms("tpot"),
        "dtype, kernels": f"{str(llm.dtype)[6:]}, {kernels.kernels_summary(llm.device)}",
        "cached prompt tokens": f"{cached} of {prompt} ({100 * cached / prompt:.0f}%)",
    }
    if llm.proposer is not None:
        m = spec_metrics(outputs)  # None per step when no step speculated: 1 token a step, 0 nodes
        rows |= {
            "drafted tokens": m["drafted"],
            "accepted tokens": m["accepted"],
            "mean accepted length": f"{m['mean_accepted_length'] or 1:.2f}",
            "nodes verified per step": f"{m['nodes_per_step'] or 0:.2f}",
            "acceptance per depth": " ".join(f"{a:.2f}" for a in m["acceptance_per_position"]),
            "K per step (K: steps)": " ".join(
                f"{k}:{n}" for k, n in sorted(llm.k_histogram.items())
            ),
        }
    table = Table("metric", Column("value", justify="right"), title="nanospec run")
    for name, value in rows.items():
        table.add_row(name, str(value))
    return table


def answer_line(out: RequestOutput) -> str:
    """One line after each streamed answer."""
    accepted = spec_metrics([out])["mean_accepted_length"] or 1
    return (
        f"{len(out.token_ids)} tokens, {len(out.token_ids) / out.latency:.1f} tok/s, "
        f"mean accepted length {accepted:.2f}, prompt {len(out.prompt_token_ids)} tokens, "
        f"{out.num_cached_tokens} cached"
    )


def print_stream(console, updates, num_requests: int) -> list[RequestOutput]:
    """Print each request's text as it streams, accepted drafts in cyan, then its answer_line;
    one request after another (a later one's updates wait). Returns the outputs."""
    pending, outputs = {i: [] for i in range(num_requests)}, []
    for update in updates:
        pending[update.index].append(update)
        while len(outputs) < num_requests and pending[len(outputs)]:
            shown = pending[len(outputs)].pop(0)
            for drafted, chars in itertools.groupby(
                zip(shown.delta, shown.drafted), lambda c: c[1]
            ):
                text = "".join(c for c, _ in chars)
                style = "cyan" if drafted else None
                console.print(text, style=style, end="", markup=False, highlight=False)
            console.file.flush()
            if shown.finished:
                outputs.append(shown.output)
                console.print("\n" + answer_line(shown.output), style="dim", highlight=False)
    return outputs


def turn_prompt_ids(llm: LLM, text: str, last) -> list[int]:
    """A chat turn's prompt (text: the template applied to the conversation) as token ids that
    extend the last turn's prompt and answer ids exactly, not a re-encoding of them (which may
    split them differently), so prefix caching finds them cached: only the template's text after
    the answer is encoded. An answer's final special token (EOS: no text) is left to the template,
    which closes the turn itself."""
    if last is not None:
        last_text, last_ids, out = last
        if text.startswith(last_text + out.text):
            answer = out.token_ids
            if answer and llm.tokenizer.decode(answer[-1:]) == "":
                answer = answer[:-1]
            rest = llm.tokenizer.encode(text[len(last_text + out.text) :], special=False)
            return last_ids + answer + rest
    return llm.tokenizer.encode(text)


def chat(llm: LLM, params: SamplingParams, console) -> int:
    """--chat without prompts: read a line, stream the answer, keep the conversation (the chat
    template's history); /reset starts over, /exit or Ctrl-D ends."""
    require(llm.tokenizer is not None, "--chat needs a tokenizer.json in the model folder")
    messages, last = [], None  # last: the last turn's prompt text, prompt ids and output
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            return 0
        if line == "/exit":
            return 0
        if line == "/reset":
            messages, last = [], None
        elif line:
            messages.append({"role": "user", "content": line})
            text = llm.tokenizer.apply_chat_template(messages)
            ids = turn_prompt_ids(llm, text, last)
            (out,) = print_stream(console, llm.generate(ids, params, stream=True), 1)
            messages.append({"role": "assistant", "content": out.text})
            last = (text, ids, out)


def main(argv=None) -> int:
    args = parse_args(argv)
    from rich.console import Console

    console = Console(no_color=args.no_color, soft_wrap=True)
    # the flags named like LLMEngine's
    engine_args = inspect.signature(LLMEngine.__init__).parameters
    settings = {name: v for name, v in vars(args).items() if name in engine_args and v is not None}
    try:
        sampling = ("temperature", "top_p", "top_k", "max_tokens", "seed", "ignore_eos", "logprobs")
        params = SamplingParams(**{name: getattr(args, name) for name in sampling})
        llm = LLM(**settings)
        prompts = args.prompt + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
        if args.chat and not prompts:
            return chat(llm, params, console)
        prompts = prompts or ["Write a short poem about the sea."]
        if args.chat:
            require(llm.tokenizer is not None, "--chat needs a tokenizer.json in the model folder")
            prompts = [
                llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts
            ]
        start = time.perf_counter()
        if console.is_terminal:  # stream
            outputs = print_stream(
                console, llm.generate(prompts, params, stream=True), len(prompts)
            )
        else:
            outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    except (ValueError, FileNotFoundError, RuntimeError, json.JSONDecodeError) as e:
        print(f"nanospec: error: {e}", file=sys.stderr)
        return 2
    for out in [] if console.is_terminal else outputs:
        console.rule(f"[bold]{out.finish_reason}[/] · {len(out.token_ids)} tokens")
        console.print(
            out.text if out.text is not None else out.token_ids, highlight=False, markup=False
        )
    console.print(summary_table(outputs, elapsed, llm))
    if args.json:
        with open(args.json, "w") as f:
            for prompt, out in zip(prompts, outputs):
                f.write(json.dumps({"prompt": prompt, **out.__dict__}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
