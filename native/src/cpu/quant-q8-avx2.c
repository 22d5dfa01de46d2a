// quant-q8-avx2.c - AVX2 integer dot products of weight rows with 8-bit activations.
//
// Each block's 32 weight quants become unsigned bytes (Q8_0: their magnitudes, the sign moved
// onto the activations), maddubs/madd sum them against the activation bytes into eight
// int32 lanes, and one FMA scales those by d_w * d_x. The offset terms (m_w * s, or
// -8 d_w * s) are summed in a second lane alongside. Two blocks per step keep two
// independent FMA chains.
#if defined(__x86_64__) || defined(__i386__)
#include "cpu/quant-q8.h"

#include "pykv.h"
#include "cpu/quant-blocks.h"
#include "cpu/simd-avx2.h"

static inline AVX2_TGT float half(uint16_t h) { return _cvtsh_ss(h); }

// Eight partial sums of u[j] * s[j] (u unsigned, s signed bytes) as floats.
static inline AVX2_TGT __m256 dot_u8s8(__m256i u, __m256i s) { return _mm256_cvtepi32_ps(isum_u8s8(u, s)); }

static inline AVX2_TGT __m256i act_bytes(const block_q8_act *x) { return _mm256_loadu_si256((const __m256i *)x->qs); }

// Lane 0: d_w * d_x, the block's scale; lane 1: the factor of its offset term, m_w * s for
// the types with a min (d and m are adjacent f16s, x's d and s adjacent floats, so one
// convert and one multiply give both) and d_w * s for the centred types (the centre, -8 or
// -16, is applied once at the end).
static inline AVX2_TGT __m128 block_scales(uint32_t f16_pair, const block_q8_act *x) {
    return _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128((int)f16_pair)), _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)x)));
}
static inline AVX2_TGT __m128 scales_dm(const void *blk, const block_q8_act *x) { return block_scales(block_f16_dm(blk), x); }
static inline AVX2_TGT __m128 scales_dd(const void *blk, const block_q8_act *x) { return block_scales(block_f16_dd(blk), x); }

// One kernel per type: QUANTS(b) gives the block's unsigned quants, SCALES its two factors,
// and the offset terms add up to CENTRE times lane 1's sum.
#define Q8_DOT(name, block_t, QUANTS, SCALES, CENTRE)                                              \
    static AVX2_TGT float name(const void *row, const block_q8_act *x, int64_t n) {               \
        const block_t *b = row;                                                                    \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                            \
        __m128 off0 = _mm_setzero_ps(), off1 = _mm_setzero_ps();                                  \
        const int64_t nb = n / QK8_ACT;                                                           \
        int64_t i = 0;                                                                             \
        for (; i + 2 <= nb; i += 2) {                                                              \
            _mm_prefetch((const char *)(b + i) + Q8_PREFETCH, WEIGHT_PREFETCH_HINT);                \
            const __m128 s0 = SCALES(&b[i], &x[i]), s1 = SCALES(&b[i + 1], &x[i + 1]);           \
            off0 = _mm_add_ps(off0, s0);                                                           \
            off1 = _mm_add_ps(off1, s1);                                                           \
            acc0 = _mm256_fmadd_ps(dot_u8s8(QUANTS(b[i]), act_bytes(&x[i])), _mm256_broadcastss_ps(s0), acc0);         \
            acc1 = _mm256_fmadd_ps(dot_u8s8(QUANTS(b[i + 1]), act_bytes(&x[i + 1])), _mm256_broadcastss_ps(s1), acc1); \
        }                                                                                          \
        if (i < nb) {                                                                              \
            const __m128 s0 = SCALES(&b[i], &x[i]);                                                \
            off0 = _mm_add_ps(off0, s0);                                                           \
            acc0 = _mm256_fmadd_ps(dot_u8s8(QUANTS(b[i]), act_bytes(&x[i])), _mm256_broadcastss_ps(s0), acc0);         \
        }                                                                                          \
        const float off = _mm_cvtss_f32(_mm_movehdup_ps(_mm_add_ps(off0, off1)));                 \
        return hsum_ps(_mm256_add_ps(acc0, acc1)) + (CENTRE) * off;                                \
    }

