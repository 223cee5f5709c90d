/* A dense decoder's whole decode step in one call: every block's norms, linear maps (the BLAS
 * sgemm that torch's matrix product calls, with the same arguments, so the same bits), fused
 * attention and SwiGLU, then the final norm. posttrain/rl/cpu_kernels/fused_step.py builds the plan
 * (StepProgram) and states the contract; this file only runs it.
 *
 * Why: at a few hundred rows, the ~40 Python-level calls of a step (each a dispatch and
 * argument checks) cost about as much as the small matrix products they start. */
#include <stdint.h>
#include <string.h>

void posttrain_add_rms_norm_f32(int64_t rows, int64_t D, float* x, int64_t x_sr, const float* delta, int64_t d_sr,
                                const float* weight, float eps, float* out, int64_t o_sr);
void posttrain_silu_mul_f32(int64_t rows, int64_t F, float* gate, int64_t g_sr, const float* up, int64_t u_sr);
void posttrain_decode_attention_step_packed(const int64_t* f);

/* BLAS's Fortran sgemm (column-major), the one torch's CPU matrix product calls. */
typedef void (*sgemm_fn)(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                         const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                         const float* beta, float* c, const int* ldc);

/* out[B, O] = x[B, I] @ w[O, I]^T, all contiguous: torch.mm(x, w.t(), out=out) makes this call
 * (the row-major result as its column-major transpose: w^T of the stored w, times x). */
static void linear(sgemm_fn sgemm, const float* w, const float* x, float* out, int64_t B, int64_t O, int64_t I) {
    const int m = (int)O, n = (int)B, k = (int)I, lda = (int)I, ldb = (int)I, ldc = (int)O;
    const float one = 1.0f, zero = 0.0f;
    sgemm("T", "N", &m, &n, &k, &one, w, &lda, x, &ldb, &zero, out, &ldc);
}

static float float_at(const int64_t* f, int i) {
    float x;
    const int32_t bits = (int32_t)f[i];
    memcpy(&x, &bits, sizeof x);
    return x;
}

#define PTR(i) ((float*)(intptr_t)p[i])
enum { N_LAYERS, ROWS, DIM, Q_WIDTH, KV_WIDTH, FFN, SGEMM, X, OUT, FINAL_NORM, FINAL_EPS, H_BUF, Q_BUF, K_BUF,
       V_BUF, O_BUF, PROJ_BUF, GATE_BUF, UP_BUF, DOWN_BUF, HEADER };
enum { ATTN_NORM, ATTN_EPS, WQ, WK, WV, WO, W_GATE, W_UP, W_DOWN, FFN_NORM, FFN_EPS, ATTENTION, PER_LAYER };

/* The plan `p`: HEADER entries (above), then PER_LAYER entries per block; pointers as
 * addresses, eps as float bits; ATTENTION is the address of the layer's packed attention
 * arguments (their q/k/v, output, rotary, mask and slot count already set for this step). */
void posttrain_decode_step_f32(const int64_t* p) {
    const int64_t L = p[N_LAYERS], B = p[ROWS], D = p[DIM], HE = p[Q_WIDTH], KE = p[KV_WIDTH], F = p[FFN];
    const sgemm_fn sgemm = (sgemm_fn)(intptr_t)p[SGEMM];
    float *x = PTR(X), *h = PTR(H_BUF), *q = PTR(Q_BUF), *k = PTR(K_BUF), *v = PTR(V_BUF), *o = PTR(O_BUF);
    float *proj = PTR(PROJ_BUF), *gate = PTR(GATE_BUF), *up = PTR(UP_BUF), *down = PTR(DOWN_BUF);
    for (int64_t l = 0; l < L; ++l) {
        const int64_t* layer = p + HEADER + l * PER_LAYER;
#define W(i) ((const float*)(intptr_t)layer[i])
        posttrain_add_rms_norm_f32(B, D, x, D, l ? down : NULL, D, W(ATTN_NORM), float_at(layer, ATTN_EPS), h, D);
        linear(sgemm, W(WQ), h, q, B, HE, D);
        linear(sgemm, W(WK), h, k, B, KE, D);
        linear(sgemm, W(WV), h, v, B, KE, D);
        posttrain_decode_attention_step_packed((const int64_t*)(intptr_t)layer[ATTENTION]);
        linear(sgemm, W(WO), o, proj, B, D, HE);
        posttrain_add_rms_norm_f32(B, D, x, D, proj, D, W(FFN_NORM), float_at(layer, FFN_EPS), h, D);
        linear(sgemm, W(W_GATE), h, gate, B, F, D);
        linear(sgemm, W(W_UP), h, up, B, F, D);
        posttrain_silu_mul_f32(B, F, gate, F, up, F);
        linear(sgemm, W(W_DOWN), gate, down, B, D, F);
#undef W
    }
    posttrain_add_rms_norm_f32(B, D, x, D, L ? down : NULL, D, PTR(FINAL_NORM), float_at(p, FINAL_EPS), PTR(OUT), D);
}
#undef PTR
