# Every triton_* kernel against its torch_* reference, on fresh random inputs each run (the seed is
# printed on failure; NANOSPEC_TEST_SEED=<n> replays it). On CPU the kernels run under
# TRITON_INTERPRET=1 (set in conftest.py), where fp32 and fp16 are exact but bf16 is broken.
import concurrent.futures
import contextlib
import functools
import os
import random
import re
import shutil
import subprocess
import warnings
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="bf16 Triton needs CUDA: the interpreter mishandles bfloat16",
)
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=needs_cuda),
]
TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@pytest.fixture(autouse=True)
def seed():
    seed = int(os.environ.get("NANOSPEC_TEST_SEED", random.randrange(2**31)))
    print(f"random seed {seed} (replay: NANOSPEC_TEST_SEED={seed})")
    torch.manual_seed(seed)


def randn(*shape, dtype=torch.float32, device=DEVICE):
    return torch.randn(*shape, device=device).to(dtype)


def _nan_filled(make):
    def make_poisoned(*args, **kwargs):
        t = make(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    return make_poisoned


@contextlib.contextmanager
def nan_filled_outputs():
    """Inside, torch.empty(_like) return NaN-filled float tensors: an output element a kernel never
    writes shows up as NaN instead of as whatever the allocator left there."""
    with (
        mock.patch.object(torch, "empty", _nan_filled(torch.empty)),
        mock.patch.object(torch, "empty_like", _nan_filled(torch.empty_like)),
    ):
        yield


def assert_triton_matches_torch(op, *args, dtype):
    with nan_filled_outputs():
        got = getattr(kernels, f"triton_{op}")(*args)
    want = getattr(kernels, f"torch_{op}")(*args)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


def qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device=DEVICE):
    """q, k, v as the model makes them: non-contiguous views into one fused projection output."""
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device)
    q, k, v = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1
    )
    return (
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )


# --------------------------------------------------------------------------------------------
# store_kv
# --------------------------------------------------------------------------------------------
def head_major(cache):
    """The same logical cache [blocks, block_size, heads, D], stored as the engine stores it:
    [heads, blocks, block_size, D] (paged_kv.allocate_kv_cache), seen through a permuted view."""
    return cache.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)


