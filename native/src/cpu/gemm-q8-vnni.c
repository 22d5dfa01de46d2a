// gemm-q8-vnni.c - prefill's integer GEMM on CPUs with AVX-512 VNNI (gemm-q8.h). vpdpbusd on
// 256-bit vectors adds each four u8 x s8 products into an int32 lane, so a super-block's sums
// need no int16 stage (no run limit: 8-bit quants fit) and no scale multiply per sub-block:
// the unit-scale types only, whose lane k is group k. AVX-512VL's 32 vector registers hold a
// tile of VNNI_R rows x VNNI_C tokens, its integer and float accumulators both.
#include "cpu/gemm-q8.h"

#if defined(__x86_64__) || defined(__i386__)
#include "cpu/simd-avx2.h"

#define VNNI_TGT __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))
#define VNNI_R 4
#define VNNI_C 3

// One super-block (nv vectors of it: 8, or fewer for a row's short last one) of R rows x C
// tokens into acc. With sc = mn = 1 the offset term sums each int32 lane's two bsum, the
// same for every row.
static inline __attribute__((always_inline)) VNNI_TGT void
super_block_vnni(const pk_weight *const *w, const pk_act *const *x, const int nv, const int R, const int C,
                 __m256 acc[VNNI_R][VNNI_C]) {
    __m256i i1[VNNI_R][VNNI_C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) i1[r][c] = _mm256_setzero_si256();
    for (int v = 0; v < nv; v++) {
        __m256i wv[VNNI_R];
        for (int r = 0; r < R; r++) wv[r] = _mm256_loadu_si256((const __m256i *)(w[r]->q + 32 * v));
        for (int c = 0; c < C; c++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(x[c]->q + 32 * v));
            __asm__("" : "+v"(xv));   // one load per token, not one per row
            for (int r = 0; r < R; r++) i1[r][c] = _mm256_dpbusd_epi32(i1[r][c], wv[r], xv);
        }
    }
    __m256 bsum[VNNI_C];
    for (int c = 0; c < C; c++)
        bsum[c] = _mm256_cvtepi32_ps(
            _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)x[c]->bsum), _mm256_set1_epi16(1)));
    for (int r = 0; r < R; r++) {
        const __m256 dw = _mm256_loadu_ps(w[r]->dw), dm = _mm256_loadu_ps(w[r]->dm);
        for (int c = 0; c < C; c++) {
            const __m256 t = _mm256_fmsub_ps(_mm256_cvtepi32_ps(i1[r][c]), dw, _mm256_mul_ps(bsum[c], dm));
            acc[r][c] = _mm256_fmadd_ps(t, _mm256_loadu_ps(x[c]->dx), acc[r][c]);
        }
    }
}

// R rows x C tokens over n_super super-blocks, the last of them last_nv vectors long; inlined
// with constant R and C so that the accumulators stay in registers.
static inline __attribute__((always_inline)) VNNI_TGT void
tile_vnni(const pk_weight *W, const pk_act *X, int64_t n_super, int last_nv, const int R, const int C, float *out,
          int64_t stride) {
    __m256 acc[VNNI_R][VNNI_C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    const pk_weight *w[VNNI_R];
    const pk_act *x[VNNI_C];
    const int64_t n_whole = last_nv == 8 ? n_super : n_super - 1;
    for (int64_t s = 0; s < n_super; s++) {
        for (int r = 0; r < R; r++) w[r] = W + r * n_super + s;
        for (int c = 0; c < C; c++) x[c] = X + c * n_super + s;
        if (s < n_whole) super_block_vnni(w, x, 8, R, C, acc);
        else             super_block_vnni(w, x, last_nv, R, C, acc);
    }
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) out[c * stride + r] = hsum_ps(acc[r][c]);
}

#define VNNI_TILE(R, C)                                                                                   \
    VNNI_TGT static void vnni_##R##x##C(const pk_weight *W, const pk_act *X, int64_t n, int last_nv, float *out, \
                                        int64_t stride) {                                                 \
        tile_vnni(W, X, n, last_nv, R, C, out, stride);                                                   \
    }
VNNI_TILE(4, 3)
VNNI_TILE(4, 1)
VNNI_TILE(1, 1)

// Tokens in tiles that stay in L2 while each group of rows passes over them.
#define VNNI_TOKEN_TILE 24

VNNI_TGT static void gemm_vnni(const pk_weight *W, int n_rows, const pk_act *X, int T, int64_t n_super,
                               int last_nv, float *out, int64_t stride) {
    for (int t0 = 0; t0 < T; t0 += VNNI_TOKEN_TILE) {
        const int t1 = T - t0 < VNNI_TOKEN_TILE ? T : t0 + VNNI_TOKEN_TILE;
        int i = 0;
        for (; i + VNNI_R <= n_rows; i += VNNI_R) {
            const pk_weight *w = W + i * n_super;
            int t = t0;
            for (; t + VNNI_C <= t1; t += VNNI_C)
                vnni_4x3(w, X + t * n_super, n_super, last_nv, out + t * stride + i, stride);
            for (; t < t1; t++) vnni_4x1(w, X + t * n_super, n_super, last_nv, out + t * stride + i, stride);
        }
        for (; i < n_rows; i++)
            for (int t = t0; t < t1; t++)
                vnni_1x1(W + i * n_super, X + t * n_super, n_super, last_nv, out + t * stride + i, stride);
    }
}
#endif

int gemm_q8_has_vnni(void) {
#if defined(__x86_64__) || defined(__i386__)
    return cpu_has_avx2() && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

int gemm_q8_rows_vnni(const pk_weight *W, int n_rows, const pk_act *X, int T, int64_t cols, float *out,
                      int64_t stride) {
#if defined(__x86_64__) || defined(__i386__)
    if (gemm_q8_has_vnni()) {
        gemm_vnni(W, n_rows, X, T, pk_blocks(cols), pk_tail_width(cols) / 32, out, stride);
        return 1;
    }
#endif
    return 0;
}
