// attention.c - softmax attention over a ragged list, plain or with merged entries.
#include "attention.h"
#include "ops.h"
#include "quant.h"

#include <math.h>
#include <string.h>

// Merged entries: member m of entry j has logit norm_m * s_j, all members share v_j, so
// entry j's weight is sum_m exp(norm_m * s_j - max) / Z (the EMS expansion).
static float merged_max(const struct kv_list *l, int n, const float *w) {
    float max = -INFINITY;
    for (int j = 0; j < n; j++) {
        const float *norm = l->member_norm[j];
        if (!norm) { if (w[j] > max) max = w[j]; continue; }
        for (int m = 0; m < l->n_members[j]; m++)
            if (norm[m] * w[j] > max) max = norm[m] * w[j];
    }
    return max;
}

// w[j] = entry j's unnormalised weight; returns their sum.
static double merged_exp_scalar(const struct kv_list *l, int n, float max, float *w) {
    double sum = 0.0;
    for (int j = 0; j < n; j++) {
        const float *norm = l->member_norm[j];
        float e = 0.0f;
        if (!norm) e = expf(w[j] - max);
        else for (int m = 0; m < l->n_members[j]; m++) e += expf(norm[m] * w[j] - max);
        w[j] = e;
        sum += e;
    }
    return sum;
}

#if defined(__x86_64__) || defined(__i386__)
#include "simd-avx2.h"

// Members' logits norm_m * s_j in vectors of eight; the tail lanes of a member list are -inf.
static inline AVX2_TGT __m256 member_logits(const float *norm, int m, int nm, __m256 s) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    if (m + 8 <= nm) return _mm256_mul_ps(_mm256_loadu_ps(norm + m), s);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(nm - m), lane);
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_mul_ps(_mm256_maskload_ps(norm + m, mask), s),
                            _mm256_castsi256_ps(mask));
}

static AVX2_TGT float merged_max_avx2(const struct kv_list *l, int n, const float *w) {
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    float max = -INFINITY;
    for (int j = 0; j < n; j++) {
        const float *norm = l->member_norm[j];
        if (!norm) { if (w[j] > max) max = w[j]; continue; }
        const __m256 s = _mm256_set1_ps(w[j]);
        for (int m = 0; m < l->n_members[j]; m += 8) vmax = _mm256_max_ps(vmax, member_logits(norm, m, l->n_members[j], s));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    for (int i = 0; i < 8; i++) if (lanes[i] > max) max = lanes[i];
    return max;
}

// The same sums, eight exponentials at a time: a merged entry's members in vectors (the
// tail lanes set to -inf, whose exp is 0); single-token entries gathered in batches.
static AVX2_TGT double merged_exp_avx2(const struct kv_list *l, int n, float max, float *w) {
    enum { BATCH = 64 };
    const __m256 vmax = _mm256_set1_ps(max);
    float x[BATCH];
    int idx[BATCH], nb = 0;
    double sum = 0.0;
    for (int j = 0; j <= n; j++) {
        if (j < n && !l->member_norm[j]) {
            idx[nb] = j;
            x[nb++] = w[j] - max;
        }
        if (nb == BATCH || (j == n && nb > 0)) {   // flush the single-token batch
            for (int b = nb; b % 8; b++) x[b] = -INFINITY;
            for (int b = 0; b < nb; b += 8) _mm256_storeu_ps(x + b, exp_ps(_mm256_loadu_ps(x + b)));
            for (int b = 0; b < nb; b++) { w[idx[b]] = x[b]; sum += x[b]; }
            nb = 0;
        }
        if (j == n || !l->member_norm[j]) continue;
        const float *norm = l->member_norm[j];
        const int nm = l->n_members[j];
        const __m256 s = _mm256_set1_ps(w[j]);
        __m256 acc = _mm256_setzero_ps();
        for (int m = 0; m < nm; m += 8) acc = _mm256_add_ps(acc, exp_ps(_mm256_sub_ps(member_logits(norm, m, nm, s), vmax)));
        w[j] = hsum_ps(acc);
        sum += w[j];
    }
    return sum;
}
#endif

static void merged_weights(const struct kv_list *l, int n, float *w) {
    double sum;
#if defined(__x86_64__) || defined(__i386__)
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) sum = merged_exp_avx2(l, n, merged_max_avx2(l, n, w), w);
    else
#endif
        sum = merged_exp_scalar(l, n, merged_max(l, n, w), w);
    const float inv = (float)(1.0 / sum);
    for (int j = 0; j < n; j++) w[j] *= inv;
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
    if (!l->n_members && use_avx2(d)) {
        scores_avx2[l->f16][nq](q, l->k, n, d, 1.0f / sqrtf((float)d), weights);
        for (int r = 0; r < nq; r++) softmax(weights + (size_t)r * n, n);
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
        for (int r = 0; r < nq; r++) lsum[r] = softmax_exp(w + (size_t)r * n, n, m + r);
        wsum_avx2[l->f16][nq](w, kv_row(l, l->v, j0, d), n, d, out);
        return;
    }
#endif
    for (int r = 0; r < nq; r++) {
        float *wr = w + (size_t)r * n;
        scores_generic(q + (size_t)r * d, l, j0, n, d, scale, wr);
        lsum[r] = softmax_exp(wr, n, m + r);
        weighted_sum_generic(wr, l, j0, n, d, out + (size_t)r * d);
    }
}
