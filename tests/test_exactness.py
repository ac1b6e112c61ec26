# Row invariance, op by op: a row (or a query) computed in a call of any size gives the same bits,
# for every implementation this machine can run (the C kernels for each ISA it can execute, the
# torch references, Triton on CUDA where there is a GPU, else in the interpreter at fp32/fp16; the C
# and torch ones on CPU tensors, Triton's on DEVICE). This is what makes speculative output
# equal plain decoding's bit for bit (DESIGN.md, "Exactness"); tests/test_engine.py checks it end to
# end.
import contextlib
import ctypes
import dataclasses
import functools
from unittest import mock

import pytest
import torch
from conftest import split_fma_chains
from test_kernels import DEVICE, X_AND_W_DTYPES, c_rotary, make_paged_batch, rebuild_cpu_kernels

import kernels

# (AVX-512: one block up to 16, 17 = 8 + 9, 24 = 12 + 12 the most rows not taken as prefill;
# AVX2 reads x in place in blocks of up to 5 rows, interleaved where a block has 6: 6 rows as one
# block, 7 as 3 + 4; cpu_kernels.c, INTERLEAVED)
ROW_COUNTS = [1, 2, 3, 5, 6, 7, 9, 13, 16, 17, 24, 33, 300]
ISAS = ["amx", "avx512bf16", "avx512", "avx2", "generic"]


@pytest.fixture(params=ISAS)
def c_isa(request, monkeypatch):
    """The C kernels built for one ISA (skipped where this CPU cannot run it, or nothing builds)."""
    have = kernels.cpu_isa()
    if ISAS.index(request.param) < ISAS.index(have):
        pytest.skip(f"this CPU runs {have}, not {request.param}")
    rebuild_cpu_kernels(monkeypatch, request.param)
    if kernels.cpu_kernels() is None:
        pytest.skip("cpu_kernels.c did not build here (no C compiler?)")
    yield request.param  # then monkeypatch restores the build for this CPU


def assert_rows_invariant(op, x: torch.Tensor, counts=ROW_COUNTS):
    """op(x[:m]) must hold op(x)'s first m rows bit for bit, for every m."""
    full = op(x[: max(counts)])
    for m in counts:
        part = op(x[:m].clone())
        assert torch.equal(part, full[:m]), f"rows differ when the call has {m} rows"


@X_AND_W_DTYPES
@pytest.mark.parametrize("n,k", [(576, 576), (96, 1536), (37, 21), (40, 64), (24, 100)])
def test_c_linear_rows_are_invariant(c_isa, n, k, x_dtype, w_dtype):
    """Every M walks the same chain: decode's 1 row, verify's few (one pass over the weights, x
    read in place on AVX2 but where a block has 6 rows; from 7 rows, 17 on AVX-512 (8 + 9), row
    blocks that take turns a chunk of k at a time, K=576 ending in a short chunk), prefill's many
    (each panel of 16-bit weights widened once; on AMX, tiles of up to 16 rows over weights split
    into bf16 halves)."""
    if w_dtype == torch.float16 and c_isa == "generic":
        pytest.skip("fp16 weights need F16C, which the generic build does not assume")
    weight, bias = (0.05 * torch.randn(n, k)).to(w_dtype), torch.randn(n).to(x_dtype)
    layer = kernels.Linear(weight.to(x_dtype), bias, kernels.pack_weight(weight))
    assert_rows_invariant(lambda x: kernels.c_linear(x, layer), torch.randn(300, k).to(x_dtype))


@pytest.mark.parametrize("c_isa", ["avx2"], indirect=True)
@pytest.mark.parametrize("n,k", [(96, 1536), (40, 64), (24, 100)])
def test_both_avx2_builds_read_prefill_fp16_weights_to_the_same_bits(c_isa, monkeypatch, n, k):
    """AMD's avx2 build reads prefill's fp16 weights where they are packed (PREFILL_READS_FP16),
    from 10 rows; Intel's widens each panel into an fp32 copy first, from 19 rows (10-18 rows go
    as a verify step's blocks, chunk by chunk): the same chain either way. Each build keeps its
    rows invariant, and the two give every row the same bits, on either vendor's CPU."""
    weight, bias, x = 0.05 * torch.randn(n, k), torch.randn(n), torch.randn(300, k)
    info, outputs = kernels.cpu_info, []
    for vendor in ("AuthenticAMD", "GenuineIntel"):
        monkeypatch.setattr(
            kernels, "cpu_info", lambda f, v=vendor: v if f == "vendor_id" else info(f)
        )
        rebuild_cpu_kernels(monkeypatch, "avx2")
        if kernels.cpu_kernels() is None:
            pytest.skip("cpu_kernels.c did not build here (no C compiler?)")
        layer = kernels.Linear(weight, bias, kernels.pack_weight(weight, torch.float16))
        # (and each side of both vendors' thresholds: 9 and 10 rows, 18 and 19)
        counts = sorted(ROW_COUNTS + [10, 12, 18, 19])
        assert_rows_invariant(functools.partial(kernels.c_linear, layer=layer), x, counts)
        outputs.append(kernels.c_linear(x, layer))
    assert torch.equal(*outputs)


