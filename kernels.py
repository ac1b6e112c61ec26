# The hot ops of every forward: linear, paged KV store, varlen paged attention, RMSNorm, rotary,
# SiLU-and-mul. Each has a torch reference (`torch_*`), a Triton kernel (`triton_*`) for GPUs unless
# elementwise or a copy (rotary and the KV store have one together: a launch, not a dozen ops),
# and C kernels (`c_*`, cpu_kernels.c) for CPUs where they pay; `pick` chooses by one rule, never
# Triton for a CPU tensor unless forced (tests). No row's result depends on the rest of the call
# (DESIGN.md, "Exactness").
import ctypes
import functools
import hashlib
import mmap
import os
import subprocess
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

# Tests set this (or NANOSPEC_TRITON=1) to run the Triton kernels on CPU under TRITON_INTERPRET=1.
FORCE_TRITON = os.environ.get("NANOSPEC_TRITON") == "1"


# ---------------------------------------------------------------------------------------------
# Per-step attention metadata. The engine sets `context` around each forward; every attention layer
# reads it, so nothing has to be threaded through the model's call signatures.
@dataclass(slots=True)
class AttentionContext:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] block ids per sequence (-1 padded)
    seq_lens: torch.Tensor  # [B] context length including this step's tokens
    query_start_loc: torch.Tensor  # [B+1] cu_seqlens of the packed queries
    max_q_len: int  # on the host, so no op needs a device->host sync
    # Tree verification (None otherwise). Token t attends to logical positions 0..tree_pos[t]; the
    # last W of them are its root-to-node path, read from physical positions tree_keys[t] ([T, W];
    # others read their own position). So a node's keys sit in the reduction order exactly where
    # plain decoding of its path has them, and its bits equal plain decoding's (DESIGN.md,
    # "Exactness").
    tree_pos: torch.Tensor | None = None
    tree_keys: torch.Tensor | None = None
    # On a CPU: cpu_kernels.c's attention arguments that every layer of the step shares, worked
    # out by its first layer's call (c_paged_attention)
    c_args: tuple | None = None


context: AttentionContext | None = None


# ---------------------------------------------------------------------------------------------
# The CPU: which instruction set the C kernels are built for, and the build itself. cpu_kernels.c is
# compiled on first use with the system's C compiler into the cache dir and called through ctypes.
# Without a compiler, or with NANOSPEC_CPU_KERNELS=0, the torch references run instead. The
# /proc/cpuinfo flags each build needs, widest first; each is also its compiler flag (amx_tile:
# -mamx-tile). amx (Intel Xeons since Sapphire Rapids) runs the linear layers on AMX's tiles, 16x
# the multiply-adds a cycle of AVX-512 FMAs (cpu_kernels.c, "Intel AMX"). avx512bf16 (Zen 4-5,
# Cooper Lake) adds AVX512-BF16's dot product, for bf16 rows over bf16 weights (--dtype bfloat16):
# a pair of k a lane in one instruction, twice the FMA path's multiply-adds (M=256 2.0x, 1.1x
# oneDNN's bf16 GEMM on a Zen 4, BENCHMARKS.md, session 25; 1.04x on a Zen 5 with prefill tiles
# of two panels, session 48). --dtype auto keeps fp32 activations over fp16 weights there, as on
# every CPU: split into bf16 halves they would take 3 dot products where the FMA path takes 2
# FMAs (session 21).
ISA_NEEDS = {
    "amx": ["amx_tile", "amx_bf16", "avx512f", "avx2", "fma", "f16c"],
    "avx512bf16": ["avx512_bf16", "avx512f", "avx2", "fma", "f16c"],
    "avx512": ["avx512f", "avx2", "fma", "f16c"],
    "avx2": ["avx2", "fma", "f16c"],
    "generic": [],
}


def cpu_isa() -> str:
    """The widest ISA this CPU runs, or NANOSPEC_ISA (amx, avx512bf16, avx512, avx2, generic): a big
    CPU can behave like a small one (set ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA and
    MKL_ENABLE_INSTRUCTIONS too, for torch's own kernels)."""
    forced = os.environ.get("NANOSPEC_ISA")
    if forced and forced not in ISA_NEEDS:
        raise ValueError(f"NANOSPEC_ISA={forced!r}: choose from {', '.join(ISA_NEEDS)}")
    return forced or next(isa for isa, needs in ISA_NEEDS.items() if set(needs) <= cpu_flags())


@functools.cache
def amx_permitted() -> bool:
    """Linux gives a process AMX's 8 KB of tile registers only when it asks (arch_prctl
    ARCH_REQ_XCOMP_PERM for XTILEDATA, kernel 5.16 and later); without them the first tile
    instruction kills the process. Asked once, for the whole process (cpu_kernels: where Linux
    refuses, the avx512bf16 build runs)."""
    # syscall 158 is arch_prctl on x86-64, 0x1023 asks, 18 is the tile data's feature bit
    return ctypes.CDLL(None).syscall(158, 0x1023, 18) == 0


def cpu_info(field: str) -> str:
    """What /proc/cpuinfo's first line of `field` ("flags", "model name") says: '' off Linux, or
    where there is no such line (no flags: the portable build)."""
    if not os.path.exists("/proc/cpuinfo"):
        return ""
    # Read up to the first such line, not whole: a many-core machine lists every core. Closed
    # after: an open file left to the garbage collector warns.
    with open("/proc/cpuinfo") as rows:
        return next((row.partition(":")[2].strip() for row in rows if row.startswith(field)), "")


def cpu_flags() -> set[str]:
    return set(cpu_info("flags").split())


def auto_dtype(checkpoint_dtype: torch.dtype, device) -> torch.dtype:
    """--dtype auto: the activations' dtype. A GPU: the checkpoint's 16-bit dtype, else bf16.

    A CPU with the C kernels: float32 activations and residual stream, with every linear's weights
    packed in 16 bits (auto_weight_dtype), whatever the ISA, and the KV cache in fp16 where the CPU
    has F16C (kv_cache_dtype). The FMA path widens x to fp32 anyway and reads the same 16-bit
    weights, so this costs little speed; AMX splits x and the weights into bf16 halves (3 tile
    products instead of 1). Greedy output stays as close to the fp32 model as llama.cpp's F16: bf16
    activations or bf16 weights left it within a few tokens (agreement with transformers fp32 on
    24 MT-bench questions, 128 tokens, on an AMX Xeon: bf16 0.37, fp32 activations over bf16
    weights 0.80, this 0.97; BENCHMARKS.md, session 21).
    Without the C kernels: bf16 where torch has bf16 instructions, else fp32 (on an AVX2 CPU
    torch's bf16 matmul is ~5x slower than fp32)."""
    if torch.device(device).type != "cpu":
        is_16_bit = checkpoint_dtype in (torch.float16, torch.bfloat16)
        return checkpoint_dtype if is_16_bit else torch.bfloat16
    return torch.bfloat16 if cpu_kernels() is None and torch_bf16_native() else torch.float32


