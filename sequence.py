# A request's state: its sampling parameters, its Sequence (tokens, cache progress, RNG, counters),
# what a step schedules for it (ScheduledSeq) and what the API returns (RequestOutput). Plain state
# and the stop rules over it: it must never run a model or touch the KV cache.
import math
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

import controls
from models import require


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
    # Per token: the sampled token's and the N most likely tokens' log-probs.
    logprobs: int | None = None
    # vLLM's controls (controls.py): penalties over the history, min_p, biases, allowed tokens.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # Structured output, at most one: a JSON schema (dict or str), a regex, a Lark grammar, choices.
    json_schema: dict | str | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None

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
            # A seed torch's generators take.
            "seed": self.seed is None or isinstance(self.seed, int) and 0 <= self.seed < 2**64,
        }
        controls.check_params(self, checks)  # these, then the controls'


# How fast auto K forgets a request's acceptance: each spec step weighs 0.8 of the one after it (a
# memory of about five steps). A request's drafts are accepted at very different rates as it goes:
# the demo's answers copy a function, 2-6.6 tokens a step, then explain it in prose that neither
# prompt holds, 1.1-1.6 (BENCHMARKS.md, session 45). Counted over its whole history, a request
# that had copied went on drafting 3-8 tokens into its prose, and at batch 2 those rows took a
# verify step past 6 rows, where on a Zen 3 (avx2) each row costs about a sixth of a plain step.
# Forgetting, the demo's n-gram run verified 422-442 rows instead of 498-514 (its decode 0.92x the
# time at the start-up profile's step costs; timed in fresh processes taking turns, 0.76-1.29x,
# median 0.90 of 15 pairs, as this host's phases move a run by 20%). Summarization prompts at
# batch 1 and 4 and MT-bench at batch 1 and 8: the same within the noise.
HISTORY_DECAY = 0.8


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
        # the rejection sampler's uniforms from the generator.
        self.seed = params.seed if params.seed is not None else torch.randint(2**62, ()).item()
        self.generator = torch.Generator(device=device).manual_seed(self.seed)
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.text: str | None = None  # set at finish; truncated at a stop string
        # The output decoded token by token (stop strings, streaming), and per character whether an
        # accepted draft produced it (the CLI colours those).
        self.decoded, self.decode_offsets = "", (self.num_prompt_tokens,) * 2
        self.drafted_chars: list[bool] = []
        self.num_cached_tokens: int | None = None  # prompt tokens found cached when first admitted
        # The n-gram proposer's copy cursor: where its last chain was copied from, less the
        # request's length then and 2 (NgramProposer.tree); at first, anywhere.
        self.copy_offset = -math.inf
        self.num_drafted = self.num_accepted = self.num_spec_steps = 0
        self.num_pruned = 0  # drafts the grammar cut before verification (not in num_drafted)
        self.grammar: controls.Grammar | None = None
        self.accepted_per_position, self.drafted_per_position = Counter(), Counter()
        # What auto K's estimate (goodput.acceptance_estimate) reads, per (strong_match,
        # position): steps that drafted a token there after accepting every draft before it
        # (reached), and those that accepted it, each step weighted HISTORY_DECAY less for every
        # spec step after it.
        self.recent_reached, self.recent_accepted = Counter(), Counter()
        # Whether this step's n-gram match is 2 tokens or longer (None: a proposer without such a
        # notion), set by the scheduler before it chooses K (NgramProposer.strong_match says why).
        self.strong_match: bool | None = None
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

    def count_spec_step(self, num_drafted: int, num_accepted: int, depth: int):
        """The counters of a step that verified num_drafted draft nodes, `depth` deep, and accepted
        a path of num_accepted (acceptance_estimate and RequestOutput read them)."""
        self.num_spec_steps += 1
        self.num_drafted += num_drafted  # nodes verified
        self.num_accepted += num_accepted
        self.drafted_per_position.update(range(depth))  # per depth
        self.accepted_per_position.update(range(num_accepted))
        # Each record decays a step, then counts this step's positions: those reached (drafted
        # after every earlier draft was accepted) and those accepted.
        reached = min(num_accepted + 1, depth)
        for counts, n in ((self.recent_reached, reached), (self.recent_accepted, num_accepted)):
            for key in counts:
                counts[key] *= HISTORY_DECAY
            counts.update((self.strong_match, i) for i in range(n))

    def check_stop(self, eos_ids, tokenizer, max_model_len: int, from_draft=False) -> bool:
        """Set finish_reason if the last token ends the request: EOS, a stop token, the grammar's
        end (the grammar is fed each token here), a stop string, max_tokens or the context.
        Called per token, so a step that brings several never emits past a stop."""
        p, last = self.params, self.token_ids[-1]
        num_new_chars = self.detokenize(tokenizer, from_draft)
        eos = not p.ignore_eos and last in eos_ids
        if eos or last in (p.stop_token_ids or ()) or (self.grammar and self.grammar.commit(last)):
            self.finish_reason = "stop"
        # Stop strings are matched on the decoded output, searching only where the new text could
        # complete one.
        elif p.stop:
            search_from = max(len(self.decoded) - num_new_chars - max(map(len, p.stop)) + 1, 0)
            hits = [i for i in (self.decoded.find(s, search_from) for s in p.stop) if i >= 0]
            if hits:
                self.finish_reason, self.text = "stop", self.decoded[: min(hits)]
        at_limit = len(self.output_ids) >= p.max_tokens or len(self) >= max_model_len
        if self.finish_reason is None and at_limit:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def detokenize(self, tokenizer, from_draft: bool, final: bool = False) -> int:
        """Decode the text the last token completes (an incomplete character waits, until the
        final call); returns how many characters it added."""
        if tokenizer is None:  # token ids only
            return 0
        new_text, self.decode_offsets = tokenizer.decode_next(
            self.token_ids, *self.decode_offsets, final=final
        )
        self.decoded += new_text
        self.drafted_chars += [from_draft] * len(new_text)
        return len(new_text)

    def shown_length(self) -> int:
        """How much of the decoded text a stream may show while running: all but the longest
        tail that could still begin a stop string (stop strings are never shown, not in part)."""
        stops = self.params.stop or []
        for n in range(min(len(self.decoded), max(map(len, stops), default=1) - 1), 0, -1):
            if any(s.startswith(self.decoded[-n:]) for s in stops):
                return len(self.decoded) - n
        return len(self.decoded)