@pytest.mark.parametrize("w_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_c_linear_outputs_do_not_depend_on_the_thread_count(c_isa, w_dtype):
    """Each thread owns a run of panels (a prefill's in whole tiles: two panels side by side on
    AVX-512), so the thread count, and which thread computes an output, never change its value:
    decode (1 row), verify (9) and prefill (300), over 36 panels and over 3 (padded to 4)."""
    if w_dtype == torch.float16 and c_isa == "generic":
        pytest.skip("fp16 weights need F16C, which the generic build does not assume")
    threads = torch.get_num_threads()
    for n, k in [(576, 576), (40, 64)]:
        weight = (0.05 * torch.randn(n, k)).to(w_dtype)
        layer = kernels.Linear(weight.float(), torch.randn(n), kernels.pack_weight(weight))
        x, outputs = torch.randn(300, k), {}
        try:
            for count in (1, 2, 3, 5):
                torch.set_num_threads(count)
                outputs[count] = [kernels.c_linear(x[:m], layer) for m in (1, 9, 300)]
        finally:
            torch.set_num_threads(threads)
        for count, ys in outputs.items():  # each against one thread's
            for y, expected in zip(ys, outputs[1]):
                assert torch.equal(y, expected), f"N={n}, {count} threads: {len(y)} rows differ"


def test_c_linear_rows_stay_invariant_under_a_compiler_that_splits_fma_chains(monkeypatch):
    """GCC 13's default tuning compiles some FMA chains as a multiply and an add; built that way,
    the AVX-512 linear's 1-row tiles summed differently from its other tiles (kernels.build_command
    turns it off). Here the compiler is told to split chains of up to 512 bits ahead of
    build_command's own flags, which must win: the rows stay the same bits at every M. (Without
    build_command's `avoid-fma-max-bits=0`, the AVX-512 builds' rows differ at M=1; the avx2
    build's do not.) The library's cache key hashes its command, so it never stands in for the
    real build."""
    monkeypatch.setattr(kernels, "build_command", split_fma_chains(kernels.build_command))
    rebuild_cpu_kernels(monkeypatch)
    if kernels.cpu_kernels() is None:
        pytest.skip("cpu_kernels.c did not build here (no C compiler?)")
    for w_dtype in (torch.float32, torch.bfloat16):
        weight = (0.05 * torch.randn(96, 576)).to(w_dtype)
        layer = kernels.Linear(weight.float(), None, kernels.pack_weight(weight))
        assert_rows_invariant(
            lambda x, layer=layer: kernels.c_linear(x, layer), torch.randn(300, 576)
        )


@X_AND_W_DTYPES
# the default model's K; one that ends in a short chunk (88 pairs of k: 64 + 24)
@pytest.mark.parametrize("k", [1536, 176])
def test_the_gated_c_linear_rows_are_invariant(c_isa, k, x_dtype, w_dtype):
    """The MLP's down projection gates its own rows (silu(gate) * up as the kernel copies them) at
    every M, prefill's included: one formula for a row however many the call has (N=40: a partial
    last panel). It is torch's silu_mul within an ulp or two (bf16 rows rounded where torch rounds
    them), so the outputs are close to the ops it replaces."""
    if w_dtype == torch.float16 and c_isa == "generic":
        pytest.skip("fp16 weights need F16C, which the generic build does not assume")
    torch.manual_seed(0)  # (bf16's tolerance: an ulp of silu's output apart, now and then)
    weight, bias = (0.05 * torch.randn(40, k)).to(w_dtype), torch.randn(40).to(x_dtype)
    layer, x = (
        kernels.Linear(weight.to(x_dtype), bias, kernels.pack_weight(weight)),
        (3 * torch.randn(300, 2 * k)).to(x_dtype),
    )
    assert_rows_invariant(lambda x: kernels.silu_mul_linear(x, layer), x)
    expected = kernels.c_linear(kernels.silu_mul(x), layer)
    got = kernels.silu_mul_linear(x, layer)
    close = dict(atol=1e-4, rtol=1e-5) if x_dtype == torch.float32 else dict(atol=0.25, rtol=2e-2)
    torch.testing.assert_close(got, expected.to(got.dtype), **close)


@X_AND_W_DTYPES
def test_a_norm_handed_to_the_c_linear_is_the_norm_then_the_linear(c_isa, x_dtype, w_dtype):
    """rms_norm_linear hands the C linear the RMSNorm before it (one call: the norm in place, then
    the tiles). The same kernels, so the same bits as rms_norm and then the linear, for the output
    and the residual stream alike, at every M. Where torch widens the rows first (bf16 rows on an
    FMA build) it makes the two calls itself."""
    if w_dtype == torch.float16 and c_isa == "generic":
        pytest.skip("fp16 weights need F16C, which the generic build does not assume")
    from models.llama import RMSNorm

    torch.manual_seed(0)
    weight = (0.05 * torch.randn(40, 576)).to(w_dtype)
    layer = kernels.Linear(weight.to(x_dtype), None, kernels.pack_weight(weight))
    norm = RMSNorm(576, 1e-5).to(x_dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(576)).to(x_dtype)
    fused = not any(layer.c_args[2:4])
    for m in (1, 9, 300):
        x, residual = torch.randn(m, 576).to(x_dtype), torch.randn(m, 576).to(x_dtype)
        normed, summed = norm(x.clone(), residual.clone())
        want = layer(normed)
        no_norm_call = mock.patch.object(kernels, "c_rms_norm", side_effect=AssertionError)
        with no_norm_call if fused else contextlib.nullcontext():
            got, got_residual = kernels.rms_norm_linear(x, residual, norm, layer)
        assert torch.equal(got, want) and torch.equal(got_residual, summed)
    assert fused or x_dtype == torch.bfloat16  # (fp32 rows always go in one call)


def test_the_bf16_dot_product_is_its_documented_chain(monkeypatch):
    """The avx512bf16 build takes bf16 rows over bf16 weights through AVX512-BF16's dot product:
    per pair of k, acc + x[k+1] w[k+1], then + x[k] w[k], each add rounded to fp32 (a product of
    two bf16 is exact), and a denormal input counts as zero. So c_linear must route bf16 rows
    there: the FMA path (the avx512 build) keeps a denormal's product."""
    if "avx512_bf16" not in kernels.cpu_flags():
        pytest.skip("this CPU has no AVX512-BF16")
    rebuild_cpu_kernels(monkeypatch, "avx512bf16")
    if kernels.cpu_kernels() is None:
        pytest.skip("cpu_kernels.c did not build here (no C compiler?)")
    x, weight = torch.randn(5, 256).bfloat16(), (0.1 * torch.randn(32, 256)).bfloat16()
    packed, y = kernels.pack_weight(weight), torch.empty(5, 32)  # y in fp32: the chain's own bits
    call = (x.data_ptr(), y.data_ptr(), 5, kernels.cpu_scratch(1).data_ptr(), 2)
    own = (ctypes.c_int64 * 8)(packed.data_ptr(), 0, 32, 256, 1, 0, 1, 0)  # w, bias, N, K, ...
    kernels.cpu_kernels().linear(*call, own, 0, None, None, 0.0)
    want, xf, wf = torch.zeros(5, 32), x.float(), weight.float()
    for k in range(0, 256, 2):
        want = (want + xf[:, k + 1, None] * wf[:, k + 1]) + xf[:, k, None] * wf[:, k]
    assert torch.equal(y, want)
    x, weight = torch.zeros(1, 2).bfloat16(), torch.zeros(16, 2).bfloat16()
    x[0, 0], weight[:, 0] = 1e-39, 1e30  # a bf16 denormal, and a product of 1e-9
    layer = kernels.Linear(weight, None, kernels.pack_weight(weight))
    assert kernels.c_linear(x, layer).abs().max() == 0
    monkeypatch.setenv("NANOSPEC_ISA", "avx512")
    kernels.cpu_kernels.cache_clear()  # (a Linear runs on the build it was packed for)
    layer = kernels.Linear(weight, None, kernels.pack_weight(weight))
    assert kernels.c_linear(x, layer).float().min() > 9e-10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_linear_rows_are_invariant(dtype):
    weight, bias = (0.05 * torch.randn(160, 576)).to(dtype), torch.randn(160).to(dtype)
    assert_rows_invariant(
        lambda x: kernels.torch_linear(x, weight, bias),
        torch.randn(300, 576).to(dtype),
        counts=[1, 2, 5, 9, 33],
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_linear_rows_are_invariant(dtype):
    """Bitwise in the interpreter too: its tl.dot is numpy's BLAS on the whole fixed-shape tile,
    which catches a K order that changes with M (BLOCK_K or a split chosen by M). It misses a
    BLOCK_M chosen by M (numpy's rows do not depend on the tile's height; MMA instructions may),
    so the launches the wrapper makes for every M are also checked to be one and the same."""
    weight = (0.05 * torch.randn(160, 576, device=DEVICE)).to(dtype)
    bias, x = torch.randn(160, device=DEVICE).to(dtype), torch.randn(300, 576, device=DEVICE)
    assert_rows_invariant(lambda x: kernels.triton_linear(x, weight, bias), x.to(dtype))
    launches = []
    record = lambda kernel, grid, args, num_warps, **c: launches.append(
        dict(c, num_warps=num_warps)
    )
    with mock.patch.object(kernels, "_launch", record):
        for m in ROW_COUNTS:
            kernels.triton_linear(
                torch.empty(m, 576, dtype=dtype, device="meta"), weight.to("meta")
            )
    assert all(options == launches[0] for options in launches)


def test_plain_f_linear_is_not_row_invariant():
    """Why the linears need their own kernels: BLAS changes its summation order with the row count.
    (If this ever fails, torch became row-invariant and the test can go; the others still hold.)"""
    weight, x = 0.05 * torch.randn(1536, 576), torch.randn(9, 576)
    full = torch.nn.functional.linear(x, weight)
    assert any(
        not torch.equal(torch.nn.functional.linear(x[:m], weight), full[:m]) for m in (1, 2, 4)
    )


def test_use_linears_packs_a_shared_weight_once():
    model = torch.nn.Sequential(torch.nn.Linear(40, 24), torch.nn.Linear(40, 24, bias=False))
    model[1].weight = model[0].weight  # tied, like an lm_head and its embedding
    weight, bias, x = (
        model[0].weight.detach().clone(),
        model[0].bias.detach().clone(),
        torch.randn(5, 40),
    )
    kernels.use_linears(model)
    if kernels.cpu_kernels() is not None:
        assert model[0].packed is model[1].packed and model[0].weight is None
    torch.testing.assert_close(model[0](x), torch.nn.functional.linear(x, weight, bias))
    torch.testing.assert_close(model[1](x), torch.nn.functional.linear(x, weight))


# A query at a given position: decoded alone, verified among 5, in a prefill chunk of 20, in a whole
# prompt. Sequence 0 is always the one whose last query sits at position `context` - 1 (44; and
# 1100, past two of the C kernel's segments of keys, ATTENTION_SEGMENT).
def attention_steps(context):
    return {
        "decode": [(context, 1)],
        "verify": [(context, 5), (30, 5)],
        "chunk": [(context, 20), (12, 1)],
        "prompt": [(context, context), (60, 3), (8, 8)],
    }


def attention_of_position(fn, dtype, block_size, context=45, device="cpu"):
    """The output row of the query at position context - 1 of one fixed sequence, in each kind of
    step (on `device`: DEVICE for Triton, the CPU for the C kernels and the torch reference)."""
    torch.manual_seed(7)  # the same cache, tables and query rows in every step
    seqs = [(context, context), (60, 60), (30, 30), (12, 12), (8, 8)]
    base = make_paged_batch(seqs, block_size, 6, 2, 16, dtype, device)
    q_all, k_cache, v_cache, _, base_ctx = base
    block_tables = base_ctx.block_tables
    rows = {}
    for name, seqs in attention_steps(context).items():
        index = {"decode": [0], "verify": [0, 2], "chunk": [0, 3], "prompt": [0, 1, 4]}[name]
        q_lens = torch.tensor([q_len for _, q_len in seqs], device=device)
        seq_lens = torch.tensor([context for context, _ in seqs], device=device)
        starts = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0))
        # query j of step sequence b is the query row its position has in the whole-prompt layout
        offsets = [0, context, context + 60, context + 90, context + 102]
        q = torch.cat(
            [
                q_all[offsets[s] + context - q_len : offsets[s] + context]
                for s, (context, q_len) in zip(index, seqs)
            ]
        )
        ctx = kernels.AttentionContext(
            None, block_tables[index], seq_lens, starts, int(q_lens.max())
        )
        out = fn(q, k_cache, v_cache, 0.25, ctx)
        rows[name] = out[int(starts[1]) - 1]  # the last query of the first sequence: position 44
    return rows


