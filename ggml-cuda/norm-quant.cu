// norm-quant.cu - the RMSNorm and the SwiGLU of a decode step with their output written as
// Q8_1 activation blocks (the input of cuda_matvec_q8_pre) instead of floats: one kernel
// where cuda_rmsnorm or cuda_swiglu and then cuda_quantize_q8_1 take two, with the same bits.
// The floats are computed as elementwise.cu computes them (norm-quant.cuh); each block of 32 is
// quantised by one warp, lane j taking value j (q8_1_quantize_warp).
//
// rmsnorm: one thread block of RMSNORM_THREADS per row. The sum of squares is rmsnorm_kernel's
// (rms_sum_squares), so the scale is the same float; warp w then quantises the row's blocks
// w, w + 8, ..., reading four of them at a time.
// swiglu: one warp per block of 32 values of the T rows together, 8 warps per thread block.
#include "common.cuh"
#include "norm-quant.cuh"

#define NORM_Q8_BLOCKS 4   // blocks of 32 a warp reads at once in rmsnorm_q8_1_kernel

// y: the row's n / 32 blocks (n a multiple of 32).
static __global__ void __launch_bounds__(RMSNORM_THREADS)
rmsnorm_q8_1_kernel(dev_block_q8_1 *__restrict__ y, const float *__restrict__ x, const float *__restrict__ w, int n,
                    float eps) {
    const size_t row = blockIdx.x;
    x += row * (size_t)n;
    y += row * (size_t)(n / 32);
    const float scale = rms_scale((double)rms_sum_squares(x, n), n, eps);
    const int warp = threadIdx.x / CUDA_WARP, lane = threadIdx.x % CUDA_WARP;
    const int n_blocks = n / 32, step = RMSNORM_THREADS / CUDA_WARP;
    // A warp's blocks NORM_Q8_BLOCKS at a time: their values are read before any is quantised,
    // so the loads are in flight together. The bounds depend on the warp only, so every lane
    // of a warp takes part in each block (past the end a lane reads its first block again).
    for (int b0 = warp; b0 < n_blocks; b0 += NORM_Q8_BLOCKS * step) {
        float v[NORM_Q8_BLOCKS];
#pragma unroll
        for (int u = 0; u < NORM_Q8_BLOCKS; u++) {
            const int b = b0 + u * step < n_blocks ? b0 + u * step : b0, i = 32 * b + lane;
            v[u] = rms_apply(x[i], scale, w[i]);
        }
#pragma unroll
        for (int u = 0; u < NORM_Q8_BLOCKS; u++)
            if (b0 + u * step < n_blocks) q8_1_quantize_warp(v[u], lane, y + b0 + u * step);
    }
}

// Block b of the n_blocks blocks of the T rows back to back (n a multiple of 32, so a block
// never straddles two rows and block b of the floats is block b of y).
static __global__ void __launch_bounds__(SWIGLU_Q8_THREADS)
swiglu_q8_1_kernel(dev_block_q8_1 *__restrict__ y, const float *__restrict__ gate, const float *__restrict__ up,
                   int64_t n_blocks) {
    const int64_t b = ((int64_t)blockIdx.x * SWIGLU_Q8_THREADS + threadIdx.x) / CUDA_WARP;
    const int lane = threadIdx.x % CUDA_WARP;
    if (b >= n_blocks) return;   // the whole warp
    const int64_t i = 32 * b + lane;
    q8_1_quantize_warp(silu_mul(gate[i], up[i]), lane, y + b);
}

extern "C" void cuda_rmsnorm_q8_1(cuda_stream s, void *xq, const float *x, const float *w, int n, int T, float eps) {
    if (n <= 0 || T <= 0 || n % 32 != 0) return;
    rmsnorm_q8_1_kernel<<<T, RMSNORM_THREADS, 0, s>>>((dev_block_q8_1 *)xq, x, w, n, eps);
}

extern "C" void cuda_swiglu_q8_1(cuda_stream s, void *xq, const float *gate, const float *up, int n, int T) {
    if (n <= 0 || T <= 0 || n % 32 != 0) return;
    const int64_t n_blocks = (int64_t)T * (n / 32);
    swiglu_q8_1_kernel<<<cuda_blocks_for(n_blocks, SWIGLU_Q8_THREADS / CUDA_WARP), SWIGLU_Q8_THREADS, 0, s>>>(
        (dev_block_q8_1 *)xq, gate, up, n_blocks);
}
