/* Single-query attention over a KV cache, fused: one pass over each row's keys (scores), a
 * float32 softmax, one pass over its values. posttrain/rl/cpu_kernels/kernels.py states the
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
 * the result does not depend on the number of threads.
 *
 * Memory: with a few hundred rows the cache is far larger than the last-level cache, and every
 * step reads all of it. Each pair asks for the next pair's keys (`delta`: their offset from
 * this pair's) line by line as it reads its own, so they are on their way while this pair
 * computes (measured at 256 rows: ~20% faster; asking for the whole next pair at once gained
 * nothing; the values, one contiguous stream a pair, need no help). A row's left padding, a
 * prompt's masked head, is not read at all. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

/* Scores of NB blocks of VW slots from slot s0 (of which `valid` are wanted) for the G query
 * heads: out[g * row_stride + s] = scale * q_g . key_s. Keys are stored slot-minor (element e of slot
 * s at keys[e * ke + s]), so VW slots' elements e are one vector load, and a query element
 * times it is one multiply-add for VW scores: no sums across a vector's lanes. The NB * G
 * accumulators stay in registers (NB, E and G are compile-time constants). With PREFETCH
 * (compile-time, so the loop without it stays as tight), the lines `delta` floats from the
 * ones read are prefetched. */
ALWAYS_INLINE void score_blocks(const float* q, int64_t q_sh, const float* keys, int64_t ke, int64_t s0,
                                int64_t valid, float scale, float* out, int64_t row_stride, const int64_t NB,
                                const int64_t E, const int64_t G, int64_t delta, const int PREFETCH) {
    vecf acc[NB * G];
    for (int64_t i = 0; i < NB * G; ++i) acc[i] = (vecf){0};
#pragma GCC unroll 8 /* without it GCC emits about twice the instructions here (callgrind) */
    for (int64_t e = 0; e < E; ++e) {
        const float* row = keys + e * ke + s0;
        if (PREFETCH) for (int64_t at = 0; at < VW * NB; at += 16) __builtin_prefetch(row + delta + at);
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
 * slots after the last whole vector go one at a time. `delta`, PREFETCH: see score_blocks. */
ALWAYS_INLINE void score_keys(const float* q, int64_t q_sh, const float* keys, int64_t ke, int64_t n,
                              int64_t readable, int64_t first, int64_t row_stride, float scale, float* scores,
                              const int64_t E, const int64_t G, int64_t delta, const int PREFETCH) {
    const int64_t CHUNK = G <= 8 ? 8 / G : 1;
    const int64_t rounded_up = (n + VW - 1) / VW * VW, in_buffer = readable / VW * VW;
    const int64_t vector_slots = rounded_up < in_buffer ? rounded_up : in_buffer;
    const int64_t covered = vector_slots < n ? vector_slots : n;
    float* out = scores + first;
    int64_t s0 = 0;
    for (; vector_slots - s0 >= VW * CHUNK; s0 += VW * CHUNK)
        score_blocks(q, q_sh, keys, ke, s0, covered - s0, scale, out, row_stride, CHUNK, E, G, delta, PREFETCH);
    for (; s0 < vector_slots; s0 += VW)
        score_blocks(q, q_sh, keys, ke, s0, covered - s0, scale, out, row_stride, 1, E, G, delta, PREFETCH);
    for (int64_t s = covered; s < n; ++s) {
        for (int64_t g = 0; g < G; ++g) {
            float acc = 0.0f;
            for (int64_t e = 0; e < E; ++e) acc += q[g * q_sh + e] * keys[e * ke + s];
            out[g * row_stride + s] = acc * scale;
        }
    }
}

/* acc[g * E + e] += scores[g * row_stride + first + s] * value_s[e] over n values from slot `first`
 * (values stored slot-major: a slot's E elements are contiguous, a stream the hardware
 * prefetcher follows without help). */
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
    const float* sinks; float scale; float* out; int64_t pairs;
} Args;

/* Whether VW mask bytes (0 or 1 each) are all 1. */
static inline int all_allowed(const uint8_t* ok) {
    for (int i = 0; i < VW; i += 8) {
        uint64_t word;
        memcpy(&word, ok + i, 8);
        if (word != 0x0101010101010101ull) return 0;
    }
    return 1;
}

/* The first slot of a vector of VW that holds an allowed slot (S when none). */
static inline int64_t first_allowed_vector(const uint8_t* ok, int64_t S) {
    int64_t s = 0;
    while (s < S && !ok[s]) ++s;
    return s / VW * VW;
}

/* Disallowed slots' scores (ok[s] == 0) become -inf; returns the largest score, at least
 * `floor`. Whole vectors of slots at a time (a vector with all slots allowed is only read),
 * the last partial one slot by slot. */
static inline float mask_scores(float* row, const uint8_t* ok, int64_t S, float floor) {
    const vecf neg_inf = (vecf){0} - INFINITY;
    vecf best_vec = neg_inf;
    int64_t s = 0;
    for (; s + VW <= S; s += VW) {
        vecf x = *(vecf*)(row + s);
        if (!all_allowed(ok + s)) {
            const veci keep = __builtin_convertvector(*(const vbyte*)(ok + s), veci) != 0;
            x = (vecf)(((veci)x & keep) | ((veci)neg_inf & ~keep));
            *(vecf*)(row + s) = x;
        }
        best_vec = max_vec(best_vec, x);
    }
    float best = max_lanes(best_vec, floor);
    for (; s < S; ++s) {
        row[s] = ok[s] ? row[s] : -INFINITY;
        best = row[s] > best ? row[s] : best;
    }
    return best;
}

/* One (row, key/value head) pair: its G query heads (`qb`, head g's elements from qb + g *
 * q_sh) over the prefix's and the row's own slots. `scores` holds G rows of S floats padded to
 * SR (whole vectors), `acc` G * E. */
ALWAYS_INLINE void attend_pair(const Args* a, int64_t bk, const float* qb, int64_t q_sh, float* scores, float* acc,
                               const int64_t E, const int64_t G) {
    const int64_t S = a->Sp + a->U, SR = (S + VW - 1) / VW * VW;  /* score rows padded to whole vectors */
    const int64_t b = bk / a->K, kh = bk % a->K, p = b / a->group;
    const uint8_t* ok = a->allowed + b * a->allowed_sb;
    /* Slots before the vector of the first allowed one (a left-padded prompt's padding) are
     * skipped: their weights would be exactly 0. */
    const int64_t begin = first_allowed_vector(ok, S);
    const int64_t p0 = begin < a->Sp ? begin : a->Sp, u0 = begin > a->Sp ? begin - a->Sp : 0;
    const float* pk = a->pk + p * a->pk_sp + kh * a->pk_sk;
    const float* k = a->k + b * a->k_sb + kh * a->k_sk;
    const float* pv = a->pv + p * a->pv_sp + kh * a->pv_sk;
    const float* v = a->v + b * a->v_sb + kh * a->v_sk;
    /* the next pair's own keys, as an offset from this pair's (0: none) */
    const int64_t last = bk + 1 == a->pairs, next_row = kh + 1 == a->K;
    const int64_t kd = last ? 0 : next_row ? a->k_sb - (a->K - 1) * a->k_sk : a->k_sk;
    score_keys(qb, q_sh, pk + p0, a->pk_se, a->Sp - p0, a->pk_readable - p0, p0, SR, a->scale, scores, E, G, 0, 0);
    score_keys(qb, q_sh, k + u0, a->k_se, a->U - u0, a->k_readable - u0, a->Sp + u0, SR, a->scale, scores, E, G, kd, 1);
    for (int64_t g = 0; g < G; ++g) {
        float* row = scores + g * SR;
        const float sink = a->sinks ? a->sinks[kh * G + g] : -INFINITY;
        float best = mask_scores(row + begin, ok + begin, S - begin, sink);
        for (int64_t s = S; s < SR; ++s) row[s] = -INFINITY;  /* padding: weight 0 */
        if (best == -INFINITY) {  /* nothing to attend to: zero weights, zero output */
            memset(row, 0, sizeof(float) * (size_t)SR);
            continue;
        }
        vecf total_vec = {0};
        for (int64_t s = begin; s < SR; s += VW) {
            const vecf w = exp_vec_nonpositive(*(vecf*)(row + s) - best);
            *(vecf*)(row + s) = w;
            total_vec += w;
        }
        const float total = sum_lanes(total_vec) + (a->sinks ? exp_one(sink - best) : 0.0f);
        const float inv = 1.0f / total;
        for (int64_t s = begin; s < SR; s += VW) *(vecf*)(row + s) *= inv;
    }
    memset(acc, 0, sizeof(float) * (size_t)(G * E));
    mix_values(pv + p0 * a->pv_ss, a->pv_ss, a->Sp - p0, p0, SR, scores, acc, E, G);
    mix_values(v + u0 * a->v_ss, a->v_ss, a->U - u0, a->Sp + u0, SR, scores, acc, E, G);
    memcpy(a->out + (b * a->H + kh * G) * E, acc, sizeof(float) * (size_t)(G * E));
}

/* What a decode step does before attending, fused (posttrain_decode_attention_step_f32): from
 * the row's raw projections, each query head and the key head get their RMSNorm (when given)
 * and rotary embedding; the key and the raw value are written to the row's own slot U - 1. */
typedef struct {
    const float* q; int64_t q_sb;  /* head h's E elements at q + b * q_sb + h * E */
    const float* k; int64_t k_sb;
    const float* v; int64_t v_sb;
    const float* q_norm; const float* k_norm; float eps;  /* per-head RMSNorm weights [E], or NULL */
    const float* cos; const float* sin; int64_t rot_sb;   /* rotary tables, [B, E] */
    float* k_cache; float* v_cache;                       /* Args.k / Args.v, written at slot U - 1 */
} Prologue;

/* out = rotary(norm(x)): RMSNorm as the model's (x * (1 / sqrt(mean(x^2) + eps)), then the
 * weight), rotate-half rotary (out = y * cos + rotate_half(y) * sin). */
ALWAYS_INLINE void norm_rotate(const float* x, const float* weight, float eps, const float* cos_e, const float* sin_e,
                               float* y, float* out, const int64_t E) {
    if (weight) {
        float squares = 0.0f;
        if (E % VW == 0) {
            vecf squares_vec = {0};
            for (int64_t e = 0; e < E; e += VW) {
                const vecf xv = *(const vecf*)(x + e);
                squares_vec += xv * xv;
            }
            squares = sum_lanes(squares_vec);
        } else {
            for (int64_t e = 0; e < E; ++e) squares += x[e] * x[e];
        }
        const float inv_rms = 1.0f / sqrtf(squares / (float)E + eps);
        for (int64_t e = 0; e < E; ++e) y[e] = weight[e] * (x[e] * inv_rms);
    } else {
        memcpy(y, x, sizeof(float) * (size_t)E);
    }
    const int64_t half = E / 2;
    for (int64_t e = 0; e < half; ++e) out[e] = y[e] * cos_e[e] - y[e + half] * sin_e[e];
    for (int64_t e = half; e < E; ++e) out[e] = y[e] * cos_e[e] + y[e - half] * sin_e[e];
}

/* The pair's prologue: its G queries into `q_out` (G * E), its key and value into the cache. */
ALWAYS_INLINE void prologue_pair(const Prologue* p, const Args* a, int64_t bk, float* q_out, float* scratch,
                                 const int64_t E, const int64_t G) {
    const int64_t b = bk / a->K, kh = bk % a->K, slot = a->U - 1;
    const float* cos_e = p->cos + b * p->rot_sb;
    const float* sin_e = p->sin + b * p->rot_sb;
    float* y = scratch;
    float* key = scratch + E;
    for (int64_t g = 0; g < G; ++g)
        norm_rotate(p->q + b * p->q_sb + (kh * G + g) * E, p->q_norm, p->eps, cos_e, sin_e, y, q_out + g * E, E);
    norm_rotate(p->k + b * p->k_sb + kh * E, p->k_norm, p->eps, cos_e, sin_e, y, key, E);
    float* k_slot = p->k_cache + b * a->k_sb + kh * a->k_sk + slot;
    for (int64_t e = 0; e < E; ++e) k_slot[e * a->k_se] = key[e];
    memcpy(p->v_cache + b * a->v_sb + kh * a->v_sk + slot * a->v_ss, p->v + b * p->v_sb + kh * E,
           sizeof(float) * (size_t)E);
}

/* One pair of a call: the prologue first when there is one (`p`), then the attention. */
ALWAYS_INLINE void pair_step(const Args* a, const Prologue* p, int64_t bk, float* queries, float* scores, float* acc,
                             const int64_t E, const int64_t G) {
    if (p) {
        prologue_pair(p, a, bk, queries, queries + G * E, E, G);
        attend_pair(a, bk, queries, E, scores, acc, E, G);
    } else {
        attend_pair(a, bk, a->q + (bk / a->K) * a->q_sb + (bk % a->K) * G * a->q_sh, a->q_sh, scores, acc, E, G);
    }
}

/* The common shapes get loops of a known length (unrolled, accumulators in registers): head
 * sizes 32..256 with 1, 2, 4 or 8 query heads per key/value head; others run the same code
 * with run-time bounds. */
static void attend_any(const Args* a, const Prologue* p, int64_t bk, float* queries, float* scores, float* acc,
                       int64_t E, int64_t G) {
#define FOR_G(E_)                                                               \
    switch (G) {                                                                \
        case 1: pair_step(a, p, bk, queries, scores, acc, E_, 1); return;       \
        case 2: pair_step(a, p, bk, queries, scores, acc, E_, 2); return;       \
        case 4: pair_step(a, p, bk, queries, scores, acc, E_, 4); return;       \
        case 8: pair_step(a, p, bk, queries, scores, acc, E_, 8); return;       \
    }
    switch (E) {
        case 32: FOR_G(32) break;
        case 64: FOR_G(64) break;
        case 128: FOR_G(128) break;
        case 256: FOR_G(256) break;
    }
#undef FOR_G
    pair_step(a, p, bk, queries, scores, acc, E, G);
}

static void run_pairs(const Args* a, const Prologue* p, int64_t B, int64_t E, int64_t G) {
    const int64_t S = a->Sp + a->U;
#pragma omp parallel
    {
        float* scores = (float*)malloc(sizeof(float) * (size_t)(G * ((S + VW - 1) / VW * VW) + VW));
        float* acc = (float*)malloc(sizeof(float) * (size_t)(G * E));
        float* queries = p ? (float*)malloc(sizeof(float) * (size_t)(G * E + 2 * E)) : NULL;
#pragma omp for schedule(static)
        for (int64_t bk = 0; bk < B * a->K; ++bk) {
            attend_any(a, p, bk, queries, scores, acc, E, G);
        }
        free(queries);
        free(acc);
        free(scores);
    }
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
                       scale, out, B * K};
    run_pairs(&args, NULL, B, E, H / K);
}

