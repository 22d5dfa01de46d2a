// quant-scalar.c - plain C dequantization (ggml's dequantize_row_* math, bit for bit) and the
// reference dot products the SIMD kernels are tested against.
#include <string.h>

#include "core/error.h"
#include "cpu/quant-blocks.h"
#include "model/types.h"

// ggml and gguf-py compute q*d and then add m. Here q*d is always exact (an f16 scale, times
// a K-quant sub-scale of at most 8 bits, times a quant of at most 6 bits fits in float's 24
// bits), so results match theirs bit for bit whether or not the compiler fuses it into an FMA.

static void deq_f32(const void *src, float *y, int64_t n) { memcpy(y, src, (size_t)n * sizeof(float)); }

static void deq_f16(const void *src, float *y, int64_t n) {
    const uint16_t *h = src;
    for (int64_t i = 0; i < n; i++) y[i] = fp16_to_fp32(h[i]);
}

static void deq_bf16(const void *src, float *y, int64_t n) {
    const uint16_t *h = src;
    for (int64_t i = 0; i < n; i++) y[i] = bf16_to_fp32(h[i]);
}

// 32-element blocks: byte j of qs holds element j in its low nibble and element j+16 in its high.
static void deq_q4_0(const void *src, float *y, int64_t n) {
    const block_q4_0 *b = src;
    for (int64_t i = 0; i < n / QK4_0; i++, y += QK4_0) {
        const float d = fp16_to_fp32(b[i].d);
        for (int j = 0; j < QK4_0 / 2; j++) {
            y[j]      = (float)((b[i].qs[j] & 0xF) - 8) * d;
            y[j + 16] = (float)((b[i].qs[j] >> 4) - 8) * d;
        }
    }
}

static void deq_q4_1(const void *src, float *y, int64_t n) {
    const block_q4_1 *b = src;
    for (int64_t i = 0; i < n / QK4_1; i++, y += QK4_1) {
        const float d = fp16_to_fp32(b[i].d), m = fp16_to_fp32(b[i].m);
        for (int j = 0; j < QK4_1 / 2; j++) {
            y[j]      = (float)(b[i].qs[j] & 0xF) * d + m;
            y[j + 16] = (float)(b[i].qs[j] >> 4) * d + m;
        }
    }
}

static void deq_q5_0(const void *src, float *y, int64_t n) {
    const block_q5_0 *b = src;
    for (int64_t i = 0; i < n / QK5_0; i++, y += QK5_0) {
        const float d = fp16_to_fp32(b[i].d);
        const uint32_t qh = q5_high_bits(b[i].qh);
        for (int j = 0; j < QK5_0 / 2; j++) {
            const int q0 = (b[i].qs[j] & 0xF) | (int)((qh >> j) & 1) << 4;
            const int q1 = (b[i].qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
            y[j]      = (float)(q0 - 16) * d;
            y[j + 16] = (float)(q1 - 16) * d;
        }
    }
}

static void deq_q5_1(const void *src, float *y, int64_t n) {
    const block_q5_1 *b = src;
    for (int64_t i = 0; i < n / QK5_1; i++, y += QK5_1) {
        const float d = fp16_to_fp32(b[i].d), m = fp16_to_fp32(b[i].m);
        const uint32_t qh = q5_high_bits(b[i].qh);
        for (int j = 0; j < QK5_1 / 2; j++) {
            const int q0 = (b[i].qs[j] & 0xF) | (int)((qh >> j) & 1) << 4;
            const int q1 = (b[i].qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
            y[j]      = (float)q0 * d + m;
            y[j + 16] = (float)q1 * d + m;
        }
    }
}

static void deq_q8_0(const void *src, float *y, int64_t n) {
    const block_q8_0 *b = src;
    for (int64_t i = 0; i < n / QK8_0; i++, y += QK8_0) {
        const float d = fp16_to_fp32(b[i].d);
        for (int j = 0; j < QK8_0; j++) y[j] = (float)b[i].qs[j] * d;
    }
}

// Q4_K: 4 chunks of 64; chunk c takes the low nibbles of qs[32c..32c+31] (sub-block 2c) then
// their high nibbles (sub-block 2c+1); x = d*scale*q - dmin*min.
static void deq_q4_K(const void *src, float *y, int64_t n) {
    const block_q4_K *b = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = fp16_to_fp32(b[i].d), dmin = fp16_to_fp32(b[i].dmin);
        const uint8_t *q = b[i].qs;
        for (int c = 0; c < 4; c++, q += 32) {
            uint8_t sc, m;
            k4_scale_min(2 * c, b[i].scales, &sc, &m);
            const float d1 = d * sc, m1 = dmin * m;
            k4_scale_min(2 * c + 1, b[i].scales, &sc, &m);
            const float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++) *y++ = d1 * (float)(q[l] & 0xF) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * (float)(q[l] >> 4) - m2;
        }
    }
}

