// take-ema.cu - TAKE's moving average of its probe's pre-RoPE query rows across prefill chunks
// (twin: the mixing loop of take_ema_update, native/src/kv/policies/take/take-score.c): row r
// of the new rows mixes with row r + shift of the kept state, rows without a partner stay as
// they are, and the result becomes the state. A thread per value; the products and the sum
// correctly rounded, as the CPU's separate multiply and add.
#include "common.cuh"
#include "policy-kernels.h"

#define EMA_THREADS 256

static __global__ void __launch_bounds__(EMA_THREADS)
ema_kernel(float *__restrict__ x, float *__restrict__ state, const float *__restrict__ old, int32_t rows,
           int32_t shift, int64_t width, float a, float b) {
    const int64_t total = (int64_t)rows * width;
    for (int64_t k = (int64_t)blockIdx.x * EMA_THREADS + threadIdx.x; k < total; k += (int64_t)gridDim.x * EMA_THREADS) {
        const int64_t r = k / width, i = k - r * width;
        float v = x[k];
        if (r + shift >= 0) v = __fadd_rn(__fmul_rn(a, old[(r + shift) * width + i]), __fmul_rn(b, v));
        x[k] = v;
        state[k] = v;
    }
}

extern "C" void cuda_take_ema(cuda_stream s, float *x, float *state, const float *old, int32_t rows, int32_t shift,
                              int64_t width, float a, float b) {
    const int64_t total = (int64_t)rows * width;
    if (total <= 0) return;
    const int64_t blocks = (total + EMA_THREADS - 1) / EMA_THREADS;
    ema_kernel<<<(unsigned)(blocks < 4096 ? blocks : 4096), EMA_THREADS, 0, s>>>(x, state, old, rows, shift, width, a, b);
}
