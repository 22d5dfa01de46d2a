// quant.h - dequantization and dot-product kernels for the GGUF tensor types.
//
// Every kernel has a scalar version and, where the CPU has them, AVX2/FMA (and AVX-512)
// versions chosen at run time; the scalar path is the reference the tests compare against.
#pragma once
#include <stdint.h>
#include "pykv.h"

// fp16 / bf16 <-> fp32 conversions (IEEE half, round to nearest even).
float    fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);
float    bf16_to_fp32(uint16_t h);
// Rows of n values (F16C where the CPU has it; the same bits as the scalar functions).
void     fp16_to_fp32_row(const uint16_t *x, float *y, int64_t n);
void     fp32_to_fp16_row(const float *x, uint16_t *y, int64_t n);

// Dequantize n elements (whole blocks) of `type` from src into dst.
// Returns PYKV_ERR_UNSUPPORTED (with a message) for an unknown type.
pykv_status dequant_row(int32_t type, const void *src, float *dst, int64_t n);

// The dot product of one weight row of `type` (n elements, whole blocks) with n floats.
// Must be supported for every type in types.c; the dispatch picks the best SIMD version.
typedef float (*vec_dot_fn)(const void *row, const float *x, int64_t n);
vec_dot_fn  vec_dot_for(int32_t type);   // NULL for an unknown type

// The same, forced to the scalar reference (for tests and the exact path).
vec_dot_fn  vec_dot_scalar_for(int32_t type);

// Plain float kernels used by the forward pass.
float dot_f32(const float *a, const float *b, int64_t n);
void  axpy_f32(float *y, float a, const float *x, int64_t n);   // y += a * x

// "avx2 fma f16c" (followed by " prefetch-t0" where the weights are prefetched with the T0
// hint, see simd-avx2.h) or "scalar": what the run-time dispatch selected.
const char *quant_simd_name(void);
