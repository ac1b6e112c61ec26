# Dynamic speculation (--num-spec-tokens auto): the GoodputChooser that picks each request's K every
# step from its own acceptance and the step costs, and the start-up profile that seeds those costs.
# It only chooses K: it must never change which tokens are emitted, only how many are drafted.
import bisect
import contextlib
import hashlib
import json
import math
import platform
import time
from pathlib import Path

import torch

from kernels import cache_dir, cpu_kernels
from models import require
from sequence import SamplingParams, Sequence


def interpolate(table: dict[int, float], x: int) -> float:
    """Piecewise-linear lookup in a {size: seconds} table from size 1 (x >= 1); proportional
    beyond the largest size. Plain Python: the chooser calls it for every draft it weighs
    (np.interp: 2x slower)."""
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
    scaled (EMA) to real steps; the a_i are each request's own (acceptance_estimate). Without the
    keys term a draft at a 600-token context looked 40% cheaper than it is, and auto K drafted 7
    where 4 was faster. Drafting must promise `margin` more goodput than plain decoding: real
    drafts cost work the model lacks (accepting, committing, Python); at batch 16 on chat even bets
    lost 12%. Each draft beyond the first choice to draft must promise `tie` more than the choice
    without it: near break-even, a few percent of profile noise then no longer flips K from run
    to run."""

    ema, margin, tie = 0.1, 0.05, 0.02  # the EMA's weight of a new step; `margin`, `tie` above

    def __init__(self, k_max: int, verify_time: dict[int, float], key_time: float):
        self.k_max = k_max
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
        ks, num_tokens, keys = [0] * len(acceptances), len(acceptances), sum(contexts)
        max_k = drafting = 0
        expected = float(num_tokens)
        best = (1 + self.margin) * expected / self.step_time(num_tokens, keys, 0, 0)
        best_ks = list(ks)
        for minus_value, _, i in drafts:
            ks[i] += 1
            num_tokens, keys, expected = num_tokens + 1, keys + contexts[i], expected - minus_value
            max_k, drafting = max(max_k, ks[i]), drafting + (ks[i] == 1)
            goodput = expected / self.step_time(num_tokens, keys, max_k, drafting)
            # (against plain decoding, `margin` alone: it is already in `best`)
            if goodput > best * (1 + self.tie if any(best_ks) else 1):
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
        commit) the profile lacks. (Storing real steps by size made a batch's one measured size
        look dear and the sizes above it, still the profile's, cheap: at batch 64 it drafted and
        lost 6%.)"""
        self.verify_scale += self.ema * (
            seconds / self.verify_cost(num_tokens, keys) - self.verify_scale
        )

    def observe_step(self, speculating, batch, draft_seconds: float, verify_seconds: float):
        """A decode-shaped step's times: drafting (per draft step, the longest chain's K of them,
        over the step's `speculating` items) and verification (the target forward over the
        batch's tokens and cached keys)."""
        keys = sum(len(tokens) * (start + 1) for _, tokens, start in batch)
        self.observe_verify(sum(len(tokens) for _, tokens, _ in batch), keys, verify_seconds)
        if speculating:  # the EMA of a draft step's seconds at this many sequences drafting
            seconds = draft_seconds / max(it.max_depth for it in speculating)
            old = self.draft_time.get(len(speculating), seconds)
            self.draft_time[len(speculating)] = old + self.ema * (seconds - old)