#define Q4_QUANTS(blk) q4_quants((blk).qs)
#define Q5_QUANTS(blk) q5_quants((blk).qs, (blk).qh)

Q8_DOT(q8dot_q4_0, block_q4_0, Q4_QUANTS, scales_dd, -8.0f)
Q8_DOT(q8dot_q4_1, block_q4_1, Q4_QUANTS, scales_dm, 1.0f)
Q8_DOT(q8dot_q5_0, block_q5_0, Q5_QUANTS, scales_dd, -16.0f)
Q8_DOT(q8dot_q5_1, block_q5_1, Q5_QUANTS, scales_dm, 1.0f)

// Q8_0: signed weights (isum_s8s8).
static AVX2_TGT float q8dot_q8_0(const void *row, const block_q8_act *x, int64_t n) {
    const block_q8_0 *b = row;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    const int64_t nb = n / QK8_ACT;
    for (int64_t i = 0; i < nb; i++) {
        _mm_prefetch((const char *)(b + i) + Q8_PREFETCH, WEIGHT_PREFETCH_HINT);
        const __m256i w = _mm256_loadu_si256((const __m256i *)b[i].qs);
        const __m256 p = _mm256_cvtepi32_ps(isum_s8s8(w, act_bytes(&x[i])));
        const __m256 scale = _mm256_set1_ps(half(b[i].d) * x[i].d);
        if (i & 1) acc1 = _mm256_fmadd_ps(p, scale, acc1);
        else       acc0 = _mm256_fmadd_ps(p, scale, acc0);
    }
    return hsum_ps(_mm256_add_ps(acc0, acc1));
}

// ---- 256-element super-blocks (see quant-q8.c): one activation block per sub-block of 32 ----
//
// The eight activation blocks' d (and s, and 16-element sums) come as vectors from the row's
// side arrays (quant-q8.h), so each super-block works out all eight sub-blocks' float factors
// in one multiply; a sub-block takes its own with a broadcast load from them stored (a load,
// where a scalar multiply and a broadcast, or a permute, take the vector units). The terms
// that depend only on the activations' sums (Q4_K's and Q2_K's mins, Q3_K's and Q6_K's
// centres) are one vector operation per super-block.

// Q4_K/Q5_K: the eight sub-blocks' 6-bit scales and mins as floats (k4_scale_min's layout:
// scales and mins 0-3 in the low 6 bits of bytes 0-3 and 4-7; 4-7 from the nibbles of bytes
// 8-11 and the top 2 bits of bytes 0-7).
static inline AVX2_TGT void k4_scales_mins(const uint8_t *scales, __m256 *sc, __m256 *mn) {
    uint32_t u[3], s[2], m[2];
    __builtin_memcpy(u, scales, 12);
    s[0] = u[0] & 0x3F3F3F3Fu;
    m[0] = u[1] & 0x3F3F3F3Fu;
    s[1] = (u[2] & 0x0F0F0F0Fu) | ((u[0] >> 6) & 0x03030303u) << 4;
    m[1] = ((u[2] >> 4) & 0x0F0F0F0Fu) | ((u[1] >> 6) & 0x03030303u) << 4;
    uint64_t s8, m8;
    __builtin_memcpy(&s8, s, 8);
    __builtin_memcpy(&m8, m, 8);
    *sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)s8)));
    *mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m8)));
}

