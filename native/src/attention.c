// attention.c - softmax attention over a ragged list, plain or with merged entries.
#include "attention.h"
#include "ops.h"
#include "quant.h"

#include <math.h>
#include <string.h>

// Merged entries: member m of entry j has logit norm_m * s_j, all members share v_j, so
// entry j's weight is sum_m exp(norm_m * s_j - max) / Z (the EMS expansion).
static float merged_max(const struct kv_list *l, int j0, int n, const float *w) {
    float max = -INFINITY;
    for (int j = 0; j < n; j++) {
        // each member list is its own allocation: fetch a few entries ahead
        if (j + 8 < n && l->member_norm[j0 + j + 8]) __builtin_prefetch(l->member_norm[j0 + j + 8]);
        const float top = kv_member_logit_max(l, j0 + j, w[j]);
        if (top > max) max = top;
    }
    return max;
}

// Entries [j0, j0 + n) of a list with merged entries, logits w in place: w[j] becomes
// sum_m exp(norm_m * w[j] - max), *max_out the largest member logit; returns the sum of the
// w[j].
static float merged_exp_scalar(const struct kv_list *l, int j0, int n, float *w, float *max_out) {
    float *const *norms = l->member_norm + j0;
    const int32_t *nm = l->n_members + j0;
    const float max = merged_max(l, j0, n, w);
    double sum = 0.0;
    for (int j = 0; j < n; j++) {
        float e = 0.0f;
        if (!norms[j]) e = expf(w[j] - max);
        else for (int m = 0; m < nm[j]; m++) e += expf(norms[j][m] * w[j] - max);
        w[j] = e;
        sum += e;
    }
    *max_out = max;
    return (float)sum;
}

#if defined(__x86_64__) || defined(__i386__)
#include "simd-avx2.h"

