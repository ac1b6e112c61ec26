# Proposers: where a step's drafts come from. N-gram prompt lookup, suffix decoding (a request's own
# text and earlier requests'), a draft model, an MLP speculator; make_proposer builds one from
# --draft. A proposer only guesses: it must never decide what is emitted (the sampler does) nor
# write the target's KV cache.
import heapq
import itertools
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from models import load_model, require
from sampling import sample_drafts
from sequence import ScheduledSeq, Sequence


# Proposers: each fills item.drafts and item.parents (per draft, its parent draft: a chain's is the
# one before), a tree of <= num_spec nodes and max_depth levels, parents before children; model
# drafts also fill item.draft_probs.
# The lookup proposers share one loop (propose) over their tree(tokens, budget, depth, branches,
# seq): seq is the request, for what a proposer keeps about it between steps (the n-gram's copy
# cursor; the suffix proposer keeps nothing).
class NgramProposer:
    """Prompt lookup: find the first occurrence of the longest suffix n-gram (n in [min_n,
    max_n]) in prompt + output, past the copy cursor where there is one (tree), and propose the
    tokens that followed it. The first occurrence is usually in the prompt, the text being quoted
    or edited; later ones are often the model's own repetitions (on the grounded bench prompts,
    first-match drafts gave 3.26 tokens per step against 3.02 from the last)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, engine, items: list[ScheduledSeq]):
        for item in items:
            tokens = np.asarray(item.seq.token_ids)
            item.drafts, item.parents = self.tree(
                tokens, item.num_spec, item.max_depth, item.branches, item.seq
            )

    def strong_match(self, seq) -> bool:
        """Whether the request's last 2 tokens occur earlier in it (a match of 2 or more tokens).
        Its drafts then usually copy a passage; after a 1-token match they are a weak guess (see
        tree). Auto K keeps apart the acceptance of steps after each (acceptance_estimate)."""
        tokens = np.asarray(seq.token_ids)
        return suffix_matches(tokens, tokens, 2)[0] >= 2

    def tree(
        self, tokens: np.ndarray, budget: int, depth: int, branches: int, seq=None
    ) -> tuple[list[int], list[int]]:
        """A chain (branches = 1): the continuation of the first occurrence at or after the copy
        cursor (seq.copy_offset), else of the first. A tree: those of every occurrence, the most
        frequent first."""
        n, ends = suffix_matches(tokens, tokens, self.max_n)
        if n < self.min_n:
            return [], []
        # The copy cursor. Quoting or editing a text, the model copies a run of it, writes
        # something new (a comment, a changed line), then copies again from where it left off.
        # There the suffix is short ("\n    ") and its first occurrence is usually the wrong one.
        # So a chain remembers where its last draft was copied from, relative to the request's
        # end, and prefers the first occurrence at or after that point, moved along as the request
        # grew (less 2: a draft cut short by a rejection resumes close behind). Replaying the
        # greedy outputs of the 16 summarization prompts at K=5: 2.89 tokens a step from the first
        # occurrence, 2.97 with the cursor, 3.36 for an oracle that picks the best occurrence in
        # hindsight; in the engine 2.95 -> 3.04 (BENCHMARKS.md, session 42).
        if seq is not None and branches == 1:
            after = ends[ends >= len(tokens) + seq.copy_offset]
            ends = after if len(after) else ends
            seq.copy_offset = int(ends[0]) - len(tokens) - 2
        # A match of the last token alone is a weak guess: on the grounded bench prompts its first
        # draft was accepted 23% of the time, and its fourth 8%, against 74% and 37% after a
        # 2-token match and 95% and 75% after 8 (greedy, the default model). Such a draft goes 3
        # deep at most, where a verify step still costs little (4 tokens: 1.15x one token on a
        # Zen 3), while auto K, whose acceptance rates then come from deeper matches past the
        # third position, drafts longer after them. The summarization prompts' decode steps took
        # 0.97x the time, `make demo`'s 1.01x (BENCHMARKS.md, session 41).
        depth = depth if n > 1 else min(depth, 3)
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
    plain numpy scan per step, no index: O(remembered tokens). (Fresh grounded requests, greedy,
    K = 4 / 8: 2.81 / 3.41 tokens per step; with the paper's factor 1 and plain frequencies
    2.60 / 2.92; n-gram 2.66 / 3.26.)"""

    def __init__(self, max_requests=256, max_match=24, max_spec_factor=8.0, min_prob=0.1):
        self.finished = deque(maxlen=max_requests)  # the oldest request drops out first
        self.corpus = np.zeros(0, dtype=np.int64)  # the finished requests, each followed by -1
        self.max_match, self.max_spec_factor, self.min_prob = max_match, max_spec_factor, min_prob

    def remember(self, token_ids: list[int]):
        self.finished.append(np.append(token_ids, -1))
        self.corpus = np.concatenate(self.finished)

    propose = NgramProposer.propose  # the same loop, over this class's tree()

    def tree(
        self, tokens: np.ndarray, budget: int, depth: int, branches: int, seq=None
    ) -> tuple[list[int], list[int]]:
        found = [
            (hay, *suffix_matches(hay, tokens, self.max_match)) for hay in (self.corpus, tokens)
        ]
        m = max(length for _, length, _ in found)
        depth = min(depth, int(self.max_spec_factor * m))
        rows = [continuations(hay, ends, depth) for hay, length, ends in found if length == m > 0]
        if not rows:
            return [], []
        # rows[-1] are the request's own, the latest last: that one outweighs all the others.
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
            sample_drafts(items, self.model.lm_head(self.feed(engine, batch)))

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
        """One draft forward; its tokens' K/V are now in the draft's cache. Returns the final
        hidden state of each sequence's last token: a draft samples from no other row, so the
        forward finishes those alone (model.forward's keep; a catch-up chunk's are not read)."""
        ends = itertools.accumulate(len(tokens) for _, tokens, _ in batch)
        keep = torch.tensor([end - 1 for end in ends], device=engine.device)
        hidden = engine.forward(self.model, batch, None, keep)  # (no tree: chains)
        for seq, tokens, start in batch:
            seq.num_draft_cached = start + len(tokens)
        return hidden


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


