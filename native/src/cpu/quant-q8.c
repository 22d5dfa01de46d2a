// quant-q8.c - activation quantisation, the scalar integer dot products (the reference the
// SIMD kernels are tested against) and the run-time choice between them.
#include "cpu/quant-q8.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pykv.h"
#include "cpu/quant-blocks.h"
#include "cpu/quant.h"
#if defined(__x86_64__) || defined(__i386__)
#include "cpu/simd-avx2.h"
#endif

void q8_act_non_finite_block(block_q8_act *y, q8_act_side side, int64_t i) {
    memset(y[i].qs, 0, sizeof(y[i].qs));
    y[i].d = side.d[i] = NAN;
    y[i].s = side.s[i] = NAN;
    side.sum16[2 * i] = side.sum16[2 * i + 1] = 0;
}

void quantize_row_q8_act_scalar(const float *x, block_q8_act *y, int64_t n) {
    const q8_act_side side = q8_side(y, n);
    for (int64_t i = 0; i < n / QK8_ACT; i++, x += QK8_ACT) {
        float amax = 0.0f;
        int finite = 1;
        for (int j = 0; j < QK8_ACT; j++) {
            finite &= isfinite(x[j]) != 0;
            amax = fmaxf(amax, fabsf(x[j]));
        }
        if (!finite) {
            q8_act_non_finite_block(y, side, i);
            continue;
        }
        const float d = amax / 127.0f, id = q8_act_inverse_scale(d);
        int half[2] = { 0, 0 };
        for (int j = 0; j < QK8_ACT; j++) {
            const int q = (int)nearbyintf(x[j] * id);   // ties to even, as the SIMD rounding
            y[i].qs[j] = (int8_t)q;
            half[j / 16] += q;
        }
        y[i].d = side.d[i] = d;
        y[i].s = side.s[i] = d * (float)(half[0] + half[1]);
        side.sum16[2 * i] = (int16_t)half[0];
        side.sum16[2 * i + 1] = (int16_t)half[1];
    }
}

// ---- scalar dots: sum over blocks of d_w * d * isum (+ m_w * s) ----

// sum(q_w * q_x) of a Q4/Q5 block whose quant j is low/high nibble of qs[j % 16] plus, for
// Q5, bit j of qh shifted to 16.
static int isum_nibbles(const uint8_t *qs, uint32_t qh, const int8_t *x) {
    int s = 0;
    for (int j = 0; j < 16; j++) {
        const int q0 = (qs[j] & 0xF) | (int)((qh >> j) & 1) << 4;
        const int q1 = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        s += q0 * x[j] + q1 * x[j + 16];
    }
    return s;
}

static float q8dot_q4_0(const void *row, const block_q8_act *x, int64_t n) {
    const block_q4_0 *b = row;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK8_ACT; i++) {
        const float d = fp16_to_fp32(b[i].d);
        acc += d * x[i].d * (float)isum_nibbles(b[i].qs, 0, x[i].qs) - 8.0f * d * x[i].s;
    }
    return acc;
}

static float q8dot_q4_1(const void *row, const block_q8_act *x, int64_t n) {
    const block_q4_1 *b = row;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK8_ACT; i++)
        acc += fp16_to_fp32(b[i].d) * x[i].d * (float)isum_nibbles(b[i].qs, 0, x[i].qs) + fp16_to_fp32(b[i].m) * x[i].s;
    return acc;
}

static float q8dot_q5_0(const void *row, const block_q8_act *x, int64_t n) {
    const block_q5_0 *b = row;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK8_ACT; i++) {
        const float d = fp16_to_fp32(b[i].d);
        acc += d * x[i].d * (float)isum_nibbles(b[i].qs, q5_high_bits(b[i].qh), x[i].qs) - 16.0f * d * x[i].s;
    }
    return acc;
}

static float q8dot_q5_1(const void *row, const block_q8_act *x, int64_t n) {
    const block_q5_1 *b = row;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK8_ACT; i++)
        acc += fp16_to_fp32(b[i].d) * x[i].d * (float)isum_nibbles(b[i].qs, q5_high_bits(b[i].qh), x[i].qs) +
               fp16_to_fp32(b[i].m) * x[i].s;
    return acc;
}

