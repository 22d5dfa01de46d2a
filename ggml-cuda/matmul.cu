// matmul.cu - the matrix product for many activation rows (prefill chunks) on the tensor
// cores, and cuda_matmul, which picks between it and the few-row path of matvec.cu.
//
// cuda_matmul_mma: out (T x rows) = x (T x cols) . W^T. x is first converted to f16 rows, once
// (mm_ld in matmul-tiles.cuh), in the work buffer. A thread block of 4 warps computes a
// 64 x 64 tile of out (64 activation rows by 64 weight rows); each warp a 32 x 32 quarter as
// 2 x 2 wmma 16x16x16 products, f16 inputs with f32 accumulation. Per step of 64 columns the
// block stages in shared memory the x tile, copied 16 bytes at a time, and the W tile decoded
// to f16 (quantised types: each of the 128 threads decodes one 32-value group); rows past T or
// `rows` and columns past `cols` are zeros there, and only the tile's part inside out is
// written, through shared memory.
#include <mma.h>

#include "common.cuh"
#include "matmul-tiles.cuh"

#define F16_ROWS_THREADS 256

// Q: a quant type struct (qt_*) when FLOAT_W is 0, a float one (ft_*) when it is 1.
template <class Q, int FLOAT_W>
static __global__ void __launch_bounds__(MM_THREADS)
matmul_mma_kernel(float *__restrict__ out, const uint8_t *__restrict__ w, int64_t row_bytes, int64_t cols, int64_t rows,
                  const half *__restrict__ xh, int T) {
    using namespace nvcuda;
    __shared__ __align__(128) half xs[MM_TM * MM_LDH];
    __shared__ __align__(128) half ws[MM_TN * MM_LDH];
    __shared__ __align__(128) float cs[MM_TM * MM_LDC];

    const int64_t r0 = (int64_t)blockIdx.x * MM_TN, t0 = (int64_t)blockIdx.y * MM_TM;
    const int warp = threadIdx.x / CUDA_WARP, wm = warp >> 1, wn = warp & 1;

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) wmma::fill_fragment(acc[i][j], 0.0f);

    for (int64_t k0 = 0; k0 < cols; k0 += MM_TK) {
        mm_load_x_tile(xs, xh, mm_ld(cols), T, t0, k0, threadIdx.x);
        if constexpr (FLOAT_W) mm_load_w_tile_f<Q>(ws, w, cols, rows, r0, k0, threadIdx.x);
        else                   mm_load_w_tile<Q>(ws, w, row_bytes, cols, rows, r0, k0, threadIdx.x);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < MM_TK; kk += 16) {
            // A = x (row-major, T x K); B = W^T (K x N), i.e. W's rows read column-major.
            wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> fa[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major> fb[2];
#pragma unroll
            for (int i = 0; i < 2; i++) wmma::load_matrix_sync(fa[i], xs + (wm * 32 + 16 * i) * MM_LDH + kk, MM_LDH);
#pragma unroll
            for (int j = 0; j < 2; j++) wmma::load_matrix_sync(fb[j], ws + (wn * 32 + 16 * j) * MM_LDH + kk, MM_LDH);
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 2; j++) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
            wmma::store_matrix_sync(cs + (wm * 32 + 16 * i) * MM_LDC + wn * 32 + 16 * j, acc[i][j], MM_LDC,
                                    wmma::mem_row_major);
    __syncthreads();
    mm_store_tile(out, cs, rows, T, t0, r0, threadIdx.x);
}

// Rows t = blockIdx.y, + gridDim.y, ... of x (T rows of cols floats) into the same rows of xh
// (rows of mm_ld(cols) halves), a pair of values per thread.
static __global__ void __launch_bounds__(F16_ROWS_THREADS)
f16_rows_kernel(half2 *__restrict__ xh, const float *__restrict__ x, int64_t cols, int T) {
    const int64_t j = (int64_t)blockIdx.x * F16_ROWS_THREADS + threadIdx.x, ld = mm_ld(cols);
    if (2 * j >= ld) return;
    for (int64_t t = blockIdx.y; t < T; t += gridDim.y) mm_f16_pair(xh + t * (ld / 2), x + t * cols, cols, j);
}

static void to_f16_rows(cuda_stream s, void *xh, const float *x, int64_t cols, int T) {
    const dim3 grid((unsigned)cuda_blocks_for(mm_ld(cols) / 2, F16_ROWS_THREADS), (unsigned)(T < 65535 ? T : 65535));
    f16_rows_kernel<<<grid, F16_ROWS_THREADS, 0, s>>>((half2 *)xh, x, cols, T);
}

template <class Q, int FLOAT_W>
static void launch_mma(cuda_stream s, float *out, const void *w, int64_t cols, int64_t rows, const void *xh, int T) {
    if constexpr (!FLOAT_W) {
        if (cols % Q::QK != 0) return;   // not a whole number of blocks: not a row of this type
    }
    const int64_t row_bytes = qtype_row_bytes(Q::TYPE, cols);
    const dim3 grid((unsigned)cuda_blocks_for(rows, MM_TN), (unsigned)cuda_blocks_for(T, MM_TM));
    matmul_mma_kernel<Q, FLOAT_W><<<grid, MM_THREADS, 0, s>>>(out, (const uint8_t *)w, row_bytes, cols, rows,
                                                              (const half *)xh, T);
}