def check_attention(fn, dtype, block_size, context=45, device="cpu"):
    rows = attention_of_position(fn, dtype, block_size, context, device)
    for name, row in rows.items():
        assert torch.equal(row, rows["decode"]), f"the query differs between decode and {name}"


def c_attention_fp16_cache(q, k_cache, v_cache, scale, ctx):
    """The C kernel over the caches rounded to fp16: --dtype auto's KV cache on AVX2."""
    return kernels.c_paged_attention(q, k_cache.half(), v_cache.half(), scale, ctx)


@pytest.mark.parametrize(
    "dtype,fn",
    [
        (torch.float32, kernels.c_paged_attention),
        (torch.bfloat16, kernels.c_paged_attention),
        (torch.float32, c_attention_fp16_cache),
    ],
    ids=["fp32", "bf16", "fp32-fp16-cache"],
)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("context", [45, 1101])
def test_c_attention_query_is_invariant(c_isa, dtype, fn, block_size, context):
    """Also across thread counts: the kernel splits a few queries into smaller blocks for more
    threads, and sums each segment of keys apart (a decode step's segments in items of their
    own)."""
    if fn is c_attention_fp16_cache and c_isa == "generic":
        pytest.skip("fp16 caches need F16C (the generic build has none)")
    threads = torch.get_num_threads()
    try:
        rows = []
        for n in (1, 2, 8):
            torch.set_num_threads(n)
            check_attention(fn, dtype, block_size, context)
            rows.append(attention_of_position(fn, dtype, block_size, context)["verify"])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(row, rows[0]) for row in rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_attention_query_is_invariant(dtype):
    check_attention(kernels.torch_paged_attention, dtype, 4)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="the interpreter's tl.dot is numpy's BLAS, whose "
    "result for a tile row depends on the row's place in the tile (GPU mma rows do not)",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_attention_query_is_invariant(dtype):
    check_attention(kernels.triton_paged_attention, dtype, 4, device=DEVICE)


