// elementwise.cu - the forward pass's element-wise kernels: RMSNorm, RoPE, SwiGLU and the
// residual add. Twins: rmsnorm_scalar, rope_rotate, swiglu_scalar (native/src/cpu).
#include "common.cuh"
#include "norm-quant.cuh"

#include <math.h>

#define ELEMENTWISE_THREADS 256
#define ELEMENTWISE_MAX_BLOCKS 65536   // grid-stride loops beyond this many blocks

// One block per row: the sum of squares in float (rms_sum_squares), the scale in double as
// the CPU's, then out = x * scale * w (out may be x: each thread writes only the elements it
// read, after the reduction has read them all).
__global__ void __launch_bounds__(RMSNORM_THREADS)
rmsnorm_kernel(float *out, const float *x, const float *w, int n, float eps) {
    const size_t row = blockIdx.x;
    x += row * (size_t)n;
    out += row * (size_t)n;
    const float scale = rms_scale((double)rms_sum_squares(x, n), n, eps);
    for (int i = threadIdx.x; i < n; i += RMSNORM_THREADS) out[i] = rms_apply(x[i], scale, w[i]);
}

// One thread per rotated pair (token t, head h, pair i).
__global__ void rope_kernel(float *x, int T, int n_heads, int head_dim, int n_rot, const float *cs) {
    const int half = n_rot / 2;
    const int64_t total = (int64_t)T * n_heads * half;
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (int64_t)gridDim.x * blockDim.x) {
        const int i = (int)(k % half);
        const int64_t th = k / half;   // t * n_heads + h
        const int t = (int)(th / n_heads);
        rope_pair(x + th * head_dim, i, cs + (size_t)t * n_rot);
    }
}

__global__ void swiglu_kernel(float *out, const float *gate, const float *up, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        out[i] = silu_mul(gate[i], up[i]);
    }
}

__global__ void add_kernel(float *y, const float *x, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] += x[i];
}

static int grid_for(int64_t n) {
    const int b = cuda_blocks_for(n, ELEMENTWISE_THREADS);
    return b < ELEMENTWISE_MAX_BLOCKS ? b : ELEMENTWISE_MAX_BLOCKS;
}

extern "C" void cuda_rmsnorm(cuda_stream s, float *out, const float *x, const float *w, int n, int n_rows, float eps) {
    if (n <= 0 || n_rows <= 0) return;
    rmsnorm_kernel<<<n_rows, RMSNORM_THREADS, 0, s>>>(out, x, w, n, eps);
}

extern "C" void cuda_rope(cuda_stream s, float *x, int T, int n_heads, int head_dim, int n_rot, const float *cs) {
    const int64_t total = (int64_t)T * n_heads * (n_rot / 2);
    if (total <= 0) return;
    rope_kernel<<<grid_for(total), ELEMENTWISE_THREADS, 0, s>>>(x, T, n_heads, head_dim, n_rot, cs);
}

extern "C" void cuda_swiglu(cuda_stream s, float *out, const float *gate, const float *up, int64_t n) {
    if (n <= 0) return;
    swiglu_kernel<<<grid_for(n), ELEMENTWISE_THREADS, 0, s>>>(out, gate, up, n);
}

extern "C" void cuda_add(cuda_stream s, float *y, const float *x, int64_t n) {
    if (n <= 0) return;
    add_kernel<<<grid_for(n), ELEMENTWISE_THREADS, 0, s>>>(y, x, n);
}
