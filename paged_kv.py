# The paged KV pool: which cache blocks each sequence owns, and the cache tensors those block ids
# index. One pool serves the target and the draft model (a block id indexes both caches). It must
# never hand a block to two sequences unless both read the same cached prefix from it, never write
# into such a shared block, and never lose one: free + cached + used == total at every moment.
#
# Prefix caching: once every position of a full block has its K/V (the target's and the draft
# model's), the block is keyed by a hash of its tokens chained to the previous block's key, so one
# key names the whole prefix up to the block's end. A new sequence starts from the longest run of
# keyed blocks of its tokens. A block whose last reader leaves keeps its key and contents ("cached")
# until it is reused, least recently released first. Keyed blocks are read-only: a sequence writes
# only at positions past its keyed blocks, so a hit gives bit for bit what recomputing would (the
# kernels are row-invariant: a token's K/V depends on its prefix only).
import hashlib
import math

import torch


class BlockManager:
    """Owns the pool. A sequence is anything with a `block_table` list of block ids and
    `token_ids`; its keyed blocks always come first in its table."""

    def __init__(self, num_blocks, block_size, enable_prefix_caching=True, draft_cache=False):
        self.num_blocks, self.block_size = num_blocks, block_size
        # draft_cache: a draft model's KV cache uses the same block ids (its K/V may lag)
        self.enable_prefix_caching, self.draft_cache = enable_prefix_caching, draft_cache
        self.ref_count = [0] * num_blocks  # tables holding each block
        self.key_of: list[bytes | None] = [None] * num_blocks
        self.block_of: dict[bytes, int] = {}  # key -> the block holding that prefix's K/V
        # unused, no key: a stack, pop() hands out low ids first
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        # unused, keyed: insertion order is release order, so the first is the least recently used
        self.cached_blocks: dict[int, None] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks - self.num_cached_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def allocate(self, seq) -> int:
        """Start a sequence without blocks (new, or preempted) from the longest run of keyed
        blocks of its tokens; returns how many tokens they hold. Its last token is always left
        to compute: the step that computes it samples the next."""
        assert not seq.block_table, "allocate() is for a sequence without blocks"
        key, size = b"", self.block_size
        reusable = (len(seq.token_ids) - 1) // size * size if self.enable_prefix_caching else 0
        for start in range(0, reusable, size):
            key = chain_key(key, seq.token_ids[start : start + size])
            if key not in self.block_of:
                break
            seq.block_table.append(self.share(self.block_of[key]))
        return len(seq.block_table) * size

    def ensure_slots(self, seq, num_tokens: int) -> bool:
        """Make seq's block table cover positions [0, num_tokens) with blocks of its own. All or
        nothing: False if short. Unkeyed free blocks go first, then the least recently used
        cached ones (their keys forgotten)."""
        missing = self.blocks_for(num_tokens) - len(seq.block_table)
        if missing > self.num_free_blocks + self.num_cached_blocks:
            return False
        # Ascending: the attention kernel reads a KV head's consecutive blocks as one stream
        # (allocate_kv_cache), and the cache gives back a freed sequence's blocks last first.
        seq.block_table.extend(sorted(self.take_unused() for _ in range(missing)))
        return True

    def register_full_blocks(self, seq, num_computed: int | None = None):
        """Key seq's full blocks below position num_computed, where every position has its K/V in
        every cache the pool serves (default: seq.num_cached, with a draft model's cache the lesser
        of it and seq.num_draft_cached), so a hit serves both models. A block whose prefix another
        block already holds is swapped for that one (same bits), and its own copy goes back to the
        pool."""
        if not self.enable_prefix_caching:
            return
        if num_computed is None:
            lagging = [seq.num_draft_cached] if self.draft_cache else []
            num_computed = min([seq.num_cached, *lagging])
        table, size = seq.block_table, self.block_size
        full = min(num_computed, len(seq.token_ids)) // size
        first = full  # keyed blocks come first: find where they end, from the back
        while first > 0 and self.key_of[table[first - 1]] is None:
            first -= 1
        key = self.key_of[table[first - 1]] if first else b""
        for i in range(first, full):
            key = chain_key(key, seq.token_ids[i * size : (i + 1) * size])
            if key in self.block_of:
                own, table[i] = table[i], self.share(self.block_of[key])
                self.release(own)
            else:
                self.key_of[table[i]], self.block_of[key] = key, table[i]

    def trim(self, seq, num_tokens: int):
        """Release the blocks wholly beyond position num_tokens (rejected lookahead, shrunk K)."""
        while len(seq.block_table) > self.blocks_for(num_tokens):
            self.release(seq.block_table.pop())

    def free(self, seq):
        """Release every block, the last first: a prefix's later blocks are then evicted before
        its earlier ones, which more sequences share."""
        self.trim(seq, 0)

    def slot(self, seq, position: int) -> int:
        size = self.block_size
        return seq.block_table[position // size] * size + position % size

    def writable(self, block: int) -> bool:
        """A block a sequence may write into: its own alone, holding no cached prefix."""
        return self.ref_count[block] == 1 and self.key_of[block] is None

    def take_unused(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.pop()
        else:  # evict the least recently used cached block
            block = next(iter(self.cached_blocks))
            del self.cached_blocks[block], self.block_of[self.key_of[block]]
            self.key_of[block] = None
        self.ref_count[block] = 1
        return block

    def share(self, block: int) -> int:
        self.cached_blocks.pop(block, None)
        self.ref_count[block] += 1
        return block

    def release(self, block: int):
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            if self.key_of[block] is None:
                self.free_blocks.append(block)
            else:
                self.cached_blocks[block] = None


def chain_key(previous: bytes, tokens: list[int]) -> bytes:
    """A block's key: its tokens hashed with the previous block's key (SHA-256: two prefixes that
    collide would silently share K/V)."""
    return hashlib.sha256(previous + repr(tokens).encode()).digest()


def attention_layers(model) -> list:
    """The modules that attend over a KV cache: those with a k_cache (set by allocate_kv_cache)."""
    return [m for m in model.modules() if hasattr(m, "k_cache")]


def bytes_per_block(models, block_size: int, dtype: torch.dtype) -> int:
    """What one block id costs across every model that shares the pool (target and draft)."""
    per_token = sum(2 * a.num_kv_heads * a.head_dim for m in models for a in attention_layers(m))
    return per_token * block_size * dtype.itemsize


def allocate_kv_cache(model, num_blocks: int, block_size: int, dtype, device) -> torch.Tensor:
    """Allocate one model's cache, [2 (K and V), layers, num_blocks, block_size, num_kv_heads,
    head_dim], and hand each attention layer its K and V views. Stored head-major across the
    whole pool ([2, layers, num_kv_heads, num_blocks, block_size, head_dim], seen through a
    permuted view): an attention item reads one KV head, and its keys then sit side by side, a
    block's 16 keys of 64 fp16 dims in 2 KB and the next block's right after when the block ids
    follow each other (as ensure_slots hands them out), so the hardware's prefetchers see one long
    stream instead of 128 bytes at a stride of all the heads, and the C kernel's own prefetch of
    the key 32 positions on (cpu_kernels.c, attend) finds that key's lines. Measured on avx2, a
    layer's decode attention over 2,000 tokens (2 threads): slot-major 162 -> 143 us head-major
    within a block (session 17); that 120 -> 76 us head-major across the pool (session 18). The
    same bits.
    Uninitialized (torch.empty), because no kernel reads a slot before it is written, by its own
    sequence or by the one whose cached prefix it shares (tests/test_engine.py fills a pool with
    NaN to check). Zeroing the default 1 GiB pool took 0.3 s of a 3-4 s start-up on a CPU and
    made all of it resident at once; an untouched allocation this large is pages the OS maps in
    as blocks are first used (`nanospec.py --prompt hi`: 2.2 GB of memory at most before, 1.4 GB
    after)."""
    layers = attention_layers(model)
    shape = (2, len(layers), layers[0].num_kv_heads, num_blocks, block_size, layers[0].head_dim)
    cache = torch.empty(shape, dtype=dtype, device=device).permute(0, 1, 3, 4, 2, 5)
    for i, attn in enumerate(layers):
        attn.k_cache, attn.v_cache = cache[0, i], cache[1, i]
    return cache


def move_kv(caches: list[torch.Tensor], blocks: BlockManager, seq, sources, destinations):
    """Copy K/V between positions of seq in every cache ([2, layers, blocks, block_size, heads,
    dim]): an accepted tree path off the first branch moves to the positions its tokens hold."""
    src, dst = (
        torch.tensor([blocks.slot(seq, p) for p in positions])
        for positions in (sources, destinations)
    )
    size = blocks.block_size
    for cache in caches:  # (indexing by block and offset: caches are transposed views)
        cache[:, :, dst // size, dst % size] = cache[:, :, src // size, src % size]
