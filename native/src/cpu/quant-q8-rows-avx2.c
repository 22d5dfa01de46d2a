// quant-q8-rows-avx2.c - four weight rows against one row of 8-bit activations (the decode
// step's matrix-vector products, 32-element block types: Q4_0..Q8_0 and IQ4_NL).
//
// The one-row kernels (quant-q8-avx2.c) spend about half of each block on its scales: an f16
// convert, a multiply and a broadcast per block per row. Here four consecutive rows share each
// activation load and one convert and multiply for all four rows' scales: each row's integer
// sums (eight int32 lanes) are folded with two rounds of hadd into one vector holding every
// row's partial sum twice, [r0 r1 r2 r3 | r0 r1 r2 r3] (the two halves of the block), which
// one FMA scales by [d0 dx .. d3 dx | the same]. It pays where the rows are in cache or
// narrow (small models' decode steps); for Q8_0 from memory, where the one-row kernel
// already streams at the memory's bandwidth, the two run at the same speed.
#if defined(__x86_64__) || defined(__i386__)
#include "pykv.h"
#include "cpu/quant-blocks.h"
#include "cpu/quant-q8.h"
#include "cpu/simd-avx2.h"

// Eight int32 partial sums of one block's 32 products, for each kind of quants.
#define Q4_ISUM(blk, xa) isum_u8s8(q4_quants((blk).qs), xa)
#define Q5_ISUM(blk, xa) isum_u8s8(q5_quants((blk).qs, (blk).qh), xa)
#define Q8_ISUM(blk, xa) isum_s8s8(_mm256_loadu_si256((const __m256i *)(blk).qs), xa)
#define IQ4_ISUM(blk, xa) isum_s8s8(nibble_lookup32((blk).qs, iq4_levels), xa)

// out[r] = dot(row r, x) for the four rows at `rows`, `rb` bytes apart; the offset terms are
// CENTRE times the sum of lanes 2r + 1 of off (see quant-q8-avx2.c's scales_dm). Each block
// step prefetches its share (span bytes) of the four rows DOT4_AHEAD bytes on (at least the
// group after next), so each line of the stream is asked for once; a prefetch per row per
// block, as the one-row kernels do, made the four-row kernel slower than one row at a time
// for Q8_0 from memory. Narrow rows need the bytes, not the rows: two groups ahead is only a
// few KiB on 576-wide Q4_1 rows, too close to hide the memory's latency, so the distance is
// in bytes (8 KiB, as the one-row kernels').
#define DOT4_AHEAD 8192
#define Q8_DOT4(name, block_t, ISUM, SCALES, CENTRE)                                                      \
    static AVX2_TGT void name(const void *rows, int64_t rb, const block_q8_act *x, int64_t n, float *out) {  \
        const block_t *b[4];                                                                              \
        for (int r = 0; r < 4; r++) b[r] = (const block_t *)((const uint8_t *)rows + r * rb);            \
        const __m256i pick_d = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);                                 \
        __m256 acc = _mm256_setzero_ps(), off = _mm256_setzero_ps();                                      \
        const int64_t span = (4 * rb + n / QK8_ACT - 1) / (n / QK8_ACT);                                  \
        const char *ahead = (const char *)rows + (8 * rb > DOT4_AHEAD ? 8 * rb : DOT4_AHEAD);           \
        for (int64_t i = 0; i < n / QK8_ACT; i++) {                                                       \
            for (int64_t at = 0; at < span; at += 64) _mm_prefetch(ahead + i * span + at, WEIGHT_PREFETCH_HINT);  \
            const __m256i xa = _mm256_loadu_si256((const __m256i *)x[i].qs);                             \
            const __m256i s01 = _mm256_hadd_epi32(ISUM(b[0][i], xa), ISUM(b[1][i], xa));                 \
            const __m256i s23 = _mm256_hadd_epi32(ISUM(b[2][i], xa), ISUM(b[3][i], xa));                 \
            /* lanes 2r, 2r + 1: row r's d and offset factor (block_f16_dm / block_f16_dd) */            \
            const __m256 dm = _mm256_cvtph_ps(_mm_setr_epi32((int)SCALES(&b[0][i]), (int)SCALES(&b[1][i]), \
                                                             (int)SCALES(&b[2][i]), (int)SCALES(&b[3][i]))); \
            const __m256 f = _mm256_mul_ps(dm, _mm256_castpd_ps(_mm256_broadcast_sd((const double *)&x[i]))); \
            off = _mm256_add_ps(off, f);                                                                  \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(s01, s23)),                        \
                                  _mm256_permutevar8x32_ps(f, pick_d), acc);                              \
        }                                                                                                 \
        float a[8], o[8];                                                                                 \
        _mm256_storeu_ps(a, acc);                                                                         \
        _mm256_storeu_ps(o, off);                                                                         \
        for (int r = 0; r < 4; r++) out[r] = (a[r] + a[r + 4]) + (CENTRE) * o[2 * r + 1];                 \
    }

Q8_DOT4(q8dot4_q4_0, block_q4_0, Q4_ISUM, block_f16_dd, -8.0f)
Q8_DOT4(q8dot4_q4_1, block_q4_1, Q4_ISUM, block_f16_dm, 1.0f)
Q8_DOT4(q8dot4_q5_0, block_q5_0, Q5_ISUM, block_f16_dd, -16.0f)
Q8_DOT4(q8dot4_q5_1, block_q5_1, Q5_ISUM, block_f16_dm, 1.0f)
Q8_DOT4(q8dot4_q8_0, block_q8_0, Q8_ISUM, block_f16_dd, 0.0f)
Q8_DOT4(q8dot4_iq4_nl, block_iq4_nl, IQ4_ISUM, block_f16_dd, 0.0f)

const vec_dot4_q8_fn WEIGHT_TABLE(q8_avx2_dots4)[Q8_N_TYPES] = {
    [PYKV_TYPE_Q4_0] = q8dot4_q4_0,
    [PYKV_TYPE_Q4_1] = q8dot4_q4_1,
    [PYKV_TYPE_Q5_0] = q8dot4_q5_0,
    [PYKV_TYPE_Q5_1] = q8dot4_q5_1,
    [PYKV_TYPE_Q8_0] = q8dot4_q8_0,
    [PYKV_TYPE_IQ4_NL] = q8dot4_iq4_nl,
};
#endif
