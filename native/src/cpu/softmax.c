// softmax.c - softmax over a row, with an AVX2 exponential for the long rows of attention.
//
// Attention at long context spends much of its time in exp(): a prefill chunk of 512 tokens
// at depth 8K takes 9 heads x 512 x 8K exponentials per layer. The AVX2 version computes
// eight at a time (exp_ps in simd-avx2.h): exp(x) = 2^n e^r with n = round(x / ln 2),
// r = x - n ln 2 (ln 2 split in two parts so r is exact), e^r from the Cephes degree-5
// polynomial (relative error about 1e-7, as expf), and 2^n put straight into the exponent
// bits. Inputs below -87.3 give 0.
#include "cpu/ops.h"

#include <math.h>

static float row_max(const float *x, int n) {
    float max = x[0];
    for (int i = 1; i < n; i++) if (x[i] > max) max = x[i];
    return max;
}

float softmax_exp_scalar(float *x, int n, float *max_out) {
    const float max = row_max(x, n);
    double sum = 0.0;   // a long row's float sum would drift by ~sqrt(n) ulps
    for (int i = 0; i < n; i++) { x[i] = expf(x[i] - max); sum += x[i]; }
    *max_out = max;
    return (float)sum;
}

void softmax_scalar(float *x, int n) {
    float max;
    const float inv = 1.0f / softmax_exp_scalar(x, n, &max);
    for (int i = 0; i < n; i++) x[i] *= inv;
}

#if defined(__x86_64__) || defined(__i386__)
#include "cpu/simd-avx2.h"

static AVX2_TGT float softmax_exp_avx2(float *x, int n, float *max_out) {
    int i = 0;
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + i));
    float max = hmax_ps(vmax);
    for (; i < n; i++) if (x[i] > max) max = x[i];

    const __m256 vm = _mm256_set1_ps(max);
    __m256 vsum = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
        const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
        _mm256_storeu_ps(x + i, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum_ps(vsum);
    for (; i < n; i++) { x[i] = expf(x[i] - max); sum += x[i]; }
    *max_out = max;
    return sum;
}

static AVX2_TGT void scale_avx2(float *x, int n, float s) {
    const __m256 vs = _mm256_set1_ps(s);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vs));
    for (; i < n; i++) x[i] *= s;
}

float softmax_exp(float *x, int n, float *max_out) {
    return n >= 8 && cpu_has_avx2() ? softmax_exp_avx2(x, n, max_out) : softmax_exp_scalar(x, n, max_out);
}

void softmax(float *x, int n) {
    if (n >= 8 && cpu_has_avx2()) {
        float max;
        scale_avx2(x, n, 1.0f / softmax_exp_avx2(x, n, &max));
    } else {
        softmax_scalar(x, n);
    }
}
#else
float softmax_exp(float *x, int n, float *max_out) { return softmax_exp_scalar(x, n, max_out); }
void softmax(float *x, int n) { softmax_scalar(x, n); }
#endif