@pytest.mark.parametrize("impl", ["c", "torch", "triton"])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_norm_rotary_silu_rows_are_invariant(impl, dtype):
    if impl == "c" and (dtype == torch.float16 or kernels.cpu_kernels() is None):
        pytest.skip("the C RMSNorm and rotary are fp32 and bf16 kernels")
    if impl == "triton" and dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("the Triton interpreter mishandles bfloat16 (CUDA only)")
    if impl == "torch" and dtype == torch.float16:
        pytest.skip("no fp16 CPU model path")
    ops = {name: getattr(kernels, f"{impl}_{name}", None) for name in ("rms_norm", "rotary")}
    if impl == "c":  # (the C rotary runs inside the attention call: read back from its cache)
        ops["rotary"] = c_rotary
    ops["silu_mul"] = kernels.silu_mul if impl == "torch" else None  # the one implementation
    device = DEVICE if impl == "triton" else "cpu"
    x = torch.randn(300, 96, device=device).to(dtype)
    weight = (1 + 0.1 * torch.randn(96, device=device)).to(dtype)
    counts = ROW_COUNTS if impl != "triton" else [1, 2, 5, 9, 33]  # the interpreter is slow
    assert_rows_invariant(lambda rows: ops["rms_norm"](rows, weight, 1e-6), x, counts)
    assert_rows_invariant(  # (fresh tensors: with a residual, the C kernel writes in place)
        lambda rows: ops["rms_norm"](rows.clone(), weight, 1e-6, rows.flip(1))[0], x, counts
    )
    cos_sin = torch.randn(300, 16, device=device).to(dtype)
    if ops["rotary"] is not None:  # (Triton's is fused with the KV store; C has no silu_mul)
        assert_rows_invariant(
            lambda rows: ops["rotary"](rows.view(-1, 6, 16), cos_sin[: len(rows)]), x, counts
        )
    if ops["silu_mul"] is not None:
        assert_rows_invariant(ops["silu_mul"], x, counts)


