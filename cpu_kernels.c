// CPU kernels: the linear layers (weight streaming), paged attention for every query shape, and
// bf16 RMSNorm and rotary. kernels.py compiles this file once per ISA (AVX-512, AVX2 + FMA, or
// generic) and calls it through ctypes; each function keeps the contract of a torch_* reference
// there. Every output is computed by one fixed chain of arithmetic that never depends on how many
// rows, queries or threads the call has: that is what makes speculation bit-exact (DESIGN.md,
// "Exactness"). The caller owns every buffer; nothing here allocates or keeps state.
#include <math.h>
#include <stdint.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

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
typedef uint16_t vh __attribute__((vector_size(LANES * 2)));

static inline float to_f32(bf16 h) {
    union {
        uint32_t u;
        float f;
    } v = {(uint32_t)h << 16};
    return v.f;
}

static inline bf16 to_bf16(float f) {  // round to nearest even, as torch does
    union {
        float f;
        uint32_t u;
    } v = {f};
    return (bf16)((v.u + 0x7FFF + ((v.u >> 16) & 1)) >> 16);
}

static inline vf load_vf(const void *p, int is_bf16) {  // LANES values, widened to fp32 (exact)
    if (!is_bf16) {
        vf v;
        __builtin_memcpy(&v, p, sizeof v);
        return v;
    }
    vh h;
    __builtin_memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}

static inline void store_vf(void *p, vf v, int is_bf16) {  // rounded to nearest even for bf16
    if (!is_bf16) {
        __builtin_memcpy(p, &v, sizeof v);
        return;
    }
    vu u = (vu)v;
    vh h = __builtin_convertvector((u + 0x7FFF + ((u >> 16) & 1)) >> 16, vh);
    __builtin_memcpy(p, &h, sizeof h);
}

static inline float load_f(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? to_f32(((const bf16 *)p)[i]) : ((const float *)p)[i];
}

static inline vi iota(void) {
    vi v;
    for (int i = 0; i < LANES; i++) v[i] = i;
    return v;
}

// a fixed pairwise tree, lane i += lane i + width: the same for every call
static inline float hsum(vf v) {
    for (int width = LANES / 2; width > 0; width /= 2) v += __builtin_shuffle(v, iota() + width);
    return v[0];
}

static inline float hmax(vf v) {  // a max is exact in any order
    for (int width = LANES / 2; width > 0; width /= 2) {
        vf other = __builtin_shuffle(v, iota() + width);
        vi larger = v > other;
        v = (vf)(((vi)v & larger) | ((vi)other & ~larger));
    }
    return v[0];
}

// -----------------------------------------------------------------------------------------------
// Linear: y[M, N] = x[M, K] W^T (+ bias). W is packed once at load time into panels of 16 output
// columns (pack_weight in kernels.py; N padded to a multiple of 16 with zero rows, K to an even
// count), walked in pairs of k: fp32 w[panel][k / 2][2][16], bf16 w[panel][k / 2][16][2], a bf16
// pair (k, k + 1) sharing one 32-bit word. The AVX512-BF16 dot product reads that word as is; the
// FMA path widens its halves exactly with one shift and one mask. A tile of ROWS x PANELS outputs
// keeps its accumulators in registers and reads each weight element once for all its rows, so
// small-M steps (decode, verify) stream the weights once: memory bound, and verifying K+1 rows
// costs about what one row does. Accumulators: 6 rows x 4 panels = 24 of AVX-512's 32 vector
// registers; 6 x 1 panel x 2 vectors = 12 of AVX2's 16; 2 x 1 x 4 = 8 of the generic 16. Each
// output y[m, n] is one fixed chain from zero, then + bias, the same for any M, tile shape or
// thread count: fp32 FMAs over k = 0..K-1, or, with AVX512-BF16 (x and W both bf16), one vdpbf16ps
// per pair of k (two exact products added to the fp32 sum), twice the MACs per instruction.
#define PANEL 16
#define PV (PANEL / LANES)  // vectors per panel row
#define MAX_ROWS (LANES == 4 ? 2 : 6)
#define PANELS (LANES == 16 ? 4 : 1)
// A tile prefetches the weights AHEAD pairs of k ahead: with the hardware prefetchers alone the
// stream stalls while a tile of several rows computes (a T=9 forward 6% slower on AVX512-BF16, 21%
// on AVX2).
#define AHEAD 32

