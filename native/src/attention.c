// attention.c - softmax attention over a ragged list, plain or with merged entries.
#include "attention.h"
#include "ops.h"
#include "quant.h"

#include <math.h>
#include <string.h>

// Merged entries: member m of entry j has logit norm_m * s_j, all members share v_j, so
// entry j's weight is sum_m exp(norm_m * s_j - max) / Z (the EMS expansion).
static void merged_weights(const struct kv_list *l, int n, float *w) {
    float max = -INFINITY;
    for (int j = 0; j < n; j++) {
        const float *norm = l->member_norm[j];
        if (!norm) { if (w[j] > max) max = w[j]; continue; }
        for (int m = 0; m < l->n_members[j]; m++)
            if (norm[m] * w[j] > max) max = norm[m] * w[j];
    }
    double sum = 0.0;
    for (int j = 0; j < n; j++) {
        const float *norm = l->member_norm[j];
        float e = 0.0f;
        if (!norm) e = expf(w[j] - max);
        else for (int m = 0; m < l->n_members[j]; m++) e += expf(norm[m] * w[j] - max);
        w[j] = e;
        sum += e;
    }
    float inv = (float)(1.0 / sum);
    for (int j = 0; j < n; j++) w[j] *= inv;
}

// logits[j] = scale * q . K[j] and out = sum_j p[j] V[j], the generic way.
static void scores_generic(const float *q, const float *K, int n, int d, float scale, float *logits) {
    for (int j = 0; j < n; j++) logits[j] = dot_f32(q, K + (size_t)j * d, d) * scale;
}

static void weighted_sum_generic(const float *p, const float *V, int n, int d, float *out) {
    memset(out, 0, (size_t)d * sizeof(float));
    for (int j = 0; j < n; j++) axpy_f32(out, p[j], V + (size_t)j * d, d);
}

#if defined(__x86_64__) || defined(__i386__)
#include "simd-avx2.h"

// head_dim a multiple of 64. Scores: eight entries at a time, one accumulator each, so eight
// FMA chains run side by side and one horizontal-add tree yields all eight scores. Weighted
// sum: the output's 64-dim blocks stay in eight registers while the entries stream past.
AVX2_TGT
static void scores_avx2(const float *q, const float *K, int n, int d, float scale, float *logits) {
    const __m256 vs = _mm256_set1_ps(scale);
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        const float *k = K + (size_t)j * d;
        __m256 a[8];
        for (int e = 0; e < 8; e++) a[e] = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8) {
            const __m256 qi = _mm256_loadu_ps(q + i);
            for (int e = 0; e < 8; e++) a[e] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k + (size_t)e * d + i), a[e]);
        }
        const __m256 h03 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        const __m256 h47 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
        const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(h03, h47, 0x20), _mm256_permute2f128_ps(h03, h47, 0x31));
        _mm256_storeu_ps(logits + j, _mm256_mul_ps(sum, vs));
    }
    for (; j < n; j++) {
        const float *k = K + (size_t)j * d;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), _mm256_loadu_ps(k + i + 8), a1);
        }
        logits[j] = hsum_ps(_mm256_add_ps(a0, a1)) * scale;
    }
}

AVX2_TGT
static void weighted_sum_avx2(const float *p, const float *V, int n, int d, float *out) {
    for (int c = 0; c < d; c += 64) {
        __m256 acc[8];
        for (int a = 0; a < 8; a++) acc[a] = _mm256_setzero_ps();
        for (int j = 0; j < n; j++) {
            const __m256 pj = _mm256_set1_ps(p[j]);
            const float *v = V + (size_t)j * d + c;
            for (int a = 0; a < 8; a++) acc[a] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * a), acc[a]);
        }
        for (int a = 0; a < 8; a++) _mm256_storeu_ps(out + c + 8 * a, acc[a]);
    }
}

// Tiles of nq <= ATTENTION_TILE queries (w: nq rows of n weights; out: nq rows of d).
// Scores: two entries at a time, one accumulator per (query, entry); each key row is loaded
// once for every query of the tile.
static inline __attribute__((always_inline)) AVX2_TGT
void scores_tile_avx2(const float *q, const int nq, const float *K, int n, int d, float scale, float *w) {
    int j = 0;
    for (; j + 2 <= n; j += 2) {
        const float *k0 = K + (size_t)j * d, *k1 = k0 + d;
        __m256 a[ATTENTION_TILE][2];
        for (int r = 0; r < nq; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8) {
            const __m256 x0 = _mm256_loadu_ps(k0 + i), x1 = _mm256_loadu_ps(k1 + i);
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
    for (; j < n; j++)
        for (int r = 0; r < nq; r++) w[(size_t)r * n + j] = dot_f32(q + (size_t)r * d, K + (size_t)j * d, d) * scale;
}

// Weighted sum: 16 output dims per pass for every query of the tile, so each pass reads a
// 16-float slice of each value row once.
static inline __attribute__((always_inline)) AVX2_TGT
void weighted_sum_tile_avx2(const float *w, const int nq, const float *V, int n, int d, float *out) {
    for (int c = 0; c < d; c += 16) {
        __m256 a[ATTENTION_TILE][2];
        for (int r = 0; r < nq; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        for (int j = 0; j < n; j++) {
            const float *v = V + (size_t)j * d + c;
            const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
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

// One instance per tile size, so the loops over the tile's queries unroll.
#define TILE_FN(nq)                                                                            \
    static AVX2_TGT void tile##nq##_avx2(const float *q, const struct kv_list *l, int n, int d, \
                                         float scale, float *w, float *out) {                    \
        scores_tile_avx2(q, nq, l->k, n, d, scale, w);                                          \
        for (int r = 0; r < nq; r++) softmax(w + (size_t)r * n, n);                             \
        weighted_sum_tile_avx2(w, nq, l->v, n, d, out);                                         \
    }
TILE_FN(1)
TILE_FN(2)
TILE_FN(3)
TILE_FN(4)

typedef void (*tile_fn)(const float *, const struct kv_list *, int, int, float, float *, float *);
static const tile_fn tile_avx2[ATTENTION_TILE + 1] = { NULL, tile1_avx2, tile2_avx2, tile3_avx2, tile4_avx2 };

static int use_avx2(int d) {
    return d % 64 == 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#else
static int use_avx2(int d) { (void)d; return 0; }
#define scores_avx2 scores_generic
#define weighted_sum_avx2 weighted_sum_generic
#endif

void attention_head(const float *q, const struct kv_list *l, int n, int d, float *weights, float *out) {
    const float scale = 1.0f / sqrtf((float)d);
    const int simd = use_avx2(d);
    (simd ? scores_avx2 : scores_generic)(q, l->k, n, d, scale, weights);
    if (l->n_members) merged_weights(l, n, weights);
    else softmax(weights, n);
    (simd ? weighted_sum_avx2 : weighted_sum_generic)(weights, l->v, n, d, out);
}

void attention_group(const float *q, int nq, const struct kv_list *l, int n, int d, float *weights, float *out) {
#if defined(__x86_64__) || defined(__i386__)
    if (!l->n_members && d % 16 == 0 && use_avx2(64)) {
        tile_avx2[nq](q, l, n, d, 1.0f / sqrtf((float)d), weights, out);
        return;
    }
#endif
    for (int r = 0; r < nq; r++)
        attention_head(q + (size_t)r * d, l, n, d, weights + (size_t)r * n, out + (size_t)r * d);
}
