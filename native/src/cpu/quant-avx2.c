// quant-avx2.c - AVX2/FMA/F16C dot products of a weight row with float activations.
//
// The library is built for baseline x86-64, so each function carries its own target
// attribute and quant.c calls them only after checking the CPU. Decode is bound by memory
// bandwidth: each kernel unpacks a block in registers, turns the quants into floats and
// feeds them straight into FMAs with several accumulators; nothing goes back to memory.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "cpu/quant-blocks.h"
#include "cpu/simd-avx2.h"

#define TGT AVX2_TGT

static inline TGT float half(uint16_t h) { return _cvtsh_ss(h); }

// pshufb controls that spread bytes 0-7 (spread_lo) or 8-15 (spread_hi) of a 128-bit lane,
// duplicated in both lanes, into eight zero-extended 32-bit lanes: in-lane shuffles, cheaper
// than vpmovzxbd ymm, xmm (which crosses lanes) plus unpacks.
#define B4(i) i, -1, -1, -1
static const int8_t spread_lo[32] = { B4(0), B4(1), B4(2), B4(3), B4(4), B4(5), B4(6), B4(7) };
static const int8_t spread_hi[32] = { B4(8), B4(9), B4(10), B4(11), B4(12), B4(13), B4(14), B4(15) };
#undef B4

// a += (q * d + m) * x[0..7] for eight quants in 32-bit lanes.
// With m = -k*d this is exactly round((q - k) * d), the scalar dequant value.
static inline TGT __m256 fma8(__m256i q, __m256 d, __m256 m, const float *x, __m256 a) {
    return _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m), _mm256_loadu_ps(x), a);
}

// 16 bytes of packed nibbles (qs): the low nibbles are 16 quants for xl[0..15] with (dl, ml),
// the high nibbles 16 quants for xh[0..15] with (dh, mh).
static inline TGT void fma_nib16(const uint8_t *qs, __m256 dl, __m256 ml, const float *xl,
                                 __m256 dh, __m256 mh, const float *xh,
                                 __m256 *a0, __m256 *a1, __m256 *a2, __m256 *a3) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    const __m256i s0 = _mm256_shuffle_epi8(v, _mm256_loadu_si256((const __m256i *)spread_lo));
    const __m256i s1 = _mm256_shuffle_epi8(v, _mm256_loadu_si256((const __m256i *)spread_hi));
    const __m256i nib = _mm256_set1_epi32(0x0F);
    *a0 = fma8(_mm256_and_si256(s0, nib), dl, ml, xl, *a0);
    *a1 = fma8(_mm256_and_si256(s1, nib), dl, ml, xl + 8, *a1);
    *a2 = fma8(_mm256_srli_epi32(s0, 4), dh, mh, xh, *a2);   // lanes hold one byte: no mask needed
    *a3 = fma8(_mm256_srli_epi32(s1, 4), dh, mh, xh + 8, *a3);
}

// 16 unsigned quants, one per byte of v (the same 16 bytes in both 128-bit lanes), for x[0..15].
static inline TGT void fma16(__m256i v, __m256 d, __m256 m, const float *x, __m256 *a0, __m256 *a1) {
    *a0 = fma8(_mm256_shuffle_epi8(v, _mm256_loadu_si256((const __m256i *)spread_lo)), d, m, x, *a0);
    *a1 = fma8(_mm256_shuffle_epi8(v, _mm256_loadu_si256((const __m256i *)spread_hi)), d, m, x + 8, *a1);
}

// The two f16 fields that start a Q4_1/Q5_1 block (d, m) as floats 0 and 1.
static inline TGT __m128 half2(const void *p) {
    uint32_t u;
    __builtin_memcpy(&u, p, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int)u));
}

static inline TGT float sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    return hsum_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

// ---- float rows ----

static TGT float dot_f32_avx2(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i),      _mm256_loadu_ps(b + i),      s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8),  _mm256_loadu_ps(b + i + 8),  s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float s = sum4(s0, s1, s2, s3);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static TGT void axpy_f32_avx2(float *y, float a, const float *x, int64_t n) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        _mm256_storeu_ps(y + i,     _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i),     _mm256_loadu_ps(y + i)));
        _mm256_storeu_ps(y + i + 8, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8)));
    }
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