// Weights of k = 2 * (pair_row % K2) + half for LANES columns (v: which slice of the panel's 16).
static inline vf load_half(const void *w, int64_t pair_row, int v, int half, int w_bf16) {
    vf wk;
    if (w_bf16) {
        vu u;
        __builtin_memcpy(&u, (const uint32_t *)w + pair_row * PANEL + v * LANES, sizeof u);
        return (vf)(half ? u & 0xFFFF0000u : u << 16);
    }
    __builtin_memcpy(&wk, (const float *)w + (pair_row * 2 + half) * PANEL + v * LANES, sizeof wk);
    return wk;
}

// x[i] low, x[i + 1] (or 0) high
static inline uint32_t x_pair(const bf16 *x, int64_t i, int both) {
    uint32_t pair = x[i];
    if (both) __builtin_memcpy(&pair, x + i, 4);
    return pair;
}

static inline __attribute__((always_inline)) void
linear_tile(const void *x, const void *w, const void *bias, void *y, int rows, int panels,
            int64_t m0, int p0, int N, int K, int x_bf16, int w_bf16, int y_bf16) {
    vf acc[MAX_ROWS][PANELS * PV] = {};
    int64_t K2 = (K + 1) / 2, y_elem = y_bf16 ? 2 : 4;
#if defined(__AVX512BF16__)
    if (x_bf16 && w_bf16) {
        for (int64_t kp = 0; kp < K2; kp++) {
            __m512bh wk[PANELS];
            for (int p = 0; p < panels; p++) {
                wk[p] = (__m512bh)_mm512_loadu_si512((const uint32_t *)w +
                                                     ((p0 + p) * K2 + kp) * PANEL);
                __builtin_prefetch((const uint32_t *)w + ((p0 + p) * K2 + kp + AHEAD) * PANEL);
            }
            for (int r = 0; r < rows; r++) {
                __m512bh xk =
                    (__m512bh)_mm512_set1_epi32(x_pair(x, (m0 + r) * K + 2 * kp, 2 * kp + 1 < K));
                for (int p = 0; p < panels; p++)
                    acc[r][p] = (vf)_mm512_dpbf16_ps((__m512)acc[r][p], xk, wk[p]);
            }
        }
    } else
#endif
        for (int64_t k = 0; k < K;
             k++) {  // one k at a time: a pair's second half would hold registers
            vf wk[PANELS * PV];
            for (int v = 0; v < panels * PV; v++)
                wk[v] = load_half(w, (p0 + v / PV) * K2 + k / 2, v % PV, k & 1, w_bf16);
            // a line a k: fp32 has two a pair of k, bf16 one (fetched twice)
            for (int p = 0; p < panels; p++)
                __builtin_prefetch((const char *)w +
                                   ((p0 + p) * K2 + k / 2 + AHEAD) * PANEL * (w_bf16 ? 4 : 8) +
                                   (k & 1) * 64);
            for (int r = 0; r < rows; r++) {
                vf xk = (vf){} + load_f(x, (m0 + r) * K + k, x_bf16);
                for (int v = 0; v < panels * PV; v++)
                    acc[r][v] += xk * wk[v];  // contracted to an FMA
            }
        }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < panels * PV; v++) {
            int n0 = (p0 + v / PV) * PANEL + v % PV * LANES;
            if (n0 >= N) continue;  // zero padding of the last panel
            vf out = acc[r][v];
            char *dst = (char *)y + ((m0 + r) * N + n0) * y_elem, tmp[LANES * 4];
            for (int j = 0; bias && j < LANES && n0 + j < N; j++)
                out[j] += load_f(bias, n0 + j, y_bf16);
            store_vf(n0 + LANES <= N ? dst : tmp, out, y_bf16);
            // the last, partial vector
            if (n0 + LANES > N) __builtin_memcpy(dst, tmp, (N - n0) * y_elem);
        }
}

