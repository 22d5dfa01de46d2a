// topk-radix.cuh - the keys and the digit step of the exact top-k selection (topk.cu), as
// __host__ __device__ functions so that tests/c/test_cuda_policy_host.cu checks them on the
// CPU against ws_select_top's ranking (window-select.c).
//
// Entry j of a list with score s has the 64-bit key (ordered bits of s) << 32 | ~j: keys are
// unique within a list, and key a > key b exactly when a outranks b in ws_select_top (higher
// score, or an equal score at a lower index; NaN counts as -inf, -0 equals +0). The bits are
// taken from the float's encoding, never from a float comparison: the device code runs with
// flush-to-zero, which would make a subnormal score equal to zero there but not on the CPU.
#pragma once
#include <stdint.h>

#include "kv-rows.cuh"

#define TOPK_RADIX_BITS 8
#define TOPK_BINS (1 << TOPK_RADIX_BITS)

// The float's bits mapped so that unsigned order is score order: NaN as -inf, -0 as +0,
// then negative values with every bit flipped, the others with the sign bit set.
static __host__ __device__ __forceinline__ uint32_t topk_order_bits(float s) {
    uint32_t u = f32_bits(s);
    const uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) u = 0xFF800000u;   // NaN: -inf
    else if (a == 0) u = 0;                 // -0: +0
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

static __host__ __device__ __forceinline__ uint64_t topk_key(float s, uint32_t j) {
    return ((uint64_t)topk_order_bits(s) << 32) | (uint64_t)(uint32_t)~j;
}

// The radix digit (TOPK_RADIX_BITS wide, taken from the top) of a key at shift.
static __host__ __device__ __forceinline__ uint32_t topk_digit(uint64_t key, int shift) {
    return (uint32_t)(key >> shift) & (TOPK_BINS - 1);
}

// One step of the select: hist counts the keys still in play by their digit; *need (>= 1,
// at most the keys in play) is the rank of the wanted key among them, counted from the
// largest. Returns the wanted key's digit and leaves its rank among the keys with that digit
// in *need.
static __host__ __device__ __forceinline__ uint32_t topk_pick_digit(const uint32_t *hist, uint32_t *need) {
    uint32_t above = 0;
    for (uint32_t d = TOPK_BINS - 1; d > 0; d--) {
        if (above + hist[d] >= *need) {
            *need -= above;
            return d;
        }
        above += hist[d];
    }
    *need -= above;
    return 0;
}