def check_prompt(
    prompt: list[int], params: SamplingParams, vocab: int, context: int, has_tokenizer: bool
):
    """A request the engine can serve: token ids in the vocabulary, room for one new token in the
    context, and a tokenizer if it has stop strings."""
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
    require(not params.stop or has_tokenizer, "stop strings need a tokenizer; use stop_token_ids")


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
    num_draft_tokens_pruned: int = 0  # drafts the grammar cut before verification
    num_cached_tokens: int = 0  # prompt tokens whose K/V a prefix-cache hit supplied

    @classmethod
    def from_sequence(cls, seq: Sequence) -> "RequestOutput":
        first = seq.first_token_time or seq.finish_time
        return cls(
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
            num_draft_tokens_pruned=seq.num_pruned,
            num_cached_tokens=seq.num_cached_tokens or 0,
        )


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

    def forward_input(self) -> tuple[Sequence, list[int], int]:
        """(seq, tokens, start position) for the step's target forward: the tokens it feeds this
        step, then its drafts."""
        start = self.seq.num_cached
        return self.seq, self.seq.token_ids[start : start + self.num_tokens] + self.drafts, start

    def depth(self) -> int:
        """How deep the drafts go: a chain's length, a tree's longest root-to-node path."""
        return max(map(len, controls.row_paths(self.drafts, self.parents)))