def acceptance_estimate(seq: Sequence, k: int) -> list[float]:
    """The request's own recent acceptance rate at draft positions 0..k-1 (given every earlier
    draft accepted), from its last steps: each step counts HISTORY_DECAY (0.8) times less than the
    one after it (sequence.py says why), so the estimate follows what the request writes now,
    text it copies or text of its own. Each position's rate is shrunk toward a prior, as if 3
    earlier tries had gone that way (against about 5 steps of memory: a first position accepted
    every time reads 0.75, which keeps K moderate inside a long copy too): the first toward a
    cautious 1/3, so a new request bets on long drafts only after it has seen drafts accepted;
    each later one toward halfway between the rate before it and 1. A draft whose earlier tokens
    all matched is likelier to match on (it is inside a repeated passage): in the demo's n-gram
    runs the rates were about 0.9, 0.88, then 0.97-1.0 from the third position on; on chat 0.25
    then 0.6. The prior matters most where the request has no data: a position it has not
    reached yet. When such a position simply inherited the rate before it, a request that settled
    on K = 2 never learned that positions 3-8 were nearly free, and the same run drafted mostly 2
    in one run and mostly 8 in the next (mean accepted length 2.4-3.0 against 4.0-4.5).

    Under n-gram lookup the counts and the first prior are kept apart by the length of this
    step's match (seq.strong_match): a 1-token match is a weak guess and a longer one often lies
    inside a copied passage (replaying the summarization prompts', the demo's and MT-bench's greedy
    outputs, the first draft was accepted 16-32% of the time after a 1-token match, 30-79% after
    2 tokens, 74-97% after 4 or more). So a request that alternates between copying and writing
    prices each kind of step by its own recent record, the first prior 1/4 for a weak match and
    2/3 for a strong one. In the engine, its decode steps priced at one start-up profile's costs
    (so this host's phases do not move them), the summarization prompts' decode took 0.98x the
    time at batch 1 and 0.94x at batch 4, MT-bench's and the demo's 1.00x (the same output,
    checked; priors of 1/6-1/4 and 1/2-3/4 did no better; BENCHMARKS.md, session 46)."""
    estimates, prior = [], {None: 1 / 3, False: 1 / 4, True: 2 / 3}[seq.strong_match]
    for i in range(k):
        key = (seq.strong_match, i)
        rate = (seq.recent_accepted[key] + 3 * prior) / (seq.recent_reached[key] + 3)
        estimates.append(rate)
        prior = (1 + rate) / 2
    return estimates


def step_costs(engine, max_tokens: int) -> tuple[dict[int, float], float]:
    """profile_step_costs(), measured once per machine and setting and kept in the cache dir
    ($NANOSPEC_CACHE): the next start-up reads it. Two reasons. The profile took 2 s of every
    start-up with auto K. And this is what makes two runs of the same work decide K alike: the
    profile fixes the shape of the costs (what a token more costs) for the whole run, and real
    steps rescale only its level. On a host whose 8-token steps cost 1.5x a 1-token step during
    one start-up and 1.75x during the next, auto K drafted mostly 3 in one run and 7 in another
    (BENCHMARKS.md, sessions 31 and 32). The key holds what the costs depend on: the model's shape
    (its config, not its weights: tests' random checkpoints of one shape share a file), the dtypes,
    the KV pool and the largest step, and the machine (host name, device, the C kernels' build,
    threads). A profile whose passes disagreed (a busy machine) is not kept. Delete the file to
    profile again."""
    lib = cpu_kernels() if engine.device.type == "cpu" else None
    pool = [engine.block_size, engine.blocks.num_blocks, engine.max_model_len, max_tokens]
    # (a GPU by its model: one host may hold several kinds)
    gpu = engine.device.type == "cuda" and torch.cuda.get_device_name(engine.device)
    # The C library by its bytes, not its name (which hashes the source): a change to the C that
    # leaves the code as it was (comments) builds the same bytes, and keeps the profile and so the
    # decisions. Each new name profiled again, and a new profile can tip choices near break-even:
    # a comment in session 54 moved `make demo`'s K histogram.
    library = lib and hashlib.sha1(Path(lib._name).read_bytes()).hexdigest()
    machine = [platform.node(), gpu or str(engine.device), library, torch.get_num_threads()]
    setting = [engine.config, str(engine.dtype), str(engine.kv_dtype), pool, machine]
    key = hashlib.sha1(json.dumps(setting, sort_keys=True).encode()).hexdigest()[:12]
    path = cache_dir() / f"step-costs-v2-{key}.json"  # v2: every size to 9
    # none yet, another start-up writing it (not atomic), or not a table (edited by hand)
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        table, key_time = json.loads(path.read_text())
        return {int(size): float(seconds) for size, seconds in table.items()}, float(key_time)
    table, key_time, steady = profile_step_costs(engine, max_tokens)
    if steady:  # (one taken beside other work serves this run only)
        with contextlib.suppress(OSError):  # an unwritable cache dir: the next start-up profiles
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps([table, key_time]))
    return table, key_time


