// random-rows.h - random but valid quantised rows for the kernel tests: random bytes with
// finite f16 scales (and mins) written over each block's scale fields.
#pragma once
#include <stdint.h>
#include <string.h>

#include "cpu/quant.h"
#include "model/types.h"

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static inline uint32_t next_u32(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}
static inline float uniform(float lo, float hi) { return lo + (hi - lo) * (float)(next_u32() & 0xFFFFFF) / 16777216.0f; }

static inline float    u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }

// Fill a row of n elements of `type` with random valid content.
static inline void random_row(int32_t type, uint8_t *row, int64_t n) {
    const struct type_traits *t = type_traits_of(type);
    const int64_t bytes = type_row_bytes(type, n);
    for (int64_t i = 0; i < bytes; i++) row[i] = (uint8_t)next_u32();
    if (type == PYKV_TYPE_F32) {
        for (int64_t i = 0; i < n; i++) { float v = uniform(-1, 1); memcpy(row + 4 * i, &v, 4); }
        return;
    }
    if (type == PYKV_TYPE_F16 || type == PYKV_TYPE_BF16) {
        for (int64_t i = 0; i < n; i++) {
            const float v = uniform(-1, 1);
            put16(row + 2 * i, type == PYKV_TYPE_F16 ? fp32_to_fp16(v) : (uint16_t)(f2u(v) >> 16));
        }
        return;
    }
    // Offsets of the f16 fields in each block: a scale and, for some types, a min.
    int off_d = 0, off_m = -1;
    switch (type) {
    case PYKV_TYPE_Q4_1: case PYKV_TYPE_Q5_1: case PYKV_TYPE_Q4_K: case PYKV_TYPE_Q5_K: off_m = 2; break;
    case PYKV_TYPE_Q6_K: off_d = 208; break;
    case PYKV_TYPE_Q2_K: off_d = 80; off_m = 82; break;
    case PYKV_TYPE_Q3_K: off_d = 108; break;
    default: break;
    }
    for (int64_t b = 0; b < n / t->block_size; b++) {
        uint8_t *blk = row + b * t->block_bytes;
        put16(blk + off_d, fp32_to_fp16(uniform(-0.1f, 0.1f)));
        if (off_m >= 0) put16(blk + off_m, fp32_to_fp16(uniform(-0.5f, 0.5f)));
    }
}