@pytest.mark.parametrize("layout", ["slot-major", "head-major"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_store_kv(block_size, layout):
    """Slot s is offset s % block_size of block s // block_size; every other slot keeps its
    value."""
    num_tokens, num_blocks, num_kv_heads, head_dim = 9, 12, 2, 16
    _, k, v = qkv_views(num_tokens, 1, num_kv_heads, head_dim, torch.float32)
    slot_mapping = torch.randperm(num_blocks * block_size)[:num_tokens]
    k_cache, v_cache = (randn(num_blocks, block_size, num_kv_heads, head_dim) for _ in range(2))
    if layout == "head-major":
        k_cache, v_cache = head_major(k_cache), head_major(v_cache)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for token, slot in enumerate(slot_mapping.tolist()):
        want_k[slot // block_size, slot % block_size] = k[token]
        want_v[slot // block_size, slot % block_size] = v[token]
    kernels.store_kv(k, v, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


# --------------------------------------------------------------------------------------------
# paged_attention
# --------------------------------------------------------------------------------------------
BATCHES = {  # (context length including this step's queries, q_len) per sequence
    # a prefill chunk after earlier chunks, a whole prompt, decode, verification with K=4, an
    # empty query, q_len 3, a long decode (several KV tiles), a long chunk (several query blocks)
    "mixed": [(45, 20), (19, 19), (70, 1), (23, 5), (9, 0), (38, 3), (150, 1), (140, 40)],
    "decode": [(1, 1), (33, 1), (130, 1)],
}


def make_paged_batch(seqs, block_size, num_heads, num_kv_heads, head_dim, dtype, device=DEVICE):
    """Random queries and a random paged cache; each sequence's blocks are scattered randomly over
    a pool with spare blocks, so reading the wrong block, slot or position changes the result.
    On `device`: the Triton tests' (CUDA where there is one), or the C kernels' CPU."""
    blocks_per_seq = [-(-context // block_size) for context, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    block_ids = torch.randperm(num_blocks, device=device).int().split(blocks_per_seq + [3])
    block_tables = torch.full(
        (len(seqs), max(blocks_per_seq) + 2), -1, dtype=torch.int32, device=device
    )
    for b, ids in enumerate(block_ids[:-1]):
        block_tables[b, : len(ids)] = ids
    k_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    seq_lens = torch.tensor([context for context, _ in seqs], device=device)
    q_lens = torch.tensor([q_len for _, q_len in seqs], device=device)
    query_start_loc = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0))
    q, _, _ = qkv_views(int(q_lens.sum()), num_heads, num_kv_heads, head_dim, dtype, device)
    ctx = kernels.AttentionContext(None, block_tables, seq_lens, query_start_loc, int(q_lens.max()))
    return q, k_cache, v_cache, head_dim**-0.5, ctx


def c_rotary(q_k, cos_sin):
    """The C attention call's rotary, read back: the heads of q_k [T, H, D] as both the query and
    the key heads of a call over one sequence of T tokens (every head goes through the same loop),
    the rotated keys from the cache it stores them in (q_k's dtype: as they were rotated)."""
    num_tokens, heads, head_dim = q_k.shape
    seqs = [(num_tokens, num_tokens)]
    _, k_cache, v_cache, _, ctx = make_paged_batch(
        seqs, 1, heads, heads, head_dim, q_k.dtype, "cpu"
    )
    ctx.slot_mapping = ctx.block_tables[0, :num_tokens].long()  # block size 1: slot = block
    qkv = torch.cat([q_k, q_k, q_k], dim=1).flatten(1)
    kernels.c_paged_attention(qkv, k_cache, v_cache, 1.0, ctx, fused=True, cos_sin=cos_sin)
    return k_cache[ctx.slot_mapping, 0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [  # GQA ratios 1, 3, 4, 8
        (2, 2, 16),
        (6, 2, 64),
        (4, 1, 128),
        (8, 1, 64),
    ],
)
@pytest.mark.parametrize("batch", BATCHES)
def test_paged_attention(batch, block_size, num_heads, num_kv_heads, head_dim, dtype):
    args = make_paged_batch(BATCHES[batch], block_size, num_heads, num_kv_heads, head_dim, dtype)
    assert_triton_matches_torch("paged_attention", *args, dtype=dtype)


def test_paged_attention_empty_batch():
    args = make_paged_batch([(5, 0), (9, 0)], 4, 2, 2, 16, torch.float32)
    assert kernels.triton_paged_attention(*args).shape == (0, 2, 16)


# --------------------------------------------------------------------------------------------
# linear: fixed tiles (fp32 32x64x32, else 64x64x64); the shapes end mid-tile in every dimension
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "lead,n,k",
    [((1,), 16, 16), ((5,), 37, 20), ((70,), 80, 72), ((2, 35), 131, 100), ((0,), 16, 8)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_linear(lead, n, k, bias, dtype):
    x = randn(*lead, k + 3, dtype=dtype)[..., :k]  # rows with a stride, as a view of a wider output
    weight, b = (0.1 * randn(n, k)).to(dtype), randn(n).to(dtype) if bias else None
    with nan_filled_outputs():
        got = kernels.triton_linear(x, weight, b)
    assert got.dtype == dtype and got.shape == (*lead, n)
    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotate", [True, False], ids=["rotary", "no-rotary"])
@pytest.mark.parametrize("layout", ["slot-major", "head-major"])
def test_triton_rotary_store_is_the_ops_it_replaces(layout, rotate, dtype):
    """One launch rotates q and k and stores k and v: q, and both caches afterwards, equal
    torch_rotary then store_kv bit for bit (not close: rotary is elementwise, and the GPU path
    must stay row-invariant), with 6 query, 2 key and 2 value heads of 80 dims (not a power of
    two) in rows at a stride wider than their heads. Every other slot keeps its value."""
    num_tokens, block_size, num_blocks = 7, 4, 9
    qkv = randn(num_tokens, 11 * 80, dtype=dtype)[:, : 10 * 80]
    cos_sin = rope_cache(300, 80)[torch.randint(0, 300, (num_tokens,))].to(DEVICE, dtype)
    cos_sin = cos_sin if rotate else None
    slot_mapping = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    k_cache, v_cache = (randn(num_blocks, block_size, 2, 80, dtype=dtype) for _ in range(2))
    if layout == "head-major":
        k_cache, v_cache = head_major(k_cache), head_major(v_cache)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    q_k, v = qkv.view(num_tokens, 10, 80).split((8, 2), dim=1)
    want_q, k = (kernels.torch_rotary(q_k, cos_sin) if rotate else q_k).split((6, 2), dim=1)
    kernels.store_kv(k, v, want_k, want_v, slot_mapping)
    with nan_filled_outputs():
        q = kernels.triton_rotary_store(qkv, cos_sin, k_cache, v_cache, slot_mapping, 6)
    assert torch.equal(q, want_q)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


# --------------------------------------------------------------------------------------------
# rms_norm (silu_mul is elementwise: torch serves it on CUDA too)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (7, 100), (2, 3, 576)])
def test_rms_norm(shape, with_residual, dtype):
    x = randn(*shape[:-1], shape[-1] + 5, dtype=dtype)[..., : shape[-1]]  # rows with a stride
    weight = (1 + 0.1 * randn(shape[-1])).to(dtype)
    residual = randn(*shape, dtype=dtype) if with_residual else None
    assert_triton_matches_torch("rms_norm", x, weight, 1e-6, residual, dtype=dtype)


def rope_cache(max_positions, head_dim, base=10000.0):  # (on the CPU: the C tests')
    inv_freq = base ** -(torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


# --------------------------------------------------------------------------------------------
# C kernels (cpu_kernels.c, bf16 on the CPU) against the torch references they replace
# --------------------------------------------------------------------------------------------
needs_c_kernels = pytest.mark.skipif(
    kernels.cpu_kernels() is None, reason="cpu_kernels.c did not build here (no C compiler?)"
)


# The linears' dtypes, rows' and weights': --dtype float32, bfloat16, and fp32 rows over 16-bit
# weights (--dtype auto)
X_AND_W_DTYPES = pytest.mark.parametrize(
    "x_dtype,w_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
    ],
    ids=["fp32", "bf16", "bf16-w", "fp16-w"],
)


def quick_compiler(tmp_path, refuse: str = "", linger: int = 0) -> str:
    """The system's C compiler at -O0 (after kernels' -O3, so it wins), refusing any command with
    `refuse` in it as an old GCC refuses a flag it lacks, and waiting `linger` seconds after a
    build before it exits: for tests of which library cpu_kernels() builds and loads, not of its
    code (a -O3 build takes 10-40 s on a 2-core Zen 3, -O0 a few)."""
    compiler = tmp_path / "cc"
    refusal = f'case "$*" in *{refuse}*) exit 1;; esac\n' if refuse else ""
    build = f'{os.environ.get("CC", "cc")} "$@" -O0 && sleep {linger}'  # (a failure: cc's status)
    compiler.write_text(f"#!/bin/sh\n{refusal}{build}\n")
    compiler.chmod(0o755)
    return str(compiler)


def rebuild_cpu_kernels(monkeypatch, isa: str | None = None):
    """The next cpu_kernels() builds (or finds) and loads the library again, for this test's
    environment (and for `isa`, as NANOSPEC_ISA sets it); monkeypatch restores the cached one
    afterwards."""
    if isa:
        monkeypatch.setenv("NANOSPEC_ISA", isa)
    monkeypatch.setattr(kernels, "cpu_kernels", functools.cache(kernels.cpu_kernels.__wrapped__))


@needs_c_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [  # GQA ratios 1, 3, 4, 8
        (2, 2, 32),
        (9, 3, 64),
        (4, 1, 128),
        (8, 1, 16),
    ],
)
@pytest.mark.parametrize("batch", BATCHES)
def test_c_paged_attention_matches_torch(
    batch, block_size, num_heads, num_kv_heads, head_dim, dtype
):
    """One C kernel for every query shape: prefill chunks, whole prompts, decode, verification."""
    args = make_paged_batch(
        BATCHES[batch], block_size, num_heads, num_kv_heads, head_dim, dtype, "cpu"
    )
    with nan_filled_outputs():
        got = kernels.c_paged_attention(*args)
    torch.testing.assert_close(got, kernels.torch_paged_attention(*args), **TOLERANCE[dtype])


@needs_c_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_c_paged_attention_merges_segments_of_keys(dtype):
    """Past ATTENTION_SEGMENT keys a query's keys are summed in segments, then merged: decode,
    verification and a chunk at 1-3 segments still match the reference."""
    seqs = [(1100, 1), (1030, 9), (600, 3), (kernels.ATTENTION_SEGMENT + 1, 2)]
    args = make_paged_batch(seqs, 16, 9, 3, 64, dtype, "cpu")
    with nan_filled_outputs():
        got = kernels.c_paged_attention(*args)
    torch.testing.assert_close(got, kernels.torch_paged_attention(*args), **TOLERANCE[dtype])


@needs_c_kernels
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("head_dim", [64, 48])  # a constant-shape instance, the general one
def test_c_attention_with_fp16_cache_equals_fp32_cache_of_its_values(batch, head_dim):
    """fp32 queries over an fp16 cache (--dtype auto on AVX2): the kernel widens each K/V value
    exactly, so it equals, bit for bit, the kernel over an fp32 cache holding the fp16 values."""
    q, k_cache, v_cache, scale, ctx = make_paged_batch(
        BATCHES[batch], 4, 6, 2, head_dim, torch.float32, "cpu"
    )
    k16, v16 = k_cache.half(), v_cache.half()
    got = kernels.c_paged_attention(q, k16, v16, scale, ctx)
    assert got.dtype == torch.float32
    assert torch.equal(got, kernels.c_paged_attention(q, k16.float(), v16.float(), scale, ctx))
    torch.testing.assert_close(got, kernels.torch_paged_attention(q, k16, v16, scale, ctx))


@needs_c_kernels
@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, "fp16")],
    ids=["fp32", "bf16", "fp32-q-fp16-cache"],
)
@pytest.mark.parametrize("rotate", [True, False], ids=["rotary", "no-rotary"])
@pytest.mark.parametrize("batch", ["mixed", "decode"])
@pytest.mark.parametrize("layout", ["slot-major", "head-major"])
def test_c_attention_rotates_and_stores_like_the_ops_it_replaces(
    layout, batch, rotate, dtype, cache_dtype
):
    """Given this step's q, k and v heads side by side in each row of qkv (as the model has them,
    here at a row stride wider than the heads), the C call first rotates and stores: the caches
    afterwards, and the output, equal its own rotary (c_rotary), store_kv, then attending. Also
    over a head-major cache, as the engine stores it (a permuted view: every path reads and
    writes it by its strides), where the torch reference reads the same values as from a
    contiguous copy."""
    if cache_dtype == "fp16" and not kernels.cpu_kernels().f16c:
        pytest.skip("an fp16 cache needs F16C (this build is generic)")
    q, k_cache, v_cache, scale, ctx = make_paged_batch(BATCHES[batch], 4, 6, 2, 64, dtype, "cpu")
    k_cache, v_cache = (c.half() if cache_dtype == "fp16" else c for c in (k_cache, v_cache))
    if layout == "head-major":
        k_cache, v_cache = head_major(k_cache), head_major(v_cache)
        assert not k_cache.is_contiguous()
    num_tokens = len(q)
    # 6 query, 2 key and 2 value heads, 1 spare
    qkv = randn(num_tokens, 11 * 64, dtype=dtype, device="cpu")
    q_k, v = qkv[:, : 8 * 64].view(num_tokens, 8, 64), qkv[:, 8 * 64 : 10 * 64].view(-1, 2, 64)
    cos_sin = rope_cache(300, 64)[torch.randint(0, 300, (num_tokens,))].to(dtype)
    cos_sin = cos_sin if rotate else None
    # this step's slots: the last q_len positions of each sequence
    tables, slots = ctx.block_tables.long(), []
    for b, (context, q_len) in enumerate(BATCHES[batch]):
        slots += [int(tables[b, p // 4]) * 4 + p % 4 for p in range(context - q_len, context)]
    ctx.slot_mapping = torch.tensor(slots)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    q, k = (c_rotary(q_k, cos_sin) if rotate else q_k).split((6, 2), dim=1)
    kernels.store_kv(k, v, want_k, want_v, ctx.slot_mapping)
    want = kernels.c_paged_attention(q, want_k, want_v, scale, ctx)
    qkv = qkv[:, : 10 * 64]  # rows at a stride wider than their heads
    got = kernels.c_paged_attention(qkv, k_cache, v_cache, scale, ctx, fused=True, cos_sin=cos_sin)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.equal(got, want.flatten(1))
    contiguous = (c.contiguous() for c in (want_k, want_v))
    reference = kernels.torch_paged_attention(q, want_k, want_v, scale, ctx)
    assert torch.equal(reference, kernels.torch_paged_attention(q, *contiguous, scale, ctx))


def test_kv_cache_dtype(monkeypatch):
    """fp16 only under --dtype auto with fp32 activations on a CPU whose C kernels have F16C."""
    lib = SimpleNamespace(f16c=True)
    monkeypatch.setattr(kernels, "cpu_kernels", lambda: lib)
    assert kernels.kv_cache_dtype(torch.float32, "cpu", auto=True) == torch.float16
    assert kernels.kv_cache_dtype(torch.float32, "cpu", auto=False) == torch.float32
    assert kernels.kv_cache_dtype(torch.bfloat16, "cpu", auto=True) == torch.bfloat16
    assert kernels.kv_cache_dtype(torch.float32, "cuda", auto=True) == torch.float32
    lib.f16c = False  # the generic build
    assert kernels.kv_cache_dtype(torch.float32, "cpu", auto=True) == torch.float32
    monkeypatch.setattr(kernels, "cpu_kernels", lambda: None)
    assert kernels.kv_cache_dtype(torch.float32, "cpu", auto=True) == torch.float32


@needs_c_kernels
@X_AND_W_DTYPES
@pytest.mark.parametrize(
    "rows,n,k", [(1, 37, 20), (5, 40, 33), (7, 96, 64), (300, 160, 576), (0, 16, 8)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_c_linear_matches_f_linear(rows, n, k, bias, x_dtype, w_dtype):
    """fp32 rows over fp16 weights (--dtype auto) stay within 2e-4 of fp32 on every build: on AMX
    (K a multiple of 32: one row block, and several) x and the weights are split into bf16 halves,
    and a half left out would be ~1e-2 off."""
    if w_dtype == torch.float16 and not kernels.cpu_kernels().f16c:
        pytest.skip("fp16 weights need F16C, which the generic build does not assume")
    weight = (0.1 * torch.randn(n, k)).to(w_dtype)
    b = torch.randn(n).to(x_dtype) if bias else None
    x = torch.randn(rows, k).to(x_dtype)
    with nan_filled_outputs():
        layer = kernels.Linear(weight.to(x_dtype), b, kernels.pack_weight(weight))
        got = kernels.c_linear(x, layer)
    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
    fp16_w = w_dtype == torch.float16
    tolerance = dict(atol=2e-4, rtol=2e-4) if fp16_w else TOLERANCE[x_dtype]
    torch.testing.assert_close(got.float(), want, **tolerance)


@needs_c_kernels
def test_a_c_linear_refuses_rows_of_another_dtype():
    """A Linear works out its C call for its model's dtype when it is built (linear_args): rows of
    another dtype would be read as the wrong type, so they are an error, not wrong numbers."""
    weight = torch.randn(16, 32)
    layer = kernels.Linear(weight, None, kernels.pack_weight(weight, torch.bfloat16))
    assert layer(torch.ones(2, 32)).shape == (2, 16)
    with pytest.raises(AssertionError, match="torch.bfloat16 rows for a linear built for"):
        layer(torch.ones(2, 32, dtype=torch.bfloat16))


def test_packed_weights_sit_in_memory_that_asks_for_huge_pages():
    """pack_weight copies the panels one after another into private mappings that ask Linux for
    transparent huge pages (kernels.weights_memory): THPeligible in /proc/self/smaps, which a
    torch.empty of the same size does not have where the mode is "madvise"."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("no transparent huge pages on this machine")
    weight = torch.randn(40, 31)
    packed = kernels.pack_weight(weight)  # [64, 32] in panels of 16 columns, pairs of k
    unpacked = packed.permute(0, 3, 1, 2).reshape(64, 32)  # [n, k] again, padded with zeros
    assert torch.equal(unpacked, F.pad(weight, (0, 1, 0, 24)))
    smaps = Path("/proc/self/smaps").read_text()  # each mapping: its range, then its fields
    mappings = re.finditer(r"^(\w+)-(\w+) .*\n(?:(?!\w+-\w+ ).*\n)*", smaps, re.M)
    (mapping,) = [m[0] for m in mappings if int(m[1], 16) <= packed.data_ptr() < int(m[2], 16)]
    if "THPeligible" not in mapping:
        pytest.skip("this kernel does not report THPeligible")
    assert re.search(r"THPeligible:\s+1", mapping), mapping


@needs_c_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("shape", [(1, 576), (7, 100), (2, 3, 48), (300, 64), (0, 32)])
def test_c_rms_norm_matches_torch_roundings(shape, with_residual, dtype):
    # rows with a stride
    x = (3 * torch.randn(*shape[:-1], shape[-1] + 5))[..., : shape[-1]].to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1])).to(dtype)
    residual = torch.randn(*shape).to(dtype) if with_residual else None
    expected, got = (
        kernels.torch_rms_norm(x, weight, 1e-6, residual),
        kernels.c_rms_norm(x, weight, 1e-6, residual),
    )
    if with_residual:  # the sum is one rounded addition in both
        assert torch.equal(got[1], expected[1])
        got, expected = got[0], expected[0]
    # Same roundings as the reference; only the fp32 sum's order (and 1 / sqrt against torch's
    # rsqrt) may differ: by 1 bf16 ulp at most, or a few fp32 ulps.
    rtol = 2**-7 if dtype == torch.bfloat16 else 4 * 2**-23
    torch.testing.assert_close(got, expected, atol=0, rtol=rtol)


@needs_c_kernels
@pytest.mark.parametrize("num_tokens", [1, 9, 40])  # 40: split across threads
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(2, 2, 16), (9, 3, 64), (8, 1, 128)])
def test_c_rotary_equals_torch_bit_for_bit(num_tokens, num_heads, num_kv_heads, head_dim):
    qkv = (3 * torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)).bfloat16()
    q_k = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_heads + num_kv_heads, head_dim
    )
    cos_sin = rope_cache(300, head_dim)[torch.randint(0, 300, (num_tokens,))].bfloat16()
    assert torch.equal(c_rotary(q_k, cos_sin), kernels.torch_rotary(q_k, cos_sin))
    # fp32: each output one product rounded and one fused multiply-add, against torch's two
    # rounded products and a rounded sum: within an ulp or two of the larger product.
    q_k, cos_sin = q_k.float(), cos_sin.float()
    torch.testing.assert_close(
        c_rotary(q_k, cos_sin), kernels.torch_rotary(q_k, cos_sin), atol=2e-6, rtol=2e-7
    )


def test_c_kernels_dispatch_and_fallback(monkeypatch, tmp_path):
    """CPU tensors take the C kernel when it built (RMSNorm: x and weight of one dtype); with no
    compiler (or the switch off) the torch path runs, after a warning that names the file; linears
    are then not packed."""
    x, weight = torch.randn(3, 32).bfloat16(), torch.ones(32).bfloat16()
    if kernels.cpu_kernels() is not None:
        with mock.patch.object(
            kernels, "torch_rms_norm", side_effect=AssertionError("took the torch path")
        ):
            kernels.rms_norm(x, weight, 1e-6)
        assert kernels.use_linears(torch.nn.Sequential(torch.nn.Linear(4, 4)))[0].packed is not None
    with mock.patch.object(kernels, "c_rms_norm", side_effect=AssertionError("took the C path")):
        kernels.rms_norm(x.float(), weight, 1e-6)  # mixed dtypes: the torch reference
    rebuild_cpu_kernels(monkeypatch)
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.warns(UserWarning, match="cpu_kernels.c"):
        assert kernels.cpu_kernels() is None
    assert torch.equal(kernels.rms_norm(x, weight, 1e-6), kernels.torch_rms_norm(x, weight, 1e-6))
    assert kernels.use_linears(torch.nn.Sequential(torch.nn.Linear(4, 4)))[0].packed is None
    rebuild_cpu_kernels(monkeypatch)
    monkeypatch.setenv("NANOSPEC_CPU_KERNELS", "0")
    assert kernels.cpu_kernels() is None


@pytest.mark.parametrize("isa", list(kernels.ISA_NEEDS))
def test_every_isa_build_compiles_wherever_there_is_a_compiler(isa, tmp_path):
    """The C tests skip where cpu_kernels.c did not build (a machine without a compiler), so a
    source that does not compile would pass the suite on the torch path. Wherever the compiler
    builds a two-line OpenMP file with an ISA's flags, cpu_kernels.c must build with them too,
    for the ISAs this CPU cannot run as well: the AMX code is only compiled in the amx build (at
    -O0: a second each, not twenty). This CPU's own build must also load."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        pytest.skip("no C compiler")
    probe = tmp_path / "probe.c"
    probe.write_text("#include <omp.h>\nint threads(void) { return omp_get_max_threads(); }\n")
    # kernels' own command, compiling an object file at -O0
    *command, source = kernels.build_command(isa, Path(kernels.__file__).with_name("cpu_kernels.c"))
    command = [{"-O3": "-O0", "-shared": "-c"}.get(a, a) for a in command]
    command += ["-o", str(tmp_path / "k.o")]
    if subprocess.run(command + [str(probe)], capture_output=True).returncode:
        pytest.skip(f"{compiler} cannot build OpenMP code with the {isa} build's flags")
    built = subprocess.run(command + [source], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    if isa == kernels.cpu_isa():
        assert kernels.cpu_kernels() is not None


@pytest.mark.parametrize(
    "vendor, isa, ahead, reads_fp16",
    [
        ("AuthenticAMD", "avx2", 32, 1),
        ("GenuineIntel", "avx2", 64, 0),
        ("AuthenticAMD", "avx512", 64, 0),
        ("GenuineIntel", "amx", 64, 0),
        ("", "generic", 32, 0),
    ],
)
def test_the_build_flags_follow_the_cpu(monkeypatch, vendor, isa, ahead, reads_fp16):
    """How far ahead the linears prefetch (cpu_kernels.c's AHEAD, in pairs of k) is a flag of the
    build command: on AVX2 a Zen 3 measured fastest 32 pairs ahead and Intel's cores 64, a Zen 5
    64 on AVX-512 (sessions 38, 51, 56). So is whether prefill reads fp16 weights where they are
    packed (PREFILL_READS_FP16: AMD's AVX2 cores, whose conversion takes no FMA pipe; session
    58). The cache key hashes the command, so each gets a library of its own."""
    monkeypatch.setattr(kernels, "cpu_info", lambda field: vendor if field == "vendor_id" else "")
    command = kernels.build_command(isa, Path("cpu_kernels.c"))
    defines = [flag for flag in command if flag.startswith("-D")]
    assert defines == [f"-DAHEAD={ahead}", f"-DPREFILL_READS_FP16={reads_fp16}"]


def test_isa_override_builds_its_own_library(monkeypatch, tmp_path):
    """NANOSPEC_ISA makes any machine behave like a smaller one; each ISA's build is cached
    apart, so a cache shared between machines never loads a library built for another CPU."""
    monkeypatch.setenv("NANOSPEC_ISA", "pentium")
    with pytest.raises(ValueError, match="NANOSPEC_ISA"):
        kernels.cpu_isa()
    if kernels.cpu_kernels() is None:
        pytest.skip("cpu_kernels.c did not build here (no C compiler?)")
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", quick_compiler(tmp_path))
    for isa in ("generic", "avx2"):
        monkeypatch.setenv("NANOSPEC_ISA", isa)
        rebuild_cpu_kernels(monkeypatch)
        if kernels.cpu_kernels() is None:
            continue
        assert kernels.cpu_isa() == isa and len(list(tmp_path.glob(f"cpu_kernels-{isa}-*.so"))) == 1


def test_two_threads_building_one_library_both_load_it(monkeypatch, tmp_path):
    """tests/conftest.py builds two ISAs at a time, and a build that falls back to the one below
    (amx without Linux's tile state) can build the same library as the other thread, at once:
    each writes a file of its own before the rename, and both load the build. (With one file a
    process, both compilers wrote the same file and the second rename found none: that thread
    warned and went without its build.)"""
    if kernels.cpu_kernels() is None:
        pytest.skip("cpu_kernels.c did not build here (no C compiler?)")
    # done a second before it exits: both builds have written their file by the time either
    # renames it
    monkeypatch.setenv("CC", quick_compiler(tmp_path, linger=1))
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path))
    build = kernels.cpu_kernels.__wrapped__
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a failed build warns: here it fails
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            libs = list(pool.map(build, [kernels.cpu_isa()] * 2))
    assert all(lib is not None and lib.isa == kernels.cpu_isa() for lib in libs)
    assert len(list(tmp_path.glob("cpu_kernels-*.so"))) == 1 and not list(tmp_path.glob("*.tmp"))


def test_amx_refused_by_linux_runs_the_avx512bf16_build(monkeypatch, tmp_path):
    """Where Linux gives no AMX tile state (kernels.amx_permitted: kernels before 5.16), the amx
    build would die at its first tile instruction: cpu_kernels() warns and builds the one below,
    AVX512-BF16's (every AMX Xeon has it), and the run's summary names it."""
    monkeypatch.setenv("CC", quick_compiler(tmp_path))  # (which build loads, not its code)
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("NANOSPEC_ISA", "amx")
    monkeypatch.setattr(kernels, "amx_permitted", lambda: False)
    rebuild_cpu_kernels(monkeypatch)
    with pytest.warns(UserWarning, match="AMX"):
        lib = kernels.cpu_kernels()
    if lib is None:
        pytest.skip("cpu_kernels.c did not build here (no C compiler?)")
    assert lib.isa == "avx512bf16"
    assert "C kernels (avx512bf16)" in kernels.kernels_summary("cpu")


def test_a_compiler_without_avx512_bf16_builds_avx512(monkeypatch, tmp_path):
    """GCC before 9 (RHEL 8's, Amazon Linux 2's) has no -mavx512bf16: cpu_kernels() warns and
    builds avx512, which runs everything but --dtype bfloat16's dot product, rather than leave a
    Zen 4 on the torch path."""
    if kernels.cpu_kernels() is None:
        pytest.skip("cpu_kernels.c did not build here (no C compiler?)")
    monkeypatch.setenv("CC", quick_compiler(tmp_path, refuse="avx512bf16"))
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("NANOSPEC_ISA", "avx512bf16")
    rebuild_cpu_kernels(monkeypatch)
    with pytest.warns(UserWarning, match="no avx512bf16 build"):
        assert kernels.cpu_kernels().isa == "avx512"
    assert "C kernels (avx512)" in kernels.kernels_summary("cpu")


def test_auto_dtype_follows_the_hardware(monkeypatch):
    """--dtype auto: with the C kernels, fp32 activations on every CPU (weights packed fp16,
    use_linears), AMX's included; without them, bf16 where torch has bf16 instructions, fp32 on a
    CPU with neither (torch's bf16 matmul is slow there); a GPU keeps a 16-bit checkpoint's
    dtype."""
    assert kernels.auto_dtype(torch.float16, "cuda") == torch.float16
    assert kernels.auto_dtype(torch.float32, "cuda") == torch.bfloat16
    monkeypatch.setattr(kernels, "cpu_kernels", lambda: SimpleNamespace(isa="amx"))  # C kernels
    assert kernels.auto_dtype(torch.float32, "cpu") == torch.float32
    monkeypatch.setattr(kernels, "cpu_kernels", lambda: None)  # no C kernels
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "fma", "avx512_bf16"})
    assert kernels.auto_dtype(torch.float32, "cpu") == torch.bfloat16
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "fma"})
    assert kernels.auto_dtype(torch.float32, "cpu") == torch.float32
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "fma", "avx512_bf16"})
    monkeypatch.setenv("NANOSPEC_ISA", "avx2")  # behaving like a smaller CPU: no bf16 instructions
    assert kernels.auto_dtype(torch.float32, "cpu") == torch.float32


def test_rms_norm_on_empty_batch():
    assert kernels.triton_rms_norm(randn(0, 32), randn(32), 1e-6).shape == (0, 32)
