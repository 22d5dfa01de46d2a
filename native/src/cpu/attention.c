// attention.c - softmax attention over a ragged list, plain or with merged entries.
#include "cpu/attention.h"
#include "cpu/ops.h"
#include "cpu/quant.h"

#include <math.h>
#include <string.h>

static int scalar_only;   // tests: the reference path on any CPU

void attention_force_scalar(int on) { scalar_only = on; }

// Merged entries: member m of entry j has logit norm_m * s_j, all members share v_j, so
// entry j's weight is sum_m exp(norm_m * s_j - max) / Z (the EMS expansion). Every function
// below takes nq rows of logits (w, row stride n) over the same entries, so each entry's
// member norms are fetched once for all the query heads of a tile.

// max[r]: the largest member logit of row r.
static void merged_max(const struct kv_list *l, int j0, int n, int nq, const float *w, float *max) {
    for (int r = 0; r < nq; r++) max[r] = -INFINITY;
    for (int j = 0; j < n; j++) {
        for (int r = 0; r < nq; r++) {
            const float top = kv_member_logit_max(l, j0 + j, w[(size_t)r * n + j]);
            if (top > max[r]) max[r] = top;
        }
    }
}

// Entries [j0, j0 + n) of a list with merged entries, nq rows of logits w in place: w[r][j]
// becomes sum_m exp(norm_m * w[r][j] - max[r]), max_out[r] the row's largest member logit,
// sum_out[r] the sum of its w[r][j].
static void merged_exp_scalar(const struct kv_list *l, int j0, int n, int nq, float *w, float *max_out,
                              float *sum_out) {
    const int32_t *nm = l->n_members + j0;
    merged_max(l, j0, n, nq, w, max_out);
    for (int r = 0; r < nq; r++) {
        float *wr = w + (size_t)r * n;
        const float max = max_out[r];
        double sum = 0.0;
        for (int j = 0; j < n; j++) {
            const float *norm = kv_member_norms(l, j0 + j);
            float e = 0.0f;
            if (!norm) e = expf(wr[j] - max);
            else for (int m = 0; m < nm[j]; m++) e += expf(norm[m] * wr[j] - max);
            wr[j] = e;
            sum += e;
        }
        sum_out[r] = (float)sum;
    }
}

#if defined(__x86_64__) || defined(__i386__)
#include "cpu/simd-avx2.h"

// The mask of lanes 0..k-1 (all eight for k >= 8).
static inline AVX2_TGT __m256i lanes_below(int k) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Members m..m+7 of a member list of cnt, and the mask of the lanes in it.
static inline AVX2_TGT __m256 member_norms8(const float *norm, int m, int cnt, __m256i *mask) {
    *mask = lanes_below(cnt - m);
    return _mm256_maskload_ps(norm + m, *mask);
}

// Entries j..j+7 (those below n): the lanes in range, the single-token ones among them, and
// the merged ones as a bit mask.
static inline AVX2_TGT unsigned entry_lanes8(const int32_t *nm, int j, int n, __m256i *valid, __m256i *single) {
    *valid = lanes_below(n - j);
    const __m256i cnt = _mm256_maskload_epi32(nm + j, *valid);
    *single = _mm256_and_si256(_mm256_cmpeq_epi32(cnt, _mm256_set1_epi32(1)), *valid);
    return (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_andnot_si256(*single, *valid)));
}