// Q5_K: as Q4_K, plus a fifth bit: bit 2c of qh[l] for sub-block 2c, bit 2c+1 for 2c+1.
static void deq_q5_K(const void *src, float *y, int64_t n) {
    const block_q5_K *b = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = fp16_to_fp32(b[i].d), dmin = fp16_to_fp32(b[i].dmin);
        const uint8_t *ql = b[i].qs, *qh = b[i].qh;
        for (int c = 0; c < 4; c++, ql += 32) {
            uint8_t sc, m;
            k4_scale_min(2 * c, b[i].scales, &sc, &m);
            const float d1 = d * sc, m1 = dmin * m;
            k4_scale_min(2 * c + 1, b[i].scales, &sc, &m);
            const float d2 = d * sc, m2 = dmin * m;
            const uint8_t u1 = (uint8_t)(1u << (2 * c)), u2 = (uint8_t)(2u << (2 * c));
            for (int l = 0; l < 32; l++) *y++ = d1 * (float)((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * (float)((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
        }
    }
}

// Q6_K: run r of half h (32 elements, q6k_quant) in two sub-blocks of 16, x = d*scale*q with
// the sub-block's int8 scale.
static void deq_q6_K(const void *src, float *restrict y, int64_t n) {
    const block_q6_K *b = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = fp16_to_fp32(b[i].d);
        for (int h = 0; h < 2; h++) {
            for (int r = 0; r < 4; r++) {
                for (int l0 = 0; l0 < 32; l0 += 16, y += 16) {
                    const float dl = d * b[i].scales[8 * h + 2 * r + l0 / 16];
                    for (int l = 0; l < 16; l++) y[l] = dl * (float)q6k_quant(&b[i], h, r, l0 + l);
                }
            }
        }
    }
}

// Q2_K: run r of half h (32 elements, q2k_quant) in two sub-blocks of 16, x = d*scale*q -
// dmin*min with scale and min the two nibbles of the sub-block's byte of scales.
static void deq_q2_K(const void *src, float *restrict y, int64_t n) {
    const block_q2_K *b = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = fp16_to_fp32(b[i].d), dmin = fp16_to_fp32(b[i].dmin);
        for (int h = 0; h < 2; h++) {
            for (int r = 0; r < 4; r++) {
                for (int l0 = 0; l0 < 32; l0 += 16, y += 16) {
                    const uint8_t sc = b[i].scales[8 * h + 2 * r + l0 / 16];
                    const float dl = d * (float)(sc & 0xF), ml = dmin * (float)(sc >> 4);
                    for (int l = 0; l < 16; l++) y[l] = dl * (float)q2k_quant(b[i].qs, h, r, l0 + l) - ml;
                }
            }
        }
    }
}

// Q3_K: as Q2_K's runs (q3k_quant), x = d*scale*q with a signed 6-bit scale (q3_scale).
static void deq_q3_K(const void *src, float *restrict y, int64_t n) {
    const block_q3_K *b = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = fp16_to_fp32(b[i].d);
        for (int h = 0; h < 2; h++) {
            for (int r = 0; r < 4; r++) {
                for (int l0 = 0; l0 < 32; l0 += 16, y += 16) {
                    const float dl = d * (float)q3_scale(b[i].scales, 8 * h + 2 * r + l0 / 16);
                    for (int l = 0; l < 16; l++) y[l] = dl * (float)q3k_quant(&b[i], h, r, l0 + l);
                }
            }
        }
    }
}

