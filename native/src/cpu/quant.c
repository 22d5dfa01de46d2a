// quant.c - fp16/bf16 conversion, run-time choice of the SIMD kernels, pykv_dequantize.
#include "cpu/quant.h"

#include <stdint.h>
#include <string.h>

#include "core/error.h"
#include "cpu/quant-blocks.h"
#include "model/types.h"

static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float    bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float fp16_to_fp32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    if (exp == 0x1F) return bits_f32(sign | 0x7F800000u | mant << 13);   // inf, nan (payload kept)
    if (exp == 0) {                                                        // zero, subnormal: mant * 2^-24
        const float v = (float)mant * 0x1p-24f;
        return sign ? -v : v;
    }
    return bits_f32(sign | (exp + 112) << 23 | mant << 13);               // rebias 15 -> 127
}

uint16_t fp32_to_fp16(float f) {
    const uint32_t x = f32_bits(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t a = x & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7E00 | (uint16_t)((a >> 13) & 0x3FF);   // nan stays quiet nan
    if (a >= 0x477FF000u) return sign | 0x7C00;        // >= 65520 rounds to inf (and inf itself)
    if (a < 0x38800000u) {
        // Below the smallest normal half (2^-14): adding 0.5 lines the value up so the float
        // add rounds it (nearest even) to a multiple of 2^-24, which is the half's encoding.
        const float s = bits_f32(a) + 0.5f;
        return sign | (uint16_t)(f32_bits(s) - f32_bits(0.5f));
    }
    // Normal: rebias the exponent and round the 13 dropped bits to nearest even; a carry out of
    // the mantissa correctly bumps the exponent.
    const uint32_t odd = (a >> 13) & 1;
    a += ((uint32_t)(15 - 127) << 23) + 0xFFFu + odd;
    return sign | (uint16_t)(a >> 13);
}

float bf16_to_fp32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

#if defined(__x86_64__) || defined(__i386__)
#include "cpu/simd-avx2.h"
static int have_f16c(void) { return __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx"); }

__attribute__((target("avx,f16c"))) static void fp16_to_fp32_f16c(const uint16_t *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
    for (; i < n; i++) y[i] = fp16_to_fp32(x[i]);
}

__attribute__((target("avx,f16c"))) static void fp32_to_fp16_f16c(const float *x, uint16_t *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++) y[i] = fp32_to_fp16(x[i]);
}
#endif

void fp16_to_fp32_row(const uint16_t *x, float *y, int64_t n) {
#if defined(__x86_64__) || defined(__i386__)
    if (have_f16c()) { fp16_to_fp32_f16c(x, y, n); return; }
#endif
    for (int64_t i = 0; i < n; i++) y[i] = fp16_to_fp32(x[i]);
}

void fp32_to_fp16_row(const float *x, uint16_t *y, int64_t n) {
#if defined(__x86_64__) || defined(__i386__)
    if (have_f16c()) { fp32_to_fp16_f16c(x, y, n); return; }
#endif
    for (int64_t i = 0; i < n; i++) y[i] = fp32_to_fp16(x[i]);
}

// ---- dispatch ----

// Chosen once when the library loads (single-threaded), then only read: dot_f32 and axpy_f32
// run in the hottest loops, so they must not pay for a pthread_once on every call.
static const struct quant_kernels *active = &quant_scalar_kernels;
static const char *active_name = "scalar";

__attribute__((constructor)) static void dispatch_init(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (cpu_has_avx2()) {
        const int t0 = cpu_weight_prefetch_t0();
        active = t0 ? &quant_avx2_kernels_t0 : &quant_avx2_kernels;
        active_name = t0 ? "avx2 fma f16c prefetch-t0" : "avx2 fma f16c";
    }
#endif
}

static const struct quant_kernels *kernels(void) { return active; }

const char *quant_simd_name(void) { return active_name; }

vec_dot_fn vec_dot_for(int32_t type) {
    if (type < 0 || type >= QUANT_N_TYPES || !type_traits_of(type)) return NULL;
    vec_dot_fn f = kernels()->vec_dot[type];
    return f ? f : quant_scalar_kernels.vec_dot[type];
}

vec_dot_fn vec_dot_scalar_for(int32_t type) {
    if (type < 0 || type >= QUANT_N_TYPES || !type_traits_of(type)) return NULL;
    return quant_scalar_kernels.vec_dot[type];
}

float dot_f32(const float *a, const float *b, int64_t n) { return kernels()->dot_f32(a, b, n); }

void axpy_f32(float *y, float a, const float *x, int64_t n) { kernels()->axpy_f32(y, a, x, n); }

// ---- public API ----

pykv_status pykv_dequantize(int32_t type, const void *src, int64_t n, float *dst) {
    const struct type_traits *t = type_traits_of(type);
    if (!t) return pykv_error(PYKV_ERR_UNSUPPORTED, "pykv_dequantize: unknown tensor type %d", (int)type);
    if (n < 0 || n % t->block_size != 0)
        return pykv_error(PYKV_ERR_INVALID_ARG,
                          "pykv_dequantize: n=%lld is not a multiple of the %s block size %d",
                          (long long)n, t->name, (int)t->block_size);
    if (n == 0) return PYKV_OK;
    if (!src || !dst) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_dequantize: NULL %s pointer", src ? "dst" : "src");
    if (((uintptr_t)src & 1) == 0 || t->block_bytes == 4 * t->block_size)
        return dequant_row(type, src, dst, n);
    // The block structs hold uint16_t fields: copy an odd-aligned source through a buffer.
    uint16_t buf[sizeof(block_q6_K) / 2 + 1];
    const uint8_t *p = src;
    for (int64_t i = 0; i < n; i += t->block_size, p += t->block_bytes) {
        memcpy(buf, p, (size_t)t->block_bytes);
        PYKV_TRY(dequant_row(type, buf, dst + i, t->block_size));
    }
    return PYKV_OK;
}