// One instance per (rows, panels) shape, so every accumulator has a register; x_bf16 / w_bf16 are
// constant inside each instance too.
#define TILE(R, P, M0, P0) linear_tile(x, w, bias, y, R, P, M0, P0, N, K, x_bf16, w_bf16, y_bf16)
static void linear_rows(const void *x, const void *w, const void *bias, void *y, int rows,
                        int panels, int64_t m0, int p0, int N, int K, int x_bf16, int w_bf16,
                        int y_bf16) {
    if (panels == PANELS) {
        switch (rows) {
        case 1:
            TILE(1, PANELS, m0, p0);
            break;
        case 2:
            TILE(2, PANELS, m0, p0);
            break;
#if MAX_ROWS == 6
        case 3:
            TILE(3, PANELS, m0, p0);
            break;
        case 4:
            TILE(4, PANELS, m0, p0);
            break;
        case 5:
            TILE(5, PANELS, m0, p0);
            break;
        case 6:
            TILE(6, PANELS, m0, p0);
            break;
#endif
        }
    } else {
        for (int p = 0; p < panels; p++)
            for (int r = 0; r < rows; r++) TILE(1, 1, m0 + r, p0 + p);
    }
}

// Each of x, the packed weight w, and y with its bias is bf16 (flag set) or fp32. (kernels.py
// widens a bf16 x of several rows to fp32 once, rather than once per column group here.)
void linear(const void *x, const void *w, const void *bias, void *y, int64_t M, int N, int K,
            int x_bf16, int w_bf16, int y_bf16, int threads) {
    int num_panels = (N + PANEL - 1) / PANEL, groups = (num_panels + PANELS - 1) / PANELS;
// A thread owns whole column groups and walks every row through them: the group's weights stay
// in its cache while the rows pass, and which thread computes an output never changes its
// value.
#pragma omp parallel for schedule(static) num_threads(threads) if (M * N * (int64_t)K > 1 << 16)
    for (int g = 0; g < groups; g++) {
        int p0 = g * PANELS, panels = num_panels - p0 < PANELS ? num_panels - p0 : PANELS;
        for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS)
            linear_rows(x, w, bias, y, M - m0 < MAX_ROWS ? (int)(M - m0) : MAX_ROWS, panels, m0, p0,
                        N, K, x_bf16, w_bf16, y_bf16);
    }
}

// -----------------------------------------------------------------------------------------------
// Paged attention for packed queries q [T, Hq, D] over caches [num_blocks, block_size, Hkv, D]: the
// contract of torch_paged_attention, for prefill chunks, decode and verification alike. A work item
// is up to QUERY_BLOCK consecutive queries of one sequence and one KV head with its group of query
// heads. It reads keys 0..position from the cache in chunks of LANES keys from position 0, widening
// each chunk once for all its queries and heads; each (query, head) then runs its own online
// softmax over the chunks it sees: the same arithmetic for a query at a given position whatever the
// step or block around it. D must be a multiple of 16. A tree node (tree_pos set, one query per
// item) reads logical keys 0..tree_pos[t], the last tree_width of them from the physical positions
// in its tree_keys row.
#define MAX_GROUP 16
#define MAX_DIM 256
#define QUERY_BLOCK 8

