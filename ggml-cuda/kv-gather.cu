// kv-gather.cu - rows of a KV list picked by index into another buffer: dst row j = src row
// keep[j] (twin: kv_compact_rows of native/src/kv/kv-cache.c on a copy). A thread per copy
// unit, the widest of 16, 4, 2 or 1 bytes that divides the row and the two pointers' alignment,
// over the flat (row, unit) range in a grid-stride loop.
#include "common.cuh"
#include "policy-kernels.h"

#define GATHER_THREADS 256
#define GATHER_MAX_BLOCKS 4096

template <class U>
static __global__ void __launch_bounds__(GATHER_THREADS)
gather_rows_kernel(U *__restrict__ dst, const U *__restrict__ src, int64_t units, const int32_t *__restrict__ keep,
                   int64_t total) {
    const int64_t stride = (int64_t)gridDim.x * GATHER_THREADS;
    for (int64_t i = (int64_t)blockIdx.x * GATHER_THREADS + threadIdx.x; i < total; i += stride) {
        const int64_t row = i / units, u = i - row * units;
        dst[i] = src[(int64_t)keep[row] * units + u];
    }
}

template <class U>
static void gather_launch(cuda_stream s, void *dst, const void *src, size_t row_bytes, const int32_t *keep,
                          int32_t n_keep) {
    const int64_t units = (int64_t)(row_bytes / sizeof(U)), total = units * n_keep;
    const int64_t blocks = (total + GATHER_THREADS - 1) / GATHER_THREADS;
    const unsigned grid = (unsigned)(blocks < GATHER_MAX_BLOCKS ? blocks : GATHER_MAX_BLOCKS);
    gather_rows_kernel<U><<<grid, GATHER_THREADS, 0, s>>>((U *)dst, (const U *)src, units, keep, total);
}

extern "C" void cuda_gather_rows(cuda_stream s, void *dst, const void *src, size_t row_bytes, const int32_t *d_keep,
                                 int32_t n_keep) {
    if (n_keep <= 0 || row_bytes == 0) return;
    const uintptr_t a = (uintptr_t)dst | (uintptr_t)src | (uintptr_t)row_bytes;
    if (a % 16 == 0) gather_launch<uint4>(s, dst, src, row_bytes, d_keep, n_keep);
    else if (a % 4 == 0) gather_launch<uint32_t>(s, dst, src, row_bytes, d_keep, n_keep);
    else if (a % 2 == 0) gather_launch<uint16_t>(s, dst, src, row_bytes, d_keep, n_keep);
    else gather_launch<uint8_t>(s, dst, src, row_bytes, d_keep, n_keep);
}
