// gemm-q8.c - the integer products of packed weight rows with packed activation rows
// (gemm-q8.h): a scalar reference, an AVX2 kernel that takes GEMM_Q8_R rows x GEMM_Q8_C
// tokens per step so that each loaded vector serves several multiply-adds, and the choice
// between them and the VNNI kernel (gemm-q8-vnni.c).
#include "cpu/gemm-q8.h"

#if defined(__x86_64__) || defined(__i386__)
#include "cpu/simd-avx2.h"
#define GEMM_Q8_X86 1
#endif

static float dot_packed_scalar(const pk_weight *w, const pk_act *x, int64_t n_super) {
    float sum = 0.0f;
    for (int64_t s = 0; s < n_super; s++, w++, x++) {
        int32_t lane[16] = { 0 };   // sum(q * qx) per sub-block
        for (int b = 0; b < PK_ELEMS; b++) lane[(b % 32) / 2] += (int32_t)w->q[b] * x->q[b];
        for (int g = 0; g < 8; g++) {
            const int32_t i1 = w->sc[2 * g] * lane[2 * g] + w->sc[2 * g + 1] * lane[2 * g + 1];
            const int32_t i2 = w->mn[2 * g] * x->bsum[2 * g] + w->mn[2 * g + 1] * x->bsum[2 * g + 1];
            sum += x->dx[g] * (w->dw[g] * (float)i1 - w->dm[g] * (float)i2);
        }
    }
    return sum;
}

// A short last super-block's bytes past its width are zero in both operands (quant-pack.c).
void gemm_q8_rows_scalar(const pk_weight *W, int n_rows, const pk_act *X, int T, int64_t cols, float *out,
                         int64_t stride) {
    const int64_t n_super = pk_blocks(cols);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < n_rows; i++)
            out[t * stride + i] = dot_packed_scalar(W + i * n_super, X + t * n_super, n_super);
}

#ifdef GEMM_Q8_X86
#define GEMM_Q8_R 2
#define GEMM_Q8_C 3

// One super-block (nv vectors of it: 8, or fewer for a row's short last one) of R rows x C
// tokens into acc; `run` vectors' products add up in int16 before each scale multiply.
static inline __attribute__((always_inline)) AVX2_TGT void
super_block_avx2(const pk_weight *const *w, const pk_act *const *x, const int nv, const int R, const int C,
                 const int run, __m256 acc[GEMM_Q8_R][GEMM_Q8_C]) {
    __m256i i1[GEMM_Q8_R][GEMM_Q8_C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) i1[r][c] = _mm256_setzero_si256();
    for (int v0 = 0; v0 < nv; v0 += run) {
        const int v1 = v0 + run < nv ? v0 + run : nv;
        __m256i a16[GEMM_Q8_R][GEMM_Q8_C];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) a16[r][c] = _mm256_setzero_si256();
        // Not unrolled: unrolled, the compiler computes every product first and spills them.
#pragma GCC unroll 1
        for (int v = v0; v < v1; v++) {
            __m256i wv[GEMM_Q8_R];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) wv[r] = _mm256_loadu_si256((const __m256i *)(w[r]->q + 32 * v));
#pragma GCC unroll 4
            for (int c = 0; c < C; c++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(x[c]->q + 32 * v));
                __asm__("" : "+x"(xv));   // one load per token, not one per row
#pragma GCC unroll 4
                for (int r = 0; r < R; r++)
                    a16[r][c] = _mm256_add_epi16(a16[r][c], _mm256_maddubs_epi16(wv[r], xv));
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256i sc = _mm256_loadu_si256((const __m256i *)w[r]->sc);
            for (int c = 0; c < C; c++) i1[r][c] = _mm256_add_epi32(i1[r][c], _mm256_madd_epi16(a16[r][c], sc));
        }
    }
    for (int r = 0; r < R; r++) {
        const __m256 dw = _mm256_loadu_ps(w[r]->dw), dm = _mm256_loadu_ps(w[r]->dm);
        const __m256i mn = _mm256_loadu_si256((const __m256i *)w[r]->mn);
        for (int c = 0; c < C; c++) {
            const __m256i i2 = _mm256_madd_epi16(mn, _mm256_loadu_si256((const __m256i *)x[c]->bsum));
            const __m256 t = _mm256_fmsub_ps(_mm256_cvtepi32_ps(i1[r][c]), dw,
                                             _mm256_mul_ps(_mm256_cvtepi32_ps(i2), dm));
            acc[r][c] = _mm256_fmadd_ps(t, _mm256_loadu_ps(x[c]->dx), acc[r][c]);
        }
    }
}