// e^x for x <= 0 (e^-inf = 0): 2^n * e^r, |r| <= ln2/2, rel. error ~1e-7
static inline vf exp_vf(vf x) {
    vi dead = x < -87.0f;
    x = (vf)(((vi)x & ~dead) | ((vi)((vf){} - 87.0f) & dead));
    vf n = (x * 1.442695041f + 12582912.0f) - 12582912.0f;  // round to nearest integer
    vf r = x - n * 0.693147181f;
    vf p = (vf){} + 1.0f / 720;
    const float taylor[] = {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    for (int i = 0; i < 6; i++) p = p * r + taylor[i];
    vi scale = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)((vi)(p * (vf)scale) & ~dead);
}

static inline int bit_reversed(int i) {  // i's log2(LANES) bits in reverse order
    int r = 0;
    for (int bit = 1; bit < LANES; bit *= 2) r = r * 2 + (i & bit ? 1 : 0);
    return r;
}

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
attend(const void *q, const void *k_cache, const void *v_cache, const int64_t *table, void *out,
       int t0, int num_queries, int kv_head, int num_keys, int num_heads, int group, int block_size,
       int64_t slot_stride, float scale, const int64_t *remap, int remap_from, const int chunks,
       const int is_bf16) {  // query t0 + i sees keys 0..num_keys + i - 1
    int head_dim = chunks * LANES, elem = is_bf16 ? 2 : 4, pairs = num_queries * group;
    int all_keys = num_keys + num_queries - 1;
    vf qv[QUERY_BLOCK * MAX_GROUP][MAX_DIM / LANES], acc[QUERY_BLOCK * MAX_GROUP][MAX_DIM / LANES];
    vf keys[LANES][MAX_DIM / LANES], values[LANES][MAX_DIM / LANES];
    float max_score[QUERY_BLOCK * MAX_GROUP], total[QUERY_BLOCK * MAX_GROUP];
    // pair i: query t0 + i / group, head i % group of the KV head's group
    for (int i = 0; i < pairs; i++) {
        int64_t head = (int64_t)(t0 + i / group) * num_heads + kv_head * group + i % group;
        for (int c = 0; c < chunks; c++) {
            qv[i][c] = load_vf((const char *)q + (head * head_dim + c * LANES) * elem, is_bf16);
            acc[i][c] = (vf){};
        }
        max_score[i] = -INFINITY, total[i] = 0.0f;
    }
    for (int l0 = 0; l0 < all_keys; l0 += LANES) {
        // A chunk within one block (no tree path in it) has consecutive slots: one table lookup.
        int one_block = block_size % LANES == 0 && !(remap && l0 + LANES > remap_from);
        int64_t first_slot = table[l0 / block_size] * block_size + l0 % block_size;
        // the next chunk's keys
        for (int64_t l = l0 + LANES; l < l0 + 2 * LANES && l < all_keys; l++) {
            int64_t next = ((table[l / block_size] * block_size + l % block_size) * slot_stride
                            // (tree paths aside) load while this one computes
                            + kv_head * head_dim) *
                           elem;
            for (int c = 0; c < head_dim * elem; c += 64) {
                __builtin_prefetch((const char *)k_cache + next + c);
                __builtin_prefetch((const char *)v_cache + next + c);
            }
        }
        // key j in slot bit_reversed(j), the order sum_lanes wants
        for (int j = 0; j < LANES; j++) {
            // past the last key: a valid one, masked below
            int64_t l = l0 + j < all_keys ? l0 + j : l0;
            if (remap && l >= remap_from) l = remap[l - remap_from];  // a tree node's path
            int64_t slot =
                one_block ? first_slot + j : table[l / block_size] * block_size + l % block_size;
            int64_t at = (slot * slot_stride + kv_head * head_dim) * elem;  // in bytes
            for (int c = 0; c < chunks; c++) {
                keys[bit_reversed(j)][c] =
                    load_vf((const char *)k_cache + at + c * LANES * elem, is_bf16);
                values[j][c] = load_vf((const char *)v_cache + at + c * LANES * elem, is_bf16);
            }
        }
        // Phase by phase over the (query, head) pairs, so that the CPU overlaps their independent
        // chains.
        int active = pairs;  // the pairs whose query sees some key of this chunk: a prefix of them
        while (active > 0 && num_keys + (active - 1) / group <= l0) active--;
        vf p[QUERY_BLOCK * MAX_GROUP];
        float alpha[QUERY_BLOCK * MAX_GROUP];
        for (int i = 0; i < active; i++) {
            vf partial[LANES];
            for (int s = 0; s < LANES; s++) {
                vf dot = {};
                for (int c = 0; c < chunks; c++) dot += qv[i][c] * keys[s][c];
                partial[s] = dot;
            }
            vi valid = iota() < num_keys + i / group - l0;
            p[i] = sum_lanes(partial) * scale;
            p[i] = (vf)(((vi)p[i] & valid) | ((vi)((vf){} - INFINITY) & ~valid));
        }
        // alpha: e^(old max - new max), 0 on the first chunk (e^-inf)
        for (int i = 0; i < active; i++) {
            float chunk_max = hmax(p[i]);
            // where the max holds, e^0: skipping the rescaling keeps the same bits
            alpha[i] = 1.0f;
            if (chunk_max > max_score[i])
                alpha[i] = expf(max_score[i] - chunk_max), max_score[i] = chunk_max;
            p[i] = exp_vf(p[i] - max_score[i]);
            total[i] = total[i] * alpha[i] + hsum(p[i]);
        }
        for (int i = 0; i < active; i++) {
            for (int c = 0; alpha[i] != 1.0f && c < chunks; c++) acc[i][c] *= alpha[i];
            // the keys query i sees
            for (int j = 0; j < LANES && j < num_keys + i / group - l0; j++)
                for (int c = 0; c < chunks; c++) acc[i][c] += p[i][j] * values[j][c];
        }
    }
    for (int i = 0; i < pairs; i++) {
        int64_t head = (int64_t)(t0 + i / group) * num_heads + kv_head * group + i % group;
        for (int c = 0; c < chunks; c++)
            store_vf((char *)out + (head * head_dim + c * LANES) * elem, acc[i][c] / total[i],
                     is_bf16);
    }
}