def torch_bf16_native() -> bool:
    """Whether torch's own bf16 ops run on bf16 instructions here (AVX512-BF16 or AMX: oneDNN's
    GEMMs), and no NANOSPEC_ISA makes this CPU act as a smaller one."""
    return not os.environ.get("NANOSPEC_ISA") and bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def auto_weight_dtype(weight: torch.Tensor) -> torch.dtype:
    """How --dtype auto stores an fp32 linear's weights for the C kernels: fp16 where the CPU
    widens it in one instruction (F16C: every build but `generic`) and its range holds the
    weights (3 more mantissa bits than bf16: it holds 67-70% of the default model's linear weights
    exactly, dequantized from its Q4_1 GGUF, and the rest within 2^-12; bf16 a quarter), else
    bf16."""
    fits_fp16 = weight.abs().max() <= torch.finfo(torch.float16).max
    return torch.float16 if cpu_kernels().f16c and fits_fp16 else torch.bfloat16


def kv_cache_dtype(dtype: torch.dtype, device, auto: bool) -> torch.dtype:
    """The KV cache's dtype: the activations', except under --dtype auto on a CPU whose C kernels
    run fp32 activations and widen fp16 in one instruction (F16C): fp16 there, llama.cpp's default
    too. K and V rounded to fp16 keep 3 more mantissa bits than bf16 (their range, +-65504, is far
    beyond what attention's K and V reach), and a long context's attention reads half the bytes:
    at 2,000 tokens an fp32 cache is a quarter of the bytes a decode step reads."""
    fp16 = auto and torch.device(device).type == "cpu" and dtype == torch.float32
    return torch.float16 if fp16 and cpu_kernels() is not None and cpu_kernels().f16c else dtype


def cache_dir() -> Path:
    """$NANOSPEC_CACHE or ~/.cache/nanospec: the converted default model, the built C kernels."""
    return Path(os.environ.get("NANOSPEC_CACHE", os.path.expanduser("~/.cache/nanospec")))


def build_command(isa: str, source: Path) -> list[str]:
    """The compiler's command line for one ISA's build of `source`, but for its output (the cache
    key hashes it; the tests compile every ISA's build with it)."""
    flags = [f"-m{flag.replace('amx_', 'amx-').replace('_', '')}" for flag in ISA_NEEDS[isa]]
    compiler = [os.environ.get("CC", "cc"), "-O3", "-ffp-contract=fast", "-fopenmp", "-shared"]
    # GCC unswitches a loop on a flag only up to 50 instructions: paged_attention's rotary, whose
    # dtype tests made it larger, stayed scalar (a verify step's attention call 4-5% slower on
    # avx2; session 29). Every other loop compiles as it did; clang warns that it is unused.
    # GCC 13's default tuning leaves some FMA chains of up to 512 bits as a multiply and an add
    # (avoid-fma-max-bits): Ubuntu 24.04's GCC 13.3 built the AVX-512 linear's 1-row tiles that
    # way and every other tile with FMAs, so a decode row and the same row in a verify step
    # differed in their last bits (session 30). Row invariance needs every chain fused.
    compiler += ["--param=max-unswitch-insns=1000", "--param=avoid-fma-max-bits=0"]
    # How far the linears prefetch their weights, in pairs of k (cpu_kernels.c, AHEAD): on AVX2 a
    # Zen 3 measured fastest 32 pairs ahead and Intel's Golden Cove cores 64, as a Zen 5 did on
    # AVX-512 (sessions 38, 51, 56). (The generic build, not measured, keeps 32.)
    amd_avx2 = isa == "avx2" and cpu_info("vendor_id") == "AuthenticAMD"
    ahead = 32 if amd_avx2 or isa == "generic" else 64
    # Prefill's tiles read fp16 weights where they are packed, not from a widened fp32 copy, on
    # AMD's AVX2 cores, whose conversion takes no FMA pipe (cpu_kernels.c, PREFILL_READS_FP16;
    # session 58). Intel's takes one: its cores keep the copy.
    defines = [f"-DAHEAD={ahead}", f"-DPREFILL_READS_FP16={int(amd_avx2)}"]
    return [*compiler, "-fPIC", "-Wno-psabi", *defines, *flags, str(source)]


@functools.cache
def cpu_kernels(isa: str | None = None):
    """The compiled C kernels for this CPU's ISA (or `isa`), or None; built and loaded on first
    call. Where a build cannot run or compile, the next one down that can: avx512bf16 for amx
    without Linux's tile state (every AMX Xeon has AVX512-BF16), avx512 for avx512bf16 under a
    compiler that predates it (GCC 8: RHEL 8, Amazon Linux 2), else the torch references."""
    # missing where an install kept only .py files
    source = Path(__file__).with_name("cpu_kernels.c")
    if os.environ.get("NANOSPEC_CPU_KERNELS", "1") == "0" or not source.exists():
        return None
    isa = isa or cpu_isa()
    if isa == "amx" and not amx_permitted():
        warnings.warn("nanospec: no AMX tile state from Linux: the avx512bf16 build", stacklevel=2)
        return cpu_kernels("avx512bf16")
    command = build_command(isa, source)
    # Keyed by source, compiler and ISA flags: a cache on a shared disk never loads another CPU's
    # build.
    key = hashlib.sha1(source.read_bytes() + " ".join(command).encode()).hexdigest()[:12]
    library = cache_dir() / f"cpu_kernels-{isa}-{key}.so"
    if not library.exists():
        # renamed: no build ever sees half a file. A file of this thread's own: the tests build
        # two ISAs at a time (tests/conftest.py), and where one falls back to the next one down
        # (amx without Linux's tile state), both threads may build the same library at once.
        partial = library.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        try:  # no compiler, a failed build or an unwritable cache dir: the torch path still works
            library.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(command + ["-o", str(partial)], check=True, capture_output=True)
            partial.rename(library)
        except (OSError, subprocess.CalledProcessError) as error:
            warnings.warn(f"nanospec: no {isa} build of {source.name} ({error})", stacklevel=2)
            return cpu_kernels("avx512") if isa == "avx512bf16" else None
    lib = ctypes.CDLL(str(library))
    lib.isa, lib.f16c = isa, isa != "generic"  # (fp16 weights need F16C)
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    # (each call's arguments first, then a layer's own or a step's: c_linear, c_paged_attention)
    lib.linear.argtypes = [ptr, ptr, i64, ptr, i32, ctypes.POINTER(i64), i32, ptr, ptr, f32]
    # q, the caches, out, the per-segment sums, the scale; rotary's cos/sin, q's row stride
    lib.paged_attention.argtypes = [ptr] * 5 + [f32, ptr, i64]
    lib.paged_attention.argtypes += [ptr] * 4 + [i32] * 9 + [ptr, ptr] + [i32] * 2 + [i64] * 3
    lib.rms_norm.argtypes = [ptr] * 5 + [i32, i32, f32, i32]
    return lib