// Sums of E accumulators, one per entry, into w[0..E) (E = 2, 4 or 8), times scale.
static inline __attribute__((always_inline)) AVX2_TGT void store_sums(const __m256 *a, const int E, float scale, float *w) {
    if (E == 2) {
        const __m256 h = _mm256_hadd_ps(a[0], a[1]);   // lanes: e0 e0 e1 e1 | e0 e0 e1 e1
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        _mm_storel_pi((__m64 *)w, _mm_mul_ps(_mm_hadd_ps(s, s), _mm_set1_ps(scale)));
        return;
    }
    // lanes of h0: e0 e1 e2 e3 | e0 e1 e2 e3, each half a partial sum
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    if (E == 4) {
        const __m128 s = _mm_add_ps(_mm256_castps256_ps128(h0), _mm256_extractf128_ps(h0, 1));
        _mm_storeu_ps(w, _mm_mul_ps(s, _mm_set1_ps(scale)));
        return;
    }
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    const __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
    _mm256_storeu_ps(w, _mm256_mul_ps(s, _mm256_set1_ps(scale)));
}
_Static_assert(ATTENTION_TILE == 2 || ATTENTION_TILE == 4 || ATTENTION_TILE == 8, "store_sums reduces a tile's rows");

// Small merged entries share a vector: most merged entries hold two to four members (a
// decode step's demoted centre joins one other entry), and one exponential per eight lanes
// per row is the cost. Entries of two members go four to a vector (lanes 2i, 2i+1: entry i),
// of three or four two to a vector (lanes 4i..4i+3), larger ones one at a time. A group not
// full repeats its first entry in the spare lanes and ignores their sums.
struct merged_group { int e[4], k; };

static inline AVX2_TGT void pairs_exp(const struct kv_list *l, const int32_t *at, const struct merged_group *g,
                                      int nq, int n, float *w, const __m256 *vmax, float *merged_sum) {
    int e[4];   // the group's entries, its first in the spare lanes
    const float *p[4];
    for (int i = 0; i < 4; i++) {
        e[i] = g->e[i < g->k ? i : 0];
        p[i] = l->member_pool + at[e[i]];
    }
    const __m128 lo = _mm_loadh_pi(_mm_loadl_pi(_mm_setzero_ps(), (const __m64 *)p[0]), (const __m64 *)p[1]);
    const __m128 hi = _mm_loadh_pi(_mm_loadl_pi(_mm_setzero_ps(), (const __m64 *)p[2]), (const __m64 *)p[3]);
    const __m256 norms = _mm256_set_m128(hi, lo);
    for (int r = 0; r < nq; r++) {
        float *wr = w + (size_t)r * n, t[8];
        const __m128 s4 = _mm_setr_ps(wr[e[0]], wr[e[1]], wr[e[2]], wr[e[3]]);
        const __m256 s = _mm256_set_m128(_mm_unpackhi_ps(s4, s4), _mm_unpacklo_ps(s4, s4));
        const __m256 x = exp_ps(_mm256_fmsub_ps(norms, s, vmax[r]));
        _mm256_storeu_ps(t, _mm256_hadd_ps(x, x));   // entry i's sum: t[0], t[1], t[4], t[5]
        for (int i = 0; i < g->k; i++) {
            wr[e[i]] = t[i + (i & 2)];
            merged_sum[r] += t[i + (i & 2)];
        }
    }
}

static inline AVX2_TGT __m128i lanes_below4(int k) {
    return _mm_cmpgt_epi32(_mm_set1_epi32(k), _mm_setr_epi32(0, 1, 2, 3));
}

static inline AVX2_TGT void quads_exp(const struct kv_list *l, const int32_t *nm, const int32_t *at,
                                      const struct merged_group *g, int nq, int n, float *w, const __m256 *vmax,
                                      float *merged_sum) {
    const int e0 = g->e[0], e1 = g->e[g->k > 1 ? 1 : 0];
    const __m128i m0 = lanes_below4(nm[e0]), m1 = lanes_below4(nm[e1]);
    const __m256 norms = _mm256_set_m128(_mm_maskload_ps(l->member_pool + at[e1], m1),
                                         _mm_maskload_ps(l->member_pool + at[e0], m0));
    const __m256 in = _mm256_castsi256_ps(_mm256_set_m128i(m1, m0));
    for (int r = 0; r < nq; r++) {
        float *wr = w + (size_t)r * n, t[8];
        const __m256 s = _mm256_set_m128(_mm_set1_ps(wr[e1]), _mm_set1_ps(wr[e0]));
        __m256 x = _mm256_and_ps(exp_ps(_mm256_fmsub_ps(norms, s, vmax[r])), in);
        x = _mm256_hadd_ps(x, x);
        _mm256_storeu_ps(t, _mm256_hadd_ps(x, x));   // entry i's sum: t[4 i]
        for (int i = 0; i < g->k; i++) {
            wr[g->e[i]] = t[4 * i];
            merged_sum[r] += t[4 * i];
        }
    }
}