void paged_attention(const void *q, const void *k_cache, const void *v_cache,
                     const int64_t *block_tables, const int64_t *seq_lens,
                     const int64_t *query_start_loc, void *out, int num_seqs, int max_blocks,
                     int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                     int is_bf16, int threads, const int64_t *tree_pos, const int64_t *tree_keys,
                     int tree_width) {
    int num_tokens = (int)query_start_loc[num_seqs], group = num_heads / num_kv_heads;
    int64_t slot_stride = (int64_t)num_kv_heads * head_dim;
    // Blocks of queries small enough to give every thread about two items (a decode or verify step
    // at batch 1 has few queries: with a block of 8 one thread would do all the work).
    int block = tree_pos ? 1 : QUERY_BLOCK;
    while (block > 1 && num_tokens * num_kv_heads / block < 2 * threads) block /= 2;
// Items start at every token; all but each block's first query return at once.
#pragma omp parallel for schedule(dynamic, 1)                                                      \
    num_threads(threads) if (num_tokens * num_kv_heads > 1)
    for (int64_t item = 0; item < (int64_t)num_tokens * num_kv_heads; item++) {
        int t = (int)(item / num_kv_heads), kv_head = (int)(item % num_kv_heads), b = 0;
        while (query_start_loc[b + 1] <= t) b++;
        int first = (int)query_start_loc[b], q_len = (int)(query_start_loc[b + 1] - first);
        if ((t - first) % block) continue;
        int num_queries = q_len - (t - first) < block ? q_len - (t - first) : block;
        int num_keys = (int)seq_lens[b] - q_len + (t - first) + 1;  // keys 0..position
        if (tree_pos) num_keys = (int)tree_pos[t] + 1;
        const int64_t *remap = tree_pos ? tree_keys + (int64_t)t * tree_width : 0;
        const int64_t *table = block_tables + (int64_t)b * max_blocks;
#define ATTEND(CHUNKS, BF16)                                                                       \
    attend(q, k_cache, v_cache, table, out, t, num_queries, kv_head, num_keys, num_heads, group,   \
           block_size, slot_stride, scale, remap, num_keys - tree_width, CHUNKS, BF16)
        // the common shapes get constant loop bounds
        if (head_dim == 64 && is_bf16)
            ATTEND(64 / LANES, 1);
        else if (head_dim == 64)
            ATTEND(64 / LANES, 0);
        else if (head_dim == 128 && is_bf16)
            ATTEND(128 / LANES, 1);
        else if (head_dim == 128)
            ATTEND(128 / LANES, 0);
        else
            ATTEND(head_dim / LANES, is_bf16);
    }
}