def make_proposer(c, target: torch.nn.Module):
    """The proposer an EngineConfig c names in c.draft ('ngram', 'suffix', 'mlp:PATH' or a draft
    model folder; None: none), loaded with the target's dtype on its device and checked against
    it. (The config is passed whole: its fields are the proposers' settings.)"""
    draft, num_spec_tokens = c.draft, c.num_spec_tokens
    if draft is None:
        return None
    if draft == "ngram":
        return NgramProposer(c.ngram_min, c.ngram_max)
    if draft == "suffix":
        return SuffixProposer(c.suffix_max_requests)
    weight = next(target.parameters())
    if draft.startswith("mlp:"):
        from models.mlp_speculator import load_speculator

        speculator = load_speculator(draft[4:], weight.dtype, weight.device)
        shape = (speculator.emb_dim, speculator.vocab_size)
        require(
            shape == (target.hidden_size, target.vocab_size),
            f"{draft}: speculator (emb_dim, vocab) {shape} does not fit the "
            f"target's (hidden, vocab) {(target.hidden_size, target.vocab_size)}",
        )
        require(
            num_spec_tokens == "auto" or num_spec_tokens <= speculator.n_predict,
            f"num_spec_tokens "
            f"{num_spec_tokens} exceeds the speculator's n_predict {speculator.n_predict}",
        )
        return MLPProposer(speculator)
    # dtype auto on a CPU: the draft too gets the target's activations and 16-bit packed weights
    cpu_auto = c.dtype in (None, "auto") and weight.device.type == "cpu"
    draft_model, _ = load_model(draft, "auto" if cpu_auto else weight.dtype, weight.device)
    require(
        draft_model.vocab_size == target.vocab_size,
        f"{draft}: draft vocabulary "
        f"({draft_model.vocab_size}) differs from the target's ({target.vocab_size})",
    )
    return DraftModelProposer(draft_model, c.max_num_batched_tokens)
