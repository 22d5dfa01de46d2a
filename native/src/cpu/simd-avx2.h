// simd-avx2.h - small AVX2 helpers shared by the kernels (x86 only). The library is built
// for baseline x86-64, so each helper carries the target attribute of its callers and is
// only reached after a run-time CPU check.
#pragma once
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define AVX2_TGT __attribute__((target("avx2,fma,f16c")))

// Whether this CPU runs AVX2_TGT code: the one run-time check in front of every AVX2 path.
static inline int cpu_has_avx2(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

static inline AVX2_TGT float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline AVX2_TGT float hmax_ps(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

// exp of eight floats (see softmax.c for the method); inputs below -87.3, -inf included, give 0.
static inline AVX2_TGT __m256 exp_ps(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// Eight signed bytes (the low 8 of b) as floats.
static inline __attribute__((always_inline)) AVX2_TGT __m256 i8_ps(__m128i b) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

// A Q8_0 block's scale (its first two bytes, a half) as a float in every lane.
static inline __attribute__((always_inline)) AVX2_TGT __m256 q8_0_scale8(const uint8_t *blk) {
    return _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(blk[0] | blk[1] << 8)));
}

// Eight int8 quants of a Q8_0 block (from quant c) as floats, not yet scaled.
static inline __attribute__((always_inline)) AVX2_TGT __m256 q8_0_quants8(const uint8_t *blk, int c) {
    return i8_ps(_mm_loadl_epi64((const __m128i *)(blk + 2 + c)));
}

// Eight elements (from i, a multiple of 8) of a key or value row as floats, from floats,
// halves or Q8_0 blocks (fmt: enum kv_format, 0, 1, 2; a constant where inlined). A Q8_0
// element is its block's scale times its int8, one product, as the scalar dequantizer.
static inline __attribute__((always_inline)) AVX2_TGT __m256 load8_kv(const void *row, int i, const int fmt) {
    if (fmt == 1) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
    if (fmt == 2) {
        const uint8_t *blk = (const uint8_t *)row + (size_t)(i / 32) * 34;
        return _mm256_mul_ps(q8_0_quants8(blk, i % 32), q8_0_scale8(blk));
    }
    return _mm256_loadu_ps((const float *)row + i);
}

// Weights are read once per token, straight from memory. The hardware prefetcher alone
// leaves the kernels waiting on loads, so the kernels ask for the bytes several rows ahead
// (each thread reads its rows in one sequential run); 8 KiB is far enough for the memory's
// latency on wide and narrow rows alike without running past what the caches hold.
// Prefetching past the end of the matrix is harmless: a prefetch never faults.
//
// The hint depends on the CPU's vendor. On AMD it is non-temporal: the bytes are used once,
// and a decode step streams every weight, so with the plain hint they push the KV lists and
// the policies' per-entry state out of cache before the next step comes back to them (this
// matters at depth). On Intel a non-temporal prefetch places the line close to the core
// only, not in the outer caches: a stream prefetched so runs at about half the rate of a
// plain one, and weights that the last-level cache could hold from one step to the next are
// read from memory again. Intel takes the plain hint (T0). Each kernel file that prefetches
// weights is therefore compiled twice: as itself with the non-temporal hint, and through a
// "-t0" twin that defines WEIGHT_PREFETCH_T0 first, whose kernel tables carry a _t0 suffix
// (WEIGHT_TABLE); the dispatch (quant.c, quant-q8.c) picks one set with
// cpu_weight_prefetch_t0().
#define Q8_PREFETCH 8192
#ifdef WEIGHT_PREFETCH_T0
#define WEIGHT_PREFETCH_HINT _MM_HINT_T0
#define WEIGHT_TABLE(name) name##_t0
#else
#define WEIGHT_PREFETCH_HINT _MM_HINT_NTA
#define WEIGHT_TABLE(name) name
#endif

// Whether this CPU takes the kernels that prefetch weights with the T0 hint (see above).
static inline int cpu_weight_prefetch_t0(void) { return __builtin_cpu_is("intel"); }

// A K-quant super-block spans two to four cache lines: ask for each of them (one prefetch per
// super-block leaves the kernel waiting on the lines it did not ask for).
static inline AVX2_TGT void prefetch_superblock(const void *blk, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) _mm_prefetch((const char *)blk + Q8_PREFETCH + off, WEIGHT_PREFETCH_HINT);
}