/* The same attention, after the prologue: queries, keys and values come raw from the step's
 * projections (`q_raw`, `k_raw`, `v_raw`: [B, H * E], [B, K * E], [B, K * E] rows), and the
 * row's newest own slot (U - 1) is written here. */
void posttrain_decode_attention_step_f32(
    int64_t B, int64_t H, int64_t K, int64_t E, int64_t group,
    const float* q_raw, int64_t q_sb, const float* k_raw, int64_t kr_sb, const float* v_raw, int64_t vr_sb,
    const float* q_norm, const float* k_norm, float eps, const float* cos_t, const float* sin_t, int64_t rot_sb,
    const float* pk, int64_t pk_sp, int64_t pk_sk, int64_t pk_se, int64_t pk_readable,
    const float* pv, int64_t pv_sp, int64_t pv_sk, int64_t pv_ss, int64_t Sp,
    float* k, int64_t k_sb, int64_t k_sk, int64_t k_se, int64_t k_readable,
    float* v, int64_t v_sb, int64_t v_sk, int64_t v_ss, int64_t U,
    const uint8_t* allowed, int64_t allowed_sb, const float* sinks, float scale, float* out) {
    const Args args = {H, K, group, NULL, 0, 0, pk, pk_sp, pk_sk, pk_se, pk_readable, pv, pv_sp, pv_sk, pv_ss,
                       Sp, k, k_sb, k_sk, k_se, k_readable, v, v_sb, v_sk, v_ss, U, allowed, allowed_sb, sinks,
                       scale, out, B * K};
    const Prologue pro = {q_raw, q_sb, k_raw, kr_sb, v_raw, vr_sb, q_norm, k_norm, eps, cos_t, sin_t, rot_sb, k, v};
    run_pairs(&args, &pro, B, E, H / K);
}

