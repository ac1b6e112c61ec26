# nanospec: the engine. Each step is schedule -> propose -> verify -> accept -> commit (plain
# decoding is K = 0); here the scheduler, the varlen batch, the engine, the LLM API and the CLI, in
# that order (requests: sequence.py, drafts: proposers.py, acceptance: sampling.py, auto K:
# goodput.py). It must never emit a token the target would not have produced with the same sampling.
import argparse
import itertools
import json
import sys
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import numpy as np
import torch

import controls
import kernels
from goodput import GoodputChooser, acceptance_estimate, clock, step_costs
from kernels import AttentionContext
from models import eos_token_ids, load_model, load_tokenizer, require
from paged_kv import BlockManager, allocate_kv_cache, bytes_per_block, move_kv
from proposers import DraftModelProposer, MLPProposer, SuffixProposer, make_proposer
from sampling import accept, couples, token_logprobs
from sequence import (
    RequestOutput,
    SamplingParams,
    ScheduledSeq,
    Sequence,
    StreamUpdate,
    check_prompt,
)


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
    spec_tree_nodes: int  # > 0: coupled requests verify trees of up to max(this, K) nodes
    stats: Counter  # the engine's counters (preemptions)
    chooser: GoodputChooser | None = None
    # The n-gram proposer's strong_match (else None): auto K keeps each kind of match's record
    strong_match: Callable[[Sequence], bool] | None = None
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
        ks = caps
        if self.chooser and decoding:
            for s in decoding:
                s.strong_match = self.strong_match(s) if self.strong_match else None
            estimates = [acceptance_estimate(s, cap) for s, cap in zip(decoding, caps)]
            ks = self.chooser.choose(estimates, [len(s) for s in decoding])
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
                samples = seq.num_cached + num_tokens == len(seq)
                max_depth, branches = min(k, nodes), nodes if tree else 1
                scheduled.append(ScheduledSeq(seq, num_tokens, nodes, samples, max_depth, branches))
                budget -= num_tokens + nodes
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.blocks.allocate(seq)  # a prefix-cache hit: both models' K/V are there
            num_tokens = min(len(seq) - cached, budget)
            if not self.blocks.ensure_slots(seq, cached + num_tokens):
                self.blocks.free(seq)
                break
            seq.num_cached = seq.num_draft_cached = cached
            if seq.num_cached_tokens is None:  # (a preempted request counts its first admission)
                seq.num_cached_tokens = cached
            self.running.append(self.waiting.popleft())
            scheduled.append(ScheduledSeq(seq, num_tokens, 0, cached + num_tokens == len(seq)))
            budget -= num_tokens
        return scheduled

    def preempt(self, seq: Sequence):
        """Free the newest sequence's blocks; it is recomputed from its tokens when readmitted."""
        self.remove(seq)
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
# Verify: one varlen forward packs every sequence's new tokens and drafts
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