static TGT float vdot_f32(const void *row, const float *x, int64_t n) { return dot_f32_avx2(row, x, n); }

static inline TGT __m256 f16x8(const uint16_t *h) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)); }
static inline TGT __m256 bf16x8(const uint16_t *h) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// F16 and BF16 rows differ only in how 8 halves become 8 floats.
#define HALF_DOT(name, load8, one)                                                            \
    static TGT float name(const void *row, const float *x, int64_t n) {                      \
        const uint16_t *h = row;                                                             \
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;                          \
        int64_t i = 0;                                                                       \
        for (; i + 32 <= n; i += 32) {                                                       \
            s0 = _mm256_fmadd_ps(load8(h + i),      _mm256_loadu_ps(x + i),      s0);        \
            s1 = _mm256_fmadd_ps(load8(h + i + 8),  _mm256_loadu_ps(x + i + 8),  s1);        \
            s2 = _mm256_fmadd_ps(load8(h + i + 16), _mm256_loadu_ps(x + i + 16), s2);        \
            s3 = _mm256_fmadd_ps(load8(h + i + 24), _mm256_loadu_ps(x + i + 24), s3);        \
        }                                                                                    \
        for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(load8(h + i), _mm256_loadu_ps(x + i), s0); \
        float s = sum4(s0, s1, s2, s3);                                                      \
        for (; i < n; i++) s += one(h[i]) * x[i];                                            \
        return s;                                                                            \
    }
HALF_DOT(vdot_f16, f16x8, half)
HALF_DOT(vdot_bf16, bf16x8, bf16_to_fp32)

// 32 unsigned quants in the bytes of q (in order) for x[0..31]: the first 16 with (d0, m0),
// the last 16 with (d1, m1).
static inline TGT void fma32(__m256i q, __m256 d0, __m256 m0, __m256 d1, __m256 m1, const float *x,
                             __m256 *a0, __m256 *a1, __m256 *a2, __m256 *a3) {
    fma16(_mm256_permute4x64_epi64(q, 0x44), d0, m0, x, a0, a1);
    fma16(_mm256_permute4x64_epi64(q, 0xEE), d1, m1, x + 16, a2, a3);
}

// ---- 32-element blocks ----

static TGT float vdot_q4_0(const void *row, const float *x, int64_t n) {
    const block_q4_0 *b = row;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < n / QK4_0; i++, x += QK4_0) {
        const __m256 d = _mm256_set1_ps(half(b[i].d));
        const __m256 m = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
        fma_nib16(b[i].qs, d, m, x, d, m, x + 16, &a0, &a1, &a2, &a3);
    }
    return sum4(a0, a1, a2, a3);
}

static TGT float vdot_q4_1(const void *row, const float *x, int64_t n) {
    const block_q4_1 *b = row;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < n / QK4_1; i++, x += QK4_1) {
        const __m128 dm = half2(&b[i]);
        const __m256 d = _mm256_broadcastss_ps(dm), m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
        fma_nib16(b[i].qs, d, m, x, d, m, x + 16, &a0, &a1, &a2, &a3);
    }
    return sum4(a0, a1, a2, a3);
}

static TGT float vdot_q5_0(const void *row, const float *x, int64_t n) {
    const block_q5_0 *b = row;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < n / QK5_0; i++, x += QK5_0) {
        const __m256 d = _mm256_set1_ps(half(b[i].d));
        const __m256 m = _mm256_mul_ps(d, _mm256_set1_ps(-16.0f));
        fma32(q5_quants(b[i].qs, b[i].qh), d, m, d, m, x, &a0, &a1, &a2, &a3);
    }
    return sum4(a0, a1, a2, a3);
}

static TGT float vdot_q5_1(const void *row, const float *x, int64_t n) {
    const block_q5_1 *b = row;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < n / QK5_1; i++, x += QK5_1) {
        const __m128 dm = half2(&b[i]);
        const __m256 d = _mm256_broadcastss_ps(dm), m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
        fma32(q5_quants(b[i].qs, b[i].qh), d, m, d, m, x, &a0, &a1, &a2, &a3);
    }
    return sum4(a0, a1, a2, a3);
}