// One Q4_K/Q5_K super-block against its eight activation blocks (x, and xd, xs: their d and s
// side by side): chunk c of 64 holds sub-blocks 2c (low nibbles) and 2c+1 (high nibbles);
// Q5_K's fifth bits come from qh (NULL for Q4_K).
static inline AVX2_TGT void k4_block(const uint8_t *scales, uint16_t d, uint16_t dmin, const uint8_t *qs,
                                     const uint8_t *qh, const block_q8_act *x, const float *xd, const float *xs,
                                     __m256 *acc0, __m256 *acc1, __m256 *off) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    const __m256i high = qh ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
    __m256 sc, mn;
    k4_scales_mins(scales, &sc, &mn);
    float f[8];
    _mm256_storeu_ps(f, _mm256_mul_ps(_mm256_mul_ps(sc, _mm256_set1_ps(half(d))), _mm256_loadu_ps(xd)));
    *off = _mm256_fmadd_ps(_mm256_mul_ps(mn, _mm256_set1_ps(half(dmin))), _mm256_loadu_ps(xs), *off);
    for (int c = 0; c < 4; c++, x += 2) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m256i lo = _mm256_and_si256(q, nib), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), nib);
        if (qh) {
            lo = _mm256_or_si256(lo, bit_as(high, 2 * c, 0x10));
            hi = _mm256_or_si256(hi, bit_as(high, 2 * c + 1, 0x10));
        }
        *acc0 = _mm256_fmadd_ps(dot_u8s8(lo, act_bytes(x)), _mm256_broadcast_ss(f + 2 * c), *acc0);
        *acc1 = _mm256_fmadd_ps(dot_u8s8(hi, act_bytes(x + 1)), _mm256_broadcast_ss(f + 2 * c + 1), *acc1);
    }
}

#define K4_DOT(name, block_t, QH)                                                                 \
    static AVX2_TGT float name(const void *row, const block_q8_act *x, int64_t n) {              \
        const block_t *b = row;                                                                   \
        const q8_act_side side = q8_side(x, n);                                                   \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), off = _mm256_setzero_ps(); \
        for (int64_t i = 0; i < n / QK_K; i++) {                                                  \
            prefetch_superblock(b + i, sizeof(block_t));                                         \
            k4_block(b[i].scales, b[i].d, b[i].dmin, b[i].qs, QH, x + 8 * i, side.d + 8 * i,     \
                     side.s + 8 * i, &acc0, &acc1, &off);                                         \
        }                                                                                         \
        return hsum_ps(_mm256_add_ps(acc0, acc1)) - hsum_ps(off);                                 \
    }
K4_DOT(q8dot_q4_K, block_q4_K, NULL)
K4_DOT(q8dot_q5_K, block_q5_K, b[i].qh)

// Q2_K, Q3_K and Q6_K: 16-element halves with their own scales. s holds a block's 16 scales
// as int16; the two of run r of half h (sub-blocks 8h + 2r and 8h + 2r + 1) become one
// vector for madd, the first in the low 128 bits, the second in the high.
static inline AVX2_TGT __m256i half_scales(const int16_t *s, int h, int r) {
    const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                            2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    int32_t pair;
    __builtin_memcpy(&pair, s + 8 * h + 2 * r, 4);
    return _mm256_shuffle_epi8(_mm256_set1_epi32(pair), spread);
}

// 16 small integers in the bytes of v as int16 in s.
static inline AVX2_TGT void widen16(__m128i v, int16_t *s) {
    _mm256_storeu_si256((__m256i *)s, _mm256_cvtepi8_epi16(v));
}

// Per activation block of a super-block, sum over its two 16s of w[k] * (the 16's quant sum),
// as floats: the 16 int16 weights against the side array's 16 sums in one madd.
static inline AVX2_TGT __m256 weighted_sums16(const int16_t *w, const int16_t *sum16) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)w),
                                                _mm256_loadu_si256((const __m256i *)sum16)));
}

