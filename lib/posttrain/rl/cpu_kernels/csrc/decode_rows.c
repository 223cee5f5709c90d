/* Row-wise float32 operations of a decode step, fused: a residual add with the RMSNorm that
 * follows it, and SwiGLU's silu(gate) * up. posttrain/rl/cpu_kernels/kernels.py states the contract
 * and compiles this file with decode_attention.c at first use.
 *
 * Rows are split over OpenMP threads when there are enough elements to pay for it; each row is
 * computed by one thread in a fixed order, so results do not depend on the thread count. */
#include <math.h>
#include <stdint.h>

#include "vec.h"

#define PARALLEL_ELEMENTS 32768 /* below this many elements one thread is faster */

/* x[r] += delta[r] (when delta is not NULL), then out[r] = weight * (x[r] / sqrt(mean(x[r]^2) +
 * eps)): the model's RMSNorm (normalise, then apply the weight). Strides in elements. */
void posttrain_add_rms_norm_f32(int64_t rows, int64_t D, float* x, int64_t x_sr, const float* delta, int64_t d_sr,
                                const float* weight, float eps, float* out, int64_t o_sr) {
#pragma omp parallel for schedule(static) if (rows * D >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        float* xr = x + r * x_sr;
        float* yr = out + r * o_sr;
        if (delta) {
            const float* dr = delta + r * d_sr;
            for (int64_t i = 0; i < D; ++i) xr[i] += dr[i];
        }
        vecf squares_vec = {0};
        int64_t i = 0;
        for (; i + VW <= D; i += VW) {
            const vecf xv = *(const vecf*)(xr + i);
            squares_vec += xv * xv;
        }
        float squares = sum_lanes(squares_vec);
        for (; i < D; ++i) squares += xr[i] * xr[i];
        const float inv_rms = 1.0f / sqrtf(squares / (float)D + eps);
        for (int64_t j = 0; j < D; ++j) yr[j] = weight[j] * (xr[j] * inv_rms);
    }
}

/* gate[r] = silu(gate[r]) * up[r] = gate / (1 + exp(-gate)) * up, in place. */
void posttrain_silu_mul_f32(int64_t rows, int64_t F, float* gate, int64_t g_sr, const float* up, int64_t u_sr) {
#pragma omp parallel for schedule(static) if (rows * F >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        float* gr = gate + r * g_sr;
        const float* ur = up + r * u_sr;
        int64_t i = 0;
        for (; i + VW <= F; i += VW) {
            const vecf g = *(const vecf*)(gr + i);
            *(vecf*)(gr + i) = g / (1.0f + exp_vec(-g)) * *(const vecf*)(ur + i);
        }
        for (; i < F; ++i) gr[i] = gr[i] / (1.0f + exp_vec((vecf){0} - gr[i])[0]) * ur[i];
    }
}
