/* Single-query attention over a KV cache, fused: one pass over each row's keys (scores), a
 * float32 softmax, one pass over its values. posttrain/ops/decode_kernel.py states the
 * contract and compiles this file at first use.
 *
 * Row b of a decode step attends over Sp slots of a shared prefix (groups of `group`
 * consecutive rows share prefix b / group; Sp may be 0), then U slots of its own. Query head h
 * reads key/value head h / (H / K). Tensors are float32 with a unit stride in the head
 * dimension; other strides are given in elements.
 *
 * Work is split over (row, key/value head) pairs with OpenMP, using the runtime torch has
 * loaded (the same libgomp.so.1). Each pair is computed by one thread in a fixed order, so
 * the result does not depend on the number of threads. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* exp(x) for float32, written so the compiler vectorises it (libm's expf is a scalar call):
 * x = k*ln2 + r with |r| <= ln2/2, e^r by the classic single-precision polynomial
 * r + r^2 * p(r) + 1 (Cephes' expf coefficients), 2^k through the exponent bits. Relative
 * error about 1e-7; x below -87 (including -inf) gives 0. */
ALWAYS_INLINE float exp_f32(float x) {
    const float log2e = 1.44269504088896341f;
    const float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    float xc = x < -87.0f ? -87.0f : x;
    float kf = floorf(xc * log2e + 0.5f);
    float r = xc - kf * ln2_hi - kf * ln2_lo;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } two_k;
    two_k.i = ((int32_t)kf + 127) << 23;
    return x < -87.0f ? 0.0f : p * two_k.f;
}

/* 16 floats as one vector (GCC/Clang vector extensions: one zmm register with AVX-512, two
 * ymm with AVX2), loadable from any float address. */
typedef float v16f __attribute__((vector_size(64), aligned(4), may_alias));
typedef float v8f __attribute__((vector_size(32), aligned(4), may_alias));

/* The sum of a vector's lanes as a tree of halves: a few shuffles, where a lane-by-lane sum
 * (what the compiler makes of a reduction loop without -ffast-math) is a chain of 16 adds. */
static inline float sum_lanes(v16f x) {
    v8f h = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    float q0 = h[0] + h[4], q1 = h[1] + h[5], q2 = h[2] + h[6], q3 = h[3] + h[7];
    return (q0 + q2) + (q1 + q3);
}

/* q . key over E floats: by vectors of 16 where E allows, else one float at a time. */
ALWAYS_INLINE float dot(const float* q, const float* key, const int64_t E) {
    if (E % 16 == 0) {
        v16f acc = *(const v16f*)q * *(const v16f*)key;
        for (int64_t c = 16; c < E; c += 16) acc += *(const v16f*)(q + c) * *(const v16f*)(key + c);
        return sum_lanes(acc);
    }
    float acc = 0.0f;
    for (int64_t e = 0; e < E; ++e) acc += q[e] * key[e];
    return acc;
}

/* scores[g * S + first + s] = scale * q_g . key_s for the G query heads of one key/value head
 * and n keys from slot `first`. E is a compile-time constant at every call (see below). */
ALWAYS_INLINE void score_keys(const float* q, int64_t q_sh, int64_t G, const float* keys, int64_t key_stride,
                              int64_t n, int64_t first, int64_t S, float scale, float* scores, const int64_t E) {
    for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * q_sh;
        float* out = scores + g * S + first;
        for (int64_t s = 0; s < n; ++s) out[s] = dot(qg, keys + s * key_stride, E) * scale;
    }
}

/* acc[g * E + e] += scores[g * S + first + s] * value_s[e] over n values from slot `first`. */
ALWAYS_INLINE void mix_values(const float* values, int64_t value_stride, int64_t n, int64_t first, int64_t S,
                              int64_t G, const float* scores, float* acc, const int64_t E) {
    for (int64_t g = 0; g < G; ++g) {
        const float* w = scores + g * S + first;
        float* a = acc + g * E;
        for (int64_t s = 0; s < n; ++s) {
            const float* val = values + s * value_stride;
#pragma omp simd
            for (int64_t e = 0; e < E; ++e) a[e] += w[s] * val[e];
        }
    }
}

/* The pairs' arguments, as one struct so the work per pair can take them by pointer. */
typedef struct {
    int64_t H, K, group;
    const float* q; int64_t q_sb, q_sh;
    const float* pk; int64_t pk_sp, pk_sk, pk_ss;
    const float* pv; int64_t pv_sp, pv_sk, pv_ss, Sp;
    const float* k; int64_t k_sb, k_sk, k_ss;
    const float* v; int64_t v_sb, v_sk, v_ss, U;
    const uint8_t* allowed; int64_t allowed_sb;
    const float* sinks; float scale; float* out;
} Args;