// Q2_K, Q3_K and Q6_K: 16-element sub-blocks with integer scales. Each run's products
// (QUANTS, unsigned) are weighed by its two scales (madd: lanes 0-3 hold elements 0-15, lanes
// 4-7 elements 16-31), then by f = d * d_x of its activation block. A term that depends only
// on the activations comes off once per super-block: the OFFSET16 weights against the
// 16-element activation sums, times OFF_FACTOR, and OFF_TIMES times their total at the end.
// For Q2_K those are its mins, dmin * d_x and 1; Q3_K and Q6_K store q + centre (0..7,
// 0..63), so theirs are their own scales, f and the centre.
#define SUB16_DOT(name, block_t, SCALES16, OFFSET16, OFF_FACTOR, OFF_TIMES, QUANTS)                \
    static AVX2_TGT float name(const void *row, const block_q8_act *x, int64_t n) {              \
        const block_t *b = row;                                                                   \
        const q8_act_side side = q8_side(x, n);                                                   \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), off = _mm256_setzero_ps(); \
        for (int64_t i = 0; i < n / QK_K; i++) {                                                  \
            prefetch_superblock(b + i, sizeof(*b));                                               \
            const __m256 xd = _mm256_loadu_ps(side.d + 8 * i);                                   \
            const __m256 fv = _mm256_mul_ps(_mm256_set1_ps(half(b[i].d)), xd);                   \
            float f[8];                                                                           \
            _mm256_storeu_ps(f, fv);                                                              \
            int16_t sc[16], mn[16];                                                               \
            widen16(SCALES16(b[i]), sc);                                                          \
            off = _mm256_fmadd_ps(weighted_sums16(OFFSET16(b[i], sc, mn), side.sum16 + 16 * i),  \
                                  OFF_FACTOR(b[i], fv, xd), off);                                 \
            for (int h = 0; h < 2; h++)                                                           \
                for (int r = 0; r < 4; r++, x++) {                                                \
                    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(QUANTS(b[i], h, r), act_bytes(x)), \
                                                        half_scales(sc, h, r));                   \
                    if (r & 1) acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(f + 4 * h + r), acc1); \
                    else       acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(f + 4 * h + r), acc0); \
                }                                                                                 \
        }                                                                                         \
        return hsum_ps(_mm256_add_ps(acc0, acc1)) - (OFF_TIMES) * hsum_ps(off);                  \
    }

// Q6_K's run r of half h: the low or high nibbles of one of two 32-byte rows of ql, the top
// two bits from qh.
static inline AVX2_TGT __m256i q6_quants(const block_q6_K *b, int h, int r) {
    const __m256i nib = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    const __m256i l = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h + 32 * (r & 1)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * h));
    const __m256i low = r < 2 ? _mm256_and_si256(l, nib) : _mm256_and_si256(_mm256_srli_epi16(l, 4), nib);
    const __m256i high = r == 0 ? _mm256_slli_epi16(qh, 4) : r == 1 ? _mm256_slli_epi16(qh, 2)
                       : r == 2 ? qh : _mm256_srli_epi16(qh, 2);   // bits 2r, 2r + 1 to 4, 5
    return _mm256_or_si256(low, _mm256_and_si256(high, top));
}

// Q3_K's run r of half h: two bits from qs, the third (as 4) from hmask.
static inline AVX2_TGT __m256i q3_quants(const block_q3_K *b, int h, int r) {
    const __m256i qs = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * h));
    return _mm256_or_si256(two_bits(qs, r), bit_as(_mm256_loadu_si256((const __m256i *)b->hmask), 4 * h + r, 4));
}

// Q2_K's scales and mins: the low and high nibbles of its 16 scale bytes.
static inline AVX2_TGT __m128i q2_nibbles(const uint8_t *scales, int high) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)scales);
    return _mm_and_si128(high ? _mm_srli_epi16(raw, 4) : raw, _mm_set1_epi8(0x0F));
}

// Q2_K's 16 mins as int16 in mn.
static inline AVX2_TGT const int16_t *q2_mins(const uint8_t *scales, int16_t *mn) {
    widen16(q2_nibbles(scales, 1), mn);
    return mn;
}

