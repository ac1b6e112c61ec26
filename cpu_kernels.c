// bf16 CPU kernels for ops that torch runs as a chain of small ops, each paying dispatch overhead and a
// round trip through memory: RMSNorm (with its fused residual add) and rotary. kernels.py
// compiles this file once with the system's C compiler and calls it through ctypes; each function
// matches a torch_* reference there. Never allocate, never keep state: the caller owns every buffer.
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

