// gemm.c - register-blocked float32 dot products for prefill: 4 weight rows x 3 tokens per
// step share their loads (12 AVX2 accumulators), instead of one row-token pair at a time.
#include "cpu/gemm.h"
#include "cpu/quant.h"

#if defined(__x86_64__) || defined(__i386__)
#include "cpu/simd-avx2.h"
#define GEMM_X86 1
#endif

static void gemm_generic(const float *W, int n_rows, const float *X, int T, int K, float *out, int64_t stride) {
    for (int t = 0; t < T; t++)
        for (int i = 0; i < n_rows; i++)
            out[t * stride + i] = dot_f32(W + (int64_t)i * K, X + (int64_t)t * K, K);
}

#ifdef GEMM_X86
AVX2_TGT
static void gemm_4x3_avx2(const float *W, const float *X, int K, float *out, int64_t stride) {
    __m256 acc[4][3];
    for (int i = 0; i < 4; i++)
        for (int t = 0; t < 3; t++) acc[i][t] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 8) {
        __m256 x0 = _mm256_loadu_ps(X + k), x1 = _mm256_loadu_ps(X + K + k), x2 = _mm256_loadu_ps(X + 2 * K + k);
        for (int i = 0; i < 4; i++) {
            __m256 w = _mm256_loadu_ps(W + (int64_t)i * K + k);
            acc[i][0] = _mm256_fmadd_ps(w, x0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(w, x1, acc[i][1]);
            acc[i][2] = _mm256_fmadd_ps(w, x2, acc[i][2]);
        }
    }
    for (int t = 0; t < 3; t++)
        for (int i = 0; i < 4; i++) out[t * stride + i] = hsum_ps(acc[i][t]);
}

// Tokens are taken in tiles small enough to stay in L2 while every row block passes over them.
#define GEMM_TOKEN_TILE 24

AVX2_TGT
static void gemm_avx2(const float *W, int n_rows, const float *X, int T, int K, float *out, int64_t stride) {
    for (int t0 = 0; t0 < T; t0 += GEMM_TOKEN_TILE) {
        int nt = T - t0 < GEMM_TOKEN_TILE ? T - t0 : GEMM_TOKEN_TILE;
        const float *Xt = X + (int64_t)t0 * K;
        float *ot = out + t0 * stride;
        int i = 0;
        for (; i + 4 <= n_rows; i += 4) {
            int t = 0;
            for (; t + 3 <= nt; t += 3) gemm_4x3_avx2(W + (int64_t)i * K, Xt + (int64_t)t * K, K, ot + t * stride + i, stride);
            if (t < nt) gemm_generic(W + (int64_t)i * K, 4, Xt + (int64_t)t * K, nt - t, K, ot + t * stride + i, stride);
        }
        if (i < n_rows) gemm_generic(W + (int64_t)i * K, n_rows - i, Xt, nt, K, ot + i, stride);
    }
}
#endif

void gemm_rows_f32(const float *W, int n_rows, const float *X, int T, int K, float *out, int64_t out_stride) {
#ifdef GEMM_X86
    if (K % 8 == 0 && cpu_has_avx2()) {
        gemm_avx2(W, n_rows, X, T, K, out, out_stride);
        return;
    }
#endif
    gemm_generic(W, n_rows, X, T, K, out, out_stride);
}
