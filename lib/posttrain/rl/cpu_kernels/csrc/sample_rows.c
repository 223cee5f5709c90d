/* Inverse-CDF sampling of one token per row from float32 logits, fused: the log-softmax, the
 * tempered distribution, its cumulative sum and the search in a few passes over a row.
 * posttrain/rl/cpu_kernels/kernels.py (`sample_rows`) states the contract and compiles this file
 * with the other decode kernels at first use.
 *
 * Row r: raw_i = (x_i - max x) - log(sum_j exp(x_j - max x)) (the model's log-probabilities);
 * with temperature T, y_i = x_i / T and logp_i the same of y (logp = raw when T == 1);
 * p_i = exp(logp_i); total = the sum of p in a fixed order (blocks of VW, each block's lanes
 * summed as a tree, blocks added in order in double); target = min(u_r * total, the float
 * just below total). The token: the block where the running block sums first exceed target,
 * and in it the first token of positive probability where the running sum, now token by
 * token, does; where rounding separates the two sums, the next positive token after the block
 * (the last positive one at worst), so a token of positive probability is always drawn.
 * Rows are split over OpenMP threads when there are enough elements; each row is one
 * thread's in a fixed order, so the result does not depend on the thread count. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

#define PARALLEL_ELEMENTS 32768 /* below this many elements one thread is faster */

/* The largest of n floats (n >= 1). */
static inline float row_max(const float* x, int64_t n) {
    float best = x[0];
    int64_t i = 0;
    if (n >= VW) {
        vecf best_vec = *(const vecf*)x;
        for (i = VW; i + VW <= n; i += VW) best_vec = max_vec(best_vec, *(const vecf*)(x + i));
        best = max_lanes(best_vec, best);
    }
    for (; i < n; ++i) best = x[i] > best ? x[i] : best;
    return best;
}

/* log(sum_i exp(x_i / t - top)), top = max(x) / t: the log-normaliser of a softmax. */
static inline float log_normaliser(const float* x, int64_t n, float t, float top) {
    vecf sum_vec = {0};
    int64_t i = 0;
    for (; i + VW <= n; i += VW) sum_vec += exp_vec_nonpositive(*(const vecf*)(x + i) / t - top);
    float sum = sum_lanes(sum_vec);
    for (; i < n; ++i) sum += exp_vec_nonpositive((vecf){0} + (x[i] / t - top))[0];
    return logf(sum);
}

/* p_i = exp(x_i / t - top - log_z) into `p`; returns their sum in the fixed block order. */
static inline double probabilities(const float* x, int64_t n, float t, float top, float log_z, float* p) {
    double total = 0.0;
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        const vecf w = exp_vec_nonpositive((*(const vecf*)(x + i) / t - top) - log_z);
        *(vecf*)(p + i) = w;
        total += (double)sum_lanes(w);
    }
    for (; i < n; ++i) {
        p[i] = exp_vec_nonpositive((vecf){0} + ((x[i] / t - top) - log_z))[0];
        total += (double)p[i];
    }
    return total;
}

/* The first index whose running sum of p (blocks as in `probabilities`) exceeds target; the
 * last index of positive probability if rounding leaves none. */
static inline int64_t search(const float* p, int64_t n, double target) {
    double running = 0.0;
    int64_t last_positive = 0;
    for (int64_t start = 0; start < n; start += VW) {
        const int64_t end = start + VW <= n ? start + VW : n;
        double block = 0.0;
        if (end - start == VW) {
            block = (double)sum_lanes(*(const vecf*)(p + start));
        } else {
            for (int64_t i = start; i < end; ++i) block += (double)p[i];
        }
        if (running + block > target) {
            double inside = running;
            for (int64_t i = start; i < end; ++i) {
                inside += (double)p[i];
                if (p[i] > 0.0f && inside > target) return i;
            }
        }
        for (int64_t i = start; i < end; ++i)
            if (p[i] > 0.0f) last_positive = i;
        running += block;
    }
    return last_positive;
}

/* See the file's comment. Each thread keeps one row's probabilities (V floats) at a time. */
void posttrain_sample_rows_f32(int64_t R, int64_t V, const float* logits, int64_t l_sr, float temperature,
                               const float* uniforms, int64_t* tokens, float* logp, float* raw) {
#pragma omp parallel if (R * V >= PARALLEL_ELEMENTS)
    {
        float* p = (float*)malloc(sizeof(float) * (size_t)V);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; ++r) {
            const float* x = logits + r * l_sr;
            const float top = row_max(x, V);
            const float raw_z = log_normaliser(x, V, 1.0f, top);
            const float tempered_top = top / temperature;  /* division keeps order: the max of x / t */
            const float tempered_z = temperature == 1.0f ? raw_z : log_normaliser(x, V, temperature, tempered_top);
            const double total = probabilities(x, V, temperature, tempered_top, tempered_z, p);
            const double below_total = (double)nextafterf((float)total, 0.0f);
            const double drawn = (double)uniforms[r] * total;
            const int64_t token = search(p, V, drawn < below_total ? drawn : below_total);
            tokens[r] = token;
            logp[r] = (x[token] / temperature - tempered_top) - tempered_z;
            raw[r] = (x[token] - top) - raw_z;
        }
        free(p);
    }
}
