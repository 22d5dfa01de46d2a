// kv-gather.cu - rows of a KV list picked by index into another buffer: dst row j = src row
// keep[j] (twin: kv_compact_rows of native/src/kv/kv-cache.c on a copy). A thread per copy
// unit, the widest of 16, 4, 2 or 1 bytes that divides the row and the two pointers' alignment,
// over the flat (row, unit) range in a grid-stride loop. And rows moved towards the front of
// their own buffer (cuda_move_rows): one block stages each piece of a move in shared memory,
// every load before any store, so overlapping ranges move as memmove moves them.
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

#define MOVE_THREADS 256
#define MOVE_STAGE_BYTES (16 * 1024)

// Pieces of at most MOVE_STAGE_BYTES: a piece's source rows lie at or after its destination
// rows and after every earlier piece's destination, so loading it whole before storing it
// never reads a row already overwritten.
template <class U>
static __device__ __forceinline__ void move_rows_block(U *base, int64_t units, const struct cuda_row_moves &m, U *stage) {
    const int64_t piece_rows = (int64_t)(MOVE_STAGE_BYTES / sizeof(U)) / units;
    for (int i = 0; i < m.n; i++) {
        for (int64_t r0 = 0; r0 < m.len[i]; r0 += piece_rows) {
            const int64_t rows = m.len[i] - r0 < piece_rows ? m.len[i] - r0 : piece_rows, n = rows * units;
            const U *src = base + ((int64_t)m.src[i] + r0) * units;
            U *dst = base + ((int64_t)m.dst[i] + r0) * units;
            for (int64_t u = threadIdx.x; u < n; u += MOVE_THREADS) stage[u] = src[u];
            __syncthreads();
            for (int64_t u = threadIdx.x; u < n; u += MOVE_THREADS) dst[u] = stage[u];
            __syncthreads();
        }
    }
}

template <class U>
static __global__ void __launch_bounds__(MOVE_THREADS)
move_rows_kernel(U *base, int64_t units, struct cuda_row_moves m) {
    __shared__ U stage[MOVE_STAGE_BYTES / sizeof(U)];
    move_rows_block<U>(base, units, m, stage);
}

// Block i takes job i (a grid-stride loop over the jobs past the grid), in the widest unit
// that divides its buffer's address and row size.
static __global__ void __launch_bounds__(MOVE_THREADS)
move_rows_many_kernel(const struct cuda_list_moves *__restrict__ jobs, int32_t n) {
    __shared__ uint4 stage[MOVE_STAGE_BYTES / sizeof(uint4)];
    for (int32_t i = blockIdx.x; i < n; i += gridDim.x) {
        const struct cuda_list_moves job = jobs[i];
        const uintptr_t a = (uintptr_t)job.base | (uintptr_t)job.row_bytes;
        if (a % 16 == 0) move_rows_block<uint4>((uint4 *)job.base, job.row_bytes / 16, job.m, stage);
        else if (a % 4 == 0) move_rows_block<uint32_t>((uint32_t *)job.base, job.row_bytes / 4, job.m, (uint32_t *)stage);
        else if (a % 2 == 0) move_rows_block<uint16_t>((uint16_t *)job.base, job.row_bytes / 2, job.m, (uint16_t *)stage);
        else move_rows_block<uint8_t>((uint8_t *)job.base, job.row_bytes, job.m, (uint8_t *)stage);
    }
}

extern "C" void cuda_move_rows(cuda_stream s, void *d_base, size_t row_bytes, const struct cuda_row_moves *m) {
    if (m->n <= 0 || row_bytes == 0 || row_bytes > MOVE_STAGE_BYTES) return;
    const uintptr_t a = (uintptr_t)d_base | (uintptr_t)row_bytes;
    if (a % 16 == 0) move_rows_kernel<uint4><<<1, MOVE_THREADS, 0, s>>>((uint4 *)d_base, (int64_t)(row_bytes / 16), *m);
    else if (a % 4 == 0) move_rows_kernel<uint32_t><<<1, MOVE_THREADS, 0, s>>>((uint32_t *)d_base, (int64_t)(row_bytes / 4), *m);
    else if (a % 2 == 0) move_rows_kernel<uint16_t><<<1, MOVE_THREADS, 0, s>>>((uint16_t *)d_base, (int64_t)(row_bytes / 2), *m);
    else move_rows_kernel<uint8_t><<<1, MOVE_THREADS, 0, s>>>((uint8_t *)d_base, (int64_t)row_bytes, *m);
}

extern "C" void cuda_move_rows_many(cuda_stream s, const struct cuda_list_moves *d_jobs, int32_t n) {
    if (n <= 0) return;
    move_rows_many_kernel<<<(unsigned)(n < GATHER_MAX_BLOCKS ? n : GATHER_MAX_BLOCKS), MOVE_THREADS, 0, s>>>(d_jobs, n);
}

// A batch of independent byte copies (cuda_copy_bytes): block i copies job i (a grid-stride
// loop over the jobs past the grid), in the widest unit that divides both pointers and the
// length.
template <class U>
static __device__ __forceinline__ void copy_units(void *dst, const void *src, int64_t bytes) {
    U *d = (U *)dst;
    const U *s = (const U *)src;
    for (int64_t u = threadIdx.x; u < bytes / (int64_t)sizeof(U); u += MOVE_THREADS) d[u] = s[u];
}

static __global__ void __launch_bounds__(MOVE_THREADS)
copy_bytes_kernel(const struct cuda_byte_copy *__restrict__ jobs, int32_t n) {
    for (int32_t i = blockIdx.x; i < n; i += gridDim.x) {
        const struct cuda_byte_copy job = jobs[i];
        const uintptr_t a = (uintptr_t)job.dst | (uintptr_t)job.src | (uintptr_t)job.bytes;
        if (a % 16 == 0) copy_units<uint4>(job.dst, job.src, job.bytes);
        else if (a % 4 == 0) copy_units<uint32_t>(job.dst, job.src, job.bytes);
        else copy_units<uint8_t>(job.dst, job.src, job.bytes);
    }
}

extern "C" void cuda_copy_bytes(cuda_stream s, const struct cuda_byte_copy *d_jobs, int32_t n) {
    if (n <= 0) return;
    copy_bytes_kernel<<<(unsigned)(n < GATHER_MAX_BLOCKS ? n : GATHER_MAX_BLOCKS), MOVE_THREADS, 0, s>>>(d_jobs, n);
}