static float q8dot_q8_0(const void *row, const block_q8_act *x, int64_t n) {
    const block_q8_0 *b = row;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK8_ACT; i++) {
        int s = 0;
        for (int j = 0; j < QK8_ACT; j++) s += b[i].qs[j] * x[i].qs[j];
        acc += fp16_to_fp32(b[i].d) * x[i].d * (float)s;
    }
    return acc;
}

// ---- 256-element super-blocks: each activation block of 32 meets one sub-block (or two
// halves of 16 with their own scales) ----

// Q4_K/Q5_K: sub-block j of 32 quants q (0..15, or 0..31 with Q5_K's fifth bit from qh, NULL
// for Q4_K) has x = q * d*scale_j - dmin*min_j; chunk c of 64 holds sub-blocks 2c and 2c+1
// (low and high nibbles).
static float q8dot_k4_block(const uint8_t *scales, uint16_t d16, uint16_t dmin16, const uint8_t *qs,
                            const uint8_t *qh, const block_q8_act *x) {
    const float d = fp16_to_fp32(d16), dmin = fp16_to_fp32(dmin16);
    float acc = 0.0f;
    for (int j = 0; j < 8; j++, x++) {
        uint8_t sc, m;
        k4_scale_min(j, scales, &sc, &m);
        int s = 0;
        for (int l = 0; l < 32; l++) {
            const uint8_t byte = qs[32 * (j / 2) + l];
            const int q = (j % 2 ? byte >> 4 : byte & 0xF) | (qh ? ((qh[l] >> j) & 1) << 4 : 0);
            s += q * x->qs[l];
        }
        acc += d * (float)sc * x->d * (float)s - dmin * (float)m * x->s;
    }
    return acc;
}

static float q8dot_q4_K(const void *row, const block_q8_act *x, int64_t n) {
    const block_q4_K *b = row;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K / QK8_ACT)
        acc += q8dot_k4_block(b[i].scales, b[i].d, b[i].dmin, b[i].qs, NULL, x);
    return acc;
}

static float q8dot_q5_K(const void *row, const block_q8_act *x, int64_t n) {
    const block_q5_K *b = row;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K / QK8_ACT)
        acc += q8dot_k4_block(b[i].scales, b[i].d, b[i].dmin, b[i].qs, b[i].qh, x);
    return acc;
}

// Q2_K, Q3_K and Q6_K: run r (0..3) of half h is activation block 4h + r; its halves of 16
// are sub-blocks 8h + 2r and 8h + 2r + 1 (quant-blocks.h: q2k_quant, q3k_quant, q6k_quant).
static float q8dot_q2_K(const void *row, const block_q8_act *x, int64_t n) {
    const block_q2_K *b = row;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = fp16_to_fp32(b[i].d), dmin = fp16_to_fp32(b[i].dmin);
        for (int h = 0; h < 2; h++) {
            for (int r = 0; r < 4; r++, x++) {
                for (int l0 = 0; l0 < 32; l0 += 16) {
                    const uint8_t sc = b[i].scales[8 * h + 2 * r + l0 / 16];
                    int s = 0, sum = 0;
                    for (int l = l0; l < l0 + 16; l++) {
                        s += q2k_quant(b[i].qs, h, r, l) * x->qs[l];
                        sum += x->qs[l];
                    }
                    acc += d * (float)(sc & 0xF) * x->d * (float)s - dmin * (float)(sc >> 4) * x->d * (float)sum;
                }
            }
        }
    }
    return acc;
}

static float q8dot_q3_K(const void *row, const block_q8_act *x, int64_t n) {
    const block_q3_K *b = row;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = fp16_to_fp32(b[i].d);
        for (int h = 0; h < 2; h++) {
            for (int r = 0; r < 4; r++, x++) {
                for (int l0 = 0; l0 < 32; l0 += 16) {
                    int s = 0;
                    for (int l = l0; l < l0 + 16; l++) s += q3k_quant(&b[i], h, r, l) * x->qs[l];
                    acc += d * (float)q3_scale(b[i].scales, 8 * h + 2 * r + l0 / 16) * x->d * (float)s;
                }
            }
        }
    }
    return acc;
}

