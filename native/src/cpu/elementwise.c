// elementwise.c - RMSNorm and SwiGLU, with AVX2 versions where the CPU has them.
//
// Both run on the calling thread while the pool's other threads wait for the next product,
// so in a decode step of a small model their time counts in full (the scalar SwiGLU's
// expf per element and the scalar RMSNorm's serial double sum show in a profile). The AVX2
// SwiGLU uses exp_ps (simd-avx2.h, relative error ~1e-7, as expf);
// RMSNorm keeps its sum of squares in double, four lanes of it at a time.
#include "cpu/ops.h"

#include <math.h>

void rmsnorm_scalar(float *out, const float *x, const float *w, int n, float eps) {
    double ss = 0.0;   // double: the sum of squares of a few thousand values, once per row
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float scale = (float)(1.0 / sqrt(ss / n + eps));
    for (int i = 0; i < n; i++) out[i] = x[i] * scale * w[i];
}

void swiglu_scalar(float *out, const float *gate, const float *up, int n) {
    for (int i = 0; i < n; i++) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

#if defined(__x86_64__) || defined(__i386__)
#include "cpu/simd-avx2.h"

static AVX2_TGT void rmsnorm_avx2(float *out, const float *x, const float *w, int n, float eps) {
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256d lo = _mm256_cvtps_pd(_mm_loadu_ps(x + i)), hi = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
        a0 = _mm256_fmadd_pd(lo, lo, a0);
        a1 = _mm256_fmadd_pd(hi, hi, a1);
    }
    const __m256d a = _mm256_add_pd(a0, a1);
    const __m128d h = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    double ss = _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
    for (int j = i; j < n; j++) ss += (double)x[j] * x[j];
    const float scale = (float)(1.0 / sqrt(ss / n + eps));
    const __m256 vs = _mm256_set1_ps(scale);
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vs), _mm256_loadu_ps(w + i)));
    for (; i < n; i++) out[i] = x[i] * scale * w[i];
}

static AVX2_TGT void swiglu_avx2(float *out, const float *gate, const float *up, int n) {
    const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp_ps(_mm256_xor_ps(g, neg))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
    swiglu_scalar(out + i, gate + i, up + i, n - i);
}

void rmsnorm(float *out, const float *x, const float *w, int n, float eps) {
    if (cpu_has_avx2()) rmsnorm_avx2(out, x, w, n, eps);
    else rmsnorm_scalar(out, x, w, n, eps);
}

void swiglu(float *out, const float *gate, const float *up, int n) {
    if (cpu_has_avx2()) swiglu_avx2(out, gate, up, n);
    else swiglu_scalar(out, gate, up, n);
}
#else
void rmsnorm(float *out, const float *x, const float *w, int n, float eps) { rmsnorm_scalar(out, x, w, n, eps); }
void swiglu(float *out, const float *gate, const float *up, int n) { swiglu_scalar(out, gate, up, n); }
#endif