// sum(q * x) over one Q8_0 block, before the scale: two short FMA chains.
static inline TGT __m256 q8_block(const int8_t *q, const float *x) {
    __m256 t0 = _mm256_mul_ps(i8_ps(_mm_loadl_epi64((const __m128i *)q)), _mm256_loadu_ps(x));
    __m256 t1 = _mm256_mul_ps(i8_ps(_mm_loadl_epi64((const __m128i *)(q + 8))), _mm256_loadu_ps(x + 8));
    t0 = _mm256_fmadd_ps(i8_ps(_mm_loadl_epi64((const __m128i *)(q + 16))), _mm256_loadu_ps(x + 16), t0);
    t1 = _mm256_fmadd_ps(i8_ps(_mm_loadl_epi64((const __m128i *)(q + 24))), _mm256_loadu_ps(x + 24), t1);
    return _mm256_add_ps(t0, t1);
}

static TGT float vdot_q8_0(const void *row, const float *x, int64_t n) {
    const block_q8_0 *b = row;
    const int64_t nb = n / QK8_0;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    int64_t i = 0;
    // Two blocks per step so the two scale-FMA chains overlap.
    for (; i + 2 <= nb; i += 2, x += 2 * QK8_0) {
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(half(b[i].d)), q8_block(b[i].qs, x), a0);
        a1 = _mm256_fmadd_ps(_mm256_set1_ps(half(b[i + 1].d)), q8_block(b[i + 1].qs, x + QK8_0), a1);
    }
    if (i < nb) a0 = _mm256_fmadd_ps(_mm256_set1_ps(half(b[i].d)), q8_block(b[i].qs, x), a0);
    return hsum_ps(_mm256_add_ps(a0, a1));
}

// ---- K-quants (256-element super-blocks) ----

// Scale and offset of sub-block j of a Q4_K/Q5_K block: x = q * d*scale - dmin*min.
static inline TGT void k_sub(const uint8_t *scales, int j, float d, float dmin, __m256 *dv, __m256 *mv) {
    uint8_t sc, mn;
    k4_scale_min(j, scales, &sc, &mn);
    *dv = _mm256_set1_ps(d * sc);
    *mv = _mm256_set1_ps(-(dmin * mn));
}

// Q4_K chunk c of 64 = sub-block 2c (low nibbles of qs[32c..]) then 2c+1 (high nibbles).
static TGT float vdot_q4_K(const void *row, const float *x, int64_t n) {
    const block_q4_K *b = row;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = half(b[i].d), dmin = half(b[i].dmin);
        for (int c = 0; c < 4; c++, x += 64) {
            __m256 d1, m1, d2, m2;
            k_sub(b[i].scales, 2 * c, d, dmin, &d1, &m1);
            k_sub(b[i].scales, 2 * c + 1, d, dmin, &d2, &m2);
            const uint8_t *q = b[i].qs + 32 * c;
            fma_nib16(q, d1, m1, x, d2, m2, x + 32, &a0, &a1, &a2, &a3);
            fma_nib16(q + 16, d1, m1, x + 16, d2, m2, x + 48, &a0, &a1, &a2, &a3);
        }
    }
    return sum4(a0, a1, a2, a3);
}

// Q5_K: as Q4_K plus a fifth bit, bit 2c of qh[l] for sub-block 2c and bit 2c+1 for 2c+1.
static TGT float vdot_q5_K(const void *row, const float *x, int64_t n) {
    const block_q5_K *b = row;
    const __m256i nib = _mm256_set1_epi8(0x0F);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = half(b[i].d), dmin = half(b[i].dmin);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)b[i].qh);
        for (int c = 0; c < 4; c++, x += 64) {
            __m256 d1, m1, d2, m2;
            k_sub(b[i].scales, 2 * c, d, dmin, &d1, &m1);
            k_sub(b[i].scales, 2 * c + 1, d, dmin, &d2, &m2);
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b[i].qs + 32 * c));
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(q, nib), bit_as(qh, 2 * c, 0x10));
            const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), nib), bit_as(qh, 2 * c + 1, 0x10));
            fma32(lo, d1, m1, d1, m1, x, &a0, &a1, &a2, &a3);
            fma32(hi, d2, m2, d2, m2, x + 32, &a0, &a1, &a2, &a3);
        }
    }
    return sum4(a0, a1, a2, a3);
}

