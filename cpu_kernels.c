// bf16 CPU kernels for ops that torch runs as a chain of small ops, each paying dispatch overhead and a
// round trip through memory: RMSNorm (with its fused residual add), rotary, and decode attention over the
// paged cache (which torch must first gather into a padded copy). kernels.py compiles this file once with
// the system's C compiler and calls it through ctypes; each function matches a torch_* reference there.
// Never allocate on the heap, never keep state: the caller owns every buffer.
#include <math.h>
#include <stdint.h>

typedef uint16_t bf16;  // raw bfloat16 bits: the top half of an fp32

static inline float to_f32(bf16 h) { union { uint32_t u; float f; } v = { (uint32_t)h << 16 }; return v.f; }

static inline bf16 to_bf16(float f) {  // round to nearest even, as torch does
    union { float f; uint32_t u; } v = { f };
    return (bf16)((v.u + 0x7FFF + ((v.u >> 16) & 1)) >> 16);
}

// RMSNorm of x [rows, H] in fp32, rounded like torch_rms_norm: bf16(bf16(x * rsqrt(mean(x^2) + eps)) * w).
// With residual: x + residual (rounded to bf16) is normed and also written to residual_out.
void rms_norm(const bf16 *x, const bf16 *residual, const bf16 *weight, bf16 *out, bf16 *residual_out,
              int rows, int hidden, float eps)
{
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
        #pragma omp simd reduction(+:sum_sq)
        for (int i = 0; i < hidden; i++) sum_sq += row[i] * row[i];
        float inv = 1.0f / sqrtf(sum_sq / hidden + eps);
        for (int i = 0; i < hidden; i++)
            out[(int64_t)r * hidden + i] = to_bf16(to_f32(to_bf16(row[i] * inv)) * to_f32(weight[i]));
    }
}

