// kernels.h - the CUDA kernels of the forward pass, callable from C. Each launcher enqueues
// its work on stream s and returns at once (launch errors surface at cuda_check or the next
// synchronising call). Every pointer is device memory; activations are float32 row-major,
// as in the CPU path. Each kernel has a CPU twin in native/src/cpu, and tests/c/test_cuda_*
// compare them on random inputs.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "device.h"

#ifdef __cplusplus
extern "C" {
#endif

// ---- matrix products (matvec.cu, matmul.cu) ----
// out[t][r] = sum_c x[t][c] * W[r][c] for t < T, r < rows: W has `rows` rows of `cols`
// values in GGUF type `type`, each row type_row_bytes(type, cols) bytes, back to back (the
// file's layout, uploaded as is). cuda_matmul picks the path: T <= CUDA_MATVEC_MAX_T takes
// the 8-bit activation path (x quantised to Q8_1 blocks in work, integer dot products with
// dp4a per weight type); larger T the tensor-core path (x converted to f16 rows in work, tiles
// of W dequantised to f16, f16 mma with f32 accumulation). work: cuda_matmul_work_bytes(cols, T)
// bytes.
#define CUDA_MATVEC_MAX_T 8
int    cuda_matmul_supported(int32_t type);   // 1: F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K
// Whether a weight type is quantised (its few-row products take 8-bit activations), not a
// float type (F32, F16, BF16: those read the float activations).
static inline int cuda_type_quantised(int32_t type) {
    return type != PYKV_TYPE_F32 && type != PYKV_TYPE_F16 && type != PYKV_TYPE_BF16;
}
size_t cuda_matmul_work_bytes(int64_t cols, int T);
void   cuda_matmul(cuda_stream s, float *out, const void *w, int32_t type, int64_t cols, int64_t rows,
                   const float *x, int T, void *work);
// cuda_matmul in two steps, for several products of the same x (q, k and v; gate and up):
// cuda_matmul_stage puts x in work as the path for T reads it (Q8_1 blocks or f16 rows), once;
// then cuda_matmul_staged is each product, the same as cuda_matmul's (x, still needed by the
// float weight types' few-row path, must not have changed).
void   cuda_matmul_stage(cuda_stream s, void *work, const float *x, int64_t cols, int T);
void   cuda_matmul_staged(cuda_stream s, float *out, const void *w, int32_t type, int64_t cols, int64_t rows,
                          const float *x, int T, const void *work);
// The two paths on their own, for any T (tests; cuda_matmul chooses between them).
void   cuda_matvec_q8(cuda_stream s, float *out, const void *w, int32_t type, int64_t cols, int64_t rows,
                      const float *x, int T, void *work);
void   cuda_matmul_mma(cuda_stream s, float *out, const void *w, int32_t type, int64_t cols, int64_t rows,
                       const float *x, int T, void *work);
// The 8-bit activation path in steps, for decode (T <= CUDA_MATVEC_MAX_T rows): one
// quantisation serves every product with the same input, and the RMSNorm or SwiGLU before it
// is fused into it. xq holds each row's Q8_1 blocks of 32 (cuda_q8_1_bytes; cols a multiple
// of 32). Then out (T x rows) = W . xq for a quantised weight type (not F32, F16, BF16), or
// out += W . xq with accumulate (the residual add fused in).
size_t cuda_q8_1_bytes(int64_t cols, int T);
void   cuda_quantize_q8_1(cuda_stream s, void *xq, const float *x, int64_t cols, int T);
// xq = Q8_1 of rmsnorm(x[t]) * w (rows of n, as cuda_rmsnorm), for the T rows.
void   cuda_rmsnorm_q8_1(cuda_stream s, void *xq, const float *x, const float *w, int n, int T, float eps);
// xq = Q8_1 of silu(gate[t]) * up[t] (rows of n, as cuda_swiglu).
void   cuda_swiglu_q8_1(cuda_stream s, void *xq, const float *gate, const float *up, int n, int T);
void   cuda_matvec_q8_pre(cuda_stream s, float *out, const void *w, int32_t type, int64_t cols, int64_t rows,
                          const void *xq, int T, int accumulate);
// Rows ids[0..T) of W (type as above) as floats: out[t][c] (the token embeddings).
void   cuda_get_rows(cuda_stream s, float *out, const void *w, int32_t type, int64_t cols, const int32_t *ids, int T);

// ---- element-wise (elementwise.cu) ----
// out[r][i] = x[r][i] / rms(x[r]) * w[i] for rows r < n_rows of n (out may be x).
void cuda_rmsnorm(cuda_stream s, float *out, const float *x, const float *w, int n, int n_rows, float eps);
// x: T tokens of n_heads heads of head_dim; rotate pairs (2i, 2i+1), i < n_rot/2, of token t
// by cs[t][2i] = cos, cs[t][2i+1] = sin (the CPU's rope_angles table for the chunk).
void cuda_rope(cuda_stream s, float *x, int T, int n_heads, int head_dim, int n_rot, const float *cs);
// out[i] = silu(gate[i]) * up[i] (out may be gate).
void cuda_swiglu(cuda_stream s, float *out, const float *gate, const float *up, int64_t n);
// y[i] += x[i].
void cuda_add(cuda_stream s, float *y, const float *x, int64_t n);

// ---- the KV lists and attention (kv-append.cu, attention-decode.cu, attention-prefill.cu) ----
// One layer's lists as the kernels see them, passed by value: list g of the layer holds n[g]
// entries; key j of list g is row j of k[g] (rows of head_dim values stored as fmt_k, an
// enum kv_format: 0 f32, 1 f16, 2 q8_0 in 34-byte blocks of 32), value j of v[g] the same.
// With n_dev set, the kv-append and decode-attention kernels read the lengths from n_dev[g]
// in device memory instead, when they run: a captured CUDA graph then serves every decode
// step (the lengths change, the launch does not), and the decode launch sizes its grid for
// lists of up to n_bound entries.
#define CUDA_MAX_KV_HEADS 64
struct cuda_kv_layer {
    void          *k[CUDA_MAX_KV_HEADS];
    void          *v[CUDA_MAX_KV_HEADS];
    int32_t        n[CUDA_MAX_KV_HEADS];
    const int32_t *n_dev;     // NULL: the lengths are n[]
    int32_t        n_bound;   // with n_dev: the most entries a list may hold
    int32_t        n_head_kv;
    int32_t        head_dim;
    int32_t        fmt_k;
    int32_t        fmt_v;
    // Merged entries (EMS; the attention kernels only): NULL, or list g's member bookkeeping
    // in device memory, as kv_list holds it: n_members (members_cap ints), member_at
    // (members_cap ints), then the pool of member key norms (floats, ascending per entry).
    // Attention expands entry j with n_members[j] > 1 into one logit per member,
    // norm * (q . key) / sqrt(head_dim), all sharing its value (the CPU's attention_group).
    const int32_t *members[CUDA_MAX_KV_HEADS];
    int32_t        members_cap[CUDA_MAX_KV_HEADS];
};
// Store token t's key and value of KV head g (k + (t * n_head_kv + g) * head_dim, same for v)
// as entry n[g] + t of list g (n_dev[g] - T + t with n_dev: the lengths after the chunk), in
// the list's formats (q8_0 rounds as the CPU's kv-cache.c).
void cuda_kv_append(cuda_stream s, const struct cuda_kv_layer *layer, const float *k, const float *v, int T);
// cuda_rope of the chunk's queries (q: T tokens of n_head heads) and keys (k), then
// cuda_kv_append of the turned keys and v, in one launch; q and k are left turned.
void cuda_rope_kv_append(cuda_stream s, const struct cuda_kv_layer *layer, float *q, int n_head, float *k,
                         const float *v, int T, int n_rot, const float *cs);

// A decode step (flash-decoding): query head h (q + h * head_dim, n_head heads, head h reads
// KV head h / (n_head / n_head_kv)) attends over all n[g] entries of its list; out has the
// same layout as q. Each list is cut into segments whose count depends only on n[g]
// (cuda_attention_segments); the partials are merged in a fixed order, so the result does
// not depend on the card. work: cuda_attention_decode_work_bytes(n_head, head_dim, max_n).
// xq: NULL, or out as Q8_1 blocks too (cuda_quantize_q8_1 of the n_head * head_dim values).
int    cuda_attention_segments(int32_t n);
size_t cuda_attention_decode_work_bytes(int n_head, int head_dim, int32_t max_n);
void   cuda_attention_decode(cuda_stream s, const struct cuda_kv_layer *layer, const float *q, int n_head,
                             float *out, void *xq, void *work);
// A prefill chunk of T tokens (causal flash attention): token t's query heads (q + (t * n_head
// + h) * head_dim) attend over the first n_before[g] + t + 1 entries of their list, where
// n_before[g] = layer->n[g] - T (the chunk's keys are already appended); out as q.
void   cuda_attention_prefill(cuda_stream s, const struct cuda_kv_layer *layer, const float *q, int n_head, int T,
                              float *out);

#ifdef __cplusplus
}
#endif
