// gemm.h - dot products of a few dequantized weight rows with many activation rows (prefill).
#pragma once
#include <stdint.h>

// out[t * out_stride + i] = dot(W[i, :], X[t, :]) for i < n_rows, t < T; rows have K floats.
void gemm_rows_f32(const float *W, int n_rows, const float *X, int T, int K, float *out, int64_t out_stride);
