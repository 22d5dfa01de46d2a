// kvzip-pass.cu - KVzip's reconstruction pass over a layer's lists (twin: pass_row of
// native/src/kv/policies/kvzip.c): query row t of query head h weighs, with one softmax, the
// first sink[g] entries of its list, the chunk's entries [c0[g], c0[g] + width) and the pass's
// own entries [self0[g], self0[g] + t]; each chunk entry keeps the largest weight any row of
// the head gives it. A block takes one (row, head): each warp takes entries in turn (a lane
// per channel slice, warp sums), the block's maximum and sum make the softmax, and the
// chunk's weights go into `best` with an atomic maximum on their bits (weights are never
// negative, so their bits order as their values; the result does not depend on the order).
#include <math.h>

#include "common.cuh"
#include "kv-rows.cuh"
#include "policy-kernels.h"

#define KVZIP_THREADS 128
#define KVZIP_WARPS (KVZIP_THREADS / CUDA_WARP)

// The list row of entry e of the row's softmax (sinks, then the chunk, then the pass's own).
static __device__ __forceinline__ int32_t kvzip_row(const struct cuda_kvzip_args &a, int g, int32_t e) {
    if (e < a.sink[g]) return e;
    if (e < a.sink[g] + a.width) return a.c0[g] + (e - a.sink[g]);
    return a.self0[g] + (e - a.sink[g] - a.width);
}

static __global__ void __launch_bounds__(KVZIP_THREADS)
kvzip_pass_kernel(const struct cuda_kv_layer layer, const float *q, const struct cuda_kvzip_args a, uint32_t *best) {
    const int t = blockIdx.x, h = blockIdx.y, g = h / (a.n_head / layer.n_head_kv), d = layer.head_dim;
    const int lane = threadIdx.x % CUDA_WARP, warp = threadIdx.x / CUDA_WARP;
    const int32_t n = a.sink[g] + a.width + t + 1;
    extern __shared__ float kvzip_z[];   // (n) the row's logits, then its weights
    __shared__ float red[KVZIP_WARPS];
    const float *qr = q + ((size_t)t * a.n_head + h) * d;
    const float scale = 1.0f / sqrtf((float)d);
    for (int32_t e = warp; e < n; e += KVZIP_WARPS) {
        const void *k = kv_row(layer.k[g], layer.fmt_k, d, kvzip_row(a, g, e));
        float dot = 0.0f;
        for (int c = lane; c < d; c += CUDA_WARP) dot = fmaf(qr[c], kv_load(k, layer.fmt_k, c), dot);
        dot = warp_sum(dot);
        if (lane == 0) kvzip_z[e] = dot * scale;
    }
    __syncthreads();
    float m = -INFINITY;
    for (int32_t e = threadIdx.x; e < n; e += KVZIP_THREADS) m = fmaxf(m, kvzip_z[e]);
    m = warp_max(m);
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = red[0];
    for (int w = 1; w < KVZIP_WARPS; w++) m = fmaxf(m, red[w]);
    __syncthreads();   // every thread has read red before it is reused
    float sum = 0.0f;
    for (int32_t e = threadIdx.x; e < n; e += KVZIP_THREADS) {
        const float x = expf(kvzip_z[e] - m);
        kvzip_z[e] = x;
        sum += x;
    }
    sum = warp_sum(sum);
    if (lane == 0) red[warp] = sum;
    __syncthreads();
    sum = 0.0f;
    for (int w = 0; w < KVZIP_WARPS; w++) sum += red[w];
    for (int32_t j = threadIdx.x; j < a.width; j += KVZIP_THREADS) {
        const float p = kvzip_z[a.sink[g] + j] / sum;
        atomicMax(best + (size_t)h * a.width + j, f32_bits(p));
    }
}

extern "C" size_t cuda_kvzip_pass_smem(const struct cuda_kv_layer *layer, const struct cuda_kvzip_args *a) {
    int32_t most = 0;
    for (int g = 0; g < layer->n_head_kv; g++) most = a->sink[g] > most ? a->sink[g] : most;
    return (size_t)(most + a->width + a->T) * sizeof(float);
}

extern "C" int cuda_kvzip_pass_supported(const struct cuda_kv_layer *layer, const struct cuda_kvzip_args *a) {
    return a->n_head >= layer->n_head_kv && a->n_head % layer->n_head_kv == 0 && a->T >= 1 && a->width >= 0 &&
           cuda_kvzip_pass_smem(layer, a) <= 48 * 1024;
}

extern "C" void cuda_kvzip_pass(cuda_stream s, const struct cuda_kv_layer *layer, const float *q,
                                const struct cuda_kvzip_args *a, float *best) {
    if (!cuda_kvzip_pass_supported(layer, a) || a->width == 0) return;
    cudaMemsetAsync(best, 0, (size_t)a->n_head * a->width * sizeof(float), s);   // 0.0f: no weight yet
    const dim3 grid((unsigned)a->T, (unsigned)a->n_head);
    kvzip_pass_kernel<<<grid, KVZIP_THREADS, cuda_kvzip_pass_smem(layer, a), s>>>(*layer, q, *a, (uint32_t *)best);
}