// Neox rotary of x [T, H, D] (row stride stride_x; heads contiguous) with cos_sin [T, D] = [cos | sin],
// into out [T, H, D], rounded like torch_rotary: each product rounded to bf16, then their difference/sum.
void rotary(const bf16 *x, const bf16 *cos_sin, bf16 *out, int tokens, int heads, int head_dim, int64_t stride_x)
{
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

#ifdef __AVX512BF16__  // paged attention needs AVX-512 with bf16 dot products; kernels.py checks for the symbol
#include <immintrin.h>

#define MAX_GROUP 8  // query heads per KV head

static inline __m512 exp_nonpositive(__m512 x) {  // e^x for x <= 0: 2^n * e^r, |r| <= ln2/2, rel. error ~1e-7
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.442695041f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    const float taylor[] = { 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f };
    for (int i = 0; i < 6; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(taylor[i]));
    return _mm512_scalef_ps(p, n);
}

// Causal attention of packed queries q [T, Hq, D] over the paged caches [num_blocks, block_size, Hkv, D]:
// the contract of torch_paged_attention (kernels.py sends it decode steps only). A work item is one query
// and one KV head with its group of query heads. Instead of gathering each context into a padded copy,
// it reads the cache in place in three passes: scores for 16 keys at a time (a gather of their bf16
// pairs per step of 2 dims, so no horizontal sums), softmax, then the weighted sum of values.
// Items never depend on their batch partners: the loop order is the same whatever the batch.
void paged_attention(const bf16 *q, const bf16 *k_cache, const bf16 *v_cache, const int64_t *block_tables,
                     const int64_t *seq_lens, const int64_t *query_start_loc, bf16 *out, int num_seqs,
                     int max_blocks, int num_heads, int num_kv_heads, int head_dim, int block_size,
                     int max_seq_len, float scale)
{
    int num_tokens = (int)query_start_loc[num_seqs], group = num_heads / num_kv_heads;
    int64_t slot_stride = (int64_t)num_kv_heads * head_dim;  // one token's row in the cache, in bf16s
    #pragma omp parallel
    {
        float scores[group][max_seq_len + 16];  // per thread, on its stack
        int64_t slot[max_seq_len + 16];  // each key's cache slot
        #pragma omp for schedule(static)
        for (int64_t item = 0; item < (int64_t)num_tokens * num_kv_heads; item++) {
            int t = (int)(item / num_kv_heads), kv_head = (int)(item % num_kv_heads), b = 0;
            while (query_start_loc[b + 1] <= t) b++;
            int q_len = (int)(query_start_loc[b + 1] - query_start_loc[b]);
            int num_keys = (int)seq_lens[b] - q_len + (t - (int)query_start_loc[b]) + 1;  // keys 0..position
            const int64_t *table = block_tables + (int64_t)b * max_blocks;
            for (int l = 0, block = 0, offset = 0; l < num_keys + 16; l++) {  // padding keys repeat key 0
                slot[l] = l < num_keys ? table[block] * block_size + offset : slot[0];
                if (++offset == block_size) offset = 0, block++;
            }
            const uint32_t *q_pairs = (const uint32_t *)(q + ((int64_t)t * num_heads + kv_head * group) * head_dim);
            const int *k_pairs = (const int *)(k_cache + kv_head * head_dim);
            for (int l0 = 0; l0 < num_keys; l0 += 16) {
                int32_t index[16];  // of each key's first bf16 pair (kernels.py keeps it below 2^31)
                for (int j = 0; j < 16; j++) index[j] = (int32_t)(slot[l0 + j] * slot_stride / 2);
                __m512i pair_index = _mm512_loadu_si512(index);
                __m512 acc[MAX_GROUP];
                for (int g = 0; g < group; g++) acc[g] = _mm512_setzero_ps();
                for (int p = 0; p < head_dim / 2; p++) {
                    __m512bh keys = (__m512bh)_mm512_i32gather_epi32(pair_index, k_pairs + p, 4);
                    for (int g = 0; g < group; g++)
                        acc[g] = _mm512_dpbf16_ps(acc[g], keys,
                                                  (__m512bh)_mm512_set1_epi32(q_pairs[g * head_dim / 2 + p]));
                }
                for (int g = 0; g < group; g++) _mm512_storeu_ps(&scores[g][l0], _mm512_mul_ps(acc[g], _mm512_set1_ps(scale)));
            }
            float inv_total[MAX_GROUP];
            for (int g = 0; g < group; g++) {
                for (int l = num_keys; l < num_keys + 16; l++) scores[g][l] = -INFINITY;
                __m512 max = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
                for (int l0 = 0; l0 < num_keys; l0 += 16) max = _mm512_max_ps(max, _mm512_loadu_ps(&scores[g][l0]));
                __m512 max_all = _mm512_set1_ps(_mm512_reduce_max_ps(max));
                for (int l0 = 0; l0 < num_keys; l0 += 16) {
                    __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(&scores[g][l0]), max_all));
                    _mm512_storeu_ps(&scores[g][l0], e);
                    sum = _mm512_add_ps(sum, e);
                }
                inv_total[g] = 1.0f / _mm512_reduce_add_ps(sum);
            }
            for (int d0 = 0; d0 < head_dim; d0 += 16) {
                __m512 acc[MAX_GROUP];
                for (int g = 0; g < group; g++) acc[g] = _mm512_setzero_ps();
                const bf16 *v_column = v_cache + kv_head * head_dim + d0;
                for (int l = 0; l < num_keys; l++) {
                    __m512 v = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)(v_column + slot[l] * slot_stride)));
                    for (int g = 0; g < group; g++) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g][l]), v, acc[g]);
                }
                for (int g = 0; g < group; g++) {
                    __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[g], _mm512_set1_ps(inv_total[g])));
                    _mm256_storeu_si256((__m256i *)(out + ((int64_t)t * num_heads + kv_head * group + g) * head_dim + d0), (__m256i)o);
                }
            }
        }
    }
}
#endif
