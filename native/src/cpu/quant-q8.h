// quant-q8.h - the fast path of the matrix-vector product: the activation row is quantised
// to 8 bits once, and each weight row's dot product with it is taken in integers.
//
// Per block of 32 activations x: d = max|x| / 127, q = round(x / d) in [-127, 127], and
// s = d * sum(q). A weight block's dot product is then d_w * d * sum(q_w * q) plus, for the
// types with an offset (Q4_1, Q5_1: x_w = q_w * d_w + m_w), m_w * s. The types that centre
// their quants (Q4_0: q - 8, Q5_0: q - 16) use s the same way. This is how llama.cpp runs
// these types; the float path (vec_dot_for) stays the exact reference.
#pragma once
#include <float.h>
#include <stddef.h>
#include <stdint.h>

#define QK8_ACT 32

typedef struct {
    float  d;            // scale
    float  s;            // d * sum(qs)
    int8_t qs[QK8_ACT];
} block_q8_act;
// The SIMD kernels load d and s together.
_Static_assert(offsetof(block_q8_act, s) == offsetof(block_q8_act, d) + 4, "d and s adjacent");

// A quantised row of n activations is its n / 32 blocks followed by the same figures side by
// side: the blocks' d (n / 32 floats), their s (n / 32 floats) and the sum of each 16 quants
// (n / 16 int16). The 256-element super-block kernels load eight of each as one vector
// instead of working them out per block. Q8_ACT_BYTES(n) is the whole row's size.
#define Q8_ACT_BYTES(n) \
    ((size_t)(n) / QK8_ACT * (sizeof(block_q8_act) + 2 * sizeof(float)) + (size_t)(n) / 16 * sizeof(int16_t))

// The same in whole blocks, for arrays of block_q8_act.
#define Q8_ACT_BLOCKS(n) ((Q8_ACT_BYTES(n) + sizeof(block_q8_act) - 1) / sizeof(block_q8_act))

typedef struct {
    float   *d, *s;
    int16_t *sum16;
} q8_act_side;

static inline q8_act_side q8_side(const block_q8_act *x, int64_t n) {
    float *d = (float *)(x + n / QK8_ACT);   // blocks are 40 bytes: the floats stay aligned
    return (q8_act_side){ d, d + n / QK8_ACT, (int16_t *)(d + 2 * (n / QK8_ACT)) };
}

// x (n a multiple of 32) into a quantised row (Q8_ACT_BYTES(n) at y). The scalar and AVX2
// versions give the same bits. A block with an inf or a NaN (a model whose weights overflow)
// gets zero quants and a NaN scale, so its products are NaN and the logits say so (the
// sampler refuses them) rather than the int conversion of a NaN feeding integer sums.
void quantize_row_q8_act(const float *x, block_q8_act *y, int64_t n);
// Block i of a quantised row as such a block: zero quants and sums, a NaN scale.
void q8_act_non_finite_block(block_q8_act *y, q8_act_side side, int64_t i);
// 1 / d for a block scale d; 0 when d is 0 or so small that 1 / d would overflow (every
// value of the block is then below 127 * FLT_MIN and quantises to 0).
static inline float q8_act_inverse_scale(float d) { return d >= FLT_MIN ? 1.0f / d : 0.0f; }
void quantize_row_q8_act_scalar(const float *x, block_q8_act *y, int64_t n);

// The dot product of one weight row of `type` (n elements) with a quantised row of n
// activations.
typedef float (*vec_dot_q8_fn)(const void *row, const block_q8_act *x, int64_t n);
vec_dot_q8_fn vec_dot_q8_for(int32_t type);          // NULL: the type has no integer kernel
vec_dot_q8_fn vec_dot_q8_scalar_for(int32_t type);   // the scalar reference of the same

// Four consecutive weight rows, row_bytes apart, with the same activations: out[0..3]. They
// share each activation load and their scale conversions (quant-q8-rows-avx2.c). NULL where
// there is none for the type or the CPU: use the one-row kernel.
typedef void (*vec_dot4_q8_fn)(const void *rows, int64_t row_bytes, const block_q8_act *x, int64_t n, float *out);
vec_dot4_q8_fn vec_dot4_q8_for(int32_t type);

// Kernel tables (quant-q8.c, quant-q8-avx2.c, quant-q8-rows-avx2.c), indexed by pykv_type;
// the _t0 tables prefetch weights with the T0 hint (simd-avx2.h).
#define Q8_N_TYPES 24
extern const vec_dot_q8_fn q8_scalar_dots[Q8_N_TYPES];
extern const vec_dot_q8_fn q8_avx2_dots[Q8_N_TYPES];
extern const vec_dot_q8_fn q8_avx2_dots_t0[Q8_N_TYPES];
extern const vec_dot4_q8_fn q8_avx2_dots4[Q8_N_TYPES];
extern const vec_dot4_q8_fn q8_avx2_dots4_t0[Q8_N_TYPES];
void quantize_row_q8_act_avx2(const float *x, block_q8_act *y, int64_t n);