// The tensor-core products from activations already in f16 rows (xh).
static void mma_from_f16(cuda_stream s, float *out, const void *w, int32_t type, int64_t cols, int64_t rows,
                         const void *xh, int T) {
    if (T <= 0 || rows <= 0) return;
    switch (type) {
    case PYKV_TYPE_F32:  launch_mma<ft_f32, 1>(s, out, w, cols, rows, xh, T); break;
    case PYKV_TYPE_F16:  launch_mma<ft_f16, 1>(s, out, w, cols, rows, xh, T); break;
    case PYKV_TYPE_BF16: launch_mma<ft_bf16, 1>(s, out, w, cols, rows, xh, T); break;
    case PYKV_TYPE_Q4_0: launch_mma<qt_q4_0, 0>(s, out, w, cols, rows, xh, T); break;
    case PYKV_TYPE_Q4_1: launch_mma<qt_q4_1, 0>(s, out, w, cols, rows, xh, T); break;
    case PYKV_TYPE_Q5_0: launch_mma<qt_q5_0, 0>(s, out, w, cols, rows, xh, T); break;
    case PYKV_TYPE_Q5_1: launch_mma<qt_q5_1, 0>(s, out, w, cols, rows, xh, T); break;
    case PYKV_TYPE_Q8_0: launch_mma<qt_q8_0, 0>(s, out, w, cols, rows, xh, T); break;
    case PYKV_TYPE_Q4_K: launch_mma<qt_q4_K, 0>(s, out, w, cols, rows, xh, T); break;
    case PYKV_TYPE_Q5_K: launch_mma<qt_q5_K, 0>(s, out, w, cols, rows, xh, T); break;
    case PYKV_TYPE_Q6_K: launch_mma<qt_q6_K, 0>(s, out, w, cols, rows, xh, T); break;
    default: break;
    }
}

extern "C" void cuda_matmul_mma(cuda_stream s, float *out, const void *w, int32_t type, int64_t cols, int64_t rows,
                                const float *x, int T, void *work) {
    if (T <= 0 || rows <= 0 || cols <= 0) return;
    to_f16_rows(s, work, x, cols, T);
    mma_from_f16(s, out, w, type, cols, rows, work, T);
}

extern "C" int cuda_matmul_supported(int32_t type) {
    switch (type) {
    case PYKV_TYPE_F32: case PYKV_TYPE_F16: case PYKV_TYPE_BF16:
    case PYKV_TYPE_Q4_0: case PYKV_TYPE_Q4_1: case PYKV_TYPE_Q5_0: case PYKV_TYPE_Q5_1: case PYKV_TYPE_Q8_0:
    case PYKV_TYPE_Q4_K: case PYKV_TYPE_Q5_K: case PYKV_TYPE_Q6_K:
        return 1;
    default:
        return 0;
    }
}

// The larger of the Q8_1 activations of up to CUDA_MATVEC_MAX_T rows (the few-row path does
// larger T that many rows at a time) and the tensor-core path's T rows of f16.
extern "C" size_t cuda_matmul_work_bytes(int64_t cols, int T) {
    if (cols <= 0 || T <= 0) return 0;
    const int64_t tc = T < CUDA_MATVEC_MAX_T ? T : CUDA_MATVEC_MAX_T;
    const size_t q8 = (size_t)tc * (size_t)((cols + 31) / 32) * sizeof(dev_block_q8_1);
    const size_t f16 = (size_t)T * (size_t)mm_ld(cols) * sizeof(half);
    return q8 > f16 ? q8 : f16;
}

extern "C" void cuda_matmul_stage(cuda_stream s, void *work, const float *x, int64_t cols, int T) {
    if (T <= 0 || cols <= 0) return;
    if (T <= CUDA_MATVEC_MAX_T) cuda_quantize_q8_1(s, work, x, cols, T);   // nothing when cols % 32 != 0
    else                        to_f16_rows(s, work, x, cols, T);
}

extern "C" void cuda_matmul_staged(cuda_stream s, float *out, const void *w, int32_t type, int64_t cols, int64_t rows,
                                   const float *x, int T, const void *work) {
    if (T > CUDA_MATVEC_MAX_T)            mma_from_f16(s, out, w, type, cols, rows, work, T);
    else if (cuda_type_quantised(type))   cuda_matvec_q8_pre(s, out, w, type, cols, rows, work, T, 0);
    else                                  cuda_matvec_q8(s, out, w, type, cols, rows, x, T, NULL);   // reads x
}

extern "C" void cuda_matmul(cuda_stream s, float *out, const void *w, int32_t type, int64_t cols, int64_t rows,
                            const float *x, int T, void *work) {
    if (T <= CUDA_MATVEC_MAX_T) cuda_matvec_q8(s, out, w, type, cols, rows, x, T, work);
    else                        cuda_matmul_mma(s, out, w, type, cols, rows, x, T, work);
}
