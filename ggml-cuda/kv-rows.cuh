// kv-rows.cuh - the KV cache's stored rows on the device: a float row stored into a list row
// in each format, and stored elements read back as floats. The functions are __host__
// __device__ and give the same bytes as native/src/kv/kv-cache.c (store_row) on both sides,
// so tests/c/test_cuda_kv_rows.cu checks them on the CPU against kv_list_push.
//
// Formats (enum kv_format of kv/kv-cache.h, which this file does not include: that header is
// C11 only): f32; f16 (IEEE half, round to nearest even); q8_0 in 34-byte blocks of 32 values,
// a half scale max|x| / 127 then 32 int8 rounded to nearest even (NaN, from an inf in the
// block, stores 0).
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.cuh"

#define CUDA_KV_F32 0
#define CUDA_KV_F16 1
#define CUDA_KV_Q8_0 2
#define CUDA_KV_Q8_BLOCK 32         // values per q8_0 block
#define CUDA_KV_Q8_BLOCK_BYTES 34   // its half scale, then 32 int8

static __host__ __device__ __forceinline__ size_t kv_row_bytes(int fmt, int d) {
    return fmt == CUDA_KV_Q8_0 ? (size_t)(d / CUDA_KV_Q8_BLOCK) * CUDA_KV_Q8_BLOCK_BYTES
                               : (size_t)d * (fmt == CUDA_KV_F16 ? 2 : 4);
}

// Storage units of a row: q8_0 is stored a block at a time, the others a value at a time.
static __host__ __device__ __forceinline__ int kv_row_units(int fmt, int d) {
    return fmt == CUDA_KV_Q8_0 ? d / CUDA_KV_Q8_BLOCK : d;
}

// Correctly rounded float arithmetic on both sides: the device code is compiled with
// --use_fast_math, where `/` is an approximation and a multiply may fuse into an add.
static __host__ __device__ __forceinline__ float kv_div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}
static __host__ __device__ __forceinline__ float kv_mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

// float -> half bits, round to nearest even, the bits of quant.c's fp32_to_fp16: a NaN stays
// a quiet NaN with the top of its payload, >= 65520 becomes inf. Subnormal halves by integer
// rounding (the same value the CPU's float-add trick gives; no denormal floats involved).
static __host__ __device__ __forceinline__ uint16_t kv_f32_to_f16_bits(float f) {
    const uint32_t x = f32_bits(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t a = x & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);
    if (a < 0x38800000u) {   // below 2^-14: a multiple of 2^-24, value * 2^24 rounded
        const uint32_t e = a >> 23;
        if (e < 102) return sign;   // below 2^-25: rounds to zero
        const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;   // value = m * 2^(e - 150)
        const uint32_t shift = 126 - e;                    // 14..24: value * 2^24 = m >> shift
        uint32_t q = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1))) q++;
        return (uint16_t)(sign | q);   // q may reach 0x400, the smallest normal: correct
    }
    const uint32_t odd = (a >> 13) & 1;
    a += ((uint32_t)(15 - 127) << 23) + 0xFFFu + odd;
    return (uint16_t)(sign | (a >> 13));
}

// One q8_0 block: 32 floats into 34 bytes, as kv-cache.c's quantize_row_q8_0. fmaxf skips
// NaN, so a NaN value leaves the scale alone and stores 0; an inf makes the scale inf and
// every value of the block 0 (x * 0 is 0 or NaN).
static __host__ __device__ __forceinline__ void kv_store_q8_0_block(uint8_t *dst, const float *x) {
    float amax = 0.0f;
    for (int i = 0; i < CUDA_KV_Q8_BLOCK; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float scale = kv_div_rn(amax, 127.0f);
    const float inv = scale != 0.0f ? kv_div_rn(1.0f, scale) : 0.0f;
    const uint16_t h = kv_f32_to_f16_bits(scale);
    dst[0] = (uint8_t)(h & 0xFF);
    dst[1] = (uint8_t)(h >> 8);
    for (int i = 0; i < CUDA_KV_Q8_BLOCK; i++) {
        const float q = rintf(kv_mul_rn(x[i], inv));   // round to nearest even (as nearbyintf)
        dst[2 + i] = (uint8_t)(int8_t)(q >= -127.0f && q <= 127.0f ? (int)q : 0);
    }
}

// Storage unit u (kv_row_units) of row x (d floats) into the stored row dst.
static __host__ __device__ __forceinline__ void kv_store_unit(void *dst, int fmt, const float *x, int u) {
    if (fmt == CUDA_KV_Q8_0) {
        kv_store_q8_0_block((uint8_t *)dst + (size_t)u * CUDA_KV_Q8_BLOCK_BYTES, x + (size_t)u * CUDA_KV_Q8_BLOCK);
    } else if (fmt == CUDA_KV_F16) {
        ((uint16_t *)dst)[u] = kv_f32_to_f16_bits(x[u]);
    } else {
        ((float *)dst)[u] = x[u];
    }
}

// A whole row, serially (host tests, and small rows).
static __host__ __device__ __forceinline__ void kv_store_row(void *dst, int fmt, const float *x, int d) {
    const int units = kv_row_units(fmt, d);
    for (int u = 0; u < units; u++) kv_store_unit(dst, fmt, x, u);
}

// Element i of a stored row as a float (q8_0: the half scale times the int8, as the CPU's
// dequantisation).
static __host__ __device__ __forceinline__ float kv_load(const void *row, int fmt, int i) {
    if (fmt == CUDA_KV_F16) return f16_bits_to_float(((const uint16_t *)row)[i]);
    if (fmt == CUDA_KV_Q8_0) {
        const uint8_t *b = (const uint8_t *)row + (size_t)(i / CUDA_KV_Q8_BLOCK) * CUDA_KV_Q8_BLOCK_BYTES;
        const uint16_t h = (uint16_t)(b[0] | (b[1] << 8));
        return f16_bits_to_float(h) * (float)(int8_t)b[2 + i % CUDA_KV_Q8_BLOCK];
    }
    return ((const float *)row)[i];
}

// Row j of a list stored as fmt (d values per row).
static __host__ __device__ __forceinline__ const void *kv_row(const void *base, int fmt, int d, int64_t j) {
    return (const char *)base + (size_t)j * kv_row_bytes(fmt, d);
}