def kernels_summary(device) -> str:
    """What runs the ops, for the CLI's and bench.py's reports."""
    if torch.device(device).type == "cuda":
        return "triton"
    c = f"C kernels ({cpu_kernels().isa})" if cpu_kernels() is not None else "torch (no C kernels)"
    return f"{c}, {torch.get_num_threads()} threads"


# ---------------------------------------------------------------------------------------------
# The rule, for every op: Triton on CUDA (or forced in tests); on a CPU the C kernel where the op
# has one for this dtype and the library built; the torch reference otherwise.
C_DTYPES = (torch.float32, torch.bfloat16)


def pick(x: torch.Tensor, triton_fn, c_fn, torch_fn):
    if x.is_cuda or FORCE_TRITON:
        return triton_fn
    c_fits = c_fn is not None and x.is_cpu and x.dtype in C_DTYPES
    return c_fn if c_fits and cpu_kernels() is not None else torch_fn


def rms_norm(x, weight, eps, residual=None):
    """RMSNorm of x, or with a residual of x + residual: (normed, sum). The C kernel writes both
    into x's and residual's own memory, so a caller passes tensors it will not read again."""
    c_fn = c_rms_norm if x.dtype == weight.dtype else None
    return pick(x, triton_rms_norm, c_fn, torch_rms_norm)(x, weight, eps, residual)


def attention(qkv, cos_sin, k_cache, v_cache, scale):
    """What a model's attention layer calls, with this step's query, key and value heads side by
    side in each row of qkv [T, (Hq + 2 Hkv) * D]: rotate q and k (cos_sin [T, D] at the tokens'
    positions; None: no rotary), store this step's K/V, then attend over the cache. Returns
    [T, Hq * D], the o projection's input. qkv is the layer's own: the C kernel rotates q and k in
    it, in place."""
    assert context is not None, "attention called outside an engine step (no AttentionContext set)"
    if context.c_args is not None:  # a later layer of a step on the C kernel: no choice to make
        return c_paged_attention(qkv, k_cache, v_cache, scale, context, True, cos_sin)
    num_kv_heads, head_dim = k_cache.shape[2:]
    num_heads = qkv.shape[1] // head_dim - 2 * num_kv_heads
    # the cache in q's dtype, or fp16 under fp32 queries (kv_cache_dtype)
    fp16_cache = qkv.dtype == torch.float32 and k_cache.dtype == torch.float16
    c_fits = head_dim % 16 == 0 and head_dim <= 256 and num_heads // num_kv_heads <= 16
    c_fits = c_fits and (qkv.dtype == k_cache.dtype or fp16_cache)
    c_fits = c_fits and (cos_sin is None or cos_sin.dtype == qkv.dtype)
    fn = pick(
        qkv, triton_paged_attention, c_paged_attention if c_fits else None, torch_paged_attention
    )
    if fn is c_paged_attention:  # which rotates and stores them itself: one call, not six ops
        return fn(qkv, k_cache, v_cache, scale, context, fused=True, cos_sin=cos_sin)
    if fn is triton_paged_attention:  # and on a GPU one launch, not a dozen
        q = triton_rotary_store(qkv, cos_sin, k_cache, v_cache, context.slot_mapping, num_heads)
        return fn(q, k_cache, v_cache, scale, context).flatten(1)
    q_k, v = qkv.view(len(qkv), -1, head_dim).split((num_heads + num_kv_heads, num_kv_heads), 1)
    # (rotary is elementwise, one fixed formula an element: torch's is row-invariant on every
    # device; where the C call runs, it rotates itself)
    rotated = q_k if cos_sin is None else torch_rotary(q_k, cos_sin)
    q, k = rotated.split((num_heads, num_kv_heads), dim=1)
    store_kv(k, v, k_cache, v_cache, context.slot_mapping)
    return fn(q, k_cache, v_cache, scale, context).flatten(1)