// The same, eight exponentials at a time: the members' logits of consecutive small entries
// are packed into one flat batch (a merged entry's in vectors, its tail lanes overwritten by
// the next entry's), exponentiated together and summed back per entry; an entry of LONG or
// more members is exponentiated and summed in vectors on its own.
// Members m..m+7 of a member list of cnt: norm * s - max, and the mask of the lanes in it.
static inline AVX2_TGT __m256 member_logits8(const float *norm, int m, int cnt, __m256 s, __m256 vmax, __m256i *mask) {
    *mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(cnt - m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_fmsub_ps(_mm256_maskload_ps(norm + m, *mask), s, vmax);
}

static AVX2_TGT float merged_exp_avx2(const struct kv_list *l, int j0, int n, float *w, float *max_out) {
    enum { BATCH = 256, LONG = 16 };
    float *const *norms = l->member_norm + j0;
    const int32_t *nm = l->n_members + j0;
    const float max = merged_max(l, j0, n, w);
    const __m256 vmax = _mm256_set1_ps(max);
    float x[BATCH + 8];
    int start[BATCH + 1];
    double sum = 0.0;
    for (int j = 0; j < n;) {
        // fill: entries [j, e), at most BATCH of them, whose small entries' members fit
        int e = j, nb = 0;
        for (; e < n && e - j < BATCH; e++) {
            const int cnt = norms[e] ? nm[e] : 1;
            start[e - j] = nb;
            if (cnt >= LONG) {   // a big entry: its members in vectors, summed in vectors
                const __m256 s = _mm256_set1_ps(w[e]);
                __m256 acc = _mm256_setzero_ps();
                for (int m = 0; m < cnt; m += 8) {
                    __m256i mask;
                    const __m256 z = member_logits8(norms[e], m, cnt, s, vmax, &mask);
                    acc = _mm256_add_ps(acc, _mm256_and_ps(exp_ps(z), _mm256_castsi256_ps(mask)));
                }
                w[e] = hsum_ps(acc);   // its batch segment stays empty
                continue;
            }
            if (nb + cnt > BATCH) break;
            if (!norms[e]) {
                x[nb++] = w[e] - max;
                continue;
            }
            const __m256 s = _mm256_set1_ps(w[e]);
            for (int m = 0; m < cnt; m += 8) {
                __m256i mask;
                _mm256_storeu_ps(x + nb + m, member_logits8(norms[e], m, cnt, s, vmax, &mask));
            }
            nb += cnt;
        }
        start[e - j] = nb;
        for (int b = nb; b % 8; b++) x[b] = -INFINITY;
        for (int b = 0; b < nb; b += 8) _mm256_storeu_ps(x + b, exp_ps(_mm256_loadu_ps(x + b)));
        for (int t = j; t < e; t++) {
            const int a = start[t - j], b = start[t - j + 1];
            if (b > a) {
                float acc = 0.0f;
                for (int i = a; i < b; i++) acc += x[i];
                w[t] = acc;
            }
            sum += w[t];
        }
        j = e;
    }
    *max_out = max;
    return (float)sum;
}
#endif

static float merged_exp(const struct kv_list *l, int j0, int n, float *w, float *max_out) {
#if defined(__x86_64__) || defined(__i386__)
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return merged_exp_avx2(l, j0, n, w, max_out);
#endif
    return merged_exp_scalar(l, j0, n, w, max_out);
}

static void merged_weights(const struct kv_list *l, int n, float *w) {
    float max;
    const float inv = 1.0f / merged_exp(l, 0, n, w, &max);
    for (int j = 0; j < n; j++) w[j] *= inv;
}

// Unnormalised weights of entries [j0, j0 + n): exp(logit - max), members expanded.
static float weights_exp(const struct kv_list *l, int j0, int n, float *w, float *max_out) {
    return l->n_members ? merged_exp(l, j0, n, w, max_out) : softmax_exp(w, n, max_out);
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
// size a multiple of 16. Scores: two entries at a time, one accumulator per (query, entry);
// each key row is loaded once for every query of the tile.
static inline __attribute__((always_inline)) AVX2_TGT
void scores_tile(const float *q, const int nq, const void *K, const int f16, int n, int d, float scale, float *w) {
    const size_t row = (size_t)d * (f16 ? 2 : 4);
    int j = 0;
    for (; j + 2 <= n; j += 2) {
        const char *k0 = (const char *)K + (size_t)j * row, *k1 = k0 + row;
        __m256 a[ATTENTION_TILE][2];
        for (int r = 0; r < nq; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8) {
            const __m256 x0 = load8_kv(k0, i, f16), x1 = load8_kv(k1, i, f16);
            for (int r = 0; r < nq; r++) {
                const __m256 qi = _mm256_loadu_ps(q + (size_t)r * d + i);
                a[r][0] = _mm256_fmadd_ps(qi, x0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(qi, x1, a[r][1]);
            }
        }
        for (int r = 0; r < nq; r++) {
            const __m256 h = _mm256_hadd_ps(a[r][0], a[r][1]);   // lanes: e0 e0 e1 e1 | e0 e0 e1 e1
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            s = _mm_mul_ps(_mm_hadd_ps(s, s), _mm_set1_ps(scale));
            _mm_storel_pi((__m64 *)(w + (size_t)r * n + j), s);
        }
    }
    for (; j < n; j++) {
        const char *k0 = (const char *)K + (size_t)j * row;
        for (int r = 0; r < nq; r++) {
            __m256 a = _mm256_setzero_ps();
            for (int i = 0; i < d; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)r * d + i), load8_kv(k0, i, f16), a);
            w[(size_t)r * n + j] = hsum_ps(a) * scale;
        }
    }
}

// Weighted sum: 16 output dims per pass for every query of the tile, so each pass reads a
// 16-element slice of each value row once.
static inline __attribute__((always_inline)) AVX2_TGT
void weighted_sum_tile(const float *w, const int nq, const void *V, const int f16, int n, int d, float *out) {
    const size_t row = (size_t)d * (f16 ? 2 : 4);
    for (int c = 0; c < d; c += 16) {
        __m256 a[ATTENTION_TILE][2];
        for (int r = 0; r < nq; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        for (int j = 0; j < n; j++) {
            const char *v = (const char *)V + (size_t)j * row;
            const __m256 v0 = load8_kv(v, c, f16), v1 = load8_kv(v, c + 8, f16);
            for (int r = 0; r < nq; r++) {
                const __m256 p = _mm256_broadcast_ss(w + (size_t)r * n + j);
                a[r][0] = _mm256_fmadd_ps(p, v0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(p, v1, a[r][1]);
            }
        }
        for (int r = 0; r < nq; r++) {
            _mm256_storeu_ps(out + (size_t)r * d + c, a[r][0]);
            _mm256_storeu_ps(out + (size_t)r * d + c + 8, a[r][1]);
        }
    }
}

// One instance per (tile size, element type), so the loops over the tile unroll and the
// element type is decided at compile time.
typedef void (*scores_fn)(const float *q, const void *K, int n, int d, float scale, float *w);
typedef void (*wsum_fn)(const float *w, const void *V, int n, int d, float *out);
#define TILE_FNS(nq, f16)                                                                          \
    static AVX2_TGT void scores_##nq##_##f16(const float *q, const void *K, int n, int d, float scale, float *w) { \
        scores_tile(q, nq, K, f16, n, d, scale, w);                                                \
    }                                                                                              \
    static AVX2_TGT void wsum_##nq##_##f16(const float *w, const void *V, int n, int d, float *out) { \
        weighted_sum_tile(w, nq, V, f16, n, d, out);                                               \
    }
TILE_FNS(1, 0) TILE_FNS(2, 0) TILE_FNS(3, 0) TILE_FNS(4, 0)
TILE_FNS(1, 1) TILE_FNS(2, 1) TILE_FNS(3, 1) TILE_FNS(4, 1)

static const scores_fn scores_avx2[2][ATTENTION_TILE + 1] = {
    { NULL, scores_1_0, scores_2_0, scores_3_0, scores_4_0 },
    { NULL, scores_1_1, scores_2_1, scores_3_1, scores_4_1 },
};
static const wsum_fn wsum_avx2[2][ATTENTION_TILE + 1] = {
    { NULL, wsum_1_0, wsum_2_0, wsum_3_0, wsum_4_0 },
    { NULL, wsum_1_1, wsum_2_1, wsum_3_1, wsum_4_1 },
};

static int use_avx2(int d) {
    return d % 16 == 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#endif

void attention_head(const float *q, const struct kv_list *l, int n, int d, float *weights, float *out) {
    const float scale = 1.0f / sqrtf((float)d);
#if defined(__x86_64__) || defined(__i386__)
    if (use_avx2(d)) {
        scores_avx2[l->f16][1](q, l->k, n, d, scale, weights);
        if (l->n_members) merged_weights(l, n, weights);
        else softmax(weights, n);
        wsum_avx2[l->f16][1](weights, l->v, n, d, out);
        return;
    }
#endif
    scores_generic(q, l, 0, n, d, scale, weights);
    if (l->n_members) merged_weights(l, n, weights);
    else softmax(weights, n);
    weighted_sum_generic(weights, l, 0, n, d, out);
}

void attention_group(const float *q, int nq, const struct kv_list *l, int n, int d, float *weights, float *out) {
#if defined(__x86_64__) || defined(__i386__)
    if (use_avx2(d)) {
        scores_avx2[l->f16][nq](q, l->k, n, d, 1.0f / sqrtf((float)d), weights);
        for (int r = 0; r < nq; r++) {
            if (l->n_members) merged_weights(l, n, weights + (size_t)r * n);
            else softmax(weights + (size_t)r * n, n);
        }
        wsum_avx2[l->f16][nq](weights, l->v, n, d, out);
        return;
    }
#endif
    for (int r = 0; r < nq; r++)
        attention_head(q + (size_t)r * d, l, n, d, weights + (size_t)r * n, out + (size_t)r * d);
}

void attention_weights(const float *q, int nq, const struct kv_list *l, int n, int d, float *weights) {
    const float scale = 1.0f / sqrtf((float)d);
#if defined(__x86_64__) || defined(__i386__)
    if (use_avx2(d)) scores_avx2[l->f16][nq](q, l->k, n, d, scale, weights);
    else
#endif
        for (int r = 0; r < nq; r++) scores_generic(q + (size_t)r * d, l, 0, n, d, scale, weights + (size_t)r * n);
    for (int r = 0; r < nq; r++) {
        if (l->n_members) merged_weights(l, n, weights + (size_t)r * n);
        else softmax(weights + (size_t)r * n, n);
    }
}

void attention_group_partial(const float *q, int nq, const struct kv_list *l, int j0, int j1, int d, float *w,
                             float *out, float *m, float *lsum) {
    const int n = j1 - j0;
    const float scale = 1.0f / sqrtf((float)d);
#if defined(__x86_64__) || defined(__i386__)
    if (use_avx2(d)) {
        scores_avx2[l->f16][nq](q, kv_row(l, l->k, j0, d), n, d, scale, w);
        for (int r = 0; r < nq; r++) lsum[r] = weights_exp(l, j0, n, w + (size_t)r * n, m + r);
        wsum_avx2[l->f16][nq](w, kv_row(l, l->v, j0, d), n, d, out);
        return;
    }
#endif
    for (int r = 0; r < nq; r++) {
        float *wr = w + (size_t)r * n;
        scores_generic(q + (size_t)r * d, l, j0, n, d, scale, wr);
        lsum[r] = weights_exp(l, j0, n, wr, m + r);
        weighted_sum_generic(wr, l, j0, n, d, out + (size_t)r * d);
    }
}

void attention_dots(const float *x, const struct kv_list *l, int values, int n, int d, float *out) {
#if defined(__x86_64__) || defined(__i386__)
    if (use_avx2(d)) {
        scores_avx2[l->f16][1](x, values ? l->v : l->k, n, d, 1.0f, out);
        return;
    }
#endif
    float tmp[PYKV_MAX_HEAD_DIM];
    for (int j = 0; j < n; j++)
        out[j] = values ? dot_f32(x, kv_value_f32(l, j, d, tmp), d) : kv_key_dot(l, j, x, d);
}
