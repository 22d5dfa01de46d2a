// norm-quant.cuh - the per-value math of the kernels that write Q8_1 activations straight
// from an RMSNorm or a SwiGLU (norm-quant.cu): the same float expressions as elementwise.cu's
// rmsnorm_kernel and swiglu_kernel (and the CPU's rmsnorm_scalar and swiglu_scalar), so that
// a fused kernel's floats are the unfused kernel's bit for bit, and the quantisation of a
// block by one warp, lane j holding value j, giving q8_1_quantize_block's bits. The value
// math is __host__ __device__: tests/c/test_cuda_blocks.cu checks it on the CPU.
#pragma once
#include "quant-blocks.cuh"

// Threads per block of the RMSNorm kernels (elementwise.cu's and the fused one): the order of
// the float sum of squares depends on it. And of the fused SwiGLU.
#define RMSNORM_THREADS 256
#define SWIGLU_Q8_THREADS 256

// The sum of squares of a row of n, in the order every RMSNorm kernel takes it: per-thread
// strided float sums, a shuffle tree per warp, then one over the warps. Called by all
// RMSNORM_THREADS threads of the block; every thread gets the sum.
static __device__ __forceinline__ float rms_sum_squares(const float *x, int n) {
    __shared__ float part[RMSNORM_THREADS / CUDA_WARP];
    float ss = 0.0f;
#pragma unroll 4   // the loads of four steps in flight together; the sum keeps its order
    for (int i = threadIdx.x; i < n; i += RMSNORM_THREADS) ss += x[i] * x[i];
    ss = warp_sum(ss);
    const int warp = threadIdx.x / CUDA_WARP, lane = threadIdx.x % CUDA_WARP;
    if (lane == 0) part[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        float t = lane < RMSNORM_THREADS / CUDA_WARP ? part[lane] : 0.0f;
        t = warp_sum(t);
        if (lane == 0) part[0] = t;
    }
    __syncthreads();
    return part[0];
}

// The RMSNorm's scale from the row's sum of squares ss (float on the device, double on the
// CPU; the rest in double either way) and a normalised value: x * scale * w, in this order.
static __host__ __device__ __forceinline__ float rms_scale(double ss, int n, float eps) {
    return (float)(1.0 / sqrt(ss / n + (double)eps));
}
static __host__ __device__ __forceinline__ float rms_apply(float x, float scale, float w) { return x * scale * w; }

// silu(g) * u as g / (1 + e^-g) * u.
static __host__ __device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

static __device__ __forceinline__ int warp_sum_int(int x) {
#pragma unroll
    for (int o = CUDA_WARP / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// The block at y from the warp's 32 values, v being value `lane`: the steps of
// q8_1_quantize_block with its loops over the block as warp reductions (a max and an integer
// sum, both exact in any order). All 32 lanes must call it.
static __device__ __forceinline__ void q8_1_quantize_warp(float v, int lane, dev_block_q8_1 *y) {
    const bool finite = __all_sync(0xffffffffu, isfinite(v));
    const float amax = warp_max(fabsf(v));
    if (!finite) {
        y->qs[lane] = 0;
        if (lane == 0) y->d = y->s = NAN;
        return;
    }
    float d, id;
    q8_1_scale(amax, &d, &id);
    const int q = q8_1_round(v, id);
    y->qs[lane] = (int8_t)q;
    const int sum = warp_sum_int(q);
    if (lane == 0) {
        y->d = d;
        y->s = d * (float)sum;
    }
}
