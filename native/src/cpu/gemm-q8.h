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
// g = p / 2 its group of 32): Q2_K, Q3_K and Q6_K put their super-block scale in dw and dmin
// in dm and their sub-blocks' scales and mins in sc and mn; the types whose scales are per
// group of 32 (Q4_0..Q5_1, Q4_K, Q5_K, Q8_0, IQ4_NL, IQ4_XS) fold them into dw and dm, with
// sc = mn = 1 ("unit scales"). The product of a weight row with a token is then, per group g,
//   dx[g] * (dw[g] * sum_p sc[p] * sum(q * qx) - dm[g] * sum_p mn[p] * bsum[p]).
//
// Where the CPU has AVX-512 VNNI, the unit-scale types take another kernel (gemm-q8-vnni.c):
// vpdpbusd multiplies the same 32 u8 x s8 pairs and adds each four into an int32 lane, in one
// instruction where AVX2 takes two. Lane k's four bytes are then elements of sub-blocks 2k and
// 2k + 1, i.e. of group k, which only unit scales allow; and with no int16 sums the quants may
// be 8 bits wide, so Q8_0 and the IQ4 levels, signed, are packed shifted by 128 (dm = 128 dw).
// Their pairs of products overflow int16, so they are packed only where that kernel runs.
//
// A row that is not whole super-blocks (the 32-element types only: SmolLM2's rows are 576 =
// 2 x 256 + 64) ends with a short super-block of its last elements, zero-padded to a width of
// 32, 64, 128 or 256 (pk_tail_width), in width / 32 vectors. m = 256 / width lanes share each
// sub-block, so that a lane still sees one sub-block in every vector: byte b of vector v holds
// element 16 * (L / m) + 2 * (m * v + L % m) + b % 2 of the short block, L = b / 2 (m = 1 is
// the layout above). Its scales are spread the same way: sc and mn per lane (lane L: sub-block
// L / m), dw, dm and dx per pair of lanes (pair k: group k / m), and a sub-block's bsum on its
// first lane, zero on the others. Only the short block's own vectors are multiplied.
#pragma once
#include <stdint.h>

#include "cpu/quant-q8.h"

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

// Packed super-blocks in a row of `cols` elements, a short last one included.
static inline int64_t pk_blocks(int64_t cols) { return (cols + PK_ELEMS - 1) / PK_ELEMS; }
// The padded width of a row's last super-block: 256 when the row is whole super-blocks.
static inline int pk_tail_width(int64_t cols) {
    const int tail = (int)(cols % PK_ELEMS);
    return tail == 0 ? PK_ELEMS : tail <= 32 ? 32 : tail <= 64 ? 64 : tail <= 128 ? 128 : PK_ELEMS;
}

// Whether a row of `cols` elements of `type` can be packed; 0: the float GEMM is used.
int gemm_q8_supports(int32_t type, int64_t cols);
// How many vectors' products add up in int16 before the AVX2 kernel must scale them: the
// largest quant times 127 times 2 per lane, at most 32767 in all; 0 for the 8-bit types.
int gemm_q8_run(int32_t type);
// Whether the type's packed rows have sc = mn = 1 (the VNNI kernel's types).
int gemm_q8_unit_scales(int32_t type);
// Whether the CPU runs the VNNI kernel.
int gemm_q8_has_vnni(void);

// One weight row (pk_blocks(cols) packed super-blocks) and T rows of activations.
void pack_weight_row(int32_t type, const void *row, pk_weight *out, int64_t cols);
void pack_act_rows(const float *x, int T, int64_t cols, pk_act *out);

// out[t * stride + i] = dot(W row i, X row t) for i < n_rows, t < T; each row is pk_blocks(cols)
// packed super-blocks of `type`. The VNNI kernel for the unit-scale types where the CPU has
// it, else AVX2 where it has that; the scalar reference gives the same integer sums, the
// float part in another order.
void gemm_q8_rows(const pk_weight *W, int n_rows, const pk_act *X, int T, int64_t cols, int32_t type, float *out,
                  int64_t stride);
void gemm_q8_rows_scalar(const pk_weight *W, int n_rows, const pk_act *X, int T, int64_t cols, float *out,
                         int64_t stride);
// Each SIMD kernel on its own, for the tests: 0 without touching out where the CPU lacks it.
// The AVX2 one takes gemm_q8_run(type); the VNNI one unit-scale types only.
int gemm_q8_rows_avx2(const pk_weight *W, int n_rows, const pk_act *X, int T, int64_t cols, int run, float *out,
                      int64_t stride);
int gemm_q8_rows_vnni(const pk_weight *W, int n_rows, const pk_act *X, int T, int64_t cols, float *out,
                      int64_t stride);