#define Q6_SCALES16(blk) _mm_loadu_si128((const __m128i *)(blk).scales)
#define Q3_SCALES16(blk) q3_scales16((blk).scales)
#define Q2_SCALES16(blk) q2_nibbles((blk).scales, 0)
#define OWN_SCALES(blk, sc, mn) ((void)(mn), (sc))
#define Q2_MINS16(blk, sc, mn) q2_mins((blk).scales, mn)
#define SCALE_FACTOR(blk, fv, xd) (fv)
#define Q2_MIN_FACTOR(blk, fv, xd) _mm256_mul_ps(_mm256_set1_ps(half((blk).dmin)), xd)
#define Q6_QUANTS(blk, h, r) q6_quants(&(blk), h, r)
#define Q3_QUANTS(blk, h, r) q3_quants(&(blk), h, r)
#define Q2_QUANTS(blk, h, r) two_bits(_mm256_loadu_si256((const __m256i *)((blk).qs + 32 * (h))), r)
SUB16_DOT(q8dot_q6_K, block_q6_K, Q6_SCALES16, OWN_SCALES, SCALE_FACTOR, 32.0f, Q6_QUANTS)
SUB16_DOT(q8dot_q3_K, block_q3_K, Q3_SCALES16, OWN_SCALES, SCALE_FACTOR, 4.0f, Q3_QUANTS)
SUB16_DOT(q8dot_q2_K, block_q2_K, Q2_SCALES16, Q2_MINS16, Q2_MIN_FACTOR, 1.0f, Q2_QUANTS)

// IQ4: signed levels; as Q8_0, |w| against x carrying w's sign.
static inline AVX2_TGT __m256 iq4_block(const uint8_t *qs, const block_q8_act *x) {
    return _mm256_cvtepi32_ps(isum_s8s8(nibble_lookup32(qs, iq4_levels), act_bytes(x)));
}

static AVX2_TGT float q8dot_iq4_nl(const void *row, const block_q8_act *x, int64_t n) {
    const block_iq4_nl *b = row;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / QK4_NL; i++) {
        _mm_prefetch((const char *)(b + i) + Q8_PREFETCH, WEIGHT_PREFETCH_HINT);
        const __m256 p = iq4_block(b[i].qs, &x[i]), scale = _mm256_set1_ps(half(b[i].d) * x[i].d);
        if (i & 1) acc1 = _mm256_fmadd_ps(p, scale, acc1);
        else       acc0 = _mm256_fmadd_ps(p, scale, acc0);
    }
    return hsum_ps(_mm256_add_ps(acc0, acc1));
}

// IQ4_XS's eight signed 6-bit sub-block scales as floats (iq4_xs_scale for j = 0..7): the low
// 4 bits are nibble j of scales_l, the top 2 bits pair j of scales_h.
static inline AVX2_TGT __m256 iq4_xs_scales(const block_iq4_xs *b) {
    uint32_t l;
    __builtin_memcpy(&l, b->scales_l, 4);
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)l), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                        _mm256_set1_epi32(0xF));
    const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(b->scales_h), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                        _mm256_set1_epi32(3));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32)));
}