/* posttrain_decode_attention_step_f32 with its 42 arguments in one array, in the order of its
 * parameters: pointers as addresses, eps (13) and scale (40) as the bits of a float. A prepared
 * call (posttrain/rl/cpu_kernels/kernels.py, AttentionStepCall) keeps the array, sets the few
 * entries that change from step to step, and passes one pointer. */
void posttrain_decode_attention_step_packed(const int64_t* f) {
#define PTR(i) ((float*)(intptr_t)f[i])
    float eps, scale;
    const int32_t eps_bits = (int32_t)f[13], scale_bits = (int32_t)f[40];
    memcpy(&eps, &eps_bits, sizeof eps);
    memcpy(&scale, &scale_bits, sizeof scale);
    posttrain_decode_attention_step_f32(
        f[0], f[1], f[2], f[3], f[4], PTR(5), f[6], PTR(7), f[8], PTR(9), f[10], PTR(11), PTR(12), eps, PTR(14),
        PTR(15), f[16], PTR(17), f[18], f[19], f[20], f[21], PTR(22), f[23], f[24], f[25], f[26], PTR(27), f[28],
        f[29], f[30], f[31], PTR(32), f[33], f[34], f[35], f[36], (const uint8_t*)(intptr_t)f[37], f[38], PTR(39),
        scale, PTR(41));
#undef PTR
}