/* One (row, key/value head) pair: its G query heads over the prefix's and the row's own
 * slots. `scores` holds G * S floats, `acc` G * E. */
ALWAYS_INLINE void attend_pair(const Args* a, int64_t bk, float* scores, float* acc, const int64_t E) {
    const int64_t G = a->H / a->K, S = a->Sp + a->U;
    const int64_t b = bk / a->K, kh = bk % a->K, p = b / a->group;
    const uint8_t* ok = a->allowed + b * a->allowed_sb;
    const float* qb = a->q + b * a->q_sb + kh * G * a->q_sh;
    score_keys(qb, a->q_sh, G, a->pk + p * a->pk_sp + kh * a->pk_sk, a->pk_ss, a->Sp, 0, S, a->scale, scores, E);
    score_keys(qb, a->q_sh, G, a->k + b * a->k_sb + kh * a->k_sk, a->k_ss, a->U, a->Sp, S, a->scale, scores, E);
    for (int64_t g = 0; g < G; ++g) {
        float* row = scores + g * S;
        const float sink = a->sinks ? a->sinks[kh * G + g] : -INFINITY;
        float best = sink;
        for (int64_t s = 0; s < S; ++s) {
            if (!ok[s]) row[s] = -INFINITY;
            if (row[s] > best) best = row[s];
        }
        float total = 0.0f;
        if (best != -INFINITY) {
#pragma omp simd reduction(+ : total)
            for (int64_t s = 0; s < S; ++s) {
                const float w = exp_f32(row[s] - best);
                row[s] = w;
                total += w;
            }
            if (a->sinks) total += exp_f32(sink - best);
        }
        if (total > 0.0f) {
            const float inv = 1.0f / total;
#pragma omp simd
            for (int64_t s = 0; s < S; ++s) row[s] *= inv;
        } else {  /* nothing to attend to: zero weights, zero output */
            memset(row, 0, sizeof(float) * (size_t)S);
        }
    }
    memset(acc, 0, sizeof(float) * (size_t)(G * E));
    mix_values(a->pv + p * a->pv_sp + kh * a->pv_sk, a->pv_ss, a->Sp, 0, S, G, scores, acc, E);
    mix_values(a->v + b * a->v_sb + kh * a->v_sk, a->v_ss, a->U, a->Sp, S, G, scores, acc, E);
    memcpy(a->out + (b * a->H + kh * G) * E, acc, sizeof(float) * (size_t)(G * E));
}

void posttrain_decode_attention_f32(
    int64_t B, int64_t H, int64_t K, int64_t E, int64_t group,
    const float* q, int64_t q_sb, int64_t q_sh,
    const float* pk, int64_t pk_sp, int64_t pk_sk, int64_t pk_ss,
    const float* pv, int64_t pv_sp, int64_t pv_sk, int64_t pv_ss, int64_t Sp,
    const float* k, int64_t k_sb, int64_t k_sk, int64_t k_ss,
    const float* v, int64_t v_sb, int64_t v_sk, int64_t v_ss, int64_t U,
    const uint8_t* allowed, int64_t allowed_sb, const float* sinks, float scale, float* out) {
    const Args args = {H, K, group, q, q_sb, q_sh, pk, pk_sp, pk_sk, pk_ss, pv, pv_sp, pv_sk, pv_ss, Sp,
                       k, k_sb, k_sk, k_ss, v, v_sb, v_sk, v_ss, U, allowed, allowed_sb, sinks, scale, out};
    const int64_t G = H / K, S = Sp + U;
#pragma omp parallel
    {
        float* scores = (float*)malloc(sizeof(float) * (size_t)(G * S + 1));
        float* acc = (float*)malloc(sizeof(float) * (size_t)(G * E));
#pragma omp for schedule(static)
        for (int64_t bk = 0; bk < B * K; ++bk) {
            /* the common head sizes get loops of a known length: unrolled, no remainder */
            switch (E) {
                case 32: attend_pair(&args, bk, scores, acc, 32); break;
                case 64: attend_pair(&args, bk, scores, acc, 64); break;
                case 128: attend_pair(&args, bk, scores, acc, 128); break;
                case 256: attend_pair(&args, bk, scores, acc, 256); break;
                default: attend_pair(&args, bk, scores, acc, E); break;
            }
        }
        free(acc);
        free(scores);
    }
}
