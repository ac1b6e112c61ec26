# Block manager invariants under random operation sequences (hypothesis stateful testing), with
# prefix caching. The test keeps a model of both caches (target and draft): the "K/V" written at a
# slot is the token prefix that produced it, so a cached block handed to the wrong prefix, a write
# into a shared block, or a block lost under a sequence all show up as a mismatch. Checked after
# every operation: free + cached + used == total, reference counts equal the tables holding each
# block, no block twice in one table, keyed blocks first and read-only, every computed position
# still holds its K/V (ensure/trim never lose accepted tokens), and a hit is the longest one.
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from paged_kv import BlockManager, chain_key

NUM_BLOCKS, BLOCK_SIZE = 12, 3


@dataclass
class FakeSeq:
    token_ids: list = field(default_factory=list)
    block_table: list = field(default_factory=list)
    num_cached: int = 0
    num_draft_cached: int = 0
    running: bool = False


class PrefixCachingMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.target, self.draft = {}, {}  # slot -> the token prefix whose K/V it holds
        self.seqs, self.history = [], [[]]  # live sequences; token lists to draw prefixes from
        self.prefix_of = {}  # key -> the tokens it names, recorded when first seen
        self.has_draft = True

    @initialize(has_draft=st.booleans())
    def choose_models(self, has_draft):
        self.has_draft = has_draft

    def computed(self, seq) -> int:
        """Positions whose K/V every cache holds: what may be registered."""
        return min(seq.num_cached, seq.num_draft_cached) if self.has_draft else seq.num_cached

    def write(self, cache, seq, tokens, positions):
        for p in positions:
            block = seq.block_table[p // BLOCK_SIZE]
            assert self.blocks.writable(block), f"write into shared or keyed block {block}"
            cache[self.blocks.slot(seq, p)] = tuple(tokens[: p + 1])

    # -- operations ----------------------------------------------------------------------------
    @rule(
        source=st.integers(0, 100),
        cut=st.integers(0, 4 * BLOCK_SIZE),
        tail=st.lists(st.integers(0, 2), min_size=1, max_size=2 * BLOCK_SIZE),
    )
    def new_sequence(self, source, cut, tail):
        """A prompt that shares a prefix with a live or an earlier sequence (or none), with a tail
        from a 3-token alphabet so that identical blocks also arise independently."""
        pool = self.history + [s.token_ids for s in self.seqs]
        self.seqs.append(FakeSeq(pool[source % len(pool)][:cut] + tail))

    @precondition(lambda self: any(not s.running for s in self.seqs))
    @rule(i=st.integers(0, 100))
    def admit(self, i):
        waiting = [s for s in self.seqs if not s.running]
        seq = waiting[i % len(waiting)]
        hit = self.blocks.allocate(seq)
        assert hit == len(seq.block_table) * BLOCK_SIZE and hit <= len(seq.token_ids) - 1
        seq.num_cached = seq.num_draft_cached = hit  # a hit covers both caches
        # the longest hit: the next block's prefix is not cached
        key, reusable = b"", (len(seq.token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
        for start in range(0, min(hit + BLOCK_SIZE, reusable), BLOCK_SIZE):
            key = chain_key(key, seq.token_ids[start : start + BLOCK_SIZE])
        assert hit == reusable or key not in self.blocks.block_of
        hits = list(seq.block_table)
        if self.blocks.ensure_slots(seq, hit + 1):
            seq.running = True
        else:
            assert seq.block_table == hits  # all or nothing
            self.blocks.free(seq)
            seq.num_cached = seq.num_draft_cached = 0

    @precondition(lambda self: any(s.running for s in self.seqs))
    @rule(
        i=st.integers(0, 100),
        chunk=st.integers(1, 3 * BLOCK_SIZE),
        drafts=st.lists(st.integers(0, 2), max_size=2 * BLOCK_SIZE),
        accepted=st.integers(0, 2 * BLOCK_SIZE),
        draft_runs=st.booleans(),
        bonus=st.integers(0, 2),
    )
    def step(self, i, chunk, drafts, accepted, draft_runs, bonus):
        """One engine step of a running sequence: a prefill chunk, or its pending tokens plus K
        drafts in lookahead slots of which some are accepted; the draft model may lag."""
        running = [s for s in self.seqs if s.running]
        seq = running[i % len(running)]
        length = len(seq.token_ids)
        n = min(chunk, length - seq.num_cached)
        drafts = drafts if seq.num_cached + n == length else []
        want = seq.num_cached + n + len(drafts)
        before, available = list(seq.block_table), self.free_and_cached()
        if not self.blocks.ensure_slots(seq, want):  # out of blocks: preempt it
            assert seq.block_table == before and self.free_and_cached() == available
            assert -(-want // BLOCK_SIZE) - len(before) > available
            return self.preempt_seq(seq)
        assert seq.block_table[: len(before)] == before  # existing blocks never move
        path = seq.token_ids + drafts
        self.write(self.target, seq, path, range(seq.num_cached, want))
        if self.has_draft and draft_runs and drafts:  # catch up, then its own guesses but the last
            self.write(self.draft, seq, path, range(seq.num_draft_cached, want - 1))
            seq.num_draft_cached = want - 1
        if not drafts and seq.num_cached + n < length:  # a prefill chunk: nothing sampled
            seq.num_cached += n
        else:
            kept = drafts[: min(accepted, len(drafts))]
            seq.num_cached = length + len(kept)
            seq.token_ids += kept + [bonus]
            seq.num_draft_cached = min(seq.num_draft_cached, seq.num_cached)
            self.blocks.trim(seq, len(seq.token_ids))
        self.blocks.register_full_blocks(seq, self.computed(seq))
        assert all(
            self.blocks.key_of[b] is not None
            for b in seq.block_table[: self.computed(seq) // BLOCK_SIZE]
        )

    @precondition(lambda self: any(s.running for s in self.seqs))
    @rule(i=st.integers(0, 100))
    def preempt(self, i):
        running = [s for s in self.seqs if s.running]
        self.preempt_seq(running[i % len(running)])

    def preempt_seq(self, seq):
        self.blocks.free(seq)
        seq.num_cached = seq.num_draft_cached = 0
        seq.running = False

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def finish_or_abort(self, i):
        seq = self.seqs.pop(i % len(self.seqs))
        self.blocks.free(seq)
        assert seq.block_table == []
        self.history.append(seq.token_ids)

    def free_and_cached(self) -> int:
        return self.blocks.num_free_blocks + self.blocks.num_cached_blocks

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def accounting(self):
        bm, tables = self.blocks, [s.block_table for s in self.seqs]
        used = {b for t in tables for b in t}
        assert bm.num_free_blocks + bm.num_cached_blocks + bm.num_used_blocks == NUM_BLOCKS
        assert bm.num_used_blocks == len(used)
        assert all(len(t) == len(set(t)) for t in tables), "a block twice in one table"
        for b in range(NUM_BLOCKS):
            assert bm.ref_count[b] == sum(t.count(b) for t in tables), f"refcount of {b}"
        assert not used & set(bm.free_blocks) and not used & set(bm.cached_blocks)
        assert len(bm.free_blocks) == len(set(bm.free_blocks))
        assert all(bm.key_of[b] is None for b in bm.free_blocks)
        assert all(bm.key_of[b] is not None for b in bm.cached_blocks)
        keyed = [b for b in range(NUM_BLOCKS) if bm.key_of[b] is not None]
        assert {bm.block_of[bm.key_of[b]] for b in keyed} == set(keyed) == set(bm.block_of.values())
        assert all(0 <= b < NUM_BLOCKS for b in used)

    @invariant()
    def contents(self):
        """Every computed position holds its own prefix's K/V; a keyed block is a prefix of its
        table, wholly computed, and holds exactly the prefix its key names in every cache."""
        bm = self.blocks
        for seq in self.seqs:
            for cache, n in ((self.target, seq.num_cached), (self.draft, seq.num_draft_cached)):
                if cache is self.target or self.has_draft:
                    for p in range(n):
                        assert cache[bm.slot(seq, p)] == tuple(seq.token_ids[: p + 1])
            keyed = [bm.key_of[b] is not None for b in seq.block_table]
            assert keyed == sorted(keyed, reverse=True), "keyed blocks must come first"
            assert sum(keyed) * BLOCK_SIZE <= self.computed(seq)
            for i, block in enumerate(seq.block_table[: sum(keyed)]):
                prefix = tuple(seq.token_ids[: (i + 1) * BLOCK_SIZE])
                assert self.prefix_of.setdefault(bm.key_of[block], prefix) == prefix
        for block, key in enumerate(bm.key_of):
            if key is not None:
                prefix = self.prefix_of[key]
                for cache in (self.target, self.draft) if self.has_draft else (self.target,):
                    for o in range(BLOCK_SIZE):
                        start = len(prefix) - BLOCK_SIZE
                        assert cache[block * BLOCK_SIZE + o] == prefix[: start + o + 1]

    def teardown(self):
        for seq in self.seqs:
            self.blocks.free(seq)
        assert self.blocks.num_used_blocks == 0
        assert self.free_and_cached() == NUM_BLOCKS


PrefixCachingMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60)
TestBlockManager = PrefixCachingMachine.TestCase


def make_seq(tokens):
    return FakeSeq(list(tokens))


def run_to_end(blocks, seq):
    """Compute every token of seq (its K/V in every cache) and register its full blocks."""
    assert blocks.ensure_slots(seq, len(seq.token_ids))
    seq.num_cached = len(seq.token_ids)
    blocks.register_full_blocks(seq, seq.num_cached)


def test_slot_crosses_block_boundaries():
    blocks = BlockManager(8, 4)
    seq = FakeSeq()
    assert blocks.ensure_slots(seq, 6)
    assert [blocks.slot(seq, p) for p in range(6)] == [
        seq.block_table[p // 4] * 4 + p % 4 for p in range(6)
    ]
    assert len(seq.block_table) == 2 and blocks.ensure_slots(seq, 9) and len(seq.block_table) == 3


@pytest.mark.parametrize("length, hit", [(8, 4), (9, 8), (12, 8), (3, 0)])
def test_a_hit_leaves_the_last_token_to_compute(length, hit):
    blocks = BlockManager(8, 4)
    first = make_seq(range(12))
    run_to_end(blocks, first)
    second = make_seq(range(length))
    assert blocks.allocate(second) == hit
    assert second.block_table == first.block_table[: hit // 4]
    assert all(blocks.ref_count[b] == 2 for b in second.block_table)


def test_a_hit_needs_the_whole_prefix_not_just_the_block():
    """The key chains the blocks: the same block after a different prefix is no hit."""
    blocks = BlockManager(8, 2)
    run_to_end(blocks, make_seq([1, 2, 3, 4, 5]))
    assert blocks.allocate(make_seq([9, 9, 3, 4, 5])) == 0
    assert blocks.allocate(make_seq([1, 2, 3, 9, 5])) == 2


def test_cached_blocks_are_evicted_least_recently_released_first_after_free_ones():
    blocks = BlockManager(4, 2)
    old, new = make_seq([1, 2, 0]), make_seq([3, 4, 0])
    run_to_end(blocks, old)
    run_to_end(blocks, new)
    blocks.free(old)
    blocks.free(new)  # [1, 2] was released first: least recently used
    assert (blocks.num_free_blocks, blocks.num_cached_blocks, blocks.num_used_blocks) == (2, 2, 0)
    filler = make_seq([7] * 5)
    assert blocks.ensure_slots(filler, 5)  # 2 free blocks, then evicts [1, 2]'s
    assert (blocks.num_free_blocks, blocks.num_cached_blocks, blocks.num_used_blocks) == (0, 1, 3)
    assert blocks.allocate(make_seq([1, 2, 0])) == 0
    assert blocks.allocate(make_seq([3, 4, 0])) == 2


def test_new_blocks_come_in_ascending_order_even_from_the_cache():
    """A KV head's consecutive blocks are one stream for the attention kernel when their ids
    follow each other (allocate_kv_cache): a sequence's new blocks are handed out ascending, also
    when they are evicted from the cache, which releases a sequence's blocks last first."""
    blocks = BlockManager(8, 2)
    old = make_seq(range(1, 9))
    run_to_end(blocks, old)  # blocks 0-3, all four full and cached when freed
    blocks.free(old)
    assert blocks.ensure_slots(make_seq([9] * 8), 8)  # the 4 free blocks
    new = make_seq([5] * 8)
    assert blocks.ensure_slots(new, 8)  # 4 evicted from the cache, in the order 3, 2, 1, 0
    assert new.block_table == [0, 1, 2, 3]


def test_a_prefix_computed_twice_ends_up_in_one_block():
    """Two sequences admitted together compute the same block; registering the second swaps its
    copy for the first's, and the copy goes back to the free list."""
    blocks = BlockManager(6, 2)
    a, b = make_seq([1, 2, 3]), make_seq([1, 2, 4])
    assert blocks.allocate(a) == blocks.allocate(b) == 0
    assert blocks.ensure_slots(a, 3) and blocks.ensure_slots(b, 3)
    a.num_cached = b.num_cached = 3
    blocks.register_full_blocks(a, 3)
    copy = b.block_table[0]
    blocks.register_full_blocks(b, 3)
    assert b.block_table[0] == a.block_table[0] and blocks.ref_count[a.block_table[0]] == 2
    assert copy in blocks.free_blocks and blocks.num_used_blocks == 3


def test_disabled_prefix_caching_keys_nothing():
    blocks = BlockManager(4, 2, enable_prefix_caching=False)
    seq = make_seq([1, 2, 3])
    run_to_end(blocks, seq)
    blocks.free(seq)
    assert blocks.num_free_blocks == 4 and blocks.allocate(make_seq([1, 2, 3])) == 0