# Tree verification: a draft node's query sees the cache and its ancestors, and must give the bits
# plain decoding of its path gives. Sequence 0: 30 cached positions, its last token at 30 and a
# 6-node tree in positions 31..36; sequence 1 beside it is an ordinary 3-query chunk.
TREE_PARENTS = [-1, 0, 0, -1, 2, 4]  # depths 1, 2, 2, 1, 3, 4


def tree_step(block_size, dtype, device="cpu"):
    from nanospec import tree_layout

    torch.manual_seed(3)
    seqs = [(37, 7), (12, 3)]
    q, k_cache, v_cache, _, ctx = make_paged_batch(seqs, block_size, 6, 2, 16, dtype, device)
    seq_lens = torch.tensor([37, 12], device=device)
    starts = torch.tensor([0, 7, 10], device=device)
    positions, keys, paths = tree_layout(
        [(None, [0] * 7, 30), (None, [0] * 3, 9)], [TREE_PARENTS, []]
    )
    positions, keys = positions.to(device), keys.to(device)
    chain = kernels.AttentionContext(None, ctx.block_tables, seq_lens, starts, 7)
    tree = dataclasses.replace(chain, tree_pos=positions, tree_keys=keys)
    return (q, k_cache, v_cache, 0.25), chain, tree, paths


