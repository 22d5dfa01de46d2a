// quant-q8.c - activation quantisation, the scalar integer dot products (the reference the
// SIMD kernels are tested against) and the run-time choice between them.
#include "quant-q8.h"

#include <math.h>
#include <stdlib.h>

#include "pykv.h"
#include "quant-blocks.h"
#include "quant.h"
#if defined(__x86_64__) || defined(__i386__)
#include "simd-avx2.h"
#endif

void quantize_row_q8_act_scalar(const float *x, block_q8_act *y, int64_t n) {
    for (int64_t i = 0; i < n / QK8_ACT; i++, x += QK8_ACT) {
        float amax = 0.0f;
        for (int j = 0; j < QK8_ACT; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK8_ACT; j++) {
            const int q = (int)nearbyintf(x[j] * id);   // ties to even, as the SIMD rounding
            y[i].qs[j] = (int8_t)q;
            sum += q;
        }
        y[i].d = d;
        y[i].s = d * (float)sum;
    }
}

// ---- scalar dots: sum over blocks of d_w * d * isum (+ m_w * s) ----

static uint32_t qh32(const uint8_t qh[4]) {
    return (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
}

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
        acc += d * x[i].d * (float)isum_nibbles(b[i].qs, qh32(b[i].qh), x[i].qs) - 16.0f * d * x[i].s;
    }
    return acc;
}

static float q8dot_q5_1(const void *row, const block_q8_act *x, int64_t n) {
    const block_q5_1 *b = row;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK8_ACT; i++)
        acc += fp16_to_fp32(b[i].d) * x[i].d * (float)isum_nibbles(b[i].qs, qh32(b[i].qh), x[i].qs) +
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

const vec_dot_q8_fn q8_scalar_dots[Q8_N_TYPES] = {
    [PYKV_TYPE_Q4_0] = q8dot_q4_0,
    [PYKV_TYPE_Q4_1] = q8dot_q4_1,
    [PYKV_TYPE_Q5_0] = q8dot_q5_0,
    [PYKV_TYPE_Q5_1] = q8dot_q5_1,
    [PYKV_TYPE_Q8_0] = q8dot_q8_0,
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
    if (have_avx2() && q8_avx2_dots[type]) return q8_avx2_dots[type];
#endif
    return q8_scalar_dots[type];
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
