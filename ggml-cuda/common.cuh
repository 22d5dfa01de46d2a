// common.cuh - what the .cu files share: the C headers they call, pykv's error reporting,
// warp reductions and the KV cache's row formats on the device.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

extern "C" {
#include "core/error.h"
}
#include "device.h"
#include "kernels.h"

#define CUDA_WARP 32

static __device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = CUDA_WARP / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
static __device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = CUDA_WARP / 2; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// A float's bits and back, on the device and in the host twins of the device code.
static __host__ __device__ __forceinline__ uint32_t f32_bits(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
#endif
}
static __host__ __device__ __forceinline__ float bits_f32(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

// An f16 stored as raw bits (the GGUF block structs' d and m fields) as a float.
static __host__ __device__ __forceinline__ float f16_bits_to_float(uint16_t h) {
    __half_raw r;
    r.x = h;
    return __half2float(__half(r));
}

// RoPE: pair i of a row (values 2i and 2i + 1) turned by cs[2i] = cos, cs[2i + 1] = sin, as
// the CPU's rope_rotate; every kernel that rotates takes this expression.
static __device__ __forceinline__ void rope_pair(float *row, int i, const float *cs) {
    const float c = cs[2 * i], s = cs[2 * i + 1];
    const float a = row[2 * i], b = row[2 * i + 1];
    row[2 * i] = a * c - b * s;
    row[2 * i + 1] = a * s + b * c;
}

static inline int cuda_blocks_for(int64_t n, int per_block) { return (int)((n + per_block - 1) / per_block); }

// Per-entry arrays of a layer's lists laid out one after another (list g's n[g] values at
// off[g], head order; total in all), and the longest list: a kernel argument, copied whole.
struct cuda_list_layout {
    int64_t off[CUDA_MAX_KV_HEADS];
    int64_t total;
    int32_t n_max;
};
static inline struct cuda_list_layout cuda_list_layout_of(const int32_t *n, int n_lists) {
    struct cuda_list_layout lay;
    memset(&lay, 0, sizeof(lay));   // every word set: a struct argument is copied whole
    int64_t total = 0;
    for (int g = 0; g < n_lists; g++) {
        lay.off[g] = total;
        total += n[g];
        lay.n_max = n[g] > lay.n_max ? n[g] : lay.n_max;
    }
    lay.total = total;
    return lay;
}

// Entries of list g of a layer (kernels.h: device-resident lengths when n_dev is set).
static __device__ __forceinline__ int32_t kv_list_len(const struct cuda_kv_layer &layer, int g) {
    return layer.n_dev ? layer.n_dev[g] : layer.n[g];
}
