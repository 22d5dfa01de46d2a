// gemm-q8.h - prefill's integer matrix products: the tokens' activations quantised to 8 bits
// (per 32, exactly as the decode step's quantize_row_q8_act) and multiplied with the weights'
// own integer quants, as llama.cpp runs its quantised types.
//
// Weights and activations are repacked per 256 elements so that one AVX2 multiply-add
// (maddubs: 32 u8 x s8 products, summed in pairs into 16 int16 lanes) gives lane p the
// products of sub-block p (16 elements): byte b of vector v (0..7) holds element
// 16 * (b / 2) + 2 * v + b % 2. A lane's sub-block stays the same across the 8 vectors, so
// the vectors' products add up in int16 before one scale multiply per sub-block, and the
// pairs of lanes that `madd` combines form the 32-element groups of the activation scales.
//
// A weight element is  dw[g] * sc[p] * q - dm[g] * mn[p]  (q unsigned, p its sub-block of 16,
// g = p / 2 its group of 32): K-quants put their super-block scale in dw and dmin in dm,
// the 32-element types (Q4_0..Q5_1) their block scale in dw and their offset in dm with
// sc = mn = 1. The product of a weight row with a token is then, per group g,
//   dx[g] * (dw[g] * sum_p sc[p] * sum(q * qx) - dm[g] * sum_p mn[p] * bsum[p]).
#pragma once
#include <stdint.h>

#include "quant-q8.h"

#define PK_ELEMS 256

typedef struct {
    float   dw[8], dm[8];
    int16_t sc[16], mn[16];
    uint8_t q[PK_ELEMS];      // interleaved as above
} pk_weight;

typedef struct {
    float   dx[8];            // the scale of each group of 32
    int16_t bsum[16];         // the sum of the quants of each sub-block of 16
    int8_t  q[PK_ELEMS];      // interleaved as above
} pk_act;

// Whether a row of `cols` elements of `type` can be packed; 0: the float GEMM is used.
int gemm_q8_supports(int32_t type, int64_t cols);
// How many vectors' products add up in int16 before they must be scaled: the largest quant
// times 127 times 2 per lane, at most 32767 in all.
int gemm_q8_run(int32_t type);

// One weight row (cols / 256 packed super-blocks) and T rows of activations.
void pack_weight_row(int32_t type, const void *row, pk_weight *out, int64_t cols);
void pack_act_rows(const float *x, int T, int64_t cols, pk_act *out);

// out[t * stride + i] = dot(W row i, X row t) for i < n_rows, t < T; each row is cols / 256
// packed super-blocks. AVX2 where the CPU has it; the scalar reference gives the same
// integer sums, the float part in another order.
void gemm_q8_rows(const pk_weight *W, int n_rows, const pk_act *X, int T, int64_t cols, int run, float *out,
                  int64_t stride);
void gemm_q8_rows_scalar(const pk_weight *W, int n_rows, const pk_act *X, int T, int64_t cols, float *out,
                         int64_t stride);
