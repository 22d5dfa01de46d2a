// quant-blocks.h - the GGUF block layouts (bit for bit ggml's block_* structs) and the kernel
// tables that quant.c dispatches between. Private to the quant*.c files, kv-cache.c (its
// Q8_0 rows are block_q8_0) and their tests.
#pragma once
#include <stdint.h>

#include "cpu/quant.h"

#define QK4_0 32
#define QK4_1 32
#define QK5_0 32
#define QK5_1 32
#define QK8_0 32
#define QK_K  256
#define K_SCALE_SIZE 12

// f16 fields are raw IEEE half bits. Every struct has 2-byte alignment, so a row must start
// on an even address (GGUF data is 32-aligned; pykv_dequantize bounces odd buffers).
typedef struct { uint16_t d; uint8_t qs[QK4_0 / 2]; } block_q4_0;          // x = (q - 8) * d
typedef struct { uint16_t d, m; uint8_t qs[QK4_1 / 2]; } block_q4_1;       // x = q * d + m
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[QK5_0 / 2]; } block_q5_0;
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[QK5_1 / 2]; } block_q5_1;
typedef struct { uint16_t d; int8_t qs[QK8_0]; } block_q8_0;

// A 32-element block's two leading f16 fields as one word, the first in the low half: d and
// m for the types with a min (Q4_1, Q5_1), d twice for the centred ones (their m-like term is
// d times the centre). The SIMD kernels convert both halves at once.
static inline uint32_t block_f16_dm(const void *blk) {
    uint32_t dm;
    __builtin_memcpy(&dm, blk, 4);
    return dm;
}
static inline uint32_t block_f16_dd(const void *blk) {
    uint16_t d;
    __builtin_memcpy(&d, blk, 2);
    return (uint32_t)d | (uint32_t)d << 16;
}
// Q4_K/Q5_K: 8 sub-blocks of 32, each with a 6-bit scale and a 6-bit min packed in `scales`.
typedef struct {
    uint16_t d, dmin;
    uint8_t  scales[K_SCALE_SIZE];
    uint8_t  qs[QK_K / 2];
} block_q4_K;
typedef struct {
    uint16_t d, dmin;
    uint8_t  scales[K_SCALE_SIZE];
    uint8_t  qh[QK_K / 8];
    uint8_t  qs[QK_K / 2];
} block_q5_K;
// Q6_K: 16 sub-blocks of 16, each with an int8 scale; 4 low bits in ql, 2 high bits in qh.
typedef struct {
    uint8_t  ql[QK_K / 2];
    uint8_t  qh[QK_K / 4];
    int8_t   scales[QK_K / 16];
    uint16_t d;
} block_q6_K;

// Q2_K: 16 sub-blocks of 16; scales[j] holds sub-block j's 4-bit scale (low) and 4-bit min
// (high); 2-bit quants, four to a byte.
typedef struct {
    uint8_t  scales[QK_K / 16];
    uint8_t  qs[QK_K / 4];
    uint16_t d, dmin;
} block_q2_K;
// Q3_K: 16 sub-blocks of 16 with 6-bit signed scales (packed in 12 bytes); 2 low bits in qs,
// the third in hmask (a clear bit subtracts 4).
typedef struct {
    uint8_t  hmask[QK_K / 8];
    uint8_t  qs[QK_K / 4];
    uint8_t  scales[K_SCALE_SIZE];
    uint16_t d;
} block_q3_K;
// IQ4_NL / IQ4_XS: 4-bit indices into a fixed table of 16 int8 levels (iq4_levels).
#define QK4_NL 32
typedef struct { uint16_t d; uint8_t qs[QK4_NL / 2]; } block_iq4_nl;
// IQ4_XS: 8 sub-blocks of 32 with 6-bit signed scales: low 4 bits in scales_l (two per byte),
// top 2 bits in scales_h (two per sub-block).
typedef struct {
    uint16_t d;
    uint16_t scales_h;
    uint8_t  scales_l[QK_K / 64];
    uint8_t  qs[QK_K / 2];
} block_iq4_xs;

