// matvec.cu - the matrix product for a few activation rows (decode steps, short chunks):
// out[t][r] = sum_c x[t][c] * W[r][c] for T <= CUDA_MATVEC_MAX_T rows at a time.
//
// Quantised weights: the activation rows are first quantised to Q8_1 blocks of 32
// (quantize_q8_1_kernel, one thread per block), then one warp per weight row walks the row's
// 32-value groups, lane l taking groups l, l + 32, ... (mv_q8_lane, matmul-tiles.cuh): each
// group is unpacked once (quant-blocks.cuh) and its integer dot product taken with the same
// group of every one of the T activation rows, so the weight row is read once for all of
// them. F32/F16/BF16 weights take a float path instead (mv_f_lane: lane l takes values l,
// l + 32, ... of the row, x read as floats). Larger T is done CUDA_MATVEC_MAX_T rows at a
// time. Launch: 4 warps (rows) per block of 128 threads.
//
// The two steps are also callable on their own for decode (kernels.h): cuda_quantize_q8_1
// writes the blocks of T rows (norm-quant.cu writes them fused with an RMSNorm or SwiGLU),
// cuda_matvec_q8_pre takes them, with out += instead of out = on request. cuda_matvec_q8
// runs the same two kernels, quantising into `work` one chunk of rows at a time.
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

// The end of weight row r's warp: acc[t] summed over the lanes, and out[t][r] = the sum for
// t < T (+= with accumulate; lane 0 is each output's one writer).
static __device__ __forceinline__ void mv_write_row(float *out, const float acc[CUDA_MATVEC_MAX_T], int64_t rows,
                                                    int64_t r, int T, int lane, int accumulate) {
#pragma unroll
    for (int t = 0; t < CUDA_MATVEC_MAX_T; t++) {
        if (t < T) {
            const float v = warp_sum(acc[t]);
            if (lane == 0) {
                float *o = out + (int64_t)t * rows + r;
                *o = accumulate ? *o + v : v;
            }
        }
    }
}

// a: T rows of n_groups activation blocks. T <= CUDA_MATVEC_MAX_T. With accumulate, out[t][r]
// += the product instead of =.
template <class Q>
static __global__ void __launch_bounds__(MV_WARPS * CUDA_WARP)
matvec_q8_kernel(float *__restrict__ out, const uint8_t *__restrict__ w, int64_t row_bytes, int n_groups, int64_t rows,
                 const dev_block_q8_1 *__restrict__ a, int T, int accumulate) {
    const int lane = threadIdx.x % CUDA_WARP;
    const int64_t r = (int64_t)blockIdx.x * MV_WARPS + threadIdx.x / CUDA_WARP;
    if (r >= rows) return;   // the whole warp: the shuffles below see all 32 lanes
    const uint8_t *row = w + r * row_bytes;

    float acc[CUDA_MATVEC_MAX_T];
#pragma unroll
    for (int t = 0; t < CUDA_MATVEC_MAX_T; t++) acc[t] = 0.0f;

    mv_q8_lane<Q>(row, a, n_groups, lane, T, acc);
    mv_write_row(out, acc, rows, r, T, lane, accumulate);
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
    mv_write_row(out, acc, rows, r, T, lane, 0);
}

// The quantised types, T rows in chunks of CUDA_MATVEC_MAX_T. With x (cuda_matvec_q8), each
// chunk of x is first quantised into work; without (cuda_matvec_q8_pre), the chunk's blocks
// are read from xq (T rows of cols / 32 blocks).
template <class Q>
static void launch_q(cuda_stream s, float *out, const void *w, int64_t cols, int64_t rows, const float *x,
                     const dev_block_q8_1 *xq, dev_block_q8_1 *work, int T, int accumulate) {
    if (cols % Q::QK != 0) return;   // not a whole number of blocks: not a row of this type
    const int n_groups = (int)(cols / 32);
    const int64_t row_bytes = cols / Q::QK * Q::BYTES;
    for (int t0 = 0; t0 < T; t0 += CUDA_MATVEC_MAX_T) {
        const int tc = T - t0 < CUDA_MATVEC_MAX_T ? T - t0 : CUDA_MATVEC_MAX_T;
        const dev_block_q8_1 *a;
        if (x) {
            const int64_t n_blocks = (int64_t)tc * n_groups;
            quantize_q8_1_kernel<<<cuda_blocks_for(n_blocks, 256), 256, 0, s>>>(x + (int64_t)t0 * cols, work, n_blocks);
            a = work;
        } else {
            a = xq + (int64_t)t0 * n_groups;
        }
        matvec_q8_kernel<Q><<<cuda_blocks_for(rows, MV_WARPS), MV_WARPS * CUDA_WARP, 0, s>>>(
            out + (int64_t)t0 * rows, (const uint8_t *)w, row_bytes, n_groups, rows, a, tc, accumulate);
    }
}

// launch_q for a quantised type; 0 (nothing launched) for any other.
static int launch_q_type(int32_t type, cuda_stream s, float *out, const void *w, int64_t cols, int64_t rows,
                         const float *x, const dev_block_q8_1 *xq, dev_block_q8_1 *work, int T, int accumulate) {
#define MV_CASE(Q) case Q::TYPE: launch_q<Q>(s, out, w, cols, rows, x, xq, work, T, accumulate); return 1;
    switch (type) {
    MV_CASE(qt_q4_0) MV_CASE(qt_q4_1) MV_CASE(qt_q5_0) MV_CASE(qt_q5_1) MV_CASE(qt_q8_0)
    MV_CASE(qt_q4_K) MV_CASE(qt_q5_K) MV_CASE(qt_q6_K)
    default: return 0;
    }
#undef MV_CASE
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
    switch (type) {
    case PYKV_TYPE_F32:  launch_f<ft_f32>(s, out, w, cols, rows, x, T); break;
    case PYKV_TYPE_F16:  launch_f<ft_f16>(s, out, w, cols, rows, x, T); break;
    case PYKV_TYPE_BF16: launch_f<ft_bf16>(s, out, w, cols, rows, x, T); break;
    default:   // cuda_matmul_supported says which types there are
        launch_q_type(type, s, out, w, cols, rows, x, (const dev_block_q8_1 *)0, (dev_block_q8_1 *)work, T, 0);
        break;
    }
}

extern "C" size_t cuda_q8_1_bytes(int64_t cols, int T) {
    if (cols <= 0 || T <= 0) return 0;
    return (size_t)T * (size_t)((cols + 31) / 32) * sizeof(dev_block_q8_1);
}

extern "C" void cuda_quantize_q8_1(cuda_stream s, void *xq, const float *x, int64_t cols, int T) {
    if (cols <= 0 || T <= 0 || cols % 32 != 0) return;
    const int64_t n_blocks = (int64_t)T * (cols / 32);
    quantize_q8_1_kernel<<<cuda_blocks_for(n_blocks, 256), 256, 0, s>>>(x, (dev_block_q8_1 *)xq, n_blocks);
}

extern "C" void cuda_matvec_q8_pre(cuda_stream s, float *out, const void *w, int32_t type, int64_t cols, int64_t rows,
                                   const void *xq, int T, int accumulate) {
    if (T <= 0 || rows <= 0 || cols <= 0 || cols % 32 != 0) return;
    launch_q_type(type, s, out, w, cols, rows, (const float *)0, (const dev_block_q8_1 *)xq, (dev_block_q8_1 *)0, T,
                  accumulate ? 1 : 0);
}