// An entry of five members or more: eight at a time, each slice of norms serves every row.
static inline AVX2_TGT void large_exp(const struct kv_list *l, int cnt, int32_t at, int e, int nq, int n, float *w,
                                      const __m256 *vmax, float *merged_sum) {
    __m256 s[ATTENTION_TILE], acc[ATTENTION_TILE];
    for (int r = 0; r < nq; r++) {
        s[r] = _mm256_set1_ps(w[(size_t)r * n + e]);
        acc[r] = _mm256_setzero_ps();
    }
    for (int m = 0; m < cnt; m += 8) {
        __m256i mask;
        const __m256 nv = member_norms8(l->member_pool + at, m, cnt, &mask);
        for (int r = 0; r < nq; r++)
            acc[r] = _mm256_add_ps(acc[r], _mm256_and_ps(exp_ps(_mm256_fmsub_ps(nv, s[r], vmax[r])),
                                                         _mm256_castsi256_ps(mask)));
    }
    for (int r = nq; r < ATTENTION_TILE; r++) acc[r] = _mm256_setzero_ps();
    float tot[ATTENTION_TILE];   // the rows' sums in one reduction tree
    store_sums(acc, ATTENTION_TILE, 1.0f, tot);
    for (int r = 0; r < nq; r++) {
        w[(size_t)r * n + e] = tot[r];
        merged_sum[r] += tot[r];
    }
}

