// get-rows.cu - rows of a weight matrix as floats (the token embeddings): out[t] = W[ids[t]],
// decoded exactly as the CPU's pykv_dequantize. Quantised types: one thread per 32-value group
// of a row (quant-blocks.cuh); float types: one thread per value. Grid: x over the row's
// groups (values), y over the tokens (a grid-stride loop past 65535).
#include "common.cuh"
#include "quant-blocks.cuh"

#define GR_THREADS 128

template <class Q>
static __global__ void __launch_bounds__(GR_THREADS)
get_rows_q_kernel(float *__restrict__ out, const uint8_t *__restrict__ w, int64_t cols, const int32_t *__restrict__ ids,
                  int T) {
    const int64_t gi = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (gi >= cols / 32) return;
    const int64_t row_bytes = cols / Q::QK * Q::BYTES;
    for (int t = blockIdx.y; t < T; t += gridDim.y) {
        qgroup g;
        Q::unpack(w + (int64_t)ids[t] * row_bytes + gi / Q::GROUPS * Q::BYTES, (int)(gi % Q::GROUPS), g);
        float y[32];
        qgroup_decode(g, y);
        float *dst = out + (int64_t)t * cols + 32 * gi;
#pragma unroll
        for (int j = 0; j < 32; j++) dst[j] = y[j];
    }
}

template <class F>
static __global__ void __launch_bounds__(GR_THREADS)
get_rows_f_kernel(float *__restrict__ out, const uint8_t *__restrict__ w, int64_t cols, const int32_t *__restrict__ ids,
                  int T) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    for (int t = blockIdx.y; t < T; t += gridDim.y)
        out[(int64_t)t * cols + c] = F::at(w + (int64_t)ids[t] * cols * F::ELEM_BYTES, c);
}

template <class Q>
static void launch_q(cuda_stream s, float *out, const void *w, int64_t cols, const int32_t *ids, int T) {
    if (cols % Q::QK != 0) return;   // not a whole number of blocks: not a row of this type
    const dim3 grid((unsigned)cuda_blocks_for(cols / 32, GR_THREADS), (unsigned)(T < 65535 ? T : 65535));
    get_rows_q_kernel<Q><<<grid, GR_THREADS, 0, s>>>(out, (const uint8_t *)w, cols, ids, T);
}

template <class F>
static void launch_f(cuda_stream s, float *out, const void *w, int64_t cols, const int32_t *ids, int T) {
    const dim3 grid((unsigned)cuda_blocks_for(cols, GR_THREADS), (unsigned)(T < 65535 ? T : 65535));
    get_rows_f_kernel<F><<<grid, GR_THREADS, 0, s>>>(out, (const uint8_t *)w, cols, ids, T);
}

extern "C" void cuda_get_rows(cuda_stream s, float *out, const void *w, int32_t type, int64_t cols, const int32_t *ids,
                              int T) {
    if (T <= 0 || cols <= 0) return;
    switch (type) {
    case PYKV_TYPE_F32:  launch_f<ft_f32>(s, out, w, cols, ids, T); break;
    case PYKV_TYPE_F16:  launch_f<ft_f16>(s, out, w, cols, ids, T); break;
    case PYKV_TYPE_BF16: launch_f<ft_bf16>(s, out, w, cols, ids, T); break;
    case PYKV_TYPE_Q4_0: launch_q<qt_q4_0>(s, out, w, cols, ids, T); break;
    case PYKV_TYPE_Q4_1: launch_q<qt_q4_1>(s, out, w, cols, ids, T); break;
    case PYKV_TYPE_Q5_0: launch_q<qt_q5_0>(s, out, w, cols, ids, T); break;
    case PYKV_TYPE_Q5_1: launch_q<qt_q5_1>(s, out, w, cols, ids, T); break;
    case PYKV_TYPE_Q8_0: launch_q<qt_q8_0>(s, out, w, cols, ids, T); break;
    case PYKV_TYPE_Q4_K: launch_q<qt_q4_K>(s, out, w, cols, ids, T); break;
    case PYKV_TYPE_Q5_K: launch_q<qt_q5_K>(s, out, w, cols, ids, T); break;
    case PYKV_TYPE_Q6_K: launch_q<qt_q6_K>(s, out, w, cols, ids, T); break;
    default: break;
    }
}
