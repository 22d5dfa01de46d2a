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

// head_dim a multiple of 64: the query (scores) or the output (weighted sum) of each block
// of 64 dimensions stays in eight registers while the entries stream past.
AVX2_TGT
static void scores_avx2(const float *q, const float *K, int n, int d, float scale, float *logits) {
    for (int j = 0; j < n; j++) {
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
