// matmul-tiles.cuh - the per-thread pieces of the matrix kernels (matvec.cu, matmul.cu): one
// lane's share of a weight row's dot products, and the loading and storing of the tensor-core
// kernel's tiles, each given its thread index. They are __host__ __device__, so that
// tests/c/test_cuda_blocks.cu runs them on the CPU for every thread of a launch and checks
// the kernels' indexing (tails included) without a GPU.
#pragma once
#include "quant-blocks.cuh"

// ---- the few-row path (matvec.cu): lane `lane` of the warp of a weight row ----

// Groups lane, lane + 32, ... of a row of n_groups 32-value groups, against the same groups
// of T activation rows (a: T rows of n_groups Q8_1 blocks): acc[t] += their dot products.
template <class Q>
static __host__ __device__ __forceinline__ void mv_q8_lane(const uint8_t *row, const dev_block_q8_1 *a, int n_groups,
                                                           int lane, int T, float acc[CUDA_MATVEC_MAX_T]) {
    for (int gi = lane; gi < n_groups; gi += CUDA_WARP) {
        qgroup wg;
        Q::unpack(row + (int64_t)(gi / Q::GROUPS) * Q::BYTES, gi % Q::GROUPS, wg);
        QB_UNROLL
        for (int t = 0; t < CUDA_MATVEC_MAX_T; t++) {
            if (t < T) {
                const dev_block_q8_1 *ab = a + (int64_t)t * n_groups + gi;
                int32_t aq[8];
                q8_1_words(ab, aq);
                acc[t] += qgroup_dot_q8_1(wg, aq, ab->d, ab->s);
            }
        }
    }
}

// Float weights: values lane, lane + 32, ... of a row of cols, against T rows of x.
template <class F>
static __host__ __device__ __forceinline__ void mv_f_lane(const void *row, const float *x, int64_t cols, int lane,
                                                          int T, float acc[CUDA_MATVEC_MAX_T]) {
    for (int64_t c = lane; c < cols; c += CUDA_WARP) {
        const float wv = F::at(row, c);
        QB_UNROLL
        for (int t = 0; t < CUDA_MATVEC_MAX_T; t++)
            if (t < T) acc[t] += wv * x[(int64_t)t * cols + c];
    }
}

// ---- the tensor-core path (matmul.cu) ----

#define MM_TM 64            // activation rows (T) per tile
#define MM_TN 64            // weight rows per tile
#define MM_TK 64            // columns per step
#define MM_THREADS 128      // 4 warps, 2 x 2 of 32 x 32
#define MM_LDH (MM_TK + 8)  // row stride (halves) of the f16 tiles: 144 bytes, keeps wmma's 32-byte
                            // fragment alignment and spreads the rows over the banks
#define MM_LDC (MM_TN + 4)  // row stride (floats) of the output tile

// ws[n][k] = W[r0 + n][k0 + k] in f16, zero outside the matrix. Quantised types: thread tid
// decodes group k0 / 32 + tid % 2 of weight row r0 + tid / 2 (cols is a multiple of 32, so a
// group is wholly inside or wholly outside).
template <class Q>
static __host__ __device__ __forceinline__ void mm_load_w_tile(half *ws, const uint8_t *w, int64_t row_bytes,
                                                               int64_t cols, int64_t rows, int64_t r0, int64_t k0,
                                                               int tid) {
    const int n = tid >> 1, sub = tid & 1;
    const int64_t r = r0 + n, gi = k0 / 32 + sub;
    half2 *dst = (half2 *)(ws + n * MM_LDH + 32 * sub);
    if (r < rows && gi < cols / 32) {
        qgroup g;
        Q::unpack(w + r * row_bytes + gi / Q::GROUPS * Q::BYTES, (int)(gi % Q::GROUPS), g);
        float y[32];
        qgroup_decode(g, y);
        QB_UNROLL
        for (int j = 0; j < 16; j++) dst[j] = __floats2half2_rn(y[2 * j], y[2 * j + 1]);
    } else {
        const half2 z = __floats2half2_rn(0.0f, 0.0f);
        QB_UNROLL
        for (int j = 0; j < 16; j++) dst[j] = z;
    }
}