// The same with vectors, in two passes over eight entries at a time. Single-token entries
// (most of a list) take the plain softmax path; the merged ones among them, found by
// a compare on their member counts, are visited one by one: their largest member logit in
// the first pass, the sum of their members' exponentials (grouped by size, above) in the
// second.
static AVX2_TGT void merged_exp_avx2(const struct kv_list *l, int j0, int n, int nq, float *w, float *max_out,
                                     float *sum_out) {
    const int32_t *nm = l->n_members + j0, *at = l->member_at + j0;
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 vmax[ATTENTION_TILE], vsum[ATTENTION_TILE];
    float top[ATTENTION_TILE], merged_sum[ATTENTION_TILE];
    for (int r = 0; r < nq; r++) {
        vmax[r] = ninf;
        top[r] = -INFINITY;
    }
    for (int j = 0; j < n; j += 8) {
        __m256i valid, single;
        for (unsigned bits = entry_lanes8(nm, j, n, &valid, &single); bits; bits &= bits - 1) {
            const int e = j + __builtin_ctz(bits);
            const float *norm = l->member_pool + at[e], lo = norm[0], hi = norm[nm[e] - 1];   // read once
            for (int r = 0; r < nq; r++) {
                const float t = kv_member_logit_max_of(lo, hi, w[(size_t)r * n + e]);
                if (t > top[r]) top[r] = t;
            }
        }
        for (int r = 0; r < nq; r++) {
            const __m256 s = _mm256_maskload_ps(w + (size_t)r * n + j, single);
            vmax[r] = _mm256_max_ps(vmax[r], _mm256_blendv_ps(ninf, s, _mm256_castsi256_ps(single)));
        }
    }
    for (int r = 0; r < nq; r++) {
        const float vm = hmax_ps(vmax[r]);
        max_out[r] = vm > top[r] ? vm : top[r];
        vmax[r] = _mm256_set1_ps(max_out[r]);
        vsum[r] = _mm256_setzero_ps();
        merged_sum[r] = 0.0f;
    }
    struct merged_group pairs = { .k = 0 }, quads = { .k = 0 };
    for (int j = 0; j < n; j += 8) {
        __m256i valid, single;
        const unsigned merged = entry_lanes8(nm, j, n, &valid, &single);
        for (int r = 0; r < nq; r++) {   // single tokens: exp(s - max) in place
            float *wr = w + (size_t)r * n + j;
            const __m256 s = _mm256_maskload_ps(wr, valid), e = exp_ps(_mm256_sub_ps(s, vmax[r]));
            const __m256 is1 = _mm256_castsi256_ps(single);
            // a masked store is microcoded on AMD, so a blend keeps the merged entries' logits
            // and a plain store writes them back; only the last eight entries, whose lanes may
            // reach into the next row, take the masked store
            if (j + 8 <= n) _mm256_storeu_ps(wr, _mm256_blendv_ps(s, e, is1));
            else _mm256_maskstore_ps(wr, single, e);
            vsum[r] = _mm256_add_ps(vsum[r], _mm256_and_ps(e, is1));
        }
        for (unsigned bits = merged; bits; bits &= bits - 1) {   // merged: the sum over members
            const int e = j + __builtin_ctz(bits), cnt = nm[e];
            if (cnt == 2) {
                pairs.e[pairs.k++] = e;
                if (pairs.k == 4) { pairs_exp(l, at, &pairs, nq, n, w, vmax, merged_sum); pairs.k = 0; }
            } else if (cnt <= 4) {
                quads.e[quads.k++] = e;
                if (quads.k == 2) { quads_exp(l, nm, at, &quads, nq, n, w, vmax, merged_sum); quads.k = 0; }
            } else {
                large_exp(l, cnt, at[e], e, nq, n, w, vmax, merged_sum);
            }
        }
    }
    if (pairs.k) pairs_exp(l, at, &pairs, nq, n, w, vmax, merged_sum);
    if (quads.k) quads_exp(l, nm, at, &quads, nq, n, w, vmax, merged_sum);
    for (int r = 0; r < nq; r++) sum_out[r] = hsum_ps(vsum[r]) + merged_sum[r];
}
#endif

static void merged_exp(const struct kv_list *l, int j0, int n, int nq, float *w, float *max_out, float *sum_out) {
#if defined(__x86_64__) || defined(__i386__)
    if (!scalar_only && cpu_has_avx2()) {
        merged_exp_avx2(l, j0, n, nq, w, max_out, sum_out);
        return;
    }
#endif
    merged_exp_scalar(l, j0, n, nq, w, max_out, sum_out);
}

// nq rows of n logits over the list's first n entries become probabilities.
static void merged_weights(const struct kv_list *l, int n, int nq, float *w) {
    float max[ATTENTION_TILE], sum[ATTENTION_TILE];
    merged_exp(l, 0, n, nq, w, max, sum);
    for (int r = 0; r < nq; r++) {
        const float inv = 1.0f / sum[r];
        for (int j = 0; j < n; j++) w[(size_t)r * n + j] *= inv;
    }
}

// Unnormalised weights of nq rows over entries [j0, j0 + n): exp(logit - max), members
// expanded; max[r] and lsum[r] per row.
static void weights_exp(const struct kv_list *l, int j0, int n, int nq, float *w, float *max, float *lsum) {
    if (l->n_members) {
        merged_exp(l, j0, n, nq, w, max, lsum);
        return;
    }
    for (int r = 0; r < nq; r++) lsum[r] = softmax_exp(w + (size_t)r * n, n, max + r);
}

// logits[j] = scale * q . K[j] and out = sum_j p[j] V[j], the generic way (any head size,
// either element type).
// Entries [j0, j0 + n) of the list.
static void scores_generic(const float *q, const struct kv_list *l, int j0, int n, int d, float scale, float *logits) {
    for (int j = 0; j < n; j++) logits[j] = kv_key_dot(l, j0 + j, q, d) * scale;
}