def pack(batch: list[tuple[Sequence, list[int], int]], parents, block_size: int, device):
    """One varlen forward's inputs (LLMEngine.forward): input_ids [T] and positions [T] on the
    device, and the step's AttentionContext."""
    q_lens = [len(tokens) for _, tokens, _ in batch]
    seq_lens = [start + len(tokens) for _, tokens, start in batch]
    input_ids = torch.tensor([t for _, tokens, _ in batch for t in tokens])
    # Each token's position, and its cache slot: that position's block in its sequence's table.
    # (In Python lists: a decode step's few tokens took 75 us this way, 190 us as torch ops.)
    spans = [(seq.block_table, range(start, start + len(tokens))) for seq, tokens, start in batch]
    positions = torch.tensor([p for _, span in spans for p in span])
    slots = [t[p // block_size] * block_size + p % block_size for t, span in spans for p in span]
    width = max(len(seq.block_table) for seq, _, _ in batch)
    block_tables = torch.tensor(
        [s.block_table + [-1] * (width - len(s.block_table)) for s, _, _ in batch]
    )
    ctx = AttentionContext(
        torch.tensor(slots, device=device),
        block_tables.to(device),
        torch.tensor(seq_lens, device=device),
        torch.tensor([0, *itertools.accumulate(q_lens)], device=device),  # query_start_loc
        max(q_lens),
    )
    # Trees only (a batch of chains skips this): a tree node's logical position, its depth past
    # the last token, differs from its cache slot.
    if parents and any(nodes != list(range(-1, len(nodes) - 1)) for nodes in parents):
        positions, keys, _ = tree_layout(batch, parents)
        ctx.tree_pos, ctx.tree_keys = positions.to(device), keys.to(device)
    return input_ids.to(device), positions.to(device), ctx


# ---------------------------------------------------------------------------------------------
# The engine's settings
@dataclass
class EngineConfig:
    """LLMEngine's settings (a field per keyword; the CLI has a flag per field), checked before any
    model loads."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int | None = None  # None: as many as kv_cache_gib holds
    kv_cache_gib: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the longest context the models can position
    draft: str | None = None  # 'ngram', 'suffix', a draft model folder or 'mlp:PATH'
    num_spec_tokens: int | str | None = None  # K, or 'auto'; None: auto with a draft, else 0
    ngram_min: int = 1
    ngram_max: int = 4
    spec_disable_batch_size: int | None = None
    suffix_max_requests: int = 256
    spec_tree_nodes: int = 0
    enable_prefix_caching: bool = True  # full blocks keyed by their prefix, shared across requests

    def __post_init__(self):
        self.draft = None if self.draft in ("", "none") else self.draft
        if self.num_spec_tokens is None:  # a draft without a K: auto
            self.num_spec_tokens = "auto" if self.draft else 0
        k, draft = self.num_spec_tokens, self.draft
        # 8: auto's largest K for a lookup or a draft model (an MLP speculator's: its n_predict)
        k_max = k if isinstance(k, int) else 8
        for name in ("block_size", "max_num_seqs", "num_blocks", "max_model_len"):
            value = getattr(self, name)  # (None, where allowed: the default)
            require(value is None or value >= 1, f"{name} must be >= 1, got {value}")
        require(self.kv_cache_gib > 0, f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        suffix_max = self.suffix_max_requests
        require(suffix_max >= 0, f"suffix_max_requests must be >= 0, got {suffix_max}")
        # (before any model loads: a missing CUDA otherwise surfaces as a pinned-memory error)
        device = str(self.device)  # ("cuda:1", or a torch.device)
        kind = device.split(":")[0]
        require(
            kind == "cpu" or kind == "cuda" and torch.cuda.is_available(),
            f"device {device!r} is not available: use cpu, or cuda where torch has a GPU",
        )
        require(
            k == "auto" or isinstance(k, int) and k >= 0,
            f"num_spec_tokens must be an int >= 0 or 'auto', got {k!r}",
        )
        require(
            not k or draft,
            "num_spec_tokens > 0 needs a draft: 'ngram', 'suffix', a model folder or 'mlp:PATH'",
        )
        require(
            self.max_num_batched_tokens >= 1 + max(k_max, 0),
            f"max_num_batched_tokens must leave room for one "
            f"token plus {k_max} drafts, got {self.max_num_batched_tokens}",
        )
        require(
            1 <= self.ngram_min <= self.ngram_max,
            f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}",
        )
        require(
            not self.spec_tree_nodes or draft in ("ngram", "suffix"),
            f"spec_tree_nodes needs draft 'ngram' or 'suffix', got {draft!r}",
        )


# ---------------------------------------------------------------------------------------------
# The engine: one step is schedule -> propose -> verify -> accept -> commit
class LLMEngine:
    def __init__(self, model: str | None = None, **settings):
        """model: a Hugging Face folder (None: the embedded default); settings: EngineConfig's."""
        c = EngineConfig(model, **settings)
        model, block_size, num_spec_tokens = c.model, c.block_size, c.num_spec_tokens
        if model is None:
            from models.gguf import default_model_path

            model = default_model_path()
        self.model_path, self.device, self.block_size = model, torch.device(c.device), block_size
        self.model, self.config = load_model(model, c.dtype, self.device)
        self.dtype = next(self.model.parameters()).dtype
        self.kv_dtype = kernels.kv_cache_dtype(self.dtype, self.device, c.dtype in (None, "auto"))
        self.tokenizer = load_tokenizer(model)
        self.eos_ids = eos_token_ids(self.config, self.tokenizer)
        self.proposer = make_proposer(c, self.model)
        has_draft_model = isinstance(self.proposer, DraftModelProposer)
        cache_models = [self.model] + ([self.proposer.model] if has_draft_model else [])
        # The context is the shortest any model can position: the target's, a draft model's, and a
        # sliding-window model's window (models/llama.py). Asking for more is an error, not a silent
        # cap.
        limit = min(m.max_position_embeddings for m in cache_models)
        require(
            (c.max_model_len or 0) <= limit,
            f"max_model_len {c.max_model_len} exceeds {limit}, the longest "
            "context the models can position (a sliding-window model stops at its window)",
        )
        self.max_model_len = c.max_model_len or limit
        # one pool: a block id costs its K/V in the target and in the draft
        num_blocks = c.num_blocks or int(c.kv_cache_gib * 2**30) // bytes_per_block(
            cache_models, block_size, self.kv_dtype
        )
        require(num_blocks >= 1, f"kv_cache_gib {c.kv_cache_gib} is too small for one KV block")
        self.kv_caches = [
            allocate_kv_cache(m, num_blocks, block_size, self.kv_dtype, self.device)
            for m in cache_models
        ]
        self.blocks = BlockManager(num_blocks, block_size, c.enable_prefix_caching, has_draft_model)
        self.stats = Counter()  # engine-wide: steps, preemptions, kv_moves
        self.k_histogram = Counter()  # K chosen per step
        self.scheduler = Scheduler(
            self.blocks,
            c.max_num_seqs,
            c.max_num_batched_tokens,
            self.max_model_len,
            num_spec_tokens,
            c.spec_disable_batch_size,
            c.spec_tree_nodes,
            self.stats,
        )
        if num_spec_tokens == "auto":
            k_max = self.proposer.model.n_predict if isinstance(self.proposer, MLPProposer) else 8
            self.scheduler.chooser = GoodputChooser(
                k_max, *step_costs(self, c.max_num_seqs * (k_max + 1))
            )
            if c.draft == "ngram":
                self.scheduler.strong_match = self.proposer.strong_match

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
        context = self.max_model_len
        check_prompt(prompt, params, self.model.vocab_size, context, self.tokenizer is not None)
        needed = self.blocks.blocks_for(min(len(prompt) + params.max_tokens, context))
        require(
            needed <= self.blocks.num_blocks,
            f"request needs {needed} KV blocks but the pool has "
            f"{self.blocks.num_blocks}: raise num_blocks / kv_cache_gib or lower max_tokens",
        )
        seq = Sequence(prompt, params, self.device)
        seq.grammar = controls.check_request(self, params)  # errors before it joins a batch
        self.scheduler.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence):
        self.scheduler.remove(seq)
        seq.finish_reason = seq.finish_reason or "abort"

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # -- one forward over a varlen batch --------------------------------------------------------
    def forward(self, model, batch: list[tuple[Sequence, list[int], int]], parents=None, keep=None):
        """batch: (seq, tokens, start position); parents[b]: the parent of each of batch b's last
        tokens when they are a draft tree (ScheduledSeq.parents). Returns hidden [T, H], or of
        the rows `keep` only (model.forward)."""
        input_ids, positions, ctx = pack(batch, parents, self.block_size, self.device)
        kernels.context = ctx
        try:
            return model(input_ids, positions, keep)
        finally:
            kernels.context = None

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
        controls.prune_drafts(speculating)  # no verify row for a draft the grammar forbids
        proposed = time.perf_counter()
        # Verify: one target forward over every sequence's new tokens plus its drafts.
        batch = [it.forward_input() for it in scheduled]
        # The rows the step samples from (each sampling sequence's last token and its drafts):
        # the only hidden states the forward finishes.
        ends = itertools.accumulate(len(tokens) for _, tokens, _ in batch)
        rows = [range(e - len(it.drafts) - 1, e) for it, e in zip(scheduled, ends) if it.samples]
        keep = torch.tensor([r for run in rows for r in run], dtype=torch.long, device=self.device)
        hidden = self.forward(self.model, batch, [it.parents for it in scheduled], keep)
        for it in scheduled:
            if not it.samples:
                it.seq.num_cached += it.num_tokens  # a prefill chunk that does not reach the end
                self.blocks.register_full_blocks(it.seq)
        sampling = [it for it in scheduled if it.samples]
        if not sampling:
            return []
        logits = self.model.lm_head(hidden)
        # Accept, then commit: the accepted drafts and one more token per sampling sequence.
        starts = itertools.accumulate(map(len, rows), initial=0)  # each one's first row in logits
        for it, start, (path, token) in zip(sampling, starts, accept(sampling, logits)):
            own = [start] + [start + 1 + node for node in path]  # the rows that produced the tokens
            self.commit(it, path, token, hidden[own[-1]], logits[own])
        chooser = self.scheduler.chooser
        if chooser and all(it.num_tokens == 1 for it in scheduled):  # time decode-shaped steps only
            # Verification is all the rest of the step: each draft also costs a logits row, its
            # share of accepting and committing. Drafting costs per draft step only where a model
            # drafts; a lookup's (0.1-0.6 ms a step, whatever K) counts as free: timed per draft,
            # the first steps' single drafts made 8 look 5 ms dearer, and the noise of those
            # sub-millisecond timings gave the demo 82-93 steps from run to run (81 every run
            # without; BENCHMARKS.md, session 45).
            model_drafts = isinstance(self.proposer, (DraftModelProposer, MLPProposer))
            drafting = proposed - started if model_drafts else 0.0
            chooser.observe_step(speculating, batch, drafting, clock(self.device) - proposed)
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
        seq = it.seq
        # Off the first branch: move the path's K/V to the positions its tokens now hold.
        if path != list(range(len(path))):
            sources = [len(seq) + node for node in path]
            move_kv(
                self.kv_caches, self.blocks, seq, sources, range(len(seq), len(seq) + len(path))
            )
            self.stats["kv_moves"] += 1
        # The last token and the accepted drafts now have valid K/V; rejected slots get overwritten
        # later.
        seq.num_cached = len(seq) + len(path)
        seq.num_draft_cached = min(seq.num_draft_cached, seq.num_cached)
        seq.last_hidden = hidden_row
        if it.num_spec:
            seq.count_spec_step(len(it.drafts), len(path), it.depth())
        seq.first_token_time = seq.first_token_time or time.perf_counter()
        for i, (t, row) in enumerate(zip([it.drafts[node] for node in path] + [token], logits)):
            seq.token_ids.append(t)
            if seq.logprobs is not None:
                seq.logprobs.append(token_logprobs(row, t, seq.params.logprobs))
            if seq.check_stop(self.eos_ids, self.tokenizer, self.max_model_len, i < len(path)):
                break
        self.blocks.register_full_blocks(seq)  # before finish frees them: they stay cached
        if seq.finish_reason is None:
            self.blocks.trim(seq, len(seq))  # give back lookahead blocks that rejected drafts used
        else:
            self.finish(seq)

    def finish(self, seq: Sequence):
        self.scheduler.remove(seq)
        seq.finish_time = time.perf_counter()
        # Finished requests feed later ones' proposals.
        if isinstance(self.proposer, SuffixProposer):
            self.proposer.remember(seq.token_ids)
        if seq.text is None and self.tokenizer is not None:  # no stop string cut it short
            seq.detokenize(self.tokenizer, from_draft=False, final=True)
            seq.text = seq.decoded


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
        if stream:
            return self.stream(seqs)
        with Progress(transient=True, disable=not use_progress) as progress:
            task = progress.add_task("generating", total=len(seqs))
            for update in self.stream(seqs):
                progress.advance(task, update.finished)
        return [RequestOutput.from_sequence(seq) for seq in seqs]

    def stream(self, seqs: list[Sequence]):
        sent = [(0, 0)] * len(seqs)  # tokens and characters each request has sent; None: done
        try:
            while any(sent):
                self.step()
                for i, (seq, done) in enumerate(zip(seqs, sent)):
                    finished = seq.finish_reason is not None
                    if done is None or done[0] == len(seq.output_ids) and not finished:
                        continue
                    text = (seq.text if finished else seq.decoded[: seq.shown_length()]) or ""
                    output = RequestOutput.from_sequence(seq) if finished else None
                    delta, drafted = text[done[1] :], seq.drafted_chars[done[1] : len(text)]
                    yield StreamUpdate(
                        i, delta, seq.output_ids[done[0] :], drafted, finished, output
                    )
                    sent[i] = None if finished else (len(seq.output_ids), len(text))
        # A failed step, Ctrl-C, an abandoned stream: leave no request and no block behind.
        except BaseException:
            for seq in seqs:
                self.abort(seq)
            raise


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
        "--spec-tree-nodes", type=int, help="verify trees of up to max(N, K) nodes (ngram, suffix)"
    )
    p.add_argument(
        "--spec-disable-batch-size",
        type=int,
        help="run without speculation while more than this many sequences are running",
    )
    floats = "top-p repetition-penalty presence-penalty frequency-penalty min-p kv-cache-gib"
    for name in floats.split():
        p.add_argument(f"--{name}", type=float)
    p.add_argument("--json-schema", help="a JSON schema file: the output is JSON that validates")
    p.add_argument("--regex", help="the output matches this regular expression")
    sizes = "block-size num-blocks max-num-seqs max-num-batched-tokens max-model-len".split()
    for name in ["top-k", "seed"] + sizes + ["ngram-min", "ngram-max", "suffix-max-requests"]:
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
    num_accepted = sum(o.num_accepted_tokens for o in outputs)
    steps = sum(o.num_spec_steps for o in outputs)
    return {
        "drafted": num_drafted,
        "pruned": sum(o.num_draft_tokens_pruned for o in outputs),
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
    median_ms = lambda name: f"{1000 * np.median([getattr(o, name) for o in outputs]):.1f}"
    rows = {
        "requests": len(outputs),
        "output tokens": num_tokens,
        "elapsed (s)": f"{elapsed:.2f}",
        "output tok/s": f"{num_tokens / elapsed:.1f}",
        "TTFT median (ms)": median_ms("ttft"),
        "TPOT median (ms)": median_ms("tpot"),
        "dtype, kernels": f"{str(llm.dtype)[6:]}{kernels.dtypes_summary(llm.model, llm.kv_dtype)}, "
        f"{kernels.kernels_summary(llm.device)}",
        "cached prompt tokens": f"{cached} of {prompt} ({100 * cached / prompt:.0f}%)",
    }
    if llm.proposer is not None:
        m = spec_metrics(outputs)  # None per step when no step speculated: 1 token a step, 0 nodes
        rows |= {
            "drafted tokens (cut by grammar)": f"{m['drafted']} ({m['pruned']})",
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
            for drafted, run in itertools.groupby(zip(shown.delta, shown.drafted), lambda c: c[1]):
                text = "".join(c for c, _ in run)
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
    # The flags named like EngineConfig's fields are the engine's settings.
    engine_args = {f.name for f in fields(EngineConfig)}
    settings = {name: v for name, v in vars(args).items() if name in engine_args and v is not None}
    try:
        sampling = "temperature top_p top_k max_tokens seed ignore_eos logprobs regex min_p".split()
        sampling += ["repetition_penalty", "presence_penalty", "frequency_penalty"]
        given = {name: getattr(args, name) for name in sampling if getattr(args, name) is not None}
        if args.json_schema:
            given["json_schema"] = open(args.json_schema).read()
        params = SamplingParams(**given)
        prompts = args.prompt + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
        conversation = args.chat and not prompts
        require(not (conversation and args.json), "--json needs prompts: a conversation has none")
        llm = LLM(**settings)
        if args.chat:
            require(llm.tokenizer is not None, "--chat needs a tokenizer.json in the model folder")
            if conversation:
                return chat(llm, params, console)
            prompts = [llm.tokenizer.apply_chat_template(p) for p in prompts]
        prompts = prompts or ["Write a short poem about the sea."]
        start = time.perf_counter()
        if console.is_terminal:  # stream
            updates = llm.generate(prompts, params, stream=True)
            outputs = print_stream(console, updates, len(prompts))
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
