// kv-append.cu - a chunk's keys and values stored into the layer's KV lists (twin:
// kv_list_push of native/src/kv/kv-cache.c, the same bytes in every format), with the RoPE of
// the chunk's queries and keys in the same launch (elementwise.cu's rotation, the same floats).
#include "common.cuh"
#include "kv-rows.cuh"

#define KV_APPEND_THREADS 64

// blockIdx.x: row i of token t, i over the token's n_head query rows, then its n_head_kv key
// rows, then its value rows. A query row is turned in place; a key row is turned in place
// and then stored as entry n0 + t of list g; a value row is stored. Each thread turns pairs
// and stores storage units (a value, or a q8_0 block of 32) of the row.
__global__ void __launch_bounds__(KV_APPEND_THREADS)
rope_kv_append_kernel(const struct cuda_kv_layer layer, float *q, int n_head, float *k, const float *v, int T,
                      int n_rot, const float *cs) {
    const int n_kv = layer.n_head_kv, per_token = n_head + 2 * n_kv, d = layer.head_dim;
    const int t = blockIdx.x / per_token, i = blockIdx.x % per_token;
    const float *cs_t = cs + (size_t)t * n_rot;
    if (i < n_head) {
        float *row = q + ((size_t)t * n_head + i) * d;
        for (int p = threadIdx.x; p < n_rot / 2; p += KV_APPEND_THREADS) rope_pair(row, p, cs_t);
        return;
    }
    const int is_v = i >= n_head + n_kv, g = i - n_head - (is_v ? n_kv : 0);
    const size_t at = ((size_t)t * n_kv + g) * d;   // (t * n_head_kv + g) * head_dim
    if (!is_v && n_rot > 0) {   // the same for the whole block
        for (int p = threadIdx.x; p < n_rot / 2; p += KV_APPEND_THREADS) rope_pair(k + at, p, cs_t);
        __syncthreads();   // the turned pairs, seen by the threads that store their units
    }
    const int32_t n0 = layer.n_dev ? layer.n_dev[g] - T : layer.n[g];   // the list's length before the chunk
    const int fmt = is_v ? layer.fmt_v : layer.fmt_k;
    const float *x = (is_v ? v : k) + at;
    void *dst = (char *)(is_v ? layer.v[g] : layer.k[g]) + (size_t)(n0 + t) * kv_row_bytes(fmt, d);
    const int units = kv_row_units(fmt, d);
    for (int u = threadIdx.x; u < units; u += KV_APPEND_THREADS) kv_store_unit(dst, fmt, x, u);
}

extern "C" void cuda_rope_kv_append(cuda_stream s, const struct cuda_kv_layer *layer, float *q, int n_head, float *k,
                                    const float *v, int T, int n_rot, const float *cs) {
    if (T <= 0 || layer->n_head_kv <= 0) return;
    const int64_t blocks = (int64_t)T * (n_head + 2 * layer->n_head_kv);
    rope_kv_append_kernel<<<(unsigned)blocks, KV_APPEND_THREADS, 0, s>>>(*layer, q, n_head, k, v, T, n_rot, cs);
}

extern "C" void cuda_kv_append(cuda_stream s, const struct cuda_kv_layer *layer, const float *k, const float *v, int T) {
    cuda_rope_kv_append(s, layer, NULL, 0, (float *)k, v, T, 0, NULL);   // n_rot 0: k is only read
}
