// softmax.c - softmax over a row, with an AVX2 exponential for the long rows of attention.
//
// Attention at long context spends much of its time in exp(): a prefill chunk of 512 tokens
// at depth 8K takes 9 heads x 512 x 8K exponentials per layer. The AVX2 version computes
// eight at a time: exp(x) = 2^n e^r with n = round(x / ln 2), r = x - n ln 2 (ln 2 split in
// two parts so r is exact), e^r from the Cephes degree-5 polynomial (relative error about
// 1e-7, as expf), and 2^n put straight into the exponent bits. Inputs below -87.3 give 0.
#include "ops.h"

#include <math.h>

void softmax_scalar(float *x, int n) {
    float max = x[0];
    for (int i = 1; i < n; i++) if (x[i] > max) max = x[i];
    double sum = 0.0;   // a long row's float sum would drift by ~sqrt(n) ulps
    for (int i = 0; i < n; i++) { x[i] = expf(x[i] - max); sum += x[i]; }
    const float inv = (float)(1.0 / sum);
    for (int i = 0; i < n; i++) x[i] *= inv;
}

#if defined(__x86_64__) || defined(__i386__)
#include "simd-avx2.h"

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

static AVX2_TGT void softmax_avx2(float *x, int n) {
    int i = 0;
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + i));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    float max = _mm_cvtss_f32(m);
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

    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
    for (; i < n; i++) x[i] *= 1.0f / sum;
}

static int have_avx2(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

void softmax(float *x, int n) {
    if (n >= 8 && have_avx2()) softmax_avx2(x, n);
    else softmax_scalar(x, n);
}
#else
void softmax(float *x, int n) { softmax_scalar(x, n); }
#endif
