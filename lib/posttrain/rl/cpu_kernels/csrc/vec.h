/* Vector helpers shared by the decode kernels (decode_attention.c, decode_rows.c,
 * sample_rows.c): float vectors as wide as the CPU's registers, a vectorised exp, a
 * fixed-order lane sum, lane-wise and lane maxima. */
#ifndef POSTTRAIN_VEC_H
#define POSTTRAIN_VEC_H
#include <math.h>
#include <stdint.h>

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
typedef uint8_t vbyte __attribute__((vector_size(VW), aligned(1), may_alias));

/* e^xc for xc in [-87, 88]: xc = k*ln2 + r with |r| <= ln2/2, e^r by the classic
 * single-precision polynomial r + r^2 * p(r) + 1 (Cephes' expf coefficients), 2^k through the
 * exponent bits. Relative error about 1e-7. */
static inline vecf exp_in_range(vecf xc) {
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
    return p * (vecf)((k + 127) << 23);
}

/* exp(x) of VW floats: x below -87 (including -inf) gives 0, above 88 +inf. Written with
 * vector operations because the compiler leaves a loop over a scalar version unvectorised. */
static inline vecf exp_vec(vecf x) {
    const veci below = x < -87.0f;  /* lanes that underflow: all bits set */
    const veci above = x > 88.0f;   /* lanes that overflow */
    const vecf low = (vecf){0} - 87.0f, high = (vecf){0} + 88.0f, inf = (vecf){0} + INFINITY;
    const vecf xc = (vecf)(((veci)x & ~below & ~above) | ((veci)low & below) | ((veci)high & above));
    return (vecf)(((veci)exp_in_range(xc) & ~below & ~above) | ((veci)inf & above));
}

/* exp_vec for x <= 0 (a softmax's scores less their maximum): the overflow lanes are left
 * out. x below -87 (including -inf) gives 0. */
static inline vecf exp_vec_nonpositive(vecf x) {
    const veci below = x < -87.0f;
    const vecf xc = (vecf)(((veci)x & ~below) | ((veci)((vecf){0} - 87.0f) & below));
    return (vecf)((veci)exp_in_range(xc) & ~below);
}

/* The lane-wise larger of two vectors (the first where they compare unordered). */
static inline vecf max_vec(vecf a, vecf b) {
    const veci b_above = b > a;
    return (vecf)(((veci)b & b_above) | ((veci)a & ~b_above));
}

/* The largest lane of a vector, or `floor` if that is larger. */
static inline float max_lanes(vecf x, float floor) {
    for (int i = 0; i < VW; ++i) floor = x[i] > floor ? x[i] : floor;
    return floor;
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

#endif
