# Block manager invariants under random operation sequences (hypothesis stateful testing):
# free + used == total, no block owned twice, ensure/trim never drop covered positions,
# all-or-nothing allocation, and every block comes back when sequences are freed.
from dataclasses import dataclass, field

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_kv import BlockManager

NUM_BLOCKS, BLOCK_SIZE = 12, 3


@dataclass
class FakeSeq:
    block_table: list = field(default_factory=list)
    covered: int = 0  # positions the test has asked to keep


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.seqs = []

    @rule()
    def new_sequence(self):
        self.seqs.append(FakeSeq())

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), extra=st.integers(0, 3 * BLOCK_SIZE))
    def ensure(self, i, extra):
        seq = self.seqs[i % len(self.seqs)]
        before, free_before = list(seq.block_table), self.blocks.num_free_blocks
        want = seq.covered + extra
        ok = self.blocks.ensure_slots(seq, want)
        assert seq.block_table[: len(before)] == before  # existing blocks never move
        if ok:
            assert len(seq.block_table) * BLOCK_SIZE >= want
            seq.covered = max(seq.covered, want)
        else:  # all or nothing
            assert seq.block_table == before and self.blocks.num_free_blocks == free_before
            assert -(-want // BLOCK_SIZE) - len(before) > free_before

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), keep=st.integers(0, 4 * BLOCK_SIZE))
    def trim(self, i, keep):
        seq = self.seqs[i % len(self.seqs)]
        keep = min(keep, seq.covered)
        before = list(seq.block_table)
        self.blocks.trim(seq, keep)
        assert seq.block_table == before[: len(seq.block_table)]
        assert len(seq.block_table) * BLOCK_SIZE >= keep  # accepted positions stay covered
        assert len(seq.block_table) == -(-keep // BLOCK_SIZE) or len(seq.block_table) == len(before)
        seq.covered = keep

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        seq = self.seqs.pop(i % len(self.seqs))
        self.blocks.free(seq)
        assert seq.block_table == []

    @invariant()
    def accounting(self):
        owned = [b for s in self.seqs for b in s.block_table]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert not set(owned) & set(self.blocks.free_blocks), "an owned block is on the free list"
        assert len(owned) + self.blocks.num_free_blocks == NUM_BLOCKS
        assert all(0 <= b < NUM_BLOCKS for b in owned)

    def teardown(self):
        for seq in self.seqs:
            self.blocks.free(seq)
        assert self.blocks.num_free_blocks == NUM_BLOCKS


TestBlockManager = BlockManagerMachine.TestCase


def test_slot_crosses_block_boundaries():
    blocks = BlockManager(8, 4)
    seq = FakeSeq()
    assert blocks.ensure_slots(seq, 6)
    assert [blocks.slot(seq, p) for p in range(6)] == [
        seq.block_table[p // 4] * 4 + p % 4 for p in range(6)
    ]
    assert len(seq.block_table) == 2 and blocks.ensure_slots(seq, 9) and len(seq.block_table) == 3