// qh's bit `bit` of each byte as `value` (a power of two) or 0: the bit shifted into place.
// The shifts are 16-bit, but no bit crosses into the masked position from the other byte
// (both positions are within a byte).
static inline AVX2_TGT __m256i bit_as(__m256i qh, int bit, char value) {
    const int to = __builtin_ctz((unsigned char)value);
    const __m256i v = bit > to ? _mm256_srli_epi16(qh, bit - to) : _mm256_slli_epi16(qh, to - bit);
    return _mm256_and_si256(v, _mm256_set1_epi8(value));
}

// 16 bytes of 4-bit indices into a table of 16 bytes: the low nibbles' entries as bytes 0-15,
// the high nibbles' as bytes 16-31 (the IQ4 layout).
static inline AVX2_TGT __m256i nibble_lookup32(const uint8_t *qs, const int8_t *table) {
    const __m128i t = _mm_loadu_si128((const __m128i *)table), nib = _mm_set1_epi8(0x0F);
    const __m128i q = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_set_m128i(_mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(q, 4), nib)),
                            _mm_shuffle_epi8(t, _mm_and_si128(q, nib)));
}

// Q2_K and Q3_K: run r (0..3) of half h takes bits 2r..2r+1 of the half's 32 bytes of qs, for
// elements 0..31 of the run; its elements 0-15 are sub-block 8h + 2r, 16-31 sub-block 8h + 2r + 1.
static inline AVX2_TGT __m256i two_bits(__m256i qs, int run) {
    return _mm256_and_si256(_mm256_srli_epi16(qs, 2 * run), _mm256_set1_epi8(3));   // masks the crossing bits
}

// The 16 signed scales of a Q3_K block as bytes (q3_scale for j = 0..15): low nibbles of bytes
// 0-7 then their high nibbles; top bits from bytes 8-11, byte 8 + j%4 shifted by 2*(j/4).
static inline AVX2_TGT __m128i q3_scales16(const uint8_t *s) {
    uint64_t lo8;
    uint32_t hi4;
    __builtin_memcpy(&lo8, s, 8);
    __builtin_memcpy(&hi4, s + 8, 4);
    const __m128i nib = _mm_set1_epi8(0x0F), v = _mm_cvtsi64_si128((long long)lo8);
    const __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(v, nib), _mm_and_si128(_mm_srli_epi16(v, 4), nib));
    const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)hi4), _mm_setr_epi32(0, 2, 4, 6)),
                                     _mm_set1_epi8(3));
    return _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
}

// The 32 bits of qh as 32 bytes: byte j is 0x10 when bit j is set, else 0.
static inline AVX2_TGT __m256i qh_bytes(uint32_t qh) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8(0x10));
}

// The 32 four-bit quants of a Q4 block in element order, one per byte: the low nibbles of
// qs are elements 0-15, the high nibbles 16-31. (One broadcast load, then the upper lane is
// shifted by 4: fewer instructions than building the halves separately.)
static inline AVX2_TGT __m256i q4_quants(const uint8_t *qs) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0F));
}

// The 32 five-bit quants of a Q5 block in element order (bit j of qh is element j's fifth).
static inline AVX2_TGT __m256i q5_quants(const uint8_t *qs, const uint8_t *qhp) {
    uint32_t qh;
    __builtin_memcpy(&qh, qhp, 4);
    return _mm256_or_si256(q4_quants(qs), qh_bytes(qh));
}

// Eight int32 partial sums of u[j] * s[j] over 32 bytes (u unsigned, s signed).
static inline AVX2_TGT __m256i isum_u8s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// The same for two signed operands (Q8_0's weights w): maddubs wants one unsigned side, so
// |w| against x with w's sign moved onto it (a pair sums to at most 2 * 128 * 127).
static inline AVX2_TGT __m256i isum_s8s8(__m256i w, __m256i x) {
    return isum_u8s8(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
}
#endif
