// kv-append.cu - a chunk's keys and values stored into the layer's KV lists (twin:
// kv_list_push of native/src/kv/kv-cache.c, the same bytes in every format).
#include "common.cuh"
#include "kv-rows.cuh"

#define KV_APPEND_THREADS 128

// blockIdx.x: t * n_head_kv + g (one stored row of the chunk), blockIdx.y: 0 keys, 1 values.
// Each thread stores storage units (a value, or a q8_0 block of 32) of the row.
__global__ void __launch_bounds__(KV_APPEND_THREADS)
kv_append_kernel(const struct cuda_kv_layer layer, const float *k, const float *v, int T) {
    const int row = blockIdx.x, g = row % layer.n_head_kv, t = row / layer.n_head_kv;
    const int32_t n0 = layer.n_dev ? layer.n_dev[g] - T : layer.n[g];   // the list's length before the chunk
    const int d = layer.head_dim, is_v = blockIdx.y;
    const int fmt = is_v ? layer.fmt_v : layer.fmt_k;
    const float *x = (is_v ? v : k) + (size_t)row * d;   // (t * n_head_kv + g) * head_dim
    void *dst = (char *)(is_v ? layer.v[g] : layer.k[g]) + (size_t)(n0 + t) * kv_row_bytes(fmt, d);
    const int units = kv_row_units(fmt, d);
    for (int u = threadIdx.x; u < units; u += KV_APPEND_THREADS) kv_store_unit(dst, fmt, x, u);
}

extern "C" void cuda_kv_append(cuda_stream s, const struct cuda_kv_layer *layer, const float *k, const float *v, int T) {
    if (T <= 0 || layer->n_head_kv <= 0) return;
    const dim3 grid((unsigned)T * (unsigned)layer->n_head_kv, 2);
    kv_append_kernel<<<grid, KV_APPEND_THREADS, 0, s>>>(*layer, k, v, T);
}
