// ops.h - the neural-net building blocks of the forward pass (float32 activations).
#pragma once
#include <stdint.h>
#include "cpu/gemm-q8.h"
#include "model/model.h"
#include "core/threadpool.h"

// out[i] = x[i] / rms(x) * w[i], for one row of n; AVX2 where the CPU has it (elementwise.c),
// rmsnorm_scalar otherwise and in the tests.
void rmsnorm(float *out, const float *x, const float *w, int n, float eps);
void rmsnorm_scalar(float *out, const float *x, const float *w, int n, float eps);

// RoPE: rotate adjacent pairs (x[2i], x[2i+1]) of each of n_heads heads by pos * inv_freq[i]
// (i < n_rot/2); dims past n_rot are left alone. This is the "normal" RoPE of llama.cpp's
// llama architecture. rope_inv_freq() fills inv_freq[i] = base^(-2i/n_rot) / factor[i];
// rope_angles() a token's cs[2i], cs[2i + 1] = cos, sin of pos * inv_freq[i] (n_rot floats,
// computed once per token for every layer); rope_rotate() rotates by them.
void rope_inv_freq(float *inv_freq, int n_rot, float base, const float *freq_factors);
void rope_angles(float *cs, int n_rot, int32_t pos, const float *inv_freq);
void rope_rotate(float *x, int n_heads, int head_dim, int n_rot, const float *cs);

// In-place softmax over n values (the max is subtracted first); AVX2 where the CPU has it,
// softmax_scalar (expf) otherwise and in the tests.
void softmax(float *x, int n);
void softmax_scalar(float *x, int n);
// The unnormalised half of softmax: x[i] = exp(x[i] - max) in place, *max_out = max;
// returns the sum (n >= 1).
float softmax_exp(float *x, int n, float *max_out);
float softmax_exp_scalar(float *x, int n, float *max_out);

// out[i] = silu(gate[i]) * up[i]; AVX2 where the CPU has it, swiglu_scalar otherwise.
void swiglu(float *out, const float *gate, const float *up, int n);
void swiglu_scalar(float *out, const float *gate, const float *up, int n);

// Row `row` of a weight matrix as floats.
pykv_status tensor_get_row(const struct tensor *t, int64_t row, float *out);

// out[T][rows] = x[T][cols] @ W^T for a weight of ne = (cols, rows), split across the pool.
// Unless buf->exact, the products take 8-bit activations and integer dot products, as
// llama.cpp does: one token (decode) has x quantised once and each row's dot product taken
// in integers (quant-q8.h), for the weight types with such kernels; several tokens (prefill)
// have x and each block of rows repacked for an integer GEMM (gemm-q8.h), for the types and
// widths it takes, and a float GEMM on dequantized rows otherwise. Exact mode is float.
#define MATMUL_ROW_BLOCK 16
// Per thread, room for a block of rows either dequantized or packed (short super-blocks
// take a whole pk_weight, so narrow rows need more than their floats).
static inline size_t matmul_scratch_floats(int64_t cols) {
    const size_t dequant = (size_t)MATMUL_ROW_BLOCK * (size_t)cols;
    const size_t packed = (size_t)MATMUL_ROW_BLOCK * (size_t)pk_blocks(cols) * (sizeof(pk_weight) / sizeof(float));
    return dequant > packed ? dequant : packed;
}
struct matmul_buf {
    float *dequant;   // threadpool_size(pool) * matmul_scratch_floats(cols) floats
    void  *xq;        // a quantised row (Q8_ACT_BYTES(cols))
    void  *xpk;       // n_ubatch * pk_blocks(cols) pk_act (prefill's packed activations)
    int    exact;     // float activations everywhere
};
void matmul(struct threadpool *pool, float *out, const struct tensor *w, const float *x, int T,
            const struct matmul_buf *buf);
// The same for n <= MATMUL_MANY matrices with the same input (q/k/v, gate/up): one token's
// products run as one dispatch over all their rows, with x quantised once. With
// MATMUL_SHORT_FLOAT a prefill keeps float activations for rows that end in a short
// super-block (matmul takes them in 8 bits): the forward pass asks it for q/k/v, whose keys
// and values every later token attends to. There 8-bit inputs move the next-token
// distribution measurably further from the float model's (the error is stored in the cache
// and read by every later token); in the other products they do not.
#define MATMUL_MANY 3
enum matmul_short_rows { MATMUL_SHORT_INT8, MATMUL_SHORT_FLOAT };
void matmul_many(struct threadpool *pool, int n, float *const *outs, const struct tensor *const *ws,
                 const float *x, int T, const struct matmul_buf *buf, enum matmul_short_rows short_rows);
