/* Single-query attention over a KV cache, fused: one pass over each row's keys (scores), a
 * float32 softmax, one pass over its values. posttrain/ops/decode_kernel.py states the
 * contract and compiles this file at first use.
 *
 * Row b of a decode step attends over Sp slots of a shared prefix (groups of `group`
 * consecutive rows share prefix b / group; Sp may be 0), then U slots of its own. Query head h
 * reads key/value head h / (H / K). Tensors are float32; strides are given in elements.
 * Queries and values have a unit stride in the head dimension, keys in the slot dimension
 * (the KV cache stores keys slot-minor for this kernel).
 *
 * Work is split over (row, key/value head) pairs with OpenMP, using the runtime torch has
 * loaded (the same libgomp.so.1). Each pair is computed by one thread in a fixed order, so
 * the result does not depend on the number of threads. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* VW floats as one vector (GCC/Clang vector extensions), loadable from any float address: 16
 * (one zmm register) with AVX-512, else 8 (one ymm register with AVX2). Wider than the
 * hardware's registers, GCC lowers these vectors piece by piece through memory, several
 * times slower (measured on Zen 3: 16 floats on AVX2 made the kernel 2.5x slower than the
 * torch ops it replaces). */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vecf __attribute__((vector_size(4 * VW), aligned(4), may_alias));
typedef int32_t veci __attribute__((vector_size(4 * VW), aligned(4), may_alias));

/* exp(x) of VW floats: x = k*ln2 + r with |r| <= ln2/2, e^r by the classic single-precision
 * polynomial r + r^2 * p(r) + 1 (Cephes' expf coefficients), 2^k through the exponent bits.
 * Relative error about 1e-7; x below -87 (including -inf) gives 0. Written with vector
 * operations because the compiler leaves a loop over a scalar version unvectorised. */
static inline vecf exp_vec(vecf x) {
    const veci below = x < -87.0f;  /* lanes that underflow: all bits set */
    const vecf xc = (vecf)(((veci)x & ~below) | ((veci)((vecf){0} - 87.0f) & below));
    const vecf t = xc * 1.44269504088896341f + 0.5f;
    veci k = __builtin_convertvector(t, veci);          /* truncates toward zero */
    k += (veci)(__builtin_convertvector(k, vecf) > t); /* ... so step down where that was up: floor */
    const vecf kf = __builtin_convertvector(k, vecf);
    const vecf r = xc - kf * 0.693359375f - kf * -2.12194440e-4f;
    vecf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const vecf two_k = (vecf)((k + 127) << 23);
    return (vecf)((veci)(p * two_k) & ~below);
}

static inline float exp_one(float x) {
    return exp_vec((vecf){0} + x)[0];
}

/* The sum of a vector's lanes, as a fixed tree of halves. */
static inline float sum_lanes(vecf x) {
    float half[VW];
    for (int i = 0; i < VW; ++i) half[i] = x[i];
    for (int width = VW / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; ++i) half[i] += half[i + width];
    return half[0];
}

/* Scores of NB blocks of VW slots from slot s0 (of which `valid` are wanted) for the G query
 * heads: out[g * row_stride + s] = scale * q_g . key_s. Keys are stored slot-minor (element e of slot
 * s at keys[e * ke + s]), so VW slots' elements e are one vector load, and a query element
 * times it is one multiply-add for VW scores: no sums across a vector's lanes. The NB * G
 * accumulators stay in registers (NB, E and G are compile-time constants). */
ALWAYS_INLINE void score_blocks(const float* q, int64_t q_sh, const float* keys, int64_t ke, int64_t s0,
                                int64_t valid, float scale, float* out, int64_t row_stride, const int64_t NB,
                                const int64_t E, const int64_t G) {
    vecf acc[NB * G];
    for (int64_t i = 0; i < NB * G; ++i) acc[i] = (vecf){0};
    for (int64_t e = 0; e < E; ++e) {
        const float* row = keys + e * ke + s0;
        for (int64_t blk = 0; blk < NB; ++blk) {
            const vecf kv = *(const vecf*)(row + VW * blk);
            for (int64_t g = 0; g < G; ++g) acc[blk * G + g] += q[g * q_sh + e] * kv;
        }
    }
    for (int64_t blk = 0; blk < NB; ++blk) {
        const int64_t at = VW * blk, m = valid - at < VW ? valid - at : VW;
        for (int64_t g = 0; g < G; ++g) {
            float* dst = out + g * row_stride + s0 + at;
            if (m == VW) {
                *(vecf*)dst = acc[blk * G + g] * scale;
            } else {
                for (int64_t j = 0; j < m; ++j) dst[j] = acc[blk * G + g][j] * scale;
            }
        }
    }
}