// Two sub-blocks at a time: their 32 bytes of qs give, in the low nibbles, elements 0-15 of
// sub-block j and of j + 1 (one per 128-bit lane), in the high nibbles elements 16-31; the
// activations are loaded in the same halves. Each lane of the int32 sums then belongs to one
// sub-block (0-3: j, 4-7: j + 1), so one FMA scales both with [f_j x4 | f_j+1 x4].
static AVX2_TGT float q8dot_iq4_xs(const void *row, const block_q8_act *x, int64_t n) {
    static const int32_t pair_lanes[4][8] = {
        { 0, 0, 0, 0, 1, 1, 1, 1 }, { 2, 2, 2, 2, 3, 3, 3, 3 }, { 4, 4, 4, 4, 5, 5, 5, 5 }, { 6, 6, 6, 6, 7, 7, 7, 7 },
    };
    const block_iq4_xs *b = row;
    const q8_act_side side = q8_side(x, n);
    const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)iq4_levels));
    const __m256i nib = _mm256_set1_epi8(0x0F);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / QK_K; i++) {
        prefetch_superblock(b + i, sizeof(*b));
        const __m256 f = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(half(b[i].d)), iq4_xs_scales(&b[i])),
                                       _mm256_loadu_ps(side.d + 8 * i));
        for (int j = 0; j < QK_K / 32; j += 2, x += 2) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b[i].qs + 16 * j));
            const __m256i lo = _mm256_shuffle_epi8(levels, _mm256_and_si256(q, nib));
            const __m256i hi = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(q, 4), nib));
            const __m256i a_lo = _mm256_loadu2_m128i((const __m128i *)x[1].qs, (const __m128i *)x[0].qs);
            const __m256i a_hi = _mm256_loadu2_m128i((const __m128i *)(x[1].qs + 16), (const __m128i *)(x[0].qs + 16));
            const __m256 p = _mm256_cvtepi32_ps(_mm256_add_epi32(isum_s8s8(lo, a_lo), isum_s8s8(hi, a_hi)));
            const __m256 scale = _mm256_permutevar8x32_ps(f, _mm256_loadu_si256((const __m256i *)pair_lanes[j / 2]));
            if (j & 2) acc1 = _mm256_fmadd_ps(p, scale, acc1);
            else       acc0 = _mm256_fmadd_ps(p, scale, acc0);
        }
    }
    return hsum_ps(_mm256_add_ps(acc0, acc1));
}

const vec_dot_q8_fn WEIGHT_TABLE(q8_avx2_dots)[Q8_N_TYPES] = {
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

#ifndef WEIGHT_PREFETCH_T0   // reads no weights: compiled once
static inline AVX2_TGT __m256i round_i32(__m256 v, __m256 id) {
    return _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Lanes holding an inf or a NaN.
static inline AVX2_TGT __m256 not_finite(__m256 v) {
    return _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v), _mm256_set1_ps(FLT_MAX), _CMP_NLE_UQ);
}

// Whether 32 floats are all finite (max_ps would drop a NaN, so each is compared).
static inline AVX2_TGT int all_finite4(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
    const __m256 bad = _mm256_or_ps(_mm256_or_ps(not_finite(v0), not_finite(v1)), _mm256_or_ps(not_finite(v2), not_finite(v3)));
    return _mm256_movemask_ps(bad) == 0;
}

// The same arithmetic as quantize_row_q8_act_scalar, eight lanes at a time.
AVX2_TGT void quantize_row_q8_act_avx2(const float *x, block_q8_act *y, int64_t n) {
    const q8_act_side side = q8_side(y, n);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);   // undo packs' lane interleave
    for (int64_t i = 0; i < n / QK8_ACT; i++, x += QK8_ACT) {
        const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
        const __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
        const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                       _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        if (!all_finite4(v0, v1, v2, v3)) {
            q8_act_non_finite_block(y, side, i);
            continue;
        }
        const float d = hmax_ps(m) / 127.0f, id = q8_act_inverse_scale(d);
        const __m256 vid = _mm256_set1_ps(id);
        const __m256i i0 = round_i32(v0, vid), i1 = round_i32(v1, vid), i2 = round_i32(v2, vid), i3 = round_i32(v3, vid);
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        _mm256_storeu_si256((__m256i *)y[i].qs, _mm256_permutevar8x32_epi32(packed, order));
        // Lane 0: the sum of quants 0-15 (i0 + i1); lane 1: of 16-31 (i2 + i3).
        const __m256i lo = _mm256_add_epi32(i0, i1), hi = _mm256_add_epi32(i2, i3);
        __m128i s4 = _mm_hadd_epi32(_mm_add_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1)),
                                    _mm_add_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)));
        s4 = _mm_hadd_epi32(s4, s4);
        const int half0 = _mm_cvtsi128_si32(s4), half1 = _mm_extract_epi32(s4, 1);
        y[i].d = side.d[i] = d;
        y[i].s = side.s[i] = d * (float)(half0 + half1);
        side.sum16[2 * i] = (int16_t)half0;
        side.sum16[2 * i + 1] = (int16_t)half1;
    }
}
#endif
#endif