static void weighted_sum_generic(const float *p, const struct kv_list *l, int j0, int n, int d, float *out) {
    float tmp[PYKV_MAX_HEAD_DIM];
    memset(out, 0, (size_t)d * sizeof(float));
    for (int j = 0; j < n; j++) axpy_f32(out, p[j], kv_value_f32(l, j0 + j, d, tmp), d);
}

#if defined(__x86_64__) || defined(__i386__)

// Tiles of nq <= ATTENTION_TILE queries (w: nq rows of n weights; out: nq rows of d), head
// size a multiple of 16. A fused multiply-add waits ~4 cycles for its accumulator and two
// issue per cycle, so each kernel keeps 8 to 12 independent accumulators in flight
// (fewer leave the FMA units idle; more spill the 16 vector registers).

// At depth the lists come from memory (the weights streamed since the last step have pushed
// them out of cache), faster than the hardware prefetcher asks for them: each pass over
// keys or values requests the rows this many bytes ahead (a few rows: nearer leaves the
// loads waiting, farther evicts rows the pass has not reached yet).
#define ATTENTION_PREFETCH 4096

// Q8_0 keys: within a 32-value block each query's dot product with the int8 quants sums
// in t, and t times the block's scale joins the row's total, so the scale costs one
// multiply-add per block rather than a multiply per eight values (the conversion, not the
// memory, bounds these kernels at depth). E = 4 entries for one query, 2 for more: a and t
// take 2 x nq x E of the 16 registers. Whole groups of E entries only: returns how many
// entries it scored (scores_tile does the rest).
static inline __attribute__((always_inline)) AVX2_TGT
int scores_tile_q8_0(const float *q, const int nq, const void *K, int n, int d, float scale, float *w) {
    enum { EMAX = 4 };
    const int E = nq == 1 ? 4 : 2;
    const size_t row = kv_format_row_bytes(KV_Q8_0, d);
    int j = 0;
    for (; j + E <= n; j += E) {
        const uint8_t *k0 = (const uint8_t *)K + (size_t)j * row;
        for (size_t b = 0; b < (size_t)E * row; b += 64) __builtin_prefetch(k0 + ATTENTION_PREFETCH + b);
        __m256 a[ATTENTION_TILE][EMAX];
        for (int r = 0; r < nq; r++)
            for (int e = 0; e < E; e++) a[r][e] = _mm256_setzero_ps();
        for (int ib = 0; ib < d; ib += KV_Q8_BLOCK) {
            const uint8_t *blk = k0 + (size_t)(ib / KV_Q8_BLOCK) * KV_Q8_BLOCK_BYTES;
            __m256 t[ATTENTION_TILE][EMAX];
            for (int c = 0; c < KV_Q8_BLOCK; c += 8)
                for (int e = 0; e < E; e++) {
                    const __m256 x = q8_0_quants8(blk + (size_t)e * row, c);
                    for (int r = 0; r < nq; r++) {
                        const __m256 qv = _mm256_loadu_ps(q + (size_t)r * d + ib + c);
                        t[r][e] = c == 0 ? _mm256_mul_ps(qv, x) : _mm256_fmadd_ps(qv, x, t[r][e]);
                    }
                }
            for (int e = 0; e < E; e++) {
                const __m256 sc = q8_0_scale8(blk + (size_t)e * row);
                for (int r = 0; r < nq; r++) a[r][e] = _mm256_fmadd_ps(t[r][e], sc, a[r][e]);
            }
        }
        for (int r = 0; r < nq; r++) store_sums(a[r], E, scale, w + (size_t)r * n + j);
    }
    return j;
}