// -----------------------------------------------------------------------------------------------
// bf16 RMSNorm and rotary: torch runs each as a chain of small ops; here one pass, rounded like the
// torch reference step by step, so the two agree bit for bit. RMSNorm of x [rows, H] in fp32:
// bf16(bf16(x * rsqrt(mean(x^2) + eps)) * w). With residual: x + residual (rounded to bf16) is
// normed and also written to residual_out.
void rms_norm(const bf16 *x, const bf16 *residual, const bf16 *weight, bf16 *out,
              bf16 *residual_out, int rows, int hidden, float eps) {
#pragma omp parallel for schedule(static) if (rows > 16)
    for (int r = 0; r < rows; r++) {
        float row[hidden], sum_sq = 0.0f;
        const bf16 *xr = x + (int64_t)r * hidden;
        for (int i = 0; i < hidden; i++) {
            float v = to_f32(xr[i]);
            if (residual) {
                bf16 sum = to_bf16(v + to_f32(residual[(int64_t)r * hidden + i]));
                residual_out[(int64_t)r * hidden + i] = sum;
                v = to_f32(sum);
            }
            row[i] = v;
        }
#pragma omp simd reduction(+ : sum_sq)
        for (int i = 0; i < hidden; i++) sum_sq += row[i] * row[i];
        float inv = 1.0f / sqrtf(sum_sq / hidden + eps);
        for (int i = 0; i < hidden; i++)
            out[(int64_t)r * hidden + i] =
                to_bf16(to_f32(to_bf16(row[i] * inv)) * to_f32(weight[i]));
    }
}

// Neox rotary of x [T, H, D] (row stride stride_x; heads contiguous) with cos_sin [T, D] = [cos |
// sin], into out [T, H, D], rounded like torch_rotary: each product rounded to bf16, then their
// difference/sum.
void rotary(const bf16 *x, const bf16 *cos_sin, bf16 *out, int tokens, int heads, int head_dim,
            int64_t stride_x) {
    int half = head_dim / 2;
#pragma omp parallel for schedule(static) if (tokens > 16)
    for (int t = 0; t < tokens; t++) {
        const bf16 *cos = cos_sin + (int64_t)t * head_dim, *sin = cos + half;
        for (int h = 0; h < heads; h++) {
            const bf16 *x1 = x + t * stride_x + (int64_t)h * head_dim, *x2 = x1 + half;
            bf16 *o = out + ((int64_t)t * heads + h) * head_dim;
            for (int i = 0; i < half; i++) {
                float c = to_f32(cos[i]), s = to_f32(sin[i]), a = to_f32(x1[i]), b = to_f32(x2[i]);
                o[i] = to_bf16(to_f32(to_bf16(a * c)) - to_f32(to_bf16(b * s)));
                o[i + half] = to_bf16(to_f32(to_bf16(b * c)) + to_f32(to_bf16(a * s)));
            }
        }
    }
}