// s[n][k] = M[r0 + n][k0 + k] in f16 for a tile of ROWS x MM_TK, zero outside the matrix M
// (n_rows rows of cols values of float type F at m): element e = i * MM_THREADS + tid of the
// tile, so consecutive threads read consecutive values of a row.
template <class F, int ROWS>
static __host__ __device__ __forceinline__ void mm_load_tile_f(half *s, const uint8_t *m, int64_t cols, int64_t n_rows,
                                                               int64_t r0, int64_t k0, int tid) {
    for (int i = 0; i < ROWS * MM_TK / MM_THREADS; i++) {
        const int e = i * MM_THREADS + tid, n = e / MM_TK, k = e % MM_TK;
        const int64_t r = r0 + n, c = k0 + k;
        const float v = r < n_rows && c < cols ? F::at(m + r * cols * F::ELEM_BYTES, c) : 0.0f;
        s[n * MM_LDH + k] = __float2half_rn(v);
    }
}

// The weight tile for a float type (any cols).
template <class F>
static __host__ __device__ __forceinline__ void mm_load_w_tile_f(half *ws, const uint8_t *w, int64_t cols, int64_t rows,
                                                                 int64_t r0, int64_t k0, int tid) {
    mm_load_tile_f<F, MM_TN>(ws, w, cols, rows, r0, k0, tid);
}

// The activations as the tensor-core path reads them: each row of x in f16, mm_ld(cols) values
// apart, zeros past cols, so that a step of MM_TK columns never crosses a row's end. They are
// made once per product (matmul.cu's f16 rows kernel: values 2j and 2j + 1 of each row per
// thread, mm_f16_pair), not once per tile of weight rows.
static __host__ __device__ __forceinline__ int64_t mm_ld(int64_t cols) { return (cols + MM_TK - 1) / MM_TK * MM_TK; }

static __host__ __device__ __forceinline__ void mm_f16_pair(half2 *row_h, const float *row, int64_t cols, int64_t j) {
    const int64_t c = 2 * j;
    row_h[j] = __floats2half2_rn(c < cols ? row[c] : 0.0f, c + 1 < cols ? row[c + 1] : 0.0f);
}

// xs[m][k] = xh[t0 + m][k0 + k] (rows of ld halves, as above), zero for rows past T: 16 bytes a
// copy, MM_TK / 8 copies a row.
static __host__ __device__ __forceinline__ void mm_load_x_tile(half *xs, const half *xh, int64_t ld, int T, int64_t t0,
                                                               int64_t k0, int tid) {
    for (int i = 0; i < MM_TM * MM_TK / 8 / MM_THREADS; i++) {
        const int e = i * MM_THREADS + tid, m = e / (MM_TK / 8), part = e % (MM_TK / 8);
        const half *src = xh + (t0 + m) * ld + k0 + 8 * part;
        half *dst = xs + m * MM_LDH + 8 * part;
        uint4 v = { 0u, 0u, 0u, 0u };
#ifdef __CUDA_ARCH__
        if (t0 + m < T) v = *(const uint4 *)src;
        *(uint4 *)dst = v;
#else   // the host twin (tests/c/test_cuda_blocks.cu), without the aliasing
        if (t0 + m < T) memcpy(&v, src, sizeof(v));
        memcpy(dst, &v, sizeof(v));
#endif
    }
}

// out[t0 + m][r0 + n] = cs[m][n] for the part of the tile inside T x rows (out: T rows of
// `rows`); consecutive threads write consecutive outputs of a row.
static __host__ __device__ __forceinline__ void mm_store_tile(float *out, const float *cs, int64_t rows, int T,
                                                              int64_t t0, int64_t r0, int tid) {
    for (int i = 0; i < MM_TM * MM_TN / MM_THREADS; i++) {
        const int e = i * MM_THREADS + tid, m = e / MM_TN, n = e % MM_TN;
        const int64_t t = t0 + m, r = r0 + n;
        if (t < T && r < rows) out[t * rows + r] = cs[m * MM_LDC + n];
    }
}