// IQ4_NL: elements 0-15 index the levels with the low nibbles of qs, 16-31 with the high ones.
static void deq_iq4_nl(const void *src, float *y, int64_t n) {
    const block_iq4_nl *b = src;
    for (int64_t i = 0; i < n / QK4_NL; i++, y += QK4_NL) {
        const float d = fp16_to_fp32(b[i].d);
        for (int l = 0; l < 16; l++) {
            y[l] = d * (float)iq4_levels[b[i].qs[l] & 0xF];
            y[l + 16] = d * (float)iq4_levels[b[i].qs[l] >> 4];
        }
    }
}

// IQ4_XS: sub-block j of 32 is IQ4_NL's layout on qs[16j..16j+15], with scale d*scale_j.
static void deq_iq4_xs(const void *src, float *y, int64_t n) {
    const block_iq4_xs *b = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = fp16_to_fp32(b[i].d);
        for (int j = 0; j < QK_K / 32; j++, y += 32) {
            const float dl = d * (float)iq4_xs_scale(&b[i], j);
            const uint8_t *q = b[i].qs + 16 * j;
            for (int l = 0; l < 16; l++) {
                y[l] = dl * (float)iq4_levels[q[l] & 0xF];
                y[l + 16] = dl * (float)iq4_levels[q[l] >> 4];
            }
        }
    }
}

typedef void (*deq_fn)(const void *src, float *y, int64_t n);

static deq_fn deq_for(int32_t type) {
    switch (type) {
    case PYKV_TYPE_F32:  return deq_f32;
    case PYKV_TYPE_F16:  return deq_f16;
    case PYKV_TYPE_BF16: return deq_bf16;
    case PYKV_TYPE_Q4_0: return deq_q4_0;
    case PYKV_TYPE_Q4_1: return deq_q4_1;
    case PYKV_TYPE_Q5_0: return deq_q5_0;
    case PYKV_TYPE_Q5_1: return deq_q5_1;
    case PYKV_TYPE_Q8_0: return deq_q8_0;
    case PYKV_TYPE_Q2_K: return deq_q2_K;
    case PYKV_TYPE_Q3_K: return deq_q3_K;
    case PYKV_TYPE_Q4_K: return deq_q4_K;
    case PYKV_TYPE_Q5_K: return deq_q5_K;
    case PYKV_TYPE_Q6_K: return deq_q6_K;
    case PYKV_TYPE_IQ4_NL: return deq_iq4_nl;
    case PYKV_TYPE_IQ4_XS: return deq_iq4_xs;
    default:             return NULL;
    }
}

pykv_status dequant_row(int32_t type, const void *src, float *dst, int64_t n) {
    deq_fn f = deq_for(type);
    if (!f) return pykv_error(PYKV_ERR_UNSUPPORTED, "dequantize: unsupported tensor type %d", (int)type);
    f(src, dst, n);
    return PYKV_OK;
}

// ---- reference dot products: dequantize a block into a buffer, then a plain float sum ----