// R rows x C tokens over n_super super-blocks, the last of them last_nv vectors long. Inlined
// with constant R, C and run, and the whole super-blocks apart from a short last one, so that
// the accumulators stay in registers and the whole blocks' loops have constant bounds.
static inline __attribute__((always_inline)) AVX2_TGT void
tile_avx2(const pk_weight *W, const pk_act *X, int64_t n_super, int last_nv, const int R, const int C,
          const int run, float *out, int64_t stride) {
    __m256 acc[GEMM_Q8_R][GEMM_Q8_C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    const pk_weight *w[GEMM_Q8_R];
    const pk_act *x[GEMM_Q8_C];
    const int64_t n_whole = last_nv == 8 ? n_super : n_super - 1;
    for (int64_t s = 0; s < n_super; s++) {
        for (int r = 0; r < R; r++) w[r] = W + r * n_super + s;
        for (int c = 0; c < C; c++) x[c] = X + c * n_super + s;
        if (s < n_whole) super_block_avx2(w, x, 8, R, C, run, acc);
        else             super_block_avx2(w, x, last_nv, R, C, run, acc);
    }
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) out[c * stride + r] = hsum_ps(acc[r][c]);
}

#define TILE_FOR_RUN(R, C)                                                                       \
    AVX2_TGT static void tile_##R##x##C(const pk_weight *W, const pk_act *X, int64_t n, int last_nv, int run, \
                                        float *out, int64_t stride) {                            \
        if (run >= 8) tile_avx2(W, X, n, last_nv, R, C, 8, out, stride);                         \
        else if (run >= 4) tile_avx2(W, X, n, last_nv, R, C, 4, out, stride);                    \
        else tile_avx2(W, X, n, last_nv, R, C, 2, out, stride);   /* the shortest run (Q6_K) */   \
    }
TILE_FOR_RUN(2, 3)
TILE_FOR_RUN(1, 1)

// Tokens in tiles that stay in L2 while each pair of rows passes over them.
#define GEMM_Q8_TOKEN_TILE 24

AVX2_TGT static void gemm_q8_avx2(const pk_weight *W, int n_rows, const pk_act *X, int T, int64_t n_super,
                                  int last_nv, int run, float *out, int64_t stride) {
    for (int t0 = 0; t0 < T; t0 += GEMM_Q8_TOKEN_TILE) {
        const int nt = T - t0 < GEMM_Q8_TOKEN_TILE ? T - t0 : GEMM_Q8_TOKEN_TILE;
        for (int i = 0; i < n_rows; i += GEMM_Q8_R) {
            const pk_weight *w = W + i * n_super;
            int t = t0;
            if (i + GEMM_Q8_R <= n_rows)
                for (; t + GEMM_Q8_C <= t0 + nt; t += GEMM_Q8_C)
                    tile_2x3(w, X + t * n_super, n_super, last_nv, run, out + t * stride + i, stride);
            for (; t < t0 + nt; t++)
                for (int r = i; r < n_rows && r < i + GEMM_Q8_R; r++)
                    tile_1x1(W + r * n_super, X + t * n_super, n_super, last_nv, run, out + t * stride + r, stride);
        }
    }
}
#endif

int gemm_q8_rows_avx2(const pk_weight *W, int n_rows, const pk_act *X, int T, int64_t cols, int run, float *out,
                      int64_t stride) {
#ifdef GEMM_Q8_X86
    if (run > 0 && cpu_has_avx2()) {
        gemm_q8_avx2(W, n_rows, X, T, pk_blocks(cols), pk_tail_width(cols) / 32, run, out, stride);
        return 1;
    }
#endif
    return 0;
}

void gemm_q8_rows(const pk_weight *W, int n_rows, const pk_act *X, int T, int64_t cols, int32_t type, float *out,
                  int64_t stride) {
    if (gemm_q8_unit_scales(type) && gemm_q8_rows_vnni(W, n_rows, X, T, cols, out, stride)) return;
    if (gemm_q8_rows_avx2(W, n_rows, X, T, cols, gemm_q8_run(type), out, stride)) return;
    gemm_q8_rows_scalar(W, n_rows, X, T, cols, out, stride);
}