def chain_reference(fn, args, ctx, paths):
    """Each tree query decoded alone, its path's K/V copied into the positions after the root;
    then the ordinary sequence alone."""
    q, k_cache, v_cache, _ = args
    block_tables = ctx.block_tables
    block_size, rows = k_cache.shape[1], {}
    for t, path in paths.items():
        k, v = k_cache.clone(), v_cache.clone()
        slot = lambda p: int(block_tables[0, p // block_size]) * block_size + p % block_size
        for depth, p in enumerate(path):
            for chain, cache in ((k, k_cache), (v, v_cache)):
                chain.flatten(0, 1)[slot(30 + depth)] = cache.flatten(0, 1)[slot(p)]
        rows[t] = alone(fn, q[t : t + 1], k, v, block_tables[:1], 30 + len(path))[0]
    rows[0] = alone(fn, q[:1], k_cache, v_cache, block_tables[:1], 31)[0]
    return rows, alone(fn, q[7:], k_cache, v_cache, block_tables[1:], 12)


def alone(fn, q, k_cache, v_cache, block_table, context):
    """One sequence's len(q) last queries, an ordinary step."""
    seq_lens = torch.tensor([context], device=q.device)
    starts = torch.tensor([0, len(q)], device=q.device)
    ctx = kernels.AttentionContext(None, block_table, seq_lens, starts, len(q))
    return fn(q, k_cache, v_cache, 0.25, ctx)


def check_tree_attention(fn, dtype, block_size, device="cpu"):
    args, chain, tree, paths = tree_step(block_size, dtype, device)
    out = fn(*args, tree)
    rows, ordinary = chain_reference(fn, args, chain, paths)
    for t, row in rows.items():
        assert torch.equal(out[t], row), f"tree query {t} differs from its path decoded as a chain"
    assert torch.equal(out[7:], ordinary), "an ordinary query beside a tree changed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_c_tree_attention_equals_chain(c_isa, dtype, block_size):
    check_tree_attention(kernels.c_paged_attention, dtype, block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_tree_attention_equals_chain(dtype):
    check_tree_attention(kernels.torch_paged_attention, dtype, 4)


@pytest.mark.parametrize("block_size", [1, 16])
def test_triton_tree_attention_matches_torch(block_size):
    args, _, tree, _ = tree_step(block_size, torch.float32, DEVICE)
    want = kernels.torch_paged_attention(*args, tree)
    torch.testing.assert_close(
        kernels.triton_paged_attention(*args, tree), want, atol=1e-5, rtol=1e-5
    )
    # GPU mma rows are row-invariant: the C and torch tests' bitwise check
    if torch.cuda.is_available():
        check_tree_attention(kernels.triton_paged_attention, torch.float32, block_size, DEVICE)