// Scores: E entries at a time (8 for one query, 4 for two or three, 2 for four), one
// accumulator per (query, entry); each key row is loaded once for every query of the tile.
static inline __attribute__((always_inline)) AVX2_TGT
void scores_tile(const float *q, const int nq, const void *K, const int fmt, int n, int d, float scale, float *w) {
    enum { EMAX = 8 };
    const int E = nq == 1 ? 8 : nq <= 3 ? 4 : 2;
    const size_t row = kv_format_row_bytes(fmt, d);
    int j = 0;
    if (fmt == KV_Q8_0) j = scores_tile_q8_0(q, nq, K, n, d, scale, w);   // whole tiles; the tail below
    else for (; j + E <= n; j += E) {
        const char *k0 = (const char *)K + (size_t)j * row;
        for (size_t b = 0; b < (size_t)E * row; b += 64) __builtin_prefetch(k0 + ATTENTION_PREFETCH + b);
        __m256 a[ATTENTION_TILE][EMAX];
        for (int r = 0; r < nq; r++)
            for (int e = 0; e < E; e++) a[r][e] = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8) {
            for (int e = 0; e < E; e++) {
                const __m256 x = load8_kv(k0 + (size_t)e * row, i, fmt);
                for (int r = 0; r < nq; r++)
                    a[r][e] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)r * d + i), x, a[r][e]);
            }
        }
        for (int r = 0; r < nq; r++) store_sums(a[r], E, scale, w + (size_t)r * n + j);
    }
    for (; j < n; j++) {
        const char *k0 = (const char *)K + (size_t)j * row;
        for (int r = 0; r < nq; r++) {
            __m256 a = _mm256_setzero_ps();
            for (int i = 0; i < d; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)r * d + i), load8_kv(k0, i, fmt), a);
            w[(size_t)r * n + j] = hsum_ps(a) * scale;
        }
    }
}

// Weighted sum: C output dims per pass (32 for one or two queries when d allows, else 16)
// for every query of the tile, over U entries at a time with their own accumulators (2 for
// one or three queries), so each pass reads a C-element slice of each value row once.
static inline __attribute__((always_inline)) AVX2_TGT
void weighted_sum_tile(const float *w, const int nq, const void *V, const int fmt, int n, int d, float *out) {
    enum { CMAX = 4, UMAX = 2 };   // C / 8 and U at most
    const int C8 = nq <= 2 && d % 32 == 0 ? 4 : 2, U = nq == 1 || nq == 3 ? 2 : 1;
    const size_t row = kv_format_row_bytes(fmt, d);
    for (int c = 0; c < d; c += 8 * C8) {
        __m256 a[UMAX][ATTENTION_TILE][CMAX];
        for (int u = 0; u < U; u++)
            for (int r = 0; r < nq; r++)
                for (int x = 0; x < C8; x++) a[u][r][x] = _mm256_setzero_ps();
        int j = 0;
        for (; j + U <= n; j += U) {
            if (c == 0)   // the first pass brings the rows in
                for (size_t b = 0; b < (size_t)U * row; b += 64)
                    __builtin_prefetch((const char *)V + (size_t)j * row + ATTENTION_PREFETCH + b);
            for (int u = 0; u < U; u++) {
                const char *v = (const char *)V + (size_t)(j + u) * row;
                __m256 vx[CMAX], sc = _mm256_setzero_ps();
                if (fmt == KV_Q8_0) {   // a pass lies inside one block: its scale goes into the weights
                    const uint8_t *blk = (const uint8_t *)v + (size_t)(c / KV_Q8_BLOCK) * KV_Q8_BLOCK_BYTES;
                    sc = q8_0_scale8(blk);
                    for (int x = 0; x < C8; x++) vx[x] = q8_0_quants8(blk, c % KV_Q8_BLOCK + 8 * x);
                } else {
                    for (int x = 0; x < C8; x++) vx[x] = load8_kv(v, c + 8 * x, fmt);
                }
                for (int r = 0; r < nq; r++) {
                    __m256 p = _mm256_broadcast_ss(w + (size_t)r * n + j + u);
                    if (fmt == KV_Q8_0) p = _mm256_mul_ps(p, sc);
                    for (int x = 0; x < C8; x++) a[u][r][x] = _mm256_fmadd_ps(p, vx[x], a[u][r][x]);
                }
            }
        }
        for (; j < n; j++) {   // the odd entry out
            const char *v = (const char *)V + (size_t)j * row;
            for (int r = 0; r < nq; r++) {
                const __m256 p = _mm256_broadcast_ss(w + (size_t)r * n + j);
                for (int x = 0; x < C8; x++) a[0][r][x] = _mm256_fmadd_ps(p, load8_kv(v, c + 8 * x, fmt), a[0][r][x]);
            }
        }
        for (int r = 0; r < nq; r++)
            for (int x = 0; x < C8; x++) {
                __m256 sum = a[0][r][x];
                for (int u = 1; u < U; u++) sum = _mm256_add_ps(sum, a[u][r][x]);
                _mm256_storeu_ps(out + (size_t)r * d + c + 8 * x, sum);
            }
    }
}