# ---------------------------------------------------------------------------------------------
# Linear layers. Models are built from plain nn.Linear; load_model swaps each for a Linear, which
# on a CPU with the C kernels holds its weight packed once at load time for the weight-streaming
# kernel (and the nn.Linear weight is dropped, unless shared with an embedding).
class Linear(nn.Module):
    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
    ):
        """weight: as the model holds it (the rows come in its dtype); packed: pack_weight's
        panels of it, where the C kernels run it, or None."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = None if packed is not None else weight
        self.bias, self.packed = bias, packed
        # how c_linear calls the C kernel, worked out once: what never changes between calls
        self.c_args = None if packed is None else linear_args(weight.dtype, self)

    def forward(self, x):
        """y = x W^T + b, row-invariant. The C kernel reads the weight as packed panels."""
        if self.packed is not None:  # packed at load time, where pick() chose the C kernels
            return c_linear(x, self)
        # not cuBLAS: picks by M
        return pick(x, triton_linear, None, torch_linear)(x, self.weight, self.bias)

    # Called ~120 times a decode step: straight to forward, past nn.Module's hook dispatch (nanospec
    # registers no hooks). With models/llama.py's modules doing the same: 0.36 ms of a 14 ms avx2
    # decode step (session 15).
    __call__ = forward


def pack_weight(weight: torch.Tensor, storage: torch.dtype | None = None) -> torch.Tensor:
    """[N, K] -> panels of 16 output columns (N zero-padded to a multiple of 32: whole pairs of
    panels, which AVX-512's prefill tiles take side by side), k in pairs (K padded to even),
    stored as `storage` (default: the weight's dtype). fp32 and fp16 [N/16, K/2, 2, 16]: 16
    columns of one k side by side, what a vector load (and F16C's vcvtph2ps) wants; bf16
    [N/16, K/2, 16, 2], so a pair of k shares one 32-bit word, a row of an AMX tile, widened by a
    shift or a mask elsewhere (cpu_kernels.c, "Linear"). (AMX splits fp16 weights from the fp16
    layout itself.)"""
    weight = weight.to(storage or weight.dtype)
    n, k = weight.shape
    # [panel, n, k / 2, 2]
    pairs = F.pad(weight, (0, k % 2, 0, -n % 32)).reshape(-1, 16, (k + 1) // 2, 2)
    order = (0, 2, 1, 3) if weight.dtype == torch.bfloat16 else (0, 2, 3, 1)
    return weights_memory(pairs.permute(order))


_weights_memory = torch.empty(0, dtype=torch.uint8)


def weights_memory(weights: torch.Tensor) -> torch.Tensor:
    """A copy of packed weights in memory the kernel may back with 2 MB pages.

    A decode step streams every weight once, ~270 MB for the default model: on 4 KB pages, a TLB
    miss every 4 KB of it. Linux backs memory with transparent huge pages where a program asks
    (madvise: the default mode of most distributions) and the region spans whole 2 MB pages, so
    packed weights go one after another into private mappings of 64 MB (or one weight's size)
    that ask; each is copied in as it is packed, so a load never holds the packed weights twice.
    On the Zen 3 (avx2, dtype auto, two models in one process taking turns, the same bits): T=1
    forwards 0.96-0.97x the time at contexts 100 and 700, T=5 0.97x, T=9 0.98x (BENCHMARKS.md,
    sessions 59-60). Every packed weight is a multiple of 128 bytes (whole pairs of 16-column
    panels), so each starts on a cache line. (What is left of the last mapping waits for the next
    weight, and keeps that mapping while it waits: a model freed leaves at most 64 MB behind.)"""
    global _weights_memory
    nbytes = weights.numel() * weights.element_size()
    if _weights_memory.numel() < nbytes:
        # (Python's default mapping is shared, and a shared mapping gets no huge pages)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        mapping = mmap.mmap(-1, max(nbytes, 64 << 20), flags=flags)
        mapping.madvise(getattr(mmap, "MADV_HUGEPAGE", mmap.MADV_NORMAL))  # (Linux's only)
        _weights_memory = torch.frombuffer(mapping, dtype=torch.uint8)
    memory, _weights_memory = _weights_memory[:nbytes], _weights_memory[nbytes:]
    return memory.view(weights.dtype).view(weights.shape).copy_(weights)


def use_linears(model: nn.Module, pack: bool = True, small_weights: bool = False) -> nn.Module:
    """Swap every nn.Linear for a Linear, packed for the C kernels when they run here (pack=False
    keeps plain weights, for code that reads them); small_weights packs fp32 weights in 16 bits
    (auto_weight_dtype; --dtype auto). A weight shared by several layers is packed once."""
    packed = {}
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            weight = child.weight.detach()
            c_runs = pack and pick(weight, "triton", "c", "torch") == "c"
            if c_runs and weight.data_ptr() not in packed:
                small = small_weights and weight.dtype == torch.float32
                storage = auto_weight_dtype(weight) if small else weight.dtype
                packed[weight.data_ptr()] = pack_weight(weight, storage)
            bias = None if child.bias is None else child.bias.detach()
            linear = Linear(weight, bias, packed[weight.data_ptr()] if c_runs else None)
            setattr(module, name, linear)
    return model


def dtypes_summary(model: nn.Module, kv_dtype: torch.dtype) -> str:
    """' (float16 weights, float16 KV cache)': what differs from the activations' dtype, the
    linears' packed weights and the KV cache, for the run summaries."""
    dtype = next(model.parameters()).dtype
    packed = {m.packed.dtype for m in model.modules() if getattr(m, "packed", None) is not None}
    other = [f"{str(d)[6:]} weights" for d in sorted(packed - {dtype}, key=str)]
    other += [f"{str(kv_dtype)[6:]} KV cache"] if kv_dtype != dtype else []
    return f" ({', '.join(other)})" if other else ""


def torch_linear(x, weight, bias=None):
    """F.linear one row at a time: BLAS picks its kernel, and so its summation order, by the
    number of rows, so a row must always be computed in a call of one row."""
    out_rows = [F.linear(row, weight, bias) for row in x.reshape(-1, x.shape[-1])]
    out = torch.stack(out_rows) if out_rows else x.new_empty(0, weight.shape[0])
    return out.view(*x.shape[:-1], weight.shape[0])


C_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # cpu_kernels.c's type codes


def silu_mul_linear(x, layer: "Linear"):
    """The MLP's down projection of silu(gate) * up, x = [gate | up] (2I a multiple of 32: whole
    vectors). Where the C linear runs, it gates the rows itself as it copies them, fp32 or bf16
    (rounded as torch rounds: silu's output, then the product; bf16 rows that the kernel takes in
    fp32 are gated by torch, c_linear), at every M (one formula a row), instead of three torch ops
    between two C calls. Those ops cost
    5-7 us alone but ~45 us in a forward, where they run right after the gate_up projection has
    streamed 3.5 MB of weights through the caches and evicted what torch's dispatch reads (the
    next op after any large linear pays the same: ~20 us instead of ~3). Measured in one process,
    fused against unfused, default model, context 100: T=1 17.3 -> 15.9 ms, T=9 27.3 -> 25.8
    on avx2; T=1 -4%, T=5 and T=9 -7 to -8%, prefill -8% on AMX (BENCHMARKS.md, session 23)."""
    if layer.packed is not None and x.shape[-1] % 32 == 0:
        return c_linear(x, layer, gated=True)
    return layer(silu_mul(x))


def rms_norm_linear(x, residual, norm, layer: Linear):
    """layer(norm(x + residual)) and x + residual (residual None: layer(norm(x)) and x), with
    rms_norm's contract: x and residual are written over. Where the C linear takes these rows as
    they are (not widened by torch, K even), one C call does both: the C norm in place, then the
    tiles. The same kernels, so the same bits, and 59 of a decode step's 61 norm calls go (a C
    call costs about 6 us of Python and ctypes): on the Zen 3 (avx2, 2 threads, taking turns with
    the two calls, 21 and 31 rounds) T=1 forwards 0.962-0.976x the time at contexts 100 and 700,
    T=9 0.969-0.970x (BENCHMARKS.md, session 61)."""
    fused = residual is not None and layer.packed is not None and x.dtype == norm.weight.dtype
    if not fused or any(layer.c_args[2:4]):  # (rows that torch widens or pads first: two calls)
        x, residual = (norm(x), x) if residual is None else norm(x, residual)
        return layer(x), residual
    residual = residual.contiguous()
    return c_linear(x, layer, norm=(residual, norm)), residual


def c_linear(x, layer: Linear, gated=False, norm=()):
    """cpu_kernels.c's linear over a packed Linear: each output one fixed fp32 chain over k, the
    weights streamed once per call. (A decode step makes ~120 of these calls, and every torch op
    or attribute read here costs about a microsecond, more right after a linear has streamed its
    weights through the caches. So what never changes between calls was worked out when the layer
    was built, linear_args: with the same for attention, a T=1 forward of the default model took
    0.91x the time on a Zen 3; BENCHMARKS.md, session 37.) norm: (residual, an RMSNorm), for
    rms_norm_linear: the kernel first norms x + residual in place."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    lib, dtype, widen, pad, fixed = layer.c_args
    assert rows.dtype == dtype, f"{rows.dtype} rows for a linear built for {dtype}"
    if widen:  # (bf16 rows where the kernel takes fp32: gated as torch gates them)
        rows, gated = (silu_mul(rows) if gated else rows).float(), False
    rows = F.pad(rows, (0, 1)) if pad else rows.contiguous()  # (contiguous: rows themselves if so)
    num_rows, threads, in_features = rows.shape[0], torch.get_num_threads(), fixed[3]
    out = torch.empty(num_rows, layer.out_features, dtype=x.dtype)
    # Room for x interleaved, [k][M] (fp16 weights, where a row block has 6 of up to 18 rows; 2-24
    # on AVX-512), gated (every M) or split in two bf16 halves (AMX over fp16 weights), then per
    # thread: a panel of 16-bit weights widened to fp32 for prefill, or a panel pair's weights
    # split (cpu_kernels.c). One size serves every case: the pages a call never touches are never
    # mapped in (a 2048-token chunk of a wide model's x would be 100 MB, but only gated or split
    # rows are copied past 18 or 24).
    scratch = cpu_scratch(in_features * (num_rows + 32 * threads)).data_ptr()
    # (rms_norm_linear's norm, as the kernel takes it: the residual stream, the weight, eps)
    norm = (norm[0].data_ptr(), norm[1].weight.data_ptr(), norm[1].eps) if norm else (0, 0, 0)
    if num_rows:  # (no tile shape has 0 rows)
        lib.linear(rows.data_ptr(), out.data_ptr(), num_rows, scratch, threads, fixed, gated, *norm)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], layer.out_features)


def linear_args(dtype: torch.dtype, layer: Linear) -> tuple:
    """How c_linear calls the C kernel for this layer's rows of `dtype`, on the build it was
    packed for: (the build, dtype, widen: the rows go as fp32, widened by torch; pad: with a zero
    column; the layer's own arguments to the kernel, as the one array it takes)."""
    lib, packed = cpu_kernels(), layer.packed
    # AMX, wherever K (padded) is a multiple of 32, takes bf16 rows over bf16 weights as they are,
    # and fp32 rows over fp16 weights, which it splits itself (cpu_kernels.c, "Intel AMX"); the
    # avx512bf16 build's dot product takes bf16 over bf16 at any K. The FMA path takes fp32 rows,
    # widened once per call (exactly), so that the kernel's broadcast of x[m, k] is a single load.
    # All walk k in pairs: an odd K gets a zero column (its weights are zero-padded too).
    w_type, amx = C_TYPES[packed.dtype], lib.isa == "amx" and packed.shape[1] % 16 == 0
    assert w_type != 2 or lib.f16c, "fp16 weights need F16C (this build is generic)"
    x_bf16 = (amx or lib.isa == "avx512bf16") and w_type == 1 and dtype == torch.bfloat16
    # AMX's tiles: fp32 x over fp16 weights (split in bf16 halves), or bf16 over bf16
    tiles = amx and (w_type == 2 or x_bf16)
    bias = 0 if layer.bias is None else layer.bias.data_ptr()
    weights = (packed.data_ptr(), bias, layer.out_features, 2 * packed.shape[1])  # K padded
    # one array, one argument: cpu_kernels.c's `layer`
    fixed = (ctypes.c_int64 * 8)(*weights, x_bf16, tiles, w_type, dtype == torch.bfloat16)
    return lib, dtype, not x_bf16 and dtype != torch.float32, layer.in_features % 2, fixed


_scratch = torch.empty(0)


def cpu_scratch(floats: int) -> torch.Tensor:
    """One buffer reused by every C call that needs room: prefill linears, attention's segments (a
    fresh one each call would cost page faults). Calls never overlap."""
    global _scratch
    if _scratch.numel() < floats:
        _scratch = torch.empty(floats)
    return _scratch


# ---------------------------------------------------------------------------------------------
# Paged attention, store_kv, norms, rotary, activations: torch references and C kernels.
def store_kv(k, v, k_cache, v_cache, slot_mapping):
    """k, v: [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] (any strides: the engine's
    are views of head-major storage, paged_kv.allocate_kv_cache) at flat slots, rounded to the
    cache's dtype (kv_cache_dtype). A pure copy: torch's scatter, for the torch path (the C kernel
    stores inside paged_attention, and on a GPU triton_rotary_store does it with the rotary)."""
    blocks, offsets = slot_mapping // k_cache.shape[1], slot_mapping % k_cache.shape[1]
    k_cache[blocks, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)


def torch_paged_attention(q, k_cache, v_cache, scale, ctx: AttentionContext):
    """Causal attention of packed queries q [T, Hq, D] over the paged cache -> [T, Hq, D]. Query
    j of sequence b sits at position seq_lens[b] - q_len_b + j and sees cached positions <= it
    (with a tree: logical positions <= tree_pos[t], see AttentionContext). Each query is attended
    on its own, over exactly its keys: the same shapes, so the same arithmetic, whatever the step
    around it."""
    out, tree_pos, tree_keys = torch.empty_like(q), ctx.tree_pos, ctx.tree_keys
    group, block_size = q.shape[1] // k_cache.shape[2], k_cache.shape[1]
    starts = ctx.query_start_loc.tolist()
    for b, seq_len in enumerate(ctx.seq_lens.tolist()):
        positions = torch.arange(seq_len, device=q.device)
        slots = (ctx.block_tables[b, positions // block_size].long(), positions % block_size)
        keys = k_cache[slots].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = v_cache[slots].float().repeat_interleave(group, dim=1)
        for t in range(starts[b], starts[b + 1]):
            # keys 0..position
            order = torch.arange(seq_len - (starts[b + 1] - t) + 1, device=q.device)
            if tree_pos is not None:
                num_keys, width = int(tree_pos[t]) + 1, tree_keys.shape[1]
                order = torch.cat(
                    [order[: max(num_keys - width, 0)], tree_keys[t, max(width - num_keys, 0) :]]
                )
            scores = torch.einsum("hd,lhd->hl", q[t].float(), keys[order]) * scale
            out[t] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values[order]).to(q.dtype)
    return out


def c_paged_attention(q, k_cache, v_cache, scale, ctx: AttentionContext, fused=False, cos_sin=None):
    """cpu_kernels.c's paged_attention; same contract as torch_paged_attention (q fp32 or bf16;
    the caches q's dtype, or fp16 under fp32 queries: attention's c_fits). Fused, q is what
    attention() takes, a layer's qkv [T, (Hq + 2 Hkv) * D] at any row stride: the kernel first
    does what attention() does before the other kernels (rotary where cos_sin is given, of q and k
    in place in qkv's rows; store_kv), and returns [T, Hq * D]."""
    if q.stride(-1) != 1 or not (fused or q.stride(1) == k_cache.shape[3]):  # rows at any stride
        q = q.contiguous()
    # Fused, as the engine calls it, what every layer of the step shares is worked out by its
    # first layer and kept on the step's context: a decode step makes 30 calls (unfused, tests
    # call with other caches over one context).
    step = ctx.c_args if fused else None
    if step is None:
        step = attention_args(q, k_cache, v_cache, cos_sin, ctx, fused)
        ctx.c_args = step if fused else None
    out_shape, partial_floats, args, _ = step
    out = torch.empty(out_shape, dtype=q.dtype)
    tensors = [t.data_ptr() for t in (q, k_cache, v_cache, out, cpu_scratch(partial_floats))]
    cpu_kernels().paged_attention(*tensors, scale, *args)
    return out


def attention_args(q, k_cache, v_cache, cos_sin, ctx: AttentionContext, fused: bool) -> tuple:
    """What c_paged_attention passes that is the same in every layer of a step: (out's shape, the
    floats of the partial sums, the kernel's arguments after scale, the tensors they point into).
    Every layer of a step rotates at the same positions (cos_sin) and has its qkv rows at the
    same stride."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens, strides = q.shape[0], k_cache.stride()
    num_heads = q.shape[1] // head_dim - 2 * num_kv_heads if fused else q.shape[1]
    assert strides == v_cache.stride() and strides[3] == 1
    # (the kernel reads int64 and contiguous: the engine's tables are, and come back as they are)
    tables, seq_lens, starts = (
        t.long().contiguous() for t in (ctx.block_tables, ctx.seq_lens, ctx.query_start_loc)
    )
    tree = [t.long().contiguous() for t in (ctx.tree_pos, ctx.tree_keys) if t is not None]
    cos_sin = None if cos_sin is None else cos_sin.contiguous()
    # Keys in segments of ATTENTION_SEGMENT positions, each summed on its own, then merged in
    # order: a decode step's few queries still make an item for every thread (cpu_kernels.c). The
    # scratch holds their partial sums.
    segments = -(-tables.shape[1] * block_size // ATTENTION_SEGMENT)
    partial_floats = num_tokens * num_heads * segments * (head_dim + 2)
    # cpu_kernels.c's arguments, in its order
    args = [None if cos_sin is None else cos_sin.data_ptr(), q.stride(0)]
    args += [t.data_ptr() for t in (tables, seq_lens, starts)]
    args += [ctx.slot_mapping.data_ptr() if fused else None, seq_lens.shape[0], tables.shape[1]]
    args += [num_heads, num_kv_heads, head_dim, block_size, q.dtype == torch.bfloat16]
    args += [C_TYPES[k_cache.dtype], torch.get_num_threads()]
    args += [t.data_ptr() for t in tree] + [tree[1].shape[1]] if tree else [None, None, 0]
    args += [ATTENTION_SEGMENT, *strides[:3]]
    out_shape = (num_tokens, num_heads * head_dim) if fused else (num_tokens, num_heads, head_dim)
    return out_shape, partial_floats, args, (tables, seq_lens, starts, tree, cos_sin)


# Keys a segment sums; a multiple of every build's LANES. The partial sums take T * Hq * segments *
# (D + 2) floats: 39 MB for the default model's 2048-token prefill chunk at 4,096 tokens of context,
# 0.5 GB for a 32-head, D=128 model at 8,192 (a prefill item could instead merge its own segments
# as it goes: only decode and verify steps need theirs apart).
ATTENTION_SEGMENT = 512


def torch_rms_norm(x, weight, eps, residual=None):
    """RMSNorm computed in fp32 (as HF does). With residual: x += residual first; returns
    (normed, sum)."""
    if residual is not None:
        x = residual = x + residual
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight
    return normed if residual is None else (normed, residual)


def c_rms_norm(x, weight, eps, residual=None):
    """cpu_kernels.c's rms_norm; same contract as torch_rms_norm (fp32 or bf16, CPU). With a
    residual in place, as vLLM's fused add-norm: the sum into residual, the normed rows into x
    (the kernel reads a row whole before it writes it), so that a decode step's 60 norms allocate
    nothing. Without one, x is the residual stream the caller keeps: a fresh output."""
    x = x.contiguous()
    out, summed = (torch.empty_like(x), None) if residual is None else (x, residual.contiguous())
    summed_at = None if summed is None else summed.data_ptr()
    pointers = (x.data_ptr(), summed_at, weight.data_ptr(), out.data_ptr(), summed_at)
    rows, is_bf16 = x.numel() // x.shape[-1], x.dtype == torch.bfloat16
    cpu_kernels().rms_norm(*pointers, rows, x.shape[-1], eps, is_bf16)
    return out if residual is None else (out, summed)


def torch_rotary(x, cos_sin):
    """Neox-style rotary on x [T, H, D] (a layer's q and k heads side by side, so one call rotates
    both); cos_sin [T, D] = [cos | sin] at each token's position, already in x's dtype."""
    cos, sin = cos_sin[:, None, :].chunk(2, dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_mul(x):
    """x: [T, 2I] = [gate | up] -> silu(gate) * up. Elementwise: the torch op serves every
    device (on a CPU with the C kernels, silu_mul_linear gates inside the down projection)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---------------------------------------------------------------------------------------------
# Triton kernels (same signatures as the torch references above). Conventions: one wrapper per op
# (shapes, strides, grid, tile sizes), one @triton.jit kernel behind it. Every load and store is
# masked (the CPU interpreter does no bounds checking), tl.arange extents are powers of two, tl.dot
# tiles are >= 16 in every dim, math is fp32 (rounded where the reference rounds), stores are in the
# output dtype.
def _pow2(n, at_least=1):
    return max(at_least, triton.next_power_of_2(n))


def _launch(kernel, grid, args, num_warps, **constexprs):
    """Every wrapper launches through here (tests/test_compile.py records the launches): an empty
    grid (no rows) does nothing."""
    if min(grid) > 0:
        kernel[grid](*args, **constexprs, num_warps=num_warps)


def _as_rows(x):
    """View x as [rows, last_dim] with unit column stride (copies only if it has to)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(1) == 1 else x.contiguous()


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    tree_pos_ptr,
    tree_keys_ptr,
    tree_width,
    scale,
    stride_qt,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TREE: tl.constexpr,
):
    q_block, seq, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:  # the grid is sized for the longest query; this sequence is done
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    # Tile row r is query j = r // GROUP of this block, for query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    j = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (j < q_len)
    q_pos = seq_len - q_len + j
    token = (q_start + j).to(tl.int64)
    # one query per tile (BLOCK_Q = 1), so its path remaps the tile's keys (AttentionContext)
    if TREE:
        q_pos = tl.load(tree_pos_ptr + token, mask=row_ok, other=0)
        remap_from = tl.load(tree_pos_ptr + q_start + q_block) - tree_width + 1
    dims = tl.arange(0, DIM_PAD)
    q_mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    # q's rows at any stride, its heads side by side in them; out's rows whole, contiguous
    in_row = head[:, None] * HEAD_DIM + dims[None, :]
    q = tl.load(q_ptr + token[:, None] * stride_qt + in_row, mask=q_mask, other=0.0)

    # Online softmax in the log2 domain (exp2 is the native instruction): scores carry log2(e).
    qk_scale = scale * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of each row's scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)  # running sum of exp2(score - m_i) * v
    # Keys from position 0 up to the tile's last query position (nothing later is visible to any of
    # its rows). Every row, padding included, sees position 0: from the first tile on m_i is finite
    # (no -inf - -inf = NaN) and l_i >= 1 (the row's max scores exp2(0) = 1).
    kv_end = tl.max(tl.where(row_ok, q_pos, -1)) + 1
    for tile_start in range(0, kv_end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_end
        phys = pos
        if TREE:
            on_path = pos_ok & (pos >= remap_from)
            path = tl.load(
                tree_keys_ptr + (q_start + q_block) * tree_width + pos - remap_from, mask=on_path
            )
            phys = tl.where(on_path, path, pos)
        block = tl.load(
            block_tables_ptr + seq * stride_bt + phys // BLOCK_SIZE, mask=pos_ok, other=0
        )
        kv_offs = (
            block.to(tl.int64) * stride_cb + (phys % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        )
        kv_ptrs = kv_offs[:, None] + dims[None, :]
        kv_mask = pos_ok[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out = acc / l_i[:, None]
    out_ptrs = out_ptr + token[:, None] * (tl.num_programs(2) * GROUP * HEAD_DIM) + in_row
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def triton_paged_attention(q, k_cache, v_cache, scale, ctx: AttentionContext):
    """Unified varlen paged attention: one kernel for prefill chunks, decode and verification.
    Grid (query blocks, sequences, kv heads), sized from the host int max_q_len (no sync). A
    tile's BLOCK_M rows are (query, head-in-group) pairs, so the GQA heads sharing a KV head read
    each K/V tile once. BLOCK_M = 64 rows whatever the step, and keys in BLOCK_N = 64 tiles from
    position 0: a query's arithmetic never depends on its batch partners (row invariance). Keys
    are gathered through the block table per position, so any block size (even 1) works. With a
    tree, one query per tile (its rows alone in the same tile shape: the same bits), so a node's
    path can remap the tile's key positions."""
    _, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    assert q.stride(2) == 1 and q.stride(1) == head_dim, "q: [T, Hq, D], heads side by side"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    group = num_heads // num_kv_heads
    # per model, never per step: a query's tile shape is always the same
    block_m = max(64, _pow2(group))
    tree_pos, tree_keys, seq_lens = ctx.tree_pos, ctx.tree_keys, ctx.seq_lens
    block_q = 1 if tree_pos is not None else block_m // group
    tree = (
        (seq_lens, seq_lens, 0) if tree_pos is None else (tree_pos, tree_keys, tree_keys.shape[1])
    )
    grid = (triton.cdiv(ctx.max_q_len, block_q), seq_lens.shape[0], num_kv_heads)
    tensors = (q, k_cache, v_cache, out, ctx.block_tables, seq_lens, ctx.query_start_loc, *tree)
    strides = (q.stride(0), *k_cache.stride()[:3], ctx.block_tables.stride(0))
    _launch(
        _paged_attention_kernel,
        grid,
        (*tensors, scale, *strides),
        4,
        BLOCK_SIZE=block_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        DIM_PAD=_pow2(head_dim, 16),
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_Q=block_q,
        TREE=tree_pos is not None,
    )
    return out


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count, M = 1 included
def _linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
    # a [BLOCK_K, BLOCK_N] tile of W^T
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):  # one fp32 accumulator over K, in order: no split-K
        x = tl.load(x_ptrs + k, mask=(rows[:, None] < M) & (k + ks[None, :] < K), other=0.0)
        w = tl.load(w_ptrs + k, mask=(cols[None, :] < N) & (k + ks[:, None] < K), other=0.0)
        acc = tl.dot(x, w, acc, input_precision="ieee")
    if HAS_BIAS:  # after the reduction, as F.linear adds it
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(
        out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N)
    )


def triton_linear(x, weight, bias=None):
    """y = x W^T + b, row-invariant: tiles fixed per dtype (never chosen by M) and no split-K, so
    an output is the same fp32 dot over K in BLOCK_K steps whatever the row count; output in x's
    dtype. The tiles were chosen on an H100 (BENCHMARKS.md, session 33), timing a forward's 121
    linears of the default model at M = 1, 9, 64, 256 and 2048 against other tiles: narrow ones
    give a 576- or 960-column layer enough programs to fill the SMs at decode's few rows. fp32
    (16 x 32 x 32, 2 warps; its dots run on the FMA units) was 2-4x faster than the 32 x 64 tiles
    it replaced at 1-64 rows, equal at 256 and 4% slower at 2048. 16-bit (32 x 32 x 64) beat
    64 x 64 x 64 at every M: 1.04-1.06x at 1-64 rows, 2.3x at 256, 1.3x at 2048."""
    x2, n = _as_rows(x), weight.shape[0]
    m, k = x2.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    fp32 = x.dtype == torch.float32
    (block_m, block_n, block_k), num_warps = ((16, 32, 32), 2) if fp32 else ((32, 32, 64), 4)
    tensors = (x2, weight, weight if bias is None else bias, out)  # (no bias: the weight, unread)
    _launch(
        _linear_kernel,
        (triton.cdiv(m, block_m), triton.cdiv(n, block_n)),
        (*tensors, m, n, k, x2.stride(0), weight.stride(0)),
        num_warps,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out.view(*x.shape[:-1], n)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_r,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # the sum is rounded to x's dtype before normalising, as the reference does
        x += tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(sum_ptr + row * hidden + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    weight = tl.load(weight_ptr + cols, mask=mask)
    normed = (xf * rstd).to(x.dtype) * weight  # round, then scale: HF's order
    tl.store(out_ptr + row * hidden + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


def triton_rms_norm(x, weight, eps, residual=None):
    """One program per row, the whole row in one tile (hidden sizes are a few thousand at most):
    one read, one fp32 reduction, one write. Warps grow with the row: 1 per 256 elements, 1..16."""
    x2, hidden = _as_rows(x), x.shape[-1]
    r2 = _as_rows(residual) if residual is not None else x2
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = torch.empty_like(x2) if residual is not None else out  # (not written without residual)
    block = _pow2(hidden)
    _launch(
        _rms_norm_kernel,
        (x2.shape[0],),
        (x2, r2, weight, out, summed, x2.stride(0), r2.stride(0), hidden, eps),
        min(max(block // 256, 1), 16),
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
    )
    return out.view(x.shape) if residual is None else (out.view(x.shape), summed.view(x.shape))


@triton.jit
def _rotary_store_kernel(
    qkv_ptr,
    cos_sin_ptr,
    slot_mapping_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    stride_qkv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROW_PAD: tl.constexpr,
    ROTARY: tl.constexpr,
):
    # One program per token, over its row of qkv: its q, k and v heads side by side.
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, ROW_PAD)
    head, dim = i // HEAD_DIM, i % HEAD_DIM
    row = qkv_ptr + t * stride_qkv
    x = tl.load(row + i, mask=head < NUM_HEADS + 2 * NUM_KV_HEADS)
    if ROTARY:  # q and k heads: torch_rotary's formula, each product rounded to x's dtype
        half: tl.constexpr = HEAD_DIM // 2
        rotated = head < NUM_HEADS + NUM_KV_HEADS
        partner = tl.load(row + head * HEAD_DIM + (dim + half) % HEAD_DIM, mask=rotated)
        cos = tl.load(cos_sin_ptr + t * HEAD_DIM + dim % half, mask=rotated)
        sin = tl.load(cos_sin_ptr + t * HEAD_DIM + half + dim % half, mask=rotated)
        a = (x.to(tl.float32) * cos.to(tl.float32)).to(x.dtype).to(tl.float32)
        b = (partner.to(tl.float32) * sin.to(tl.float32)).to(x.dtype).to(tl.float32)
        x = tl.where(rotated, tl.where(dim < half, a - b, a + b).to(x.dtype), x)
    tl.store(q_ptr + t * NUM_HEADS * HEAD_DIM + i, x, mask=head < NUM_HEADS)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    at = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot + dim
    kv_head = head - NUM_HEADS  # k's heads, then v's (tl.store rounds to the cache's dtype)
    is_k = (kv_head >= 0) & (kv_head < NUM_KV_HEADS)
    tl.store(k_cache_ptr + at + kv_head * stride_cache_head, x, mask=is_k)
    v_head = kv_head - NUM_KV_HEADS
    is_v = (v_head >= 0) & (v_head < NUM_KV_HEADS)
    tl.store(v_cache_ptr + at + v_head * stride_cache_head, x, mask=is_v)


def triton_rotary_store(qkv, cos_sin, k_cache, v_cache, slot_mapping, num_heads):
    """What attention() does before the attention kernel, in one launch instead of about a dozen
    small torch ops (a decode step on a GPU waits on its launches: on an H200, a bf16 decode step
    of the default model took 0.75-0.8x the time, 317 kernels a step against 617; BENCHMARKS.md,
    session 35). Rotates this step's q and k heads, side by side in each row of qkv
    [T, (Hq + 2 Hkv) * D] (cos_sin [T, D], contiguous; None: no rotary), stores k and v at their
    slots, and returns q [T, Hq, D]: the same bits as torch_rotary then store_kv, its reference
    (fp fusion off, each product rounded where torch rounds it)."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and qkv.stride(1) == 1
    assert cos_sin is None or cos_sin.is_contiguous()
    q = torch.empty(len(qkv), num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    rotary = cos_sin is not None
    pointers = (qkv, cos_sin if rotary else qkv, slot_mapping, q, k_cache, v_cache)
    _launch(
        _rotary_store_kernel,
        (len(qkv),),
        (*pointers, qkv.stride(0), *k_cache.stride()[:3]),
        4,
        BLOCK_SIZE=k_cache.shape[1],
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        ROW_PAD=_pow2((num_heads + 2 * num_kv_heads) * head_dim),
        ROTARY=rotary,
        enable_fp_fusion=False,
    )
    return q