/* scores[g * row_stride + first + s] = scale * q_g . key_s for the G query heads of one key/value head
 * and n keys from slot `first` (see score_blocks). Runs of CHUNK blocks are scored together,
 * element by element, so each element's row is read in runs of VW * CHUNK slots. Vector loads
 * may read up to slot `readable` (past n: inside the buffer, the extra lanes are dropped);
 * slots after the last whole vector go one at a time. */
ALWAYS_INLINE void score_keys(const float* q, int64_t q_sh, const float* keys, int64_t ke, int64_t n,
                              int64_t readable, int64_t first, int64_t row_stride, float scale, float* scores,
                              const int64_t E, const int64_t G) {
    const int64_t CHUNK = G <= 8 ? 8 / G : 1;
    const int64_t rounded_up = (n + VW - 1) / VW * VW, in_buffer = readable / VW * VW;
    const int64_t vector_slots = rounded_up < in_buffer ? rounded_up : in_buffer;
    const int64_t covered = vector_slots < n ? vector_slots : n;
    float* out = scores + first;
    int64_t s0 = 0;
    for (; vector_slots - s0 >= VW * CHUNK; s0 += VW * CHUNK)
        score_blocks(q, q_sh, keys, ke, s0, covered - s0, scale, out, row_stride, CHUNK, E, G);
    for (; s0 < vector_slots; s0 += VW)
        score_blocks(q, q_sh, keys, ke, s0, covered - s0, scale, out, row_stride, 1, E, G);
    for (int64_t s = covered; s < n; ++s) {
        for (int64_t g = 0; g < G; ++g) {
            float acc = 0.0f;
            for (int64_t e = 0; e < E; ++e) acc += q[g * q_sh + e] * keys[e * ke + s];
            out[g * row_stride + s] = acc * scale;
        }
    }
}

/* acc[g * E + e] += scores[g * row_stride + first + s] * value_s[e] over n values from slot `first`
 * (values stored slot-major: a slot's E elements are contiguous). */
ALWAYS_INLINE void mix_values(const float* values, int64_t value_stride, int64_t n, int64_t first, int64_t row_stride,
                              const float* scores, float* acc, const int64_t E, const int64_t G) {
    if (E % VW == 0) {  /* the accumulators stay in registers */
        vecf sum[G * E / VW];
        for (int64_t c = 0; c < G * E / VW; ++c) sum[c] = *(const vecf*)(acc + VW * c);
        for (int64_t s = 0; s < n; ++s) {
            const float* val = values + s * value_stride;
            for (int64_t g = 0; g < G; ++g) {
                const float w = scores[g * row_stride + first + s];
                for (int64_t c = 0; c < E / VW; ++c) sum[g * E / VW + c] += w * *(const vecf*)(val + VW * c);
            }
        }
        for (int64_t c = 0; c < G * E / VW; ++c) *(vecf*)(acc + VW * c) = sum[c];
        return;
    }
    for (int64_t s = 0; s < n; ++s) {
        const float* val = values + s * value_stride;
        for (int64_t g = 0; g < G; ++g) {
            const float w = scores[g * row_stride + first + s];
            for (int64_t e = 0; e < E; ++e) acc[g * E + e] += w * val[e];
        }
    }
}

/* The pairs' arguments, as one struct so the work per pair can take them by pointer. */
typedef struct {
    int64_t H, K, group;
    const float* q; int64_t q_sb, q_sh;
    const float* pk; int64_t pk_sp, pk_sk, pk_se, pk_readable;
    const float* pv; int64_t pv_sp, pv_sk, pv_ss, Sp;
    const float* k; int64_t k_sb, k_sk, k_se, k_readable;
    const float* v; int64_t v_sb, v_sk, v_ss, U;
    const uint8_t* allowed; int64_t allowed_sb;
    const float* sinks; float scale; float* out;
} Args;

/* One (row, key/value head) pair: its G query heads over the prefix's and the row's own
 * slots. `scores` holds G rows of S floats padded to SR (whole vectors), `acc` G * E. */