// One instance per (tile size, element format), so the loops over the tile unroll and the
// format is decided at compile time.
typedef void (*scores_fn)(const float *q, const void *K, int n, int d, float scale, float *w);
typedef void (*wsum_fn)(const float *w, const void *V, int n, int d, float *out);
#define TILE_FNS(nq, fmt)                                                                          \
    static AVX2_TGT void scores_##nq##_##fmt(const float *q, const void *K, int n, int d, float scale, float *w) { \
        scores_tile(q, nq, K, fmt, n, d, scale, w);                                                \
    }                                                                                              \
    static AVX2_TGT void wsum_##nq##_##fmt(const float *w, const void *V, int n, int d, float *out) { \
        weighted_sum_tile(w, nq, V, fmt, n, d, out);                                               \
    }
TILE_FNS(1, 0) TILE_FNS(2, 0) TILE_FNS(3, 0) TILE_FNS(4, 0)
TILE_FNS(1, 1) TILE_FNS(2, 1) TILE_FNS(3, 1) TILE_FNS(4, 1)
TILE_FNS(1, 2) TILE_FNS(2, 2) TILE_FNS(3, 2) TILE_FNS(4, 2)
_Static_assert(KV_F32 == 0 && KV_F16 == 1 && KV_Q8_0 == 2 && KV_N_FORMATS == 3, "one row per format");

static const scores_fn scores_avx2[KV_N_FORMATS][ATTENTION_TILE + 1] = {
    { NULL, scores_1_0, scores_2_0, scores_3_0, scores_4_0 },
    { NULL, scores_1_1, scores_2_1, scores_3_1, scores_4_1 },
    { NULL, scores_1_2, scores_2_2, scores_3_2, scores_4_2 },
};
static const wsum_fn wsum_avx2[KV_N_FORMATS][ATTENTION_TILE + 1] = {
    { NULL, wsum_1_0, wsum_2_0, wsum_3_0, wsum_4_0 },
    { NULL, wsum_1_1, wsum_2_1, wsum_3_1, wsum_4_1 },
    { NULL, wsum_1_2, wsum_2_2, wsum_3_2, wsum_4_2 },
};

static int use_avx2(int d) {
    return !scalar_only && d % 16 == 0 && cpu_has_avx2();
}
#endif

void attention_head(const float *q, const struct kv_list *l, int n, int d, float *weights, float *out) {
    const float scale = 1.0f / sqrtf((float)d);
#if defined(__x86_64__) || defined(__i386__)
    if (use_avx2(d)) {
        scores_avx2[l->fmt_k][1](q, l->k, n, d, scale, weights);
        if (l->n_members) merged_weights(l, n, 1, weights);
        else softmax(weights, n);
        wsum_avx2[l->fmt_v][1](weights, l->v, n, d, out);
        return;
    }
#endif
    scores_generic(q, l, 0, n, d, scale, weights);
    if (l->n_members) merged_weights(l, n, 1, weights);
    else softmax(weights, n);
    weighted_sum_generic(weights, l, 0, n, d, out);
}