// f[j] = (float)v[j] * k for 16 small signed integers in the bytes of v.
static inline TGT void scaled16(__m128i v, float k, float *f) {
    const __m256 kv = _mm256_set1_ps(k);
    _mm256_storeu_ps(f, _mm256_mul_ps(i8_ps(v), kv));
    _mm256_storeu_ps(f + 8, _mm256_mul_ps(i8_ps(_mm_srli_si128(v, 8)), kv));
}

// Q2_K: x = q * d*scale - dmin*min, scale and min the two nibbles of scales[sub-block]; the
// block's 16 sub-block factors are made together, then broadcast run by run.
static TGT float vdot_q2_K(const void *row, const float *x, int64_t n) {
    const block_q2_K *b = row;
    const __m128i nib = _mm_set1_epi8(0x0F);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    float dl[16], ml[16];
    for (int64_t i = 0; i < n / QK_K; i++) {
        prefetch_superblock(b + i, sizeof(*b));
        const __m128i sc = _mm_loadu_si128((const __m128i *)b[i].scales);
        scaled16(_mm_and_si128(sc, nib), half(b[i].d), dl);
        scaled16(_mm_and_si128(_mm_srli_epi16(sc, 4), nib), -half(b[i].dmin), ml);
        for (int h = 0; h < 2; h++) {
            const __m256i qs = _mm256_loadu_si256((const __m256i *)(b[i].qs + 32 * h));
            for (int r = 0; r < 4; r++, x += 32) {
                const int j = 8 * h + 2 * r;
                fma32(two_bits(qs, r), _mm256_broadcast_ss(dl + j), _mm256_broadcast_ss(ml + j),
                      _mm256_broadcast_ss(dl + j + 1), _mm256_broadcast_ss(ml + j + 1), x, &a0, &a1, &a2, &a3);
            }
        }
    }
    return sum4(a0, a1, a2, a3);
}

// Q3_K: the third bit of run r of half h is bit 4h + r of hmask's bytes; taken as q + 4 (0..7)
// with the offset -4*d*scale, as the scalar's d*scale*(q - 4 or q).
static TGT float vdot_q3_K(const void *row, const float *x, int64_t n) {
    const block_q3_K *b = row;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    float dl[16], ml[16];
    for (int64_t i = 0; i < n / QK_K; i++) {
        prefetch_superblock(b + i, sizeof(*b));
        const __m128i sc = q3_scales16(b[i].scales);
        const float d = half(b[i].d);
        scaled16(sc, d, dl);
        scaled16(sc, -4.0f * d, ml);   // exact: -4 d s is -4 times d s, a power of two apart
        const __m256i hm = _mm256_loadu_si256((const __m256i *)b[i].hmask);
        for (int h = 0; h < 2; h++) {
            const __m256i qs = _mm256_loadu_si256((const __m256i *)(b[i].qs + 32 * h));
            for (int r = 0; r < 4; r++, x += 32) {
                const int j = 8 * h + 2 * r;
                const __m256i q = _mm256_or_si256(two_bits(qs, r), bit_as(hm, 4 * h + r, 4));
                fma32(q, _mm256_broadcast_ss(dl + j), _mm256_broadcast_ss(ml + j),
                      _mm256_broadcast_ss(dl + j + 1), _mm256_broadcast_ss(ml + j + 1), x, &a0, &a1, &a2, &a3);
            }
        }
    }
    return sum4(a0, a1, a2, a3);
}