ALWAYS_INLINE void attend_pair(const Args* a, int64_t bk, float* scores, float* acc, const int64_t E,
                               const int64_t G) {
    const int64_t S = a->Sp + a->U, SR = (S + VW - 1) / VW * VW;  /* score rows padded to whole vectors */
    const int64_t b = bk / a->K, kh = bk % a->K, p = b / a->group;
    const uint8_t* ok = a->allowed + b * a->allowed_sb;
    const float* qb = a->q + b * a->q_sb + kh * G * a->q_sh;
    const float* pv = a->pv + p * a->pv_sp + kh * a->pv_sk;
    const float* v = a->v + b * a->v_sb + kh * a->v_sk;
    score_keys(qb, a->q_sh, a->pk + p * a->pk_sp + kh * a->pk_sk, a->pk_se, a->Sp, a->pk_readable, 0, SR,
               a->scale, scores, E, G);
    score_keys(qb, a->q_sh, a->k + b * a->k_sb + kh * a->k_sk, a->k_se, a->U, a->k_readable, a->Sp, SR,
               a->scale, scores, E, G);
    for (int64_t g = 0; g < G; ++g) {
        float* row = scores + g * SR;
        const float sink = a->sinks ? a->sinks[kh * G + g] : -INFINITY;
        float best = sink;
        for (int64_t s = 0; s < S; ++s) {
            row[s] = ok[s] ? row[s] : -INFINITY;
            best = row[s] > best ? row[s] : best;
        }
        for (int64_t s = S; s < SR; ++s) row[s] = -INFINITY;  /* padding: weight 0 */
        if (best == -INFINITY) {  /* nothing to attend to: zero weights, zero output */
            memset(row, 0, sizeof(float) * (size_t)SR);
            continue;
        }
        vecf total_vec = {0};
        for (int64_t s = 0; s < SR; s += VW) {
            const vecf w = exp_vec(*(vecf*)(row + s) - best);
            *(vecf*)(row + s) = w;
            total_vec += w;
        }
        const float total = sum_lanes(total_vec) + (a->sinks ? exp_one(sink - best) : 0.0f);
        const float inv = 1.0f / total;
        for (int64_t s = 0; s < SR; s += VW) *(vecf*)(row + s) *= inv;
    }
    memset(acc, 0, sizeof(float) * (size_t)(G * E));
    mix_values(pv, a->pv_ss, a->Sp, 0, SR, scores, acc, E, G);
    mix_values(v, a->v_ss, a->U, a->Sp, SR, scores, acc, E, G);
    memcpy(a->out + (b * a->H + kh * G) * E, acc, sizeof(float) * (size_t)(G * E));
}

/* The common shapes get loops of a known length (unrolled, accumulators in registers): head
 * sizes 32..256 with 1, 2, 4 or 8 query heads per key/value head; others run the same code
 * with run-time bounds. */
static void attend_any(const Args* a, int64_t bk, float* scores, float* acc, int64_t E, int64_t G) {
#define FOR_G(E_)                                                 \
    switch (G) {                                                  \
        case 1: attend_pair(a, bk, scores, acc, E_, 1); return;   \
        case 2: attend_pair(a, bk, scores, acc, E_, 2); return;   \
        case 4: attend_pair(a, bk, scores, acc, E_, 4); return;   \
        case 8: attend_pair(a, bk, scores, acc, E_, 8); return;   \
    }
    switch (E) {
        case 32: FOR_G(32) break;
        case 64: FOR_G(64) break;
        case 128: FOR_G(128) break;
        case 256: FOR_G(256) break;
    }
#undef FOR_G
    attend_pair(a, bk, scores, acc, E, G);
}

void posttrain_decode_attention_f32(
    int64_t B, int64_t H, int64_t K, int64_t E, int64_t group,
    const float* q, int64_t q_sb, int64_t q_sh,
    const float* pk, int64_t pk_sp, int64_t pk_sk, int64_t pk_se, int64_t pk_readable,
    const float* pv, int64_t pv_sp, int64_t pv_sk, int64_t pv_ss, int64_t Sp,
    const float* k, int64_t k_sb, int64_t k_sk, int64_t k_se, int64_t k_readable,
    const float* v, int64_t v_sb, int64_t v_sk, int64_t v_ss, int64_t U,
    const uint8_t* allowed, int64_t allowed_sb, const float* sinks, float scale, float* out) {
    const Args args = {H, K, group, q, q_sb, q_sh, pk, pk_sp, pk_sk, pk_se, pk_readable, pv, pv_sp, pv_sk, pv_ss,
                       Sp, k, k_sb, k_sk, k_se, k_readable, v, v_sb, v_sk, v_ss, U, allowed, allowed_sb, sinks,
                       scale, out};
    const int64_t G = H / K, S = Sp + U;
#pragma omp parallel
    {
        float* scores = (float*)malloc(sizeof(float) * (size_t)(G * ((S + VW - 1) / VW * VW) + VW));
        float* acc = (float*)malloc(sizeof(float) * (size_t)(G * E));
#pragma omp for schedule(static)
        for (int64_t bk = 0; bk < B * K; ++bk) attend_any(&args, bk, scores, acc, E, G);
        free(acc);
        free(scores);
    }
}