void attention_group(const float *q, int nq, const struct kv_list *l, int n, int d, float *weights, float *out) {
#if defined(__x86_64__) || defined(__i386__)
    if (use_avx2(d)) {
        scores_avx2[l->fmt_k][nq](q, l->k, n, d, 1.0f / sqrtf((float)d), weights);
        if (l->n_members) merged_weights(l, n, nq, weights);
        else for (int r = 0; r < nq; r++) softmax(weights + (size_t)r * n, n);
        wsum_avx2[l->fmt_v][nq](weights, l->v, n, d, out);
        return;
    }
#endif
    for (int r = 0; r < nq; r++)
        attention_head(q + (size_t)r * d, l, n, d, weights + (size_t)r * n, out + (size_t)r * d);
}

void attention_weights(const float *q, int nq, const struct kv_list *l, int n, int d, float *weights) {
    const float scale = 1.0f / sqrtf((float)d);
#if defined(__x86_64__) || defined(__i386__)
    if (use_avx2(d)) scores_avx2[l->fmt_k][nq](q, l->k, n, d, scale, weights);
    else
#endif
        for (int r = 0; r < nq; r++) scores_generic(q + (size_t)r * d, l, 0, n, d, scale, weights + (size_t)r * n);
    if (l->n_members) merged_weights(l, n, nq, weights);
    else for (int r = 0; r < nq; r++) softmax(weights + (size_t)r * n, n);
}

// A merged list's member counts, offsets and norm pool come from memory at depth, as its rows
// do; requested before the scores pass, they are in cache when the expansion after it reads
// them (otherwise its loads wait on memory one entry at a time).
static void prefetch_members(const struct kv_list *l, int j0, int j1) {
    for (int j = j0; j < j1; j += 16) {   // 16 int32 per 64-byte line
        __builtin_prefetch(l->n_members + j);
        __builtin_prefetch(l->member_at + j);
    }
    for (int32_t i = 0; i < l->pool_used; i += 16) __builtin_prefetch(l->member_pool + i);
}

void attention_group_partial(const float *q, int nq, const struct kv_list *l, int j0, int j1, int d, float *w,
                             float *out, float *m, float *lsum) {
    const int n = j1 - j0;
    const float scale = 1.0f / sqrtf((float)d);
    if (l->n_members) prefetch_members(l, j0, j1);
#if defined(__x86_64__) || defined(__i386__)
    if (use_avx2(d)) {
        scores_avx2[l->fmt_k][nq](q, kv_key_row(l, j0, d), n, d, scale, w);
        weights_exp(l, j0, n, nq, w, m, lsum);
        wsum_avx2[l->fmt_v][nq](w, kv_value_row(l, j0, d), n, d, out);
        return;
    }
#endif
    for (int r = 0; r < nq; r++) scores_generic(q + (size_t)r * d, l, j0, n, d, scale, w + (size_t)r * n);
    weights_exp(l, j0, n, nq, w, m, lsum);
    for (int r = 0; r < nq; r++) weighted_sum_generic(w + (size_t)r * n, l, j0, n, d, out + (size_t)r * d);
}

void attention_dots(const float *x, const struct kv_list *l, int values, int n, int d, float *out) {
#if defined(__x86_64__) || defined(__i386__)
    if (use_avx2(d)) {
        scores_avx2[values ? l->fmt_v : l->fmt_k][1](x, values ? l->v : l->k, n, d, 1.0f, out);
        return;
    }
#endif
    float tmp[PYKV_MAX_HEAD_DIM];
    for (int j = 0; j < n; j++)
        out[j] = values ? dot_f32(x, kv_value_f32(l, j, d, tmp), d) : kv_key_dot(l, j, x, d);
}