// IQ4: 16 bytes of indices for x[0..31] (low nibbles for 0-15, high for 16-31), each level
// times d, as the scalar's d * level.
static inline TGT void iq4_32(const uint8_t *qs, __m256 d, const float *x,
                              __m256 *a0, __m256 *a1, __m256 *a2, __m256 *a3) {
    const __m256i w = nibble_lookup32(qs, iq4_levels);
    const __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
    *a0 = _mm256_fmadd_ps(_mm256_mul_ps(i8_ps(lo), d), _mm256_loadu_ps(x), *a0);
    *a1 = _mm256_fmadd_ps(_mm256_mul_ps(i8_ps(_mm_srli_si128(lo, 8)), d), _mm256_loadu_ps(x + 8), *a1);
    *a2 = _mm256_fmadd_ps(_mm256_mul_ps(i8_ps(hi), d), _mm256_loadu_ps(x + 16), *a2);
    *a3 = _mm256_fmadd_ps(_mm256_mul_ps(i8_ps(_mm_srli_si128(hi, 8)), d), _mm256_loadu_ps(x + 24), *a3);
}

static TGT float vdot_iq4_nl(const void *row, const float *x, int64_t n) {
    const block_iq4_nl *b = row;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < n / QK4_NL; i++, x += QK4_NL) iq4_32(b[i].qs, _mm256_set1_ps(half(b[i].d)), x, &a0, &a1, &a2, &a3);
    return sum4(a0, a1, a2, a3);
}

static TGT float vdot_iq4_xs(const void *row, const float *x, int64_t n) {
    const block_iq4_xs *b = row;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = half(b[i].d);
        for (int j = 0; j < QK_K / 32; j++, x += 32)
            iq4_32(b[i].qs + 16 * j, _mm256_set1_ps(d * (float)iq4_xs_scale(&b[i], j)), x, &a0, &a1, &a2, &a3);
    }
    return sum4(a0, a1, a2, a3);
}

// Q6_K run of 32 (quant-blocks.h: q6k_quant): elements 0-15 use scale sc[0], 16-31 use sc[1]; q - 32.
static inline TGT void q6_run(__m256i q, float d, const int8_t *sc, const float *x,
                              __m256 *a0, __m256 *a1, __m256 *a2, __m256 *a3) {
    const float d0 = d * sc[0], d1 = d * sc[1];
    fma32(q, _mm256_set1_ps(d0), _mm256_set1_ps(-32.0f * d0), _mm256_set1_ps(d1), _mm256_set1_ps(-32.0f * d1),
          x, a0, a1, a2, a3);
}

static TGT float vdot_q6_K(const void *row, const float *x, int64_t n) {
    const block_q6_K *b = row;
    const __m256i nib = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = half(b[i].d);
        for (int h = 0; h < 2; h++, x += 128) {
            const uint8_t *ql = b[i].ql + 64 * h;
            const int8_t *sc = b[i].scales + 8 * h;
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b[i].qh + 32 * h));
            // 16-bit shifts are fine: the masks drop the bits that cross a byte.
            const __m256i q1 = _mm256_or_si256(_mm256_and_si256(l0, nib), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top));
            const __m256i q2 = _mm256_or_si256(_mm256_and_si256(l1, nib), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top));
            const __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), nib), _mm256_and_si256(qh, top));
            const __m256i q4 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), nib),
                                               _mm256_and_si256(_mm256_srli_epi16(qh, 2), top));
            q6_run(q1, d, sc + 0, x,      &a0, &a1, &a2, &a3);
            q6_run(q2, d, sc + 2, x + 32, &a0, &a1, &a2, &a3);
            q6_run(q3, d, sc + 4, x + 64, &a0, &a1, &a2, &a3);
            q6_run(q4, d, sc + 6, x + 96, &a0, &a1, &a2, &a3);
        }
    }
    return sum4(a0, a1, a2, a3);
}

const struct quant_kernels WEIGHT_TABLE(quant_avx2_kernels) = {
    .vec_dot = {
        [PYKV_TYPE_F32]  = vdot_f32,
        [PYKV_TYPE_F16]  = vdot_f16,
        [PYKV_TYPE_BF16] = vdot_bf16,
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
    .dot_f32  = dot_f32_avx2,
    .axpy_f32 = axpy_f32_avx2,
};
#endif