def profile_step_costs(engine, max_tokens: int) -> tuple[dict[int, float], float, bool]:
    """The chooser's first costs: seconds per forward with logits of 1-9, 16, 32, ... tokens from
    position 0, and per token per cached key (a verify-sized forward after up to 512 tokens;
    0 if none fit); and whether its passes agreed (steady). It borrows the engine's free KV
    blocks and gives them back."""
    capacity = min(engine.blocks.num_blocks * engine.block_size, engine.max_model_len)
    # On a CPU a step of 128 tokens or more costs about in proportion to its tokens, which is what
    # interpolate() assumes past the table (the default model: 256 and 512 tokens cost 1.97x and
    # 4.00x 128's under avx2, 1.88x and 3.53x natively on AVX-512, where the proportion makes the
    # largest steps look up to 13% dearer than they are). Timing them took 1.5-1.9 s of every
    # start-up (BENCHMARKS.md, session 31). A GPU's larger steps cost far less than in
    # proportion, so there they are timed.
    largest = min(128 if engine.device.type == "cpu" else 512, max_tokens, capacity)
    # Every size a verify step can have (1-9 tokens: auto K drafts up to 8), then powers of two. The
    # costs are not linear in between: on a Zen 3 (avx2) 5-6 tokens cost 1.15-1.2x one token and 7
    # cost 1.5x, as the linears' row blocks go from one pass over the weights to two. Timing only
    # 1, 2, 4 and 8, the table's straight line from 4 to 8 made 6 tokens look dearer and 7-8
    # cheaper than they are, and auto K drafted 6-7 where 5 was faster: with every size timed,
    # `make demo`'s decode steps took 0.93x the time, the summarization prompts' the same
    # (priced at each size's cost measured in situ; BENCHMARKS.md, session 41).
    sizes = [s for s in (*range(1, 10), *(2**i for i in range(4, 10))) if s <= largest]
    n = max(size for size in sizes if size <= 8)
    context = min(512, capacity - n) if capacity - n >= 64 else 0
    probe = Sequence([0] * max(context + n, sizes[-1]), SamplingParams(), engine.device)
    require(engine.blocks.ensure_slots(probe, len(probe)), "the KV pool is too small to profile")
    try:
        if context:  # cached once: the forwards from position 0 rewrite the same tokens' K/V
            engine.forward(engine.model, [(probe, probe.token_ids[:context], 0)])
        # Five passes, each size's best kept: a burst of other work on the machine spoils a
        # pass, not a size (a spoilt size or context bent the costs: drafting looked too dear to
        # try, K stayed 0). The sizes verification uses (up to 9 tokens) decide K: with three
        # passes, three runs on a busy machine chose K = 3 in one and 4 in another. Sizes past 64
        # take long enough that a burst hardly moves them: one pass (a second saved). So each pass
        # times the sizes up to its limit: all, up to 64 twice, then up to 9 twice.
        passes = [
            [time_forward(engine, probe, size, 0) if size <= limit else math.inf for size in sizes]
            + [time_forward(engine, probe, n, context)]
            for limit in (math.inf, 64, 64, 9, 9)
        ]
    finally:
        engine.blocks.free(probe)
    *best, with_context = map(min, zip(*passes))
    # Noise only ever adds time, and more tokens never cost less: a size costs at most what any
    # larger one measured (a burst during size 2's passes had it cost more than size 8).
    best = [min(best[i:]) for i in range(len(best))]
    table = dict(zip(sizes, best))
    key_time = max(with_context - table[n], 0.0) / (n * context) if context else 0.0
    # On a quiet machine the two best passes of a size timed five times agree within a few
    # percent (at most 7% on session 32's host, though the costs' shape moved 20% between
    # profiles). Far apart, the profile ran beside other work (three processes' threads on two
    # cores made one forward take 2 s, not 11 ms): not steady, so not worth keeping.
    steady = all(sorted(t)[1] < 1.25 * min(t) for t in zip(*passes) if math.inf not in t)
    return table, key_time, steady


def time_forward(engine, probe: Sequence, num_tokens: int, start: int) -> float:
    """Seconds for the forward and logits (all rows, as in a verify) of num_tokens of probe at
    start."""
    started, tokens = clock(engine.device), probe.token_ids[start : start + num_tokens]
    engine.model.lm_head(engine.forward(engine.model, [(probe, tokens, start)]))
    return clock(engine.device) - started


def clock(device: torch.device) -> float:
    """time.perf_counter() once the device has finished its work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()
