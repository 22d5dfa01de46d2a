// matvec.cu - the matrix product for a few activation rows (decode steps, short chunks):
// out[t][r] = sum_c x[t][c] * W[r][c] for T <= CUDA_MATVEC_MAX_T rows at a time.
//
// Quantised weights: the activation rows are first quantised to Q8_1 blocks of 32 in `work`
// (quantize_q8_1_kernel, one thread per block), then one warp per weight row walks the row's
// 32-value groups, lane l taking groups l, l + 32, ... (mv_q8_lane, matmul-tiles.cuh): each
// group is unpacked once (quant-blocks.cuh) and its integer dot product taken with the same
// group of every one of the T activation rows, so the weight row is read once for all of
// them. F32/F16/BF16 weights take a float path instead (mv_f_lane: lane l takes values l,
// l + 32, ... of the row, x read as floats). Larger T is done CUDA_MATVEC_MAX_T rows at a
// time, reusing `work`. Launch: 4 warps (rows) per block of 128 threads.
#include "common.cuh"
#include "matmul-tiles.cuh"

#define MV_WARPS 4   // weight rows (warps) per thread block

// y: n_blocks blocks of 32 activations of x (the T rows back to back, cols a multiple of 32).
static __global__ void __launch_bounds__(256) quantize_q8_1_kernel(const float *__restrict__ x, dev_block_q8_1 *__restrict__ y,
                                                            int64_t n_blocks) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_blocks) return;
    q8_1_quantize_block(x + 32 * i, y + i);
}

// a: T rows of n_groups activation blocks. T <= CUDA_MATVEC_MAX_T.
template <class Q>
static __global__ void __launch_bounds__(MV_WARPS * CUDA_WARP)
matvec_q8_kernel(float *__restrict__ out, const uint8_t *__restrict__ w, int64_t row_bytes, int n_groups, int64_t rows,
                 const dev_block_q8_1 *__restrict__ a, int T) {
    const int lane = threadIdx.x % CUDA_WARP;
    const int64_t r = (int64_t)blockIdx.x * MV_WARPS + threadIdx.x / CUDA_WARP;
    if (r >= rows) return;   // the whole warp: the shuffles below see all 32 lanes
    const uint8_t *row = w + r * row_bytes;

    float acc[CUDA_MATVEC_MAX_T];
#pragma unroll
    for (int t = 0; t < CUDA_MATVEC_MAX_T; t++) acc[t] = 0.0f;

    mv_q8_lane<Q>(row, a, n_groups, lane, T, acc);
#pragma unroll
    for (int t = 0; t < CUDA_MATVEC_MAX_T; t++) {
        if (t < T) {
            const float v = warp_sum(acc[t]);
            if (lane == 0) out[(int64_t)t * rows + r] = v;
        }
    }
}

// Float weights, any cols. T <= CUDA_MATVEC_MAX_T.
template <class F>
static __global__ void __launch_bounds__(MV_WARPS * CUDA_WARP)
matvec_f_kernel(float *__restrict__ out, const uint8_t *__restrict__ w, int64_t cols, int64_t rows,
                const float *__restrict__ x, int T) {
    const int lane = threadIdx.x % CUDA_WARP;
    const int64_t r = (int64_t)blockIdx.x * MV_WARPS + threadIdx.x / CUDA_WARP;
    if (r >= rows) return;
    const void *row = w + r * cols * F::ELEM_BYTES;

    float acc[CUDA_MATVEC_MAX_T];
#pragma unroll
    for (int t = 0; t < CUDA_MATVEC_MAX_T; t++) acc[t] = 0.0f;

    mv_f_lane<F>(row, x, cols, lane, T, acc);
#pragma unroll
    for (int t = 0; t < CUDA_MATVEC_MAX_T; t++) {
        if (t < T) {
            const float v = warp_sum(acc[t]);
            if (lane == 0) out[(int64_t)t * rows + r] = v;
        }
    }
}

template <class Q>
static void launch_q(cuda_stream s, float *out, const void *w, int64_t cols, int64_t rows, const float *x, int T,
                     dev_block_q8_1 *work) {
    if (cols % Q::QK != 0) return;   // not a whole number of blocks: not a row of this type
    const int n_groups = (int)(cols / 32);
    const int64_t row_bytes = cols / Q::QK * Q::BYTES;
    for (int t0 = 0; t0 < T; t0 += CUDA_MATVEC_MAX_T) {
        const int tc = T - t0 < CUDA_MATVEC_MAX_T ? T - t0 : CUDA_MATVEC_MAX_T;
        const int64_t n_blocks = (int64_t)tc * n_groups;
        quantize_q8_1_kernel<<<cuda_blocks_for(n_blocks, 256), 256, 0, s>>>(x + (int64_t)t0 * cols, work, n_blocks);
        matvec_q8_kernel<Q><<<cuda_blocks_for(rows, MV_WARPS), MV_WARPS * CUDA_WARP, 0, s>>>(
            out + (int64_t)t0 * rows, (const uint8_t *)w, row_bytes, n_groups, rows, work, tc);
    }
}

template <class F>
static void launch_f(cuda_stream s, float *out, const void *w, int64_t cols, int64_t rows, const float *x, int T) {
    for (int t0 = 0; t0 < T; t0 += CUDA_MATVEC_MAX_T) {
        const int tc = T - t0 < CUDA_MATVEC_MAX_T ? T - t0 : CUDA_MATVEC_MAX_T;
        matvec_f_kernel<F><<<cuda_blocks_for(rows, MV_WARPS), MV_WARPS * CUDA_WARP, 0, s>>>(
            out + (int64_t)t0 * rows, (const uint8_t *)w, cols, rows, x + (int64_t)t0 * cols, tc);
    }
}

extern "C" void cuda_matvec_q8(cuda_stream s, float *out, const void *w, int32_t type, int64_t cols, int64_t rows,
                               const float *x, int T, void *work) {
    if (T <= 0 || rows <= 0) return;
    dev_block_q8_1 *a = (dev_block_q8_1 *)work;
    switch (type) {
    case PYKV_TYPE_F32:  launch_f<ft_f32>(s, out, w, cols, rows, x, T); break;
    case PYKV_TYPE_F16:  launch_f<ft_f16>(s, out, w, cols, rows, x, T); break;
    case PYKV_TYPE_BF16: launch_f<ft_bf16>(s, out, w, cols, rows, x, T); break;
    case PYKV_TYPE_Q4_0: launch_q<qt_q4_0>(s, out, w, cols, rows, x, T, a); break;
    case PYKV_TYPE_Q4_1: launch_q<qt_q4_1>(s, out, w, cols, rows, x, T, a); break;
    case PYKV_TYPE_Q5_0: launch_q<qt_q5_0>(s, out, w, cols, rows, x, T, a); break;
    case PYKV_TYPE_Q5_1: launch_q<qt_q5_1>(s, out, w, cols, rows, x, T, a); break;
    case PYKV_TYPE_Q8_0: launch_q<qt_q8_0>(s, out, w, cols, rows, x, T, a); break;
    case PYKV_TYPE_Q4_K: launch_q<qt_q4_K>(s, out, w, cols, rows, x, T, a); break;
    case PYKV_TYPE_Q5_K: launch_q<qt_q5_K>(s, out, w, cols, rows, x, T, a); break;
    case PYKV_TYPE_Q6_K: launch_q<qt_q6_K>(s, out, w, cols, rows, x, T, a); break;
    default: break;   // cuda_matmul_supported says which types there are
    }
}