static float dot_scalar(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static void axpy_scalar(float *y, float a, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

// Dequantize one block at a time; `bs` elements of `bb` bytes.
static float dot_blocks(deq_fn deq, int bs, int bb, const void *row, const float *x, int64_t n) {
    float buf[QK_K], s = 0.0f;
    const uint8_t *p = row;
    for (int64_t i = 0; i < n; i += bs, p += bb) {
        deq(p, buf, bs);
        for (int j = 0; j < bs; j++) s += buf[j] * x[i + j];
    }
    return s;
}

#define REF_DOT(name, deq, bs, type)                                                          \
    static float name(const void *row, const float *x, int64_t n) {                          \
        return dot_blocks(deq, bs, (int)sizeof(type), row, x, n);                            \
    }
REF_DOT(vdot_q4_0, deq_q4_0, QK4_0, block_q4_0)
REF_DOT(vdot_q4_1, deq_q4_1, QK4_1, block_q4_1)
REF_DOT(vdot_q5_0, deq_q5_0, QK5_0, block_q5_0)
REF_DOT(vdot_q5_1, deq_q5_1, QK5_1, block_q5_1)
REF_DOT(vdot_q8_0, deq_q8_0, QK8_0, block_q8_0)
REF_DOT(vdot_q2_K, deq_q2_K, QK_K, block_q2_K)
REF_DOT(vdot_q3_K, deq_q3_K, QK_K, block_q3_K)
REF_DOT(vdot_q4_K, deq_q4_K, QK_K, block_q4_K)
REF_DOT(vdot_q5_K, deq_q5_K, QK_K, block_q5_K)
REF_DOT(vdot_q6_K, deq_q6_K, QK_K, block_q6_K)
REF_DOT(vdot_iq4_nl, deq_iq4_nl, QK4_NL, block_iq4_nl)
REF_DOT(vdot_iq4_xs, deq_iq4_xs, QK_K, block_iq4_xs)
REF_DOT(vdot_f16, deq_f16, 32, uint16_t[32])
REF_DOT(vdot_bf16, deq_bf16, 32, uint16_t[32])

// F16/BF16 rows need not be a multiple of 32: finish the tail one element at a time.
static float vdot_f16_any(const void *row, const float *x, int64_t n) {
    const int64_t n32 = n & ~(int64_t)31;
    float s = vdot_f16(row, x, n32);
    for (int64_t i = n32; i < n; i++) s += fp16_to_fp32(((const uint16_t *)row)[i]) * x[i];
    return s;
}

static float vdot_bf16_any(const void *row, const float *x, int64_t n) {
    const int64_t n32 = n & ~(int64_t)31;
    float s = vdot_bf16(row, x, n32);
    for (int64_t i = n32; i < n; i++) s += bf16_to_fp32(((const uint16_t *)row)[i]) * x[i];
    return s;
}

static float vdot_f32(const void *row, const float *x, int64_t n) { return dot_scalar(row, x, n); }

const struct quant_kernels quant_scalar_kernels = {
    .vec_dot = {
        [PYKV_TYPE_F32]  = vdot_f32,
        [PYKV_TYPE_F16]  = vdot_f16_any,
        [PYKV_TYPE_BF16] = vdot_bf16_any,
        [PYKV_TYPE_Q4_0] = vdot_q4_0,
        [PYKV_TYPE_Q4_1] = vdot_q4_1,
        [PYKV_TYPE_Q5_0] = vdot_q5_0,
        [PYKV_TYPE_Q5_1] = vdot_q5_1,
        [PYKV_TYPE_Q8_0] = vdot_q8_0,
        [PYKV_TYPE_Q2_K] = vdot_q2_K,
        [PYKV_TYPE_Q3_K] = vdot_q3_K,
        [PYKV_TYPE_Q4_K] = vdot_q4_K,
        [PYKV_TYPE_Q5_K] = vdot_q5_K,
        [PYKV_TYPE_Q6_K] = vdot_q6_K,
        [PYKV_TYPE_IQ4_NL] = vdot_iq4_nl,
        [PYKV_TYPE_IQ4_XS] = vdot_iq4_xs,
    },
    .dot_f32  = dot_scalar,
    .axpy_f32 = axpy_scalar,
};