_Static_assert(sizeof(block_q4_0) == 18, "q4_0 layout");
_Static_assert(sizeof(block_q4_1) == 20, "q4_1 layout");
_Static_assert(sizeof(block_q5_0) == 22, "q5_0 layout");
_Static_assert(sizeof(block_q5_1) == 24, "q5_1 layout");
_Static_assert(sizeof(block_q8_0) == 34, "q8_0 layout");
_Static_assert(sizeof(block_q2_K) == 84, "q2_K layout");
_Static_assert(sizeof(block_q3_K) == 110, "q3_K layout");
_Static_assert(sizeof(block_q4_K) == 144, "q4_K layout");
_Static_assert(sizeof(block_q5_K) == 176, "q5_K layout");
_Static_assert(sizeof(block_q6_K) == 210, "q6_K layout");
_Static_assert(sizeof(block_iq4_nl) == 18, "iq4_nl layout");
_Static_assert(sizeof(block_iq4_xs) == 136, "iq4_xs layout");

// The 16 levels of the IQ4 types (ggml's kvalues_iq4nl).
static const int8_t iq4_levels[16] = { -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113 };

// Q5_0/Q5_1: the little-endian 32-bit qh, whose bit j is element j's fifth bit.
static inline uint32_t q5_high_bits(const uint8_t qh[4]) {
    return (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
}

// Sub-block j (0..15) of a Q3_K block: its signed scale. Bytes 0-7 hold the low 4 bits (of j
// in the low nibble of byte j%8 for j < 8, the high nibble for j >= 8); bytes 8-11 the top 2
// bits, byte 8 + j%4 at bit 2*(j/4).
static inline int q3_scale(const uint8_t *s, int j) {
    const int lo = (s[j % 8] >> (4 * (j / 8))) & 0xF, hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    return (lo | hi << 4) - 32;
}

// The quants of Q2_K, Q3_K and Q6_K, element l (0..31) of run r (0..3) of half h (0..1), i.e.
// element 128h + 32r + l; its sub-block of 16 is 8h + 2r + l/16. Q2_K/Q3_K: bits 2r..2r+1 of
// byte l of the half's 32 bytes of qs; Q3_K's third bit is bit 4h + r of hmask[l], and a
// clear one subtracts 4.
static inline int q2k_quant(const uint8_t *qs, int h, int r, int l) { return (qs[32 * h + l] >> (2 * r)) & 3; }
static inline int q3k_quant(const block_q3_K *b, int h, int r, int l) {
    return q2k_quant(b->qs, h, r, l) - 4 + 4 * ((b->hmask[l] >> (4 * h + r)) & 1);
}
// Q6_K: the low 4 bits are the low (runs 0, 1) or high (runs 2, 3) nibble of ql[64h + l]
// (runs 0, 2) or ql[64h + 32 + l] (runs 1, 3), the top 2 bits bits 2r..2r+1 of qh[32h + l];
// minus 32.
static inline int q6k_quant(const block_q6_K *b, int h, int r, int l) {
    const uint8_t low = b->ql[64 * h + 32 * (r & 1) + l];
    return ((r < 2 ? low & 0xF : low >> 4) | ((b->qh[32 * h + l] >> (2 * r)) & 3) << 4) - 32;
}

// Sub-block j (0..7) of an IQ4_XS block: its signed scale.
static inline int iq4_xs_scale(const block_iq4_xs *b, int j) {
    return (((b->scales_l[j / 2] >> (4 * (j % 2))) & 0xF) | ((b->scales_h >> (2 * j)) & 3) << 4) - 32;
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K block (ggml get_scale_min_k4):
// bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; sub-blocks 4-7 take their low
// 4 bits from bytes 8-11 and their top 2 bits from the spare top bits of bytes 0-7.
static inline void k4_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m  = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m  = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

// One set of kernels, indexed by pykv_type (NULL where a type has none).
#define QUANT_N_TYPES 31
struct quant_kernels {
    vec_dot_fn vec_dot[QUANT_N_TYPES];
    float (*dot_f32)(const float *a, const float *b, int64_t n);
    void  (*axpy_f32)(float *y, float a, const float *x, int64_t n);
};

extern const struct quant_kernels quant_scalar_kernels;   // quant-scalar.c
extern const struct quant_kernels quant_avx2_kernels;     // quant-avx2.c (x86 only)
extern const struct quant_kernels quant_avx2_kernels_t0;  // the same, T0 prefetch (quant-avx2-t0.c)
