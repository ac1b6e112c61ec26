// CPU kernels: the linear layers (weight streaming), paged attention for every query shape, and
// RMSNorm and rotary. kernels.py compiles this file once per ISA (AMX, AVX512-BF16, AVX-512,
// AVX2 + FMA, or generic) and calls it through ctypes; each function keeps the contract of a
// torch_* reference there. Every output is computed by one fixed chain of arithmetic that never
// depends on how many rows, queries or threads the call has: that is what makes speculation
// bit-exact (DESIGN.md, "Exactness"). The caller owns every buffer; nothing here allocates or
// keeps state.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#ifdef __F16C__  // (every build with AMX or AVX512-BF16 has it too)
#include <immintrin.h>
#endif
// Compiled without GCC's partial redundancy elimination: with it, GCC hoists the second k of a
// linear's pair of k above the first k's FMAs, runs out of AVX2's 16 vector registers and keeps
// accumulators on the stack (a store and a reload in every FMA chain): the 6-row tile ran at half
// the FMA rate of the 4-row one. Without it the 120 linears at 6 rows took 8.5 ms instead of 10.2
// on avx2, at 18 rows 21.1 instead of 28.6; AVX-512's 32 registers never spilled, and the other
// kernels ran as fast as before (BENCHMARKS.md, session 16). Other compilers ignore the pragma.
#pragma GCC optimize("no-tree-pre")

typedef uint16_t bf16;  // raw bfloat16 bits: the top half of an fp32
// One vector register of floats: 16 with AVX-512, 8 with AVX2, 4 otherwise (SSE, NEON).
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX2__)
#define LANES 8
#else
#define LANES 4
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));
// The same, read or written at any address (a plain vector type promises its own alignment)
typedef float vf_u __attribute__((vector_size(LANES * 4), aligned(2), may_alias));
typedef uint32_t vu_u __attribute__((vector_size(LANES * 4), aligned(2), may_alias));
typedef uint16_t vh_u __attribute__((vector_size(LANES * 2), aligned(2), may_alias));

// An fp32 and its bits as lane 0 of vectors: a cast between vf and vu keeps the bits
static inline float to_f32(bf16 h) { return ((vf)(vu){(uint32_t)h << 16})[0]; }

static inline float get(const void *p, int64_t i, int is_bf16) {  // element i: fp32 or bf16
    return is_bf16 ? to_f32(((const bf16 *)p)[i]) : ((const float *)p)[i];
}

// fp32 bits u (a uint32 or a vector of them) rounded to bf16's bits: to nearest even, as torch does
#define ROUND_BF16(u) (((u) + 0x7FFF + (((u) >> 16) & 1)) >> 16)
static inline bf16 to_bf16(float f) { return ROUND_BF16(((vu)(vf){f})[0]); }

// LANES values of type 0 (fp32), 1 (bf16: a shift) or 2 (fp16: F16C's vcvtph2ps, every build but
// the generic one), widened to fp32 exactly.
static inline vf load_vf(const void *p, const int type) {
#if defined(__F16C__) && LANES == 16
    if (type == 2) return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(p));
#elif defined(__F16C__)
    if (type == 2) return (vf)_mm256_cvtph_ps(_mm_loadu_si128(p));
#endif
    if (!type) return *(const vf_u *)p;
    return (vf)(__builtin_convertvector(*(const vh_u *)p, vu) << 16);
}

static inline void store_vf(void *p, vf v, int is_bf16) {  // rounded to nearest even for bf16
    if (is_bf16)
        *(vh_u *)p = __builtin_convertvector(ROUND_BF16((vu)v), vh_u);
    else
        *(vf_u *)p = v;
}

static inline vi iota(void) {
    vi v;
    for (int i = 0; i < LANES; i++) v[i] = i;
    return v;
}

