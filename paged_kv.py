# The paged KV pool: which cache blocks each sequence owns, and the cache tensors those block ids
# index. One pool serves the target and the draft model (a block id indexes both caches). It must
# never hand one block to two sequences or lose one: free + used == total at every moment.
import math

import torch


class BlockManager:
    """Owns the free list. A sequence is anything with a `block_table` list of block ids."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        # a stack: pop() hands out low ids first
        self.free_blocks = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def ensure_slots(self, seq, num_tokens: int) -> bool:
        """Make seq's block table cover positions [0, num_tokens). All or nothing: False if
        short."""
        missing = self.blocks_for(num_tokens) - len(seq.block_table)
        if missing > len(self.free_blocks):
            return False
        seq.block_table.extend(self.free_blocks.pop() for _ in range(missing))
        return True

    def trim(self, seq, num_tokens: int):
        """Release the blocks wholly beyond position num_tokens (rejected lookahead, shrunk K)."""
        while len(seq.block_table) > self.blocks_for(num_tokens):
            self.free_blocks.append(seq.block_table.pop())

    def free(self, seq):
        self.trim(seq, 0)

    def slot(self, seq, position: int) -> int:
        return (
            seq.block_table[position // self.block_size] * self.block_size
            + position % self.block_size
        )


def attention_layers(model) -> list:
    """The modules that attend over a KV cache: those with a k_cache (set by allocate_kv_cache)."""
    return [m for m in model.modules() if hasattr(m, "k_cache")]


def bytes_per_block(models, block_size: int, dtype: torch.dtype) -> int:
    """What one block id costs across every model that shares the pool (target and draft)."""
    per_token = sum(2 * a.num_kv_heads * a.head_dim for m in models for a in attention_layers(m))
    return per_token * block_size * dtype.itemsize


def allocate_kv_cache(model, num_blocks: int, block_size: int, dtype, device) -> torch.Tensor:
    """Allocate one model's cache, [2 (K and V), layers, num_blocks, block_size, num_kv_heads,
    head_dim], and hand each attention layer its K and V views."""
    layers = attention_layers(model)
    shape = (2, len(layers), num_blocks, block_size, layers[0].num_kv_heads, layers[0].head_dim)
    cache = torch.zeros(shape, dtype=dtype, device=device)
    for i, attn in enumerate(layers):
        attn.k_cache, attn.v_cache = cache[0, i], cache[1, i]
    return cache


def move_kv(caches: list[torch.Tensor], blocks: BlockManager, seq, sources, destinations):
    """Copy K/V between positions of seq in every cache ([2, layers, blocks, block_size, heads,
    dim]): an accepted tree path off the first branch moves to the positions its tokens hold."""
    src, dst = ([blocks.slot(seq, p) for p in positions] for positions in (sources, destinations))
    for cache in caches:
        by_slot = cache.flatten(2, 3)
        by_slot[:, :, dst] = by_slot[:, :, src]