static float q8dot_q6_K(const void *row, const block_q8_act *x, int64_t n) {
    const block_q6_K *b = row;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = fp16_to_fp32(b[i].d);
        for (int h = 0; h < 2; h++) {
            for (int r = 0; r < 4; r++, x++) {
                int s[2] = { 0, 0 };
                for (int l = 0; l < 32; l++) s[l / 16] += q6k_quant(&b[i], h, r, l) * x->qs[l];
                acc += d * x->d * ((float)b[i].scales[8 * h + 2 * r] * (float)s[0] + (float)b[i].scales[8 * h + 2 * r + 1] * (float)s[1]);
            }
        }
    }
    return acc;
}

// IQ4: 16 bytes of level indices (low nibbles for 0-15, high for 16-31) against one block.
static int isum_iq4(const uint8_t *qs, const int8_t *x) {
    int s = 0;
    for (int l = 0; l < 16; l++) s += iq4_levels[qs[l] & 0xF] * x[l] + iq4_levels[qs[l] >> 4] * x[l + 16];
    return s;
}

static float q8dot_iq4_nl(const void *row, const block_q8_act *x, int64_t n) {
    const block_iq4_nl *b = row;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK4_NL; i++) acc += fp16_to_fp32(b[i].d) * x[i].d * (float)isum_iq4(b[i].qs, x[i].qs);
    return acc;
}

static float q8dot_iq4_xs(const void *row, const block_q8_act *x, int64_t n) {
    const block_iq4_xs *b = row;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = fp16_to_fp32(b[i].d);
        for (int j = 0; j < QK_K / 32; j++, x++)
            acc += d * (float)iq4_xs_scale(&b[i], j) * x->d * (float)isum_iq4(b[i].qs + 16 * j, x->qs);
    }
    return acc;
}

const vec_dot_q8_fn q8_scalar_dots[Q8_N_TYPES] = {
    [PYKV_TYPE_Q4_0] = q8dot_q4_0,
    [PYKV_TYPE_Q4_1] = q8dot_q4_1,
    [PYKV_TYPE_Q5_0] = q8dot_q5_0,
    [PYKV_TYPE_Q5_1] = q8dot_q5_1,
    [PYKV_TYPE_Q8_0] = q8dot_q8_0,
    [PYKV_TYPE_Q2_K] = q8dot_q2_K,
    [PYKV_TYPE_Q3_K] = q8dot_q3_K,
    [PYKV_TYPE_Q4_K] = q8dot_q4_K,
    [PYKV_TYPE_Q5_K] = q8dot_q5_K,
    [PYKV_TYPE_Q6_K] = q8dot_q6_K,
    [PYKV_TYPE_IQ4_NL] = q8dot_iq4_nl,
    [PYKV_TYPE_IQ4_XS] = q8dot_iq4_xs,
};

// ---- dispatch ----

static int have_avx2(void) {
#if defined(__x86_64__) || defined(__i386__)
    return cpu_has_avx2();
#else
    return 0;
#endif
}

vec_dot_q8_fn vec_dot_q8_scalar_for(int32_t type) {
    return type >= 0 && type < Q8_N_TYPES ? q8_scalar_dots[type] : NULL;
}

vec_dot_q8_fn vec_dot_q8_for(int32_t type) {
    if (type < 0 || type >= Q8_N_TYPES) return NULL;
#if defined(__x86_64__) || defined(__i386__)
    if (have_avx2() && q8_avx2_dots[type]) return (cpu_weight_prefetch_t0() ? q8_avx2_dots_t0 : q8_avx2_dots)[type];
#endif
    return q8_scalar_dots[type];
}

vec_dot4_q8_fn vec_dot4_q8_for(int32_t type) {
    if (type < 0 || type >= Q8_N_TYPES) return NULL;
#if defined(__x86_64__) || defined(__i386__)
    if (have_avx2()) return (cpu_weight_prefetch_t0() ? q8_avx2_dots4_t0 : q8_avx2_dots4)[type];
#endif
    return NULL;
}

void quantize_row_q8_act(const float *x, block_q8_act *y, int64_t n) {
#if defined(__x86_64__) || defined(__i386__)
    if (have_avx2()) {
        quantize_row_q8_act_avx2(x, y, n);
        return;
    }
#endif
    quantize_row_q8_act_scalar(x, y, n);
}