// a where the mask's lane is set, else b
static inline vf select_vf(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

// e^x for x <= 0 (e^-inf = 0): 2^n * e^r, |r| <= ln2/2, rel. error ~1e-7
static inline vf exp_vf(vf x) {
    vi dead = x < -87.0f;
    x = select_vf(dead, (vf){} - 87.0f, x);
    vf n = (x * 1.442695041f + 12582912.0f) - 12582912.0f;  // round to nearest integer
    vf r = x - n * 0.693147181f, p = {};
    const float taylor[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    for (int i = 0; i < 7; i++) p = p * r + taylor[i];  // (the first: 0 * r + 1/720 = 1/720)
    vi scale = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)((vi)(p * (vf)scale) & ~dead);
}

// -----------------------------------------------------------------------------------------------
// RMSNorm and rotary, fp32 or bf16: torch runs each as a chain of small ops (a dozen calls of ~1 us
// each at decode); here one pass. bf16 is rounded like the torch reference step by step, so the two
// agree bit for bit; fp32 rounds each operation once, as torch does, but may fuse a multiply and an
// add (and sums in its own order). Scalar reads and writes of element i: fp32 or bf16, and for put
// fp16 too (type as load_vf's), rounded to nearest even as torch rounds.
static inline float rounded(float v, int is_bf16) { return is_bf16 ? to_f32(to_bf16(v)) : v; }

static inline void put(void *p, int64_t i, float v, int type) {
#ifdef __F16C__
    if (type == 2) ((uint16_t *)p)[i] = _cvtss_sh(v, 0);
#endif
    if (type == 1) ((bf16 *)p)[i] = to_bf16(v);
    if (!type) ((float *)p)[i] = v;
}

// RMSNorm of x [rows, H] in fp32: x * rsqrt(mean(x^2) + eps), rounded to x's dtype, times w. With
// residual: x + residual (rounded) is normed and also written to residual_out.
void rms_norm(const void *x, const void *residual, const void *weight, void *out,
              void *residual_out, int rows, int hidden, float eps, int is_bf16) {
#pragma omp parallel for schedule(static) if (rows > 16)
    for (int r = 0; r < rows; r++) {
        float row[hidden], sum_sq = 0.0f;
        int64_t at = (int64_t)r * hidden;
        for (int i = 0; i < hidden; i++) {
            float v = get(x, at + i, is_bf16);
            row[i] = residual ? rounded(v + get(residual, at + i, is_bf16), is_bf16) : v;
            if (residual) put(residual_out, at + i, row[i], is_bf16);
        }
#pragma omp simd reduction(+ : sum_sq)
        for (int i = 0; i < hidden; i++) sum_sq += row[i] * row[i];
        float inv = 1.0f / sqrtf(sum_sq / hidden + eps);
        for (int i = 0; i < hidden; i++)
            put(out, at + i, rounded(row[i] * inv, is_bf16) * get(weight, i, is_bf16), is_bf16);
    }
}

// -----------------------------------------------------------------------------------------------
// Linear: y[M, N] = x[M, K] W^T (+ bias). W is packed once at load time into panels of 16 output
// columns (pack_weight in kernels.py; N padded to a multiple of 32 with zero rows, so that the
// panels come in pairs, K to an even count), walked in pairs of k: fp32 w[panel][k / 2][2][16],
// bf16 w[panel][k / 2][16][2], a bf16 pair (k, k + 1) sharing one 32-bit word. AMX (below) reads
// that word as is; the FMA path widens its halves exactly with one shift (k) and one mask (k + 1),
// so one load serves two k.
//
// Each output y[m, n] is one fixed chain from zero, then + bias: fp32 FMAs over k = 0..K-1 (x in
// fp32), or AMX's tile products (below), or, in the avx512bf16 build for bf16 x over bf16 weights,
// AVX512-BF16's dot products: a pair of k at a time, acc + x[k+1] w[k+1], then + x[k] w[k], each
// add rounded to fp32 (a product of two bf16 is exact in fp32; denormals count as zero). The
// chain never depends on M, the tile shape or the thread count, so every row is bitwise the same
// whatever the step around it.
//
// A tile of R rows x one panel keeps its R * PV accumulators in registers for the whole of K and
// reads each weight once for its R rows: a decode or verify step (M <= 6; on AVX-512 M <= 16)
// streams the weights from memory exactly once, so verifying K+1 rows costs little more than one.
// One panel, not several side by side: each thread then reads a single sequential stream, and tiles
// of 2-4 panels (more accumulators to hide the FMA latency) measured slower at every M on every
// build: M=1 8-17% on AVX2, M=1-6 15-25% and prefill 10-13% on AVX-512 (BENCHMARKS.md, session 18).
// The exception is AVX-512's prefill, from its widened copy (below): a 6-row tile of one panel has
// 6 FMA chains where two FMA ports of latency 4 want 8, and every FMA takes its broadcast of x from
// memory (1.17 loads a FMA), where one of two panels side by side (WIDE) has 12 chains and each
// broadcast feeds two FMAs (0.67 loads a FMA). The default model's 121 linear shapes at M=256,
// taking turns with the one-panel build (same bits): 0.75-0.82x the time on an Intel Xeon (2
// threads; 0.89-0.93x with 16) and 0.80x on a Zen 5; against torch's fp32 GEMM on the Xeon, in
// three runs on a shared host, from 0.59-0.78x to 0.78-1.02x at 2 threads and from 0.81-0.84x to
// 0.90-0.92x at 16 (BENCHMARKS.md, session 48). The avx512bf16 build's dot products (bf16 x over
// bf16 weights) take two panels in prefill too, straight from the packed weights (a panel's pairs
// are one vector, nothing to widen): 12 dot-product chains, not 6; M=256 on a Zen 5 0.64x the time,
// from 0.66x oneDNN's bf16 GEMM to 1.04x (session 48). AVX2 already has two vectors a panel row:
// one panel there. Up to 18 rows (AVX-512: 24), the row blocks (ROW_BLOCKS) re-read (from L1, a
// chunk of K at a time: CHUNK below) and re-widen a thread's weights; beyond (prefill), each panel
// of 16-bit weights is widened once into an fp32 buffer that every row block reads (measured:
// direct wins below 19 rows, widened above; BENCHMARKS.md, session 12; but on AMD's AVX2 cores
// fp16 is read directly at every M: PREFILL_READS_FP16 below). The whole panel, K x 16
// floats (36-98 KB for the default model: L2; twice that on AVX-512, two panels), not chunks in
// L1: as fast on avx2 at M=256 (172-179 GFLOP/s in blocks of 128 pairs of k, 175-189 whole;
// BENCHMARKS.md, session 20). What makes it fast is what the loop does not do: every shape and
// dtype is a compile-time constant (no flag tests, no spilled row pointers), and x is fp32 before
// the call, so a broadcast is one load. `bench.py kernels` counts the instructions per FMA of the
// inner loops.
// PREFILL_READS_FP16 (set by kernels.build_command: 1 on AMD's AVX2-only cores, Zen 1-3): prefill
// over fp16 weights skips the widened copy, and each row block's tiles read the packed panel
// itself, widening as they go with the decode tiles' vcvtph2ps from memory. On a Zen 3 that
// conversion takes no FMA pipe (session 57), and the packed panel (K * 32 bytes: 18 KB at K=576)
// stays in L1, where the fp32 copy (36 KB) did not. Whole forwards of the default model under
// dtype auto, taking turns with the copy (the Zen 3, 2 threads, the same bits): 19-64 rows, as
// verify steps of batches of 3-8 with every row's logits, 0.79-0.90x the time; prompts of 100, 423
// and 700 tokens 0.94x, 0.99x and 0.98x (BENCHMARKS.md, session 58). On Intel's cores the
// conversion takes one of the two FMA ports (session 56): a 6-row tile would give 2 of every 14
// of their slots to it, so their AVX2 build keeps the copy (not measured). Neither changes a bit.
#define PANEL 16
#define PV (PANEL / LANES)  // vectors per panel row
#define WIDE (LANES == 16 ? 2 : 1)
// The rows of a row block: AVX2 keeps 6 rows x 2 vectors of accumulators in 12 of its 16 registers,
// SSE 2 rows x 4 in 8. AVX-512 keeps a panel row in one vector and has 32 registers, so a verify
// step of up to 16 rows is one block of up to 16 accumulators: each weight is widened once and
// every FMA chain overlaps 6 others or more. As 6 + 2 or 6 + 3 rows, the last block had 2-3 chains
// against an FMA latency of 4 and re-read the panel (default model, avx512bf16 on a Zen 4, paired
// with a control build: T=7-12 forwards 6-8% faster, T=13-16 3-7%). 17 and 18 rows go as two blocks
// of 9 (8 + 9, 9 + 9): as one block, 18 accumulators and 18 broadcasts spilled (T=18 2x slower;
// BENCHMARKS.md, session 27), and as 6 + 6 + 5 or 6, as before session 49, each block had 5-6
// chains and re-read the panel (on a Zen 5, the default model's body linears at 17 and 18 rows took
// 0.87x and 0.92x the time as 8 + 9 and 9 + 9 over fp16 weights, 0.80x and 0.79x in the bf16 dot
// product). The same bits: a row's chain never depends on its block. So every build splits its rows
// into B blocks, the fewest of at most MAX_BLOCK rows (up to 3 MAX_ROWS rows; prefill: of at most
// MAX_ROWS), near-equal in size: block i starts at row M i / B. On AVX2 7 = 3 + 4, 8 = 4 + 4,
// 9 = 4 + 5, 13 = 4 + 4 + 5, not 6 + 1, 6 + 2, 6 + 3: a block of R rows has 2R chains, each taking
// a FMA every 4 cycles, so below 4 rows a block waits on the latency (6 + 3: 12 + 8 cycles a pair
// of k where 5 + 4 takes 10 + 8, the FMA ports' own limit). Measured on a Zen 3 (2 threads, each
// through 3,000 panels of K=576 from DRAM, best of 6 taking turns with the 6 + n build): 7 rows
// 0.88x the time, 8 rows 0.94x, 9 rows 0.85x; T=7-9 forwards 0.92-0.98x (BENCHMARKS.md, session
// 36). Prefill's blocks of 6 with what was left last made 19 rows 6 + 6 + 6 + 1, and a 1-row block
// (2 chains on AVX-512) takes most of a 6-row block's time: split evenly (4 + 5 + 5 + 5), the body
// linears at 19-31 rows took 0.94-0.97x the time on a Zen 5, on the avx2 emulation 0.96-0.99x at
// 5-25 rows (session 49). AVX-512's prefill blocks take 8 rows: its tile of two panels then keeps
// 16 chains, not 12 (16 accumulators, 2 weight vectors and a broadcast: 19 of its 32 registers),
// and 19-24 rows go as a verify step's 2 blocks, each weight widened once a block (as prefill
// they were 4 blocks of 5-6 rows over a widened copy). On an Intel Xeon (Emerald Rapids, 2 threads,
// avx512bf16, dtype auto, whole forwards taking turns with blocks of 6, the same bits): T=20 and 24
// 0.77x and 0.83x the time, T=64 0.97x, T=256 0.98x, a 700-token prefill 0.99x; under --dtype
// bfloat16 (the dot product) T=20 0.91x, T=256 0.97x; `bench.py kernels` (avx512) at M=256 read
// 0.91-1.14x torch's fp32 GEMM in five runs, 0.80-1.14x in three with blocks of 6 (BENCHMARKS.md,
// session 52; session 48 had measured 8 rows 1-5% faster there, the same on a Zen 5).
#define MAX_ROWS (LANES == 4 ? 2 : LANES == 16 ? 8 : 6)
// the most rows one block can have (a tile's accumulators)
#define MAX_BLOCK (LANES == 16 ? 16 : MAX_ROWS)
#define CEIL(a, b) (((a) + (b) - 1) / (b))  // a / b rounded up
// Prefill: more rows than a verify step has (up to 18; AVX-512 24), in blocks of MAX_ROWS and
// tiles of WIDE panels, x read in place; decode and verify in blocks of up to MAX_BLOCK (several:
// chunk by chunk of k, CHUNK below), fp16 weights' x interleaved (linear; on AVX2 only where a
// block has 6 rows: INTERLEAVED below). The one threshold every choice keys on. Where prefill
// reads fp16 weights as packed (PREFILL_READS_FP16), it takes 10 rows and more (two blocks of 5-6
// rows, or more blocks): on the Zen 3, whole forwards at 10-12 rows took 0.95-0.96x the time,
// 13-18 rows 0.93-0.95x (taking turns with the verify step's chunked blocks, context 100, 15
// rounds; 9 rows, below both thresholds, read 1.00x). From 7 rows (blocks of 3-5 rows, each
// walking the whole panel), 7 and 9 rows took 1.05x (session 58).
#define PREFILL(M) ((M) > (PREFILL_READS_FP16 ? 9 : 3 * MAX_ROWS))
#define ROW_BLOCKS(M) CEIL(M, PREFILL(M) ? MAX_ROWS : MAX_BLOCK)  // B; block i from row M i / B
// Decode and verify over fp16 weights read x interleaved (linear, "x interleaved"), but on AVX2
// only where a row block has 6 rows (6 rows; on Intel's cores 11, 12 and 16-18 too): blocks of at
// most 5 rows read their rows in place, with no copy before the tiles (nor a wait for the other
// threads' share of it), and their loops keep the same instructions (43 for 20 FMAs at 5 rows; at
// 6 rows GCC keeps the row pointers on the stack, 67 for 24 where interleaved takes 46, so 6-row
// blocks stay interleaved). The default model's 120 body linears, taking turns with the build
// before on the Zen 3 (2 threads, the same bits): 2-5 rows 0.88-0.97x the time; whole forwards of
// 2-5 rows at contexts 100 and 700 0.97-1.00x (two runs of 15 rounds; session 59). 7-9 rows (3 + 4,
// 4 + 4, 4 + 5) too from session 60: forwards of 7-9 rows at context 100 0.97-0.98x the time, 9 at
// 700 0.97x (T=1, the same code, 0.995x; 15 rounds). Not measured on AVX-512, which keeps the copy.
// The call works out whether it interleaves once, and hands its tiles M there, 0 elsewhere (xm):
// a tile that worked it out from M itself kept the divisions in its loop (1.1-1.5x slower).
#define INTERLEAVED(M) ((LANES == 8 ? CEIL(M, ROW_BLOCKS(M)) == MAX_ROWS : (M) >= 2) && !PREFILL(M))
// A tile prefetches its weights AHEAD pairs of k ahead: with the hardware prefetchers alone the
// stream stalls while a tile of several rows computes (a T=9 forward 6% slower on AVX512-BF16, 21%
// on AVX2, session 10). Into L2 (prefetcht1), not non-temporal: prefetchnta, landed for a
// 2-5% gain at T=1 on a Zen 4 (session 28), made an Intel Xeon's linears (H200 host, avx512
// build, 2 threads, all 121 shapes taking turns) 1.5x slower at M=1 and 1.6x at M=256 (with 16
// threads 1.5x and 1.2x): there the stream loses the L2 prefetchers, as session 23 had seen on a
// Sapphire Rapids. On the Zen 3 (avx2) the hints are within 2% of each other at T=1-256
// (BENCHMARKS.md, session 39). Not where a tile reads AVX-512 prefill's widened copy of two panels
// (pv = WIDE * PV, "not a copy" below): written just before, it is in cache already, and the
// prefetches only took load slots (a 700-token prefill 0.955-0.984x the time on a Zen 5, on both
// AVX-512 builds; session 49). AVX2's copy (one panel) is read by the instance that fp32 weights'
// decode tiles need prefetching in; dropped there, the prefetches measured within the noise.
// AHEAD, set by kernels.build_command (-DAHEAD), is 64 pairs (4 KB of fp16 weights), but 32 on
// AMD's AVX2-only cores (a Zen 3 measured) and in the generic build (not measured). On a Zen 5
// (avx512bf16, fp16 weights under dtype auto: 2 KB of a panel ahead, then 4 KB), 60 linears from
// DRAM at M=9 and 16 took 0.88-0.89x the time, M=5 0.95x, M=1 0.96x; whole forwards T=1 0.975x, T=5
// 0.965x, T=9 0.93x, T=16 0.92x, a 700-token prefill 0.99x; bf16 and fp32 weights within the noise
// (session 51). 96 and 128 pairs measured no better than 64. On a Zen 3 (avx2) 64 pairs took M=1
// and T=1 1.04x the time and 16 pairs M=5 1.05x (session 38), and 64 or 128 measured within the
// noise on a Zen 4 (session 24, avx512bf16, when the tiles were slower). Intel's cores want the
// longer lead on AVX2 too: on an Emerald Rapids Xeon under NANOSPEC_ISA=avx2 (Golden Cove cores,
// those of Intel's client CPUs since Alder Lake), 64 pairs made whole forwards T=1 0.89-0.94x the
// time at 100-2,000 tokens, T=5 0.93-0.94x, T=9 within the noise (96 and 128 alike); its avx512bf16
// build read 0.97-1.03x with 96 and 128 (session 56). A decode row takes about 3.6 ns a pair there,
// so 32 pairs ahead is some 115 ns: no more than a read from DRAM takes.
// A verify step of 7-18 rows in 2-3 row blocks (ROW_BLOCKS; on AVX-512 only 17-24 rows take more
// than one; where PREFILL_READS_FP16, 7-9 rows in 2) walks each panel in chunks of CHUNK pairs of k
// (4 KB of fp16 weights), every row block through a chunk before the next chunk, the blocks'
// accumulators kept in `sums` between chunks. The second block's pass then reads the chunk from L1
// while the first block's prefetches keep the memory stream going; with each block walking the
// whole panel, memory sat idle while the later blocks re-read it from cache. A T=9 forward
// 29.5-30.9 ms instead of 32.1-33.6 on avx2, 26.7-27.6 instead of 31.0-33.2 on avx512, on a
// Sapphire Rapids Xeon (chunks of 8 to 128 pairs no faster there; BENCHMARKS.md, session 22).
// Storing and reloading an fp32 sum keeps its bits: the chain is the same. The later blocks
// prefetch a chunk further ahead than the first (AHEAD + CHUNK pairs), so that memory streams
// through their passes too: the first block's prefetches then find the next chunk on its way (30
// matrices of 3072 x 576 at M=9, from DRAM, paired over 20-30 rounds beside an identical control
// build: 2.2% faster on avx2, 2.1% on avx512bf16; M=13 2.9% and 0.9%; BENCHMARKS.md, session 26).
// Chunks of 64 pairs, not 16: on a Zen 3 (avx2, native), the default model's linears at 7-13 rows
// took 0.93-0.94x the time, T=9 forwards 0.93x, 5 rows (no chunks) 1.00x (taking turns with 16
// every call, 150 pairs); 32 and 128 pairs of k were slower than 64. Each chunk's restart (the sums
// stored and reloaded, the loop's ramp) comes a quarter as often (BENCHMARKS.md, session 38).
#define CHUNK 64

static inline vf splat(float s) { return s - (vf){}; }  // s - 0 is s, even -0: one broadcast

// The weights of one half (k even: 0, odd: 1) of a pair for LANES columns (v: which slice of 16).
// wt, the packed weights' type: 0 fp32, 1 bf16 (a shift or a mask widens it), 2 fp16 (F16C's
// vcvtph2ps widens LANES of them in one instruction, straight from memory).
static inline vf widen(const char *pair, int v, int half, const int wt, const int pv) {
    if (wt != 1) return load_vf(pair + (half * pv + v) * LANES * (wt ? 2 : 4), wt);
    vu u = *(const vu_u *)(pair + v * LANES * 4);
    return (vf)(half ? u & 0xFFFF0000u : u << 16);
}

// y rows m0.. of the tile, + bias, rounded to bf16 or stored as fp32; the last panel may be
// partial.
static inline void store_tile(const vf *acc, const void *bias, void *y, int64_t m0, int p0, int N,
                              const int R, const int pv, int y_bf16) {
    int elem = y_bf16 ? 2 : 4;
    for (int r = 0; r < R; r++)
        for (int v = 0, n0 = p0 * PANEL; v < pv && n0 < N; v++, n0 += LANES) {  // (not the padding)
            vf out = acc[r * pv + v];
            char *dst = (char *)y + ((m0 + r) * N + n0) * elem, tmp[LANES * 4];
            for (int j = 0; bias && j < LANES && n0 + j < N; j++)
                out[j] += get(bias, n0 + j, y_bf16);
            store_vf(n0 + LANES <= N ? dst : tmp, out, y_bf16);
            if (n0 + LANES > N) __builtin_memcpy(dst, tmp, (N - n0) * elem);  // a partial vector
        }
}

// One tile: rows m0..m0+R-1, panel p0 (and the ones after it: pv vectors a row, PV a panel), the
// pairs of k kp0..kp1-1 (all of them, or a chunk), with the tile's weights at w. R, pv and the
// dtypes are constants in each instance (tile_rows), so the accumulators live in registers. After
// the last pair it adds the bias and writes y. wt 3: bf16 weights under bf16 x, one dot product a
// pair of k (AVX512-BF16; a panel is one vector there): x's pair is one 32-bit word, broadcast, and
// the weights' pair layout is what the instruction takes, so nothing is widened; the tile reads its
// panels where they are packed, K2 * 64 bytes apart (prefill's tiles of WIDE panels too). xm, for
// fp16 weights (wt 2) in decode and verify where INTERLEAVED: the call's rows, x being all of them
// interleaved, [k][xm] (linear); else 0, x read in place.
static inline __attribute__((always_inline)) void
tile(const void *x, const char *w, const void *bias, void *y, int64_t xm, int64_t m0, int p0, int N,
     int64_t K2, int64_t kp0, int64_t kp1, vf *sums, const int R, const int pv, const int wt,
     int y_bf16) {
    if (R > MAX_BLOCK) return;  // (a row count no call has: not compiled)
    vf acc[MAX_BLOCK * PV * WIDE];  // acc[r * pv + v]: from zero, or the sums of the pairs to kp0
    for (int i = 0; i < R * pv; i++) acc[i] = kp0 ? sums[i] : (vf){};
    const int64_t pair_bytes = (wt == 3 ? PV : pv) * LANES * (wt ? 4 : 8);  // (wt 3: a panel's)
    for (int64_t kp = kp0; kp < kp1; kp++) {
        const char *pair = w + kp * pair_bytes;
        for (int line = 0; (wt || pv == PV) && line < pair_bytes; line += 64)  // (not a copy)
            __builtin_prefetch(pair + (m0 ? AHEAD + CHUNK : AHEAD) * pair_bytes + line, 0, 2);
#ifdef __AVX512BF16__
        for (int i = 0; wt == 3 && i < R * pv; i++)  // row i / pv's pair of x, both halves
            acc[i] = _mm512_dpbf16_ps(
                acc[i], (__m512bh)((vu){} + ((const uint32_t *)x)[(m0 + i / pv) * K2 + kp]),
                (__m512bh) * (const vf_u *)(pair + i % pv * K2 * 64));  // panel i % pv's pairs
#endif
        if (wt == 3) continue;  // (a build without AVX512-BF16 is never asked for wt 3: no loop)
        for (int half = 0; half < 2; half++) {  // k = 2 kp, then 2 kp + 1: the chain's order
            vf wk[PV * WIDE];
            for (int v = 0; v < pv; v++) wk[v] = widen(pair, v, half, wt, pv);
            for (int r = 0; r < R; r++) {
                int64_t k = 2 * kp + half, at = (m0 + r) * 2 * K2 + k;
                if (wt == 2 && xm) at = k * xm + m0 + r;  // (x interleaved: linear)
                vf xk = splat(((const float *)x)[at]);
                for (int v = 0; v < pv; v++) acc[r * pv + v] += xk * wk[v];  // FMA
            }
        }
    }
    // To go on from kp1, or to store: store_tile reads `sums`, never acc. Handed acc itself, GCC
    // kept the accumulators in a stack array around the loop, and every chunk's restart copied
    // them twice through memory, store by reload (paired with a control build: a T=9 forward 3-6.5%
    // faster on avx2 in three runs, T=18 6.6% on avx512bf16; BENCHMARKS.md, session 27).
    for (int i = 0; i < R * pv; i++) sums[i] = acc[i];
    if (kp1 == K2) store_tile(sums, bias, y, m0, p0, N, R, pv, y_bf16);
}

// Every row count a tile can have, each compiled as its own instance (7-16: AVX-512 only).
// Prefill's tiles of WIDE panels only ever have up to MAX_ROWS rows, but are compiled at every
// count too: pruned to 6 or 8 rows, GCC 12 kept the 6-row tile's row pointers on the stack (68
// instructions and 24 loads for its 24 FMAs, against 60 and 16) and it ran 1.06x slower on a Zen 5.
#define ROWS(R)                                                                                    \
    case R:                                                                                        \
        tile(x, w0, bias, y, xm, m0, p0, N, K2, kp0, kp1, sums, R, pv, wt, y_bf16);                \
        break;
#define ROWS4(R1, R2, R3, R4) ROWS(R1) ROWS(R2) ROWS(R3) ROWS(R4)
static inline __attribute__((always_inline)) void
tile_rows(const void *x, const char *w0, const void *bias, void *y, int64_t xm, int64_t m0, int p0,
          int N, int64_t K2, int64_t kp0, int64_t kp1, vf *sums, int rows, const int pv,
          const int wt, int y_bf16) {
    switch (rows) { ROWS4(1, 5, 9, 13) ROWS4(2, 6, 10, 14) ROWS4(3, 7, 11, 15) ROWS4(4, 8, 12, 16) }
}

// The tiles of one thread: its share of the panels, one at a time; every row block walks a panel
// while its weights are in this core's cache. With 16-bit weights and several row blocks (prefill,
// `blocked`) a tile takes WIDE panels (the thread's share is whole tiles: linear): the FMA path
// widens them once into `scratch`, side by side (K * 16 * WIDE floats); the dot product (wt 3)
// reads them as packed.
static inline __attribute__((always_inline)) void
linear_panels(const void *x, const void *w, const void *bias, void *y, int64_t M, int N, int64_t K2,
              int first, int last, float *scratch, const int wt, int y_bf16) {
    // Prefill over 16-bit weights: tiles of WIDE panels, from the widened copy; but fp16 weights
    // straight from the packed panel where the build says so (PREFILL_READS_FP16, below)
    int blocked = wt && PREFILL(M) && !(PREFILL_READS_FP16 && wt == 2);
    int64_t blocks = ROW_BLOCKS(M), chunk = blocks > 1 && !PREFILL(M) ? CHUNK : K2;
    int64_t xm = wt == 2 && INTERLEAVED(M) ? M : 0;  // (tile)
    // the row blocks' accumulators between chunks, or on their way to y
    vf sums[3 * MAX_ROWS * PV * WIDE];
    for (int p0 = first; p0 < last; p0 += blocked ? WIDE : 1) {
        const char *w0 = (const char *)w + p0 * K2 * PANEL * (wt ? 4 : 8);
        // Prefill: the panel's pairs of k widened from 16 bits once into an fp32 copy that every
        // row block then reads (fp32 layout: [pair][2][WIDE * 16])
        for (int64_t kp = 0; blocked && wt != 3 && kp < K2; kp++)
            for (int half = 0; half < 2; half++)
                for (int v = 0; v < WIDE * PV; v++)  // panel p0 + v / PV
                    *(vf_u *)(scratch + ((kp * 2 + half) * WIDE * PV + v) * LANES) =
                        widen(w0 + (v / PV * K2 + kp) * PANEL * 4, v % PV, half, wt, PV);
        for (int64_t kp0 = 0; kp0 < K2; kp0 += chunk)
            for (int64_t i = 0; i < blocks; i++) {
                int64_t m0 = M * i / blocks, rows = M * (i + 1) / blocks - m0;
                int64_t kp1 = kp0 + chunk < K2 ? kp0 + chunk : K2;
// (each row block's sums at its own rows where the blocks take turns a chunk at a time; with one
// chunk, each tile's sums go to y at once, and every tile's start at sums[0])
#define TILES(PVS, WT)                                                                             \
    tile_rows(x, blocked && wt != 3 ? (const char *)scratch : w0, bias, y, xm, m0, p0, N, K2, kp0,\
              kp1, sums + (chunk < K2 ? m0 * PV : 0), rows, PVS, WT, y_bf16)
                blocked ? TILES(WIDE * PV, wt == 3 ? 3 : 0) : TILES(PV, wt);
            }
    }
}

#ifdef __AMX_BF16__
// Intel AMX (Xeons since Sapphire Rapids): one tdpbf16ps multiplies 16 rows x 32 k of bf16 x by
// 32 k x 16 columns of bf16 weights into 16 x 16 fp32 sums, 8,192 multiply-adds every 16 cycles:
// 16 times what AVX-512 FMAs do in that time.
// Each output is still one fixed chain, the k-blocks of 32 in order, of its own row and column
// alone (measured: a row in a tile of 1 row gets the bits it gets among 16). So the AMX build takes
// it at every M, decode included, wherever K is a multiple of 32 (a fact of the layer, never of the
// step).
//
// bf16 alone leaves the fp32 model's greedy output within a few tokens (BENCHMARKS.md, session
// 21), so under --dtype auto (fp32 x, fp16 weights) each operand is split in two bf16 halves:
// x = x_hi + x_lo (16 of fp32's 24 bits) and w = w_hi + w_lo (exact: fp16 has 11 bits) and each
// block of 32 k adds x_hi w_hi, then x_lo w_hi, then x_hi w_lo (x_lo w_lo, ~2^-17 of a product,
// is left out). Three products instead of one, from weights that stay fp16 in memory: decode
// reads the bytes it read, greedy output stays with the fp32 model's, and prefill runs at twice
// the FMA path's speed (BENCHMARKS.md, session 21). w_hi is w's top 16 bits (a mask), w_lo the
// exact rest (a subtraction), each pair of k joined into a word (a shift and an or) from the fp16
// layout's two vectors a pair. The first row block splits each block of 16 pairs of k just
// before its products (the blocks 2 ahead prefetched: without, decode waited for memory), into a
// buffer of the whole panel pair that the other row blocks read, or, where it is the only row
// block (decode, verify), into one block's 4 KB, which stays in L1 (M=1 15% faster than writing
// through the whole panel's buffer; splitting the next block before this one's products measured
// within the noise; BENCHMARKS.md, session 21). Each panel's part of a block is split just before
// its own first product, the second panel's after the first panel's: the tile unit multiplies
// while the vector units split. Until session 53 one loop split both panels, alternating between
// them (27 instructions for each 64 bytes of weights, 17 now), then all six products ran. On an
// Intel Xeon (Emerald Rapids, 2 threads, taking turns with that build, the same bits): the default
// model's 121 linears, cold, at M=1 0.86-0.88x the time, M=9 0.90-0.98x, M=64 and 256
// 0.97-0.99x; whole forwards T=1-9 0.88-0.95x, a 700-token prefill 0.95-1.00x. About half of it is
// the shorter loop (both panels split first, then the products: M=1 1.05x the time of splitting
// between them). All six products of one panel in a row (three on one accumulator, each waiting
// for the last) made prefill 1.06-1.10x slower. bf16 x and weights (--dtype bfloat16) take one
// product: their weights are tile rows as packed (a pair of k in each 32-bit word, 16 columns a
// 64-byte row).
//
// Tiles 0-1 hold the sums of one row block x 2 panels, 4-5 x_hi and x_lo, 6-7 the panels'
// weights. A row block is min(M, 16) rows; the last one starts at M - 16 and recomputes rows the
// one before wrote (the same bits); past the thread's last panel the second panel repeats the
// first: tile shapes stay one configuration a call. (Not inlined: inside linear's parallel region
// it kept the FMA tiles' accumulators on the stack, 37 instructions for 12 FMAs instead of 19.)
static void split_weights(const char *w, int64_t pairs, vu *out) {
    for (int64_t i = 0; i < pairs; i++, w += 64) {  // out[pair][4][16]: hi at 0, lo at 2
        __builtin_prefetch(w + 32 * 64);  // 2 blocks ahead: decode would wait for memory
        vu k0 = (vu)load_vf(w, 2), k1 = (vu)load_vf(w + 32, 2);
        vu hi0 = k0 & 0xFFFF0000u, hi1 = k1 & 0xFFFF0000u;  // exact: the low bits go to lo
        out[i * 4] = hi1 | hi0 >> 16;
        out[i * 4 + 2] = (vu)((vf)k1 - (vf)hi1) | (vu)((vf)k0 - (vf)hi0) >> 16;
    }
}

static __attribute__((noinline)) void amx_panels(const bf16 *x, const char *w, const void *bias,
                                                 void *y, int64_t M, int N, int64_t K2, int first,
                                                 int last, int split, int y_bf16, vu *own) {
    float out[2][16 * 16] __attribute__((aligned(64)));
    int rows = M < 16 ? (int)M : 16, stride = split ? 256 : 64;
    // palette 1; each tile's bytes a row (16-bit, from byte 16) and rows (from byte 48)
    uint8_t config[64] __attribute__((aligned(64))) = {1};
    for (int t = 0; t < 8; t++) config[16 + 2 * t] = 64, config[48 + t] = t < 6 ? rows : 16;
    _tile_loadconfig(config);
    for (int p0 = first; p0 < last; p0 += 2) {
        const char *w0 = w + p0 * K2 * 64, *w1 = p0 + 1 < last ? w0 + K2 * 64 : w0;
        for (int64_t m = 0; m < M; m += 16) {
            int64_t m0 = m + rows > M ? M - rows : m;
            _tile_zero(0);
            _tile_zero(1);
            for (int64_t kp = 0; kp < K2; kp += 16) {
                const char *h0 = w0 + kp * 64, *h1 = w1 + kp * 64;  // bf16: the packed tile rows
                vu *block = own + kp * 4 * (M > 16);  // (one row block: always the first)
                if (split) h0 = (const char *)block, h1 = h0 + 64;  // (the halves, split below)
                _tile_loadd(4, x + 2 * (m0 * K2 + kp), 4 * K2);
                if (split && !m) split_weights(w0 + kp * 64, 16, block);  // (its w_hi, w_lo: 0, 2)
                _tile_loadd(6, h0, stride);
                _tile_dpbf16ps(0, 4, 6);
                if (split && !m) split_weights(w1 + kp * 64, 16, block + 1);  // (1 and 3)
                _tile_loadd(7, h1, stride);
                _tile_dpbf16ps(1, 4, 7);
                if (!split) continue;
                _tile_loadd(5, x + 2 * ((M + m0) * K2 + kp), 4 * K2);  // x_lo
                _tile_dpbf16ps(0, 5, 6);
                _tile_dpbf16ps(1, 5, 7);
                _tile_loadd(6, h0 + 128, stride);  // w_lo
                _tile_loadd(7, h1 + 128, stride);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
            }
            _tile_stored(0, out[0], 64);
            _tile_stored(1, out[1], 64);
            for (int i = 0; i < 1 + (w1 != w0); i++)  // (a repeated panel: stored once)
                store_tile((vf *)out[i], bias, y, m0, p0 + i, N, rows, PV, y_bf16);
        }
    }
    _tile_release();  // (the kernel then saves no tile state at a context switch)
}
#endif

// The MLP's gating, for the down projection's rows (linear's `gated`): silu(g) u for LANES of
// rows [g | u], fp32 or bf16 (type), g at p and u `half` bytes on, silu(g) = g / (1 + e^-g), or
// g e^g / (1 + e^g) below 0 (exp_vf takes x <= 0). One formula for every row at every M, like
// torch's (not bit for bit the same as torch's: within an ulp or two); bf16 rounds silu(g) to
// bf16 before the product, as torch's two ops do (the caller rounds the product). Whole vectors:
// K, the up half's width, is a multiple of 16 (kernels.silu_mul_linear gates only then), so a
// row's last vector never reads past its end.
static inline vf silu_mul_vf(const char *p, int64_t half, int type) {
    vf g = load_vf(p, type), e = exp_vf((vf)((vu)g | 0x80000000u));  // e^-|g|
    vu s = (vu)(g * select_vf(g < 0, e, splat(1.0f)) / (1.0f + e));
    if (type) s = ROUND_BF16(s) << 16;  // to nearest even, as store_vf
    return (vf)s * load_vf(p + half, type);
}

// x: fp32 rows of K (even; kernels.py pads), or bf16 rows (x_bf16: AMX or AVX512-BF16's dot
// product, W bf16 too). amx: the tiles take the product (an amx build, K a multiple of 32, bf16 x
// or fp16 weights: kernels.linear_args decides); fp32 x is split into halves, x_hi rows first. W
// packed fp32, bf16 or fp16 (wt 0, 1, 2; fp16 needs F16C); y and its bias fp32 or bf16 (y_bf16).
// scratch: K * 32 floats a thread, after M * K for x's copy (up to 3 MAX_ROWS rows, or AMX's
// halves: kernels.c_linear). What changes from call to call comes first; the layer's own come as
// one array, `layer`, that kernels.linear_args fills once a layer: w, bias, N, K, x_bf16, amx, wt,
// y_bf16. (ctypes converts each argument of every call, about 0.25 us each: 14 arguments took
// 3.8 us a call, 7 take 2.1, and a decode step makes 121 of these calls: T=1 forwards 0.98-0.99x
// the time on the Zen 3, taking turns every forward, 150 pairs; session 39.)
// norm (an RMSNorm's weight, eps): x's rows are first x + residual, normed, in place, as rms_norm
// does with a residual (x and residual written over: kernels.rms_norm_linear). A layer's two norms
// each go with the projection after them: one C call instead of two, 59 fewer a decode step.
void linear(const void *x, void *y, int64_t M, float *scratch, int threads, const int64_t *layer,
            int gated, void *residual, const void *norm, float eps) {
    const void *w = (const void *)layer[0], *bias = (const void *)layer[1];
    int N = layer[2], K = layer[3], x_bf16 = layer[4], amx = layer[5], wt = layer[6];
    int y_bf16 = layer[7], vectors = CEIL(K, LANES), step = amx ? 2 : PREFILL(M) ? WIDE : 1;
    if (norm) rms_norm(x, residual, norm, (void *)x, residual, M, K, eps, x_bf16);
    // (in whole tiles of WIDE panels, as pack_weight pads them to pairs: on AVX-512 a panel past N
    // is zeros, computed, never stored)
    int64_t K2 = K / 2, num_panels = CEIL(N, WIDE * PANEL) * WIDE;
    // Decode and verify over fp16 weights (dtype auto on AVX2, where most users are): x interleaved
    // into `scratch` as [k][M] (x transposed: at each k, the M rows side by side), so that a tile
    // reads all its rows' broadcasts through one pointer. With a pointer a row, GCC kept six of
    // them on the stack and reloaded them every k: 6 of the 52 instructions for 24 FMAs of the
    // 6-row tile on avx2. (Until session 49 each row block had its own [k][its rows]; finding a
    // row's block took the copy a division a row and vector, and three once blocks were split
    // evenly: [k][M] needs none, and the gated copy at 9-13 rows took 0.95-0.98x the time.)
    // Prefill's blocked tiles, the other weight types and AVX2's blocks of up to 5 rows
    // (INTERLEAVED) read x in place (for prefill the copy cost more than it saved; for blocks of
    // up to 5 rows the copy and the wait after it cost more than the 5 row pointers). One row
    // is the same either way. Gated rows (the MLP's down projection, at every M) are always
    // copied, as silu(g) u, in the layout their tiles read.
    // (elem: the bytes of an element of x; only gated rows come in bf16)
    int interleaved = !amx && wt == 2 && INTERLEAVED(M), elem = x_bf16 ? 2 : 4;
    int64_t copied_rows = (amx && !x_bf16) || interleaved || gated ? M : 0;
    const void *rows = copied_rows ? scratch : x;  // (x's copy: the start of scratch)
    // Each thread takes runs of panels (below) and walks every row through them: its weights stay
    // in its cache while the rows pass, and which thread computes an output never changes its
    // value. The interleaving before the tiles shares the threads too (one parallel region for
    // both: a T=9 forward 2% faster on avx2, session 19). Interleaved rows are split between the
    // threads by k, LANES of k at a time (i: a vector of k, j: a row), so that each thread writes
    // its own cache lines: split by rows, the two threads wrote the rows of one block, side by side
    // in the same lines, and each store waited for the line to come back from the other core (at
    // M=9 and K=576 the copy took 8.8 us a call instead of 1.9, and a T=9 forward of the default
    // model 1.04-1.10x longer). Row-major copies (a prefill's gated rows, AMX's halves) stay split
    // by rows (i: a row, j: a vector of k): each thread's rows are then one run of memory, and
    // split by k a 700-row gated copy took 1.7x as long (BENCHMARKS.md, session 26).
#pragma omp parallel num_threads(threads) if (M * N * (int64_t)K > 1 << 16)
    {
#pragma omp for collapse(2)
        for (int64_t i = 0; i < (interleaved ? vectors : copied_rows); i++)
            for (int64_t j = 0; j < (interleaved ? copied_rows : vectors); j++) {
                int64_t m = interleaved ? j : i, k0 = (interleaved ? i : j) * LANES;
                const char *gate = (const char *)x + (m * 2 * K + k0) * elem;  // (gated rows)
                vf v = gated ? silu_mul_vf(gate, K * elem, x_bf16) : (vf){};
                // Vectorized: each k's arithmetic is its own, so the bits are the same. Bounded by
                // `k < k0 + LANES && k < K`, GCC could not count the iterations and left the loop
                // scalar, and AMX's halves of fp32 rows made a T=9 forward 1.02-1.07x as long on
                // the amx build, a 256- or 700-token prefill 1.13-1.15x (an Emerald Rapids, whole
                // forwards taking turns; the FMA builds' copies within the noise; session 53).
#pragma omp simd
                for (int64_t k = k0; k < (k0 + LANES < K ? k0 + LANES : K); k++) {
                    // x_hi (rounded as torch rounds), x_lo
                    bf16 *half = (bf16 *)scratch + m * K + k;
                    float value = gated ? v[k - k0] : ((const float *)x)[m * K + k];
                    if (!x_bf16 && !amx)
                        scratch[interleaved ? k * M + m : m * K + k] = value;
                    else  // gated rows for bf16 tiles (AMX's or the dot product's), or AMX's x_hi
                        half[0] = to_bf16(value);
                    if (amx && !x_bf16) half[M * K] = to_bf16(value - to_f32(half[0]));  // x_lo
                }
            }
        // (past x's copy; see linear_panels, amx_panels)
        float *own = scratch ? scratch + (copied_rows + omp_get_thread_num() * 2 * PANEL) * K : 0;
        // The panels go out `step` at a time (the tile's panels: AMX's take two, AVX-512 prefill's
        // WIDE; others one, so that 36 panels over 16 threads are at most 3 a thread, not 4 as in
        // pairs), "guided": each thread that comes for work takes half of what is left, then a
        // quarter, and so on down to one step. Two threads at the same pace thus read one run of
        // panels each, as equal shares gave them: a decode step's weights stream as before. Where
        // one core runs slower (another tenant's work on a shared host, or a slower core of a
        // hybrid CPU), the faster thread takes more of the end, where equal shares made every call
        // wait for the slower one. On the Zen 3 (avx2, 2 threads, the same bits), taking turns with
        // equal shares: in a slow phase of its host T=9 forwards 0.79x the time (every one of 21
        // rounds faster), T=5 at 700 tokens 0.87x, T=1 0.97x; in other phases T=5 and T=9
        // 0.93-1.00x, T=1 0.97-1.03x (one panel at a time or two alike). Linears alone: 576-3,072
        // columns at 5-9 rows 0.79-0.96x, at 1 row and the vocabulary projection within 2-4%.
        // Handed out two, four, 8 or 16 panels at a time (dynamic), the runs broke up: a decode row
        // took up to 1.3x the time (BENCHMARKS.md, session 57).
#pragma omp for schedule(guided) nowait
        for (int first = 0; first < num_panels; first += step) {
#ifdef __AMX_BF16__
            if (amx)
                amx_panels(rows, w, bias, y, M, N, K2, first, first + step, !x_bf16, y_bf16,
                           (vu *)own);
            else
#endif
#define PANELS(WT) linear_panels(rows, w, bias, y, M, N, K2, first, first + step, own, WT, y_bf16)
                // an instance per weight type (fp16 only on a build with F16C: kernels.linear_args)
                x_bf16 ? PANELS(3) : wt == 1 ? PANELS(1) : wt == 2 ? PANELS(2) : PANELS(0);
        }
    }
}

// -----------------------------------------------------------------------------------------------
// Paged attention for packed queries q [T, Hq, D] (rows at stride q_stride) over caches
// [num_blocks, block_size, Hkv, D]: the contract of torch_paged_attention, for prefill chunks,
// decode and verification alike. Keys 0..position are summed in segments of segment_keys
// positions (from 0), each on its own, then merged in order. A work item is one segment for up to
// QUERY_BLOCK consecutive queries of one sequence and one KV head with its group of query heads. It
// reads the segment's keys from the cache in chunks of LANES, widening each chunk once for all its
// queries and heads; each (query, head) then runs its own online softmax over the chunks it sees,
// into `partial`: the same arithmetic for a query at a given position whatever the step, block or
// item around it (and a decode step's few queries still give every thread work). D must be a
// multiple of 16.
// A tree node (tree_pos set, one query per item) reads logical keys 0..tree_pos[t], the last
// tree_width of them from the physical positions in its tree_keys row. q and out are fp32 or bf16;
// the caches are q's dtype, or fp16 under fp32 queries (--dtype auto: half the bytes a long
// context reads). The arguments up to scale are a layer's own; from cos_sin on they are the
// same in every layer of a step (kernels.c_paged_attention works them out once a step).
#define MAX_GROUP 16
#define MAX_DIM 256
// Blocks of up to 16 queries, not 8: a verify step of 9-16 tokens is then one block wherever its
// segments alone give the threads their items (past 512 tokens), and each chunk's keys are widened
// once for all its pairs, not twice. A T=9 or T=12 forward 0.95x the time at 2,500 tokens, 0.99x
// at 1,500, the same at 700 and for a 466-token prefill (the Zen 3, avx2, taking turns forward by
// forward with the old build; the attention call alone 0.91-0.96x at 1,500-3,000 tokens, 1.03x at
// 600, where the last segment is short; BENCHMARKS.md, session 42). The stack arrays below grow
// to 256 pairs (0.5 MB a thread, for MAX_GROUP heads a KV head).
#define QUERY_BLOCK 16

// i's log2(LANES) bits in reverse order
static const int REVERSED16[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
static inline int bit_reversed(int i) { return REVERSED16[i] / (16 / LANES); }

// blocks of w lanes of a and b, paired with the next w and summed
static inline vf fold(vf a, vf b, int w) {
    // w is a power of 2
    vi within = iota() & (2 * w - 1), lo = iota() + ((within >= w) & (LANES - w));
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, lo + w);
}

// Output lane bit_reversed(i) = the sum of v[i]'s lanes, by the same tree for every lane: LANES - 1
// shuffle pairs for LANES horizontal sums.
static inline vf sum_lanes(vf v[LANES]) {
    for (int n = LANES, w = LANES / 2; w > 0; n /= 2, w /= 2)
        for (int i = 0; i < n / 2; i++) v[i] = fold(v[2 * i], v[2 * i + 1], w);
    return v[0];
}

static inline __attribute__((always_inline)) void
attend(const void *q, const char *k_cache, const char *v_cache, const int64_t *table,
       float *partial, int t0, int num_queries, int kv_head, int num_keys, int num_heads, int group,
       int block_size, const int64_t *stride, float scale, const int64_t *remap, int remap_from,
       int64_t q_stride, int segment, int segments, int segment_keys, const int chunks,
       const int is_bf16, const int kv_type) {  // query t0 + i sees keys 0..num_keys + i - 1
    int head_dim = chunks * LANES, elem = is_bf16 ? 2 : 4, pairs = num_queries * group;
    int kv_elem = kv_type ? 2 : 4, all_keys = num_keys + num_queries - 1;
    int64_t ahead = 32 * stride[1] * kv_elem;  // bytes to 32 keys on: see the prefetch below
    vf qv[QUERY_BLOCK * MAX_GROUP][MAX_DIM / LANES], acc[QUERY_BLOCK * MAX_GROUP][MAX_DIM / LANES];
    vf keys[LANES][MAX_DIM / LANES], values[LANES][MAX_DIM / LANES], total[QUERY_BLOCK * MAX_GROUP];
    float max_score[QUERY_BLOCK * MAX_GROUP];
    // Pair i's query sees keys 0..seen[i] - 1: worked out once, not with a division by `group` a
    // pair and chunk (on a Zen 5, avx512bf16, T=5 and T=9 forwards at 700 and 2,000 tokens
    // 0.98-0.99x the time; the avx2 emulation the same; session 50)
    int seen[QUERY_BLOCK * MAX_GROUP];
    // pair i: query t0 + i / group, head i % group of the KV head's group
    for (int i = 0; i < pairs; i++) {
        int64_t at = (t0 + i / group) * q_stride + (kv_head * group + i % group) * head_dim;
        for (int c = 0; c < chunks; c++) {
            qv[i][c] = load_vf((const char *)q + (at + c * LANES) * elem, is_bf16);
            acc[i][c] = (vf){};
        }
        max_score[i] = -INFINITY, total[i] = (vf){}, seen[i] = num_keys + i / group;
    }
    for (int l0 = segment * segment_keys; l0 < all_keys && l0 < (segment + 1) * segment_keys;
         l0 += LANES) {
        // A chunk within one block (no tree path in it) has consecutive slots: one table lookup.
        int one_block = block_size % LANES == 0 && !(remap && l0 + LANES > remap_from);
        int64_t first = table[l0 / block_size] * stride[0] + l0 % block_size * stride[1];
        // Each key's lines are prefetched 32 keys ahead (`ahead`), K's and V's: a KV head's keys
        // sit one after another in the engine's head-major cache, across its blocks where their ids
        // follow each other (ensure_slots hands them out ascending), so 32 keys on is most often
        // the same head's key 32 positions later. An item reads only a segment of 512 keys, too
        // short a stream for the hardware's prefetchers to run far ahead: sampled on a Zen 5
        // (avx512bf16), a T=9 step at 2,000 tokens spent 30% of its attention on the first loads
        // of each chunk. With the prefetch, whole forwards taking turns with the build before
        // (identical outputs), the default model, dtype auto: T=1 at 700 and 2,000 tokens
        // 0.93x and 0.88x the time, T=9 at 700 and 2,000 0.97x and 0.94x, T=5 at 4,000 0.87x;
        // on the avx2 emulation 0.98-1.00x at T=1, 0.96-0.98x at T=9, 0.91x at T=5 over 4,000; a
        // 700-token prefill the same on both (BENCHMARKS.md, session 50). Sessions 17-18 had
        // measured no gain on avx2, when every chunk took several times the cycles it takes now.
        // A line past the pool, or of another head where the ids jump, is a wasted hint: a
        // prefetch never faults.
#pragma GCC unroll 16
        // key j in slot bit_reversed(j), the order sum_lanes wants (the loop unrolled, so that
        // bit_reversed(j) is a constant: at 2,000 keys, 12% faster on avx2, session 17)
        for (int j = 0; j < LANES; j++) {
            // Past the last key: the chunk's first, masked below. Never a slot beyond it, which
            // this sequence may not have written: the pool is uninitialized memory, and a weight
            // of 0 would not hide a NaN there (0 x NaN is NaN).
            int64_t l = l0 + j < all_keys ? l0 + j : l0;
            if (remap && l >= remap_from) l = remap[l - remap_from];  // a tree node's path
            int64_t at = one_block ? first + (l - l0) * stride[1]
                                   : table[l / block_size] * stride[0] + l % block_size * stride[1];
            at = (at + kv_head * stride[2]) * kv_elem;  // in bytes
            for (int line = 0; line < head_dim * kv_elem; line += 64)
                for (int kv = 0; kv < 2; kv++)
                    __builtin_prefetch((kv ? v_cache : k_cache) + at + ahead + line);
            for (int c = 0; c < chunks; c++) {
                keys[bit_reversed(j)][c] = load_vf(k_cache + at + c * LANES * kv_elem, kv_type);
                values[j][c] = load_vf(v_cache + at + c * LANES * kv_elem, kv_type);
            }
        }
        // Phase by phase over the (query, head) pairs, so that the CPU overlaps their independent
        // chains. Every pair takes every chunk: the block's last query sees the loop's every key,
        // and an earlier query's keys past its own weigh e^-inf = 0 (below). (Until session 50 a
        // count of "active" pairs stood here that always came to all of them.)
        vf p[QUERY_BLOCK * MAX_GROUP];
        for (int i = 0; i < pairs; i++) {
            // Each key's dot is its own chain over c; written c by c, the LANES chains interleave
            // in the code itself, where the CPU needs them to overlap (a T=5-64 item's attention
            // 4-6% faster on avx2, 2-4% slower on AVX-512's 16 chains of 4; session 19. On a Zen 5
            // key by key measured within the noise on avx512bf16, 1-2% slower on avx2; session 50).
            vf partial[LANES] = {};
            for (int c = 0; c < chunks; c++)
                for (int s = 0; s < LANES; s++) partial[s] += qv[i][c] * keys[s][c];
            vi valid = iota() < seen[i] - l0;
            p[i] = select_vf(valid, sum_lanes(partial) * scale, splat(-INFINITY));
        }
        // alpha: e^(old max - new max), 0 on the first chunk (e^-inf); by exp_vf, not libm's expf:
        // no call in the loop (attention 6-9% faster on avx2, session 17)
        for (int i = 0; i < pairs; i++) {
            // (a max is exact in any order; a compare, not fmaxf, whose NaN rules cost a T=1 step
            // 4% on avx2, session 21)
            float chunk_max = p[i][0];
            for (int j = 1; j < LANES; j++) chunk_max = p[i][j] > chunk_max ? p[i][j] : chunk_max;
            // where the max holds, e^0: skipping the rescaling keeps the same bits
            float alpha = chunk_max > max_score[i] ? exp_vf(splat(max_score[i] - chunk_max))[0] : 1;
            max_score[i] = chunk_max > max_score[i] ? chunk_max : max_score[i];
            p[i] = exp_vf(p[i] - max_score[i]);
            // The sum of the weights is kept lane by lane and summed across lanes once, after the
            // segment's last chunk: a horizontal sum every chunk sat on each pair's chain, and
            // attention took 0.92-0.98x the time without it at every shape timed (T=1-9 at
            // 100-2,000 tokens, a 466-token prefill, batch 3; avx2 on the Zen 3, a C harness
            // taking turns; BENCHMARKS.md, session 41). Every query still sums in one fixed order.
            total[i] = total[i] * alpha + p[i];
            for (int c = 0; alpha != 1.0f && c < chunks; c++) acc[i][c] *= alpha;
        }
        for (int i = 0; i < pairs; i++) {
            // Every key of the chunk, a constant count (the loop unrolled: attention 5-7% faster on
            // avx2, session 18): one query i does not see has p = e^-inf = 0 and a finite value
            // (past the last key, the chunk's first), so it adds +-0 and leaves acc's bits as they
            // were.
            for (int j = 0; j < LANES; j++)
                for (int c = 0; c < chunks; c++) acc[i][c] += p[i][j] * values[j][c];
        }
    }
    for (int i = 0; i < pairs; i++) {  // this segment's sums, in fp32
        int64_t head = (int64_t)(t0 + i / group) * num_heads + kv_head * group + i % group;
        float *at = partial + (head * segments + segment) * (head_dim + 2);
        // (its lanes summed by a fixed tree into lane 0: lane l += lane l + w)
        for (int w = LANES / 2; w > 0; w /= 2) total[i] += __builtin_shuffle(total[i], iota() + w);
        at[0] = max_score[i], at[1] = total[i][0];
        __builtin_memcpy(at + 2, acc[i], head_dim * 4);
    }
}

// Which sequence (*b) query t belongs to, and how many keys it sees: positions 0..its own (a tree
// node: 0..tree_pos[t]). Both of paged_attention's loops ask.
static inline int keys_seen(int t, const int64_t *query_start_loc, const int64_t *seq_lens,
                            const int64_t *tree_pos, int *b) {
    for (*b = 0; query_start_loc[*b + 1] <= t;) ++*b;
    return tree_pos ? (int)tree_pos[t] + 1 : (int)(seq_lens[*b] - query_start_loc[*b + 1]) + t + 1;
}

void paged_attention(void *q, void *k_cache, void *v_cache, void *out, float *partial,
                     float scale, const void *cos_sin, int64_t q_stride,
                     const int64_t *block_tables, const int64_t *seq_lens,
                     const int64_t *query_start_loc, const int64_t *slot_mapping, int num_seqs,
                     int max_blocks, int num_heads, int num_kv_heads, int head_dim, int block_size,
                     int is_bf16, int kv_type, int threads, const int64_t *tree_pos,
                     const int64_t *tree_keys, int tree_width, int segment_keys,
                     int64_t block_stride, int64_t slot_stride, int64_t head_stride) {
    int num_tokens = (int)query_start_loc[num_seqs], group = num_heads / num_kv_heads;
    const int64_t stride[3] = {block_stride, slot_stride, head_stride};  // the caches', in elements
    // Where slot_mapping is given, each row of q holds this step's query heads, then its key and
    // value heads: [T, Hq + 2 Hkv, D] (a layer's qkv). Where cos_sin [T, D] = [cos | sin] is given,
    // the query and key heads are first rotated in place (neox rotary), rounded like torch_rotary:
    // each product rounded, then their difference or sum. The keys and values then go into their
    // slots, rounded to the cache's type (kernels.store_kv's contract). One call a layer instead of
    // rotary, store_kv and attention, each token's part on a thread of its own from 2 tokens on.
    // In place, the rotary needs no buffer of its own, and the store finds a head's slot once, not
    // with two divisions an element; GCC vectorizes the rotary (kernels.build_command). Measured
    // against rotating into a buffer, then storing on one thread (avx2 and avx512bf16, identical
    // bits): a call of 5-9 queries at context 109 0.85-0.89 of the time, 9 at 700 0.95, two
    // sequences of 8 at 300 0.81-0.93, a 640-token prefill chunk 0.88-0.93 (session 29).
    int heads = num_heads + num_kv_heads, half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (num_tokens > 1)
    for (int t = 0; t < num_tokens; t++) {
        for (int64_t h = 0; cos_sin && h < heads; h++)
            for (int i = 0; i < half; i++) {
                int64_t at = t * q_stride + h * head_dim + i, cos = (int64_t)t * head_dim + i;
                float c = get(cos_sin, cos, is_bf16), s = get(cos_sin, cos + half, is_bf16);
                float a = get(q, at, is_bf16), b = get(q, at + half, is_bf16);
                put(q, at, rounded(a * c, is_bf16) - rounded(b * s, is_bf16), is_bf16);
                put(q, at + half, rounded(b * c, is_bf16) + rounded(a * s, is_bf16), is_bf16);
            }
        for (int64_t h = 0; slot_mapping && h < num_kv_heads; h++)
            for (int64_t d = 0, i = h * head_dim; d < head_dim; d++, i++) {  // i: in a row's keys
                int64_t slot = slot_mapping[t] / block_size * block_stride + h * head_stride + d;
                slot += slot_mapping[t] % block_size * slot_stride;
                put(k_cache, slot, get(q, t * q_stride + num_heads * head_dim + i, is_bf16),
                    kv_type);
                put(v_cache, slot, get(q, t * q_stride + heads * head_dim + i, is_bf16), kv_type);
            }
    }
    // Blocks of queries small enough to give every thread two items or more, and no smaller: every
    // item widens its keys and values once for all its queries (a verify step at batch 1 has few
    // queries: in blocks of QUERY_BLOCK they would not spread over the threads; measured: a T=5 or
    // T=9 step's attention 10% faster than with two items a thread, session 15). A sequence's
    // queries (per_seq: their mean count over the sequences) go in `split` blocks of even size,
    // until the items (sequences x blocks x KV heads x segments, a short last segment counted)
    // number twice the threads: at batch 1 and 100-500 tokens, 9 queries as 5 + 4 where blocks of 8
    // made 8 + 1, three items of 8 that kept one of two threads busy while the other waited (T=9 at
    // 109-300 tokens of context 4-8% faster on avx2, session 28). Until session 40 the items were
    // made a multiple of the threads, counting whole segments only: past 512 tokens that split
    // every other range (512-1,024, 1,536-2,048, ...) into blocks of 2-3 queries whose items each
    // widened their keys for a few pairs. Not splitting there, a T=2-8 step's attention took
    // 0.77-0.94x the time at 900, 1,700 and 2,900 tokens on the Zen 3 (avx2, 2 threads, a C harness
    // taking turns with the old build), 0.86-0.98x at 700 (T=2-7), and 0.95-1.04x at 550-650 (where
    // the last segment holds few keys), the same where both rules agree (up to 512 tokens, and
    // 1,024-1,536 at batch 1); at batch 3, T=5: 0.90-0.93x (BENCHMARKS.md, session 40). Which item
    // computes a query never changes its bits.
    int per_seq = num_tokens / num_seqs;
    int segments = CEIL(max_blocks * block_size, segment_keys);  // at most
    int split = tree_pos ? per_seq : CEIL(per_seq, QUERY_BLOCK);
    while (split < per_seq && num_seqs * split * num_kv_heads * segments < 2 * threads) split++;
    int block = split ? CEIL(per_seq, split) : 1;
    int64_t items = (int64_t)num_tokens * num_kv_heads * segments;
// Items start at every token and segment; all but each block's first query return at once.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (items > 1)
    for (int64_t item = 0; item < items; item++) {
        int t = (int)(item / segments / num_kv_heads), segment = (int)(item % segments), b;
        int kv_head = (int)(item / segments % num_kv_heads);
        int num_keys = keys_seen(t, query_start_loc, seq_lens, tree_pos, &b);
        int first = (int)query_start_loc[b], q_len = (int)(query_start_loc[b + 1] - first);
        int num_queries = q_len - (t - first) < block ? q_len - (t - first) : block;
        if ((t - first) % block || segment * segment_keys >= num_keys + num_queries - 1) continue;
        const int64_t *remap = tree_pos ? tree_keys + (int64_t)t * tree_width : 0;
        const int64_t *table = block_tables + (int64_t)b * max_blocks;
#define ATTEND(CHUNKS, BF16, KV)                                                                   \
    attend(q, k_cache, v_cache, table, partial, t, num_queries, kv_head, num_keys, num_heads,      \
           group, block_size, stride, scale, remap, num_keys - tree_width, q_stride, segment,      \
           segments, segment_keys, CHUNKS, BF16, KV)
// (q, K/V) in bf16 and bf16, fp32 and fp32, or fp32 and fp16 (kernels.c_paged_attention)
#define ATTEND_TYPES(CHUNKS)                                                                       \
    (is_bf16 ? ATTEND(CHUNKS, 1, 1) : kv_type == 2 ? ATTEND(CHUNKS, 0, 2) : ATTEND(CHUNKS, 0, 0))
        // the common shapes get constant loop bounds and types
        head_dim == 64    ? ATTEND_TYPES(64 / LANES)
        : head_dim == 128 ? ATTEND_TYPES(128 / LANES)
                          : ATTEND(head_dim / LANES, is_bf16, kv_type);
    }
    // Each query head's segments merged in order, from the first: the same arithmetic whichever
    // items computed them (one segment: out = acc / total, as with no segments at all).
#pragma omp parallel for num_threads(threads) if (num_tokens > 16)
    for (int64_t head = 0; head < (int64_t)num_tokens * num_heads; head++) {
        int t = (int)(head / num_heads), b;
        int num_keys = keys_seen(t, query_start_loc, seq_lens, tree_pos, &b);
        const float *part = partial + head * segments * (head_dim + 2);
        float max_score = -INFINITY, total = 0.0f;
        vf acc[MAX_DIM / LANES] = {};
        for (int s = 0; s * segment_keys < num_keys; s++, part += head_dim + 2) {
            float new_max = fmaxf(max_score, part[0]);
            float old_weight = expf(max_score - new_max), weight = expf(part[0] - new_max);
            total = total * old_weight + part[1] * weight, max_score = new_max;
            for (int c = 0; c < head_dim / LANES; c++)
                acc[c] = acc[c] * old_weight + load_vf(part + 2 + c * LANES, 0) * weight;
        }
        for (int c = 0; c < head_dim / LANES; c++)
            store_vf((char *)out + (head * head_dim + c * LANES) * (is_bf16 ? 2 : 4),
                     acc[c] / total, is_bf16);
    }
}
