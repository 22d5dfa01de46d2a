// expected-attention.cu - Expected Attention's scores of a layer's entries (twin: score_head and
// keep_list of native/src/kv/policies/expected-attention/expected-attention.c), in three
// launches:
//  1. the logits z = m . k + k^T A k of every query head and entry past the sinks: a block
//     takes EA_TILE entries of one query head, their keys as floats in shared memory; each
//     thread sums a quarter of the channels of one entry (Y_i = A_i . k in float, then
//     Y_i k_i and m_i k_i in double), and the quarters are added in order;
//  2. each query head's softmax over its list's entries past the sinks (the exponentials in
//     double, rounded to float as expf rounds, their sum in double);
//  3. per KV head the mean of its query heads' probabilities (in head order), times
//     ||v_j|| (with use_vnorm), the sinks +inf: the scores the selection ranks.
#include <math.h>

#include "common.cuh"
#include "kv-rows.cuh"
#include "policy-kernels.h"

#define EA_TILE 32      // entries per block of the logits
#define EA_PARTS 4      // threads per entry: each takes a quarter of the channels
#define EA_THREADS (EA_TILE * EA_PARTS)
#define EA_SOFTMAX_THREADS 256

struct ea_layout {
    int64_t off[CUDA_MAX_KV_HEADS];   // list g's scores start at off[g]
    int32_t n_max;                    // the longest list: the logits' row length
};

static __global__ void __launch_bounds__(EA_THREADS)
ea_logits_kernel(const struct cuda_kv_layer layer, const struct cuda_ea_args a, const struct ea_layout lay,
                 float *z) {
    const int hq = blockIdx.y, G = a.n_head / layer.n_head_kv, g = hq / G, d = layer.head_dim;
    const int32_t n = layer.n[g], j0 = a.first[g] + (int32_t)blockIdx.x * EA_TILE;
    if (j0 >= n) return;
    extern __shared__ float ea_keys[];   // (EA_TILE, d)
    __shared__ double part[EA_PARTS][EA_TILE];
    const int32_t rows = n - j0 < EA_TILE ? n - j0 : EA_TILE;
    for (int x = threadIdx.x; x < EA_TILE * d; x += EA_THREADS)   // rows past the list: zeros
        ea_keys[x] = x / d < rows ? kv_load(kv_row(layer.k[g], layer.fmt_k, d, j0 + x / d), layer.fmt_k, x % d) : 0.0f;
    __syncthreads();
    // a thread past the tile's rows works on row 0 and drops its sum (no branch around the barriers)
    const int e = threadIdx.x % EA_TILE, q = threadIdx.x / EA_TILE, active = e < rows;
    const float *k = ea_keys + (size_t)(e * active) * d, *m = a.m + (size_t)hq * d;
    const int i0 = q * d / EA_PARTS, i1 = (q + 1) * d / EA_PARTS;
    double v = 0.0;
    for (int i = i0; i < i1; i++) v = __dadd_rn(v, (double)m[i] * (double)k[i]);
    if (a.A) {
        const float *A = a.A + (size_t)hq * d * d;
        for (int i = i0; i < i1; i++) {
            float y = 0.0f;
            for (int l = 0; l < d; l++) y = fmaf(A[(size_t)i * d + l], k[l], y);
            v = __dadd_rn(v, (double)y * (double)k[i]);
        }
    }
    part[q][e] = v * (double)active;
    __syncthreads();
    if (q == 0 && e < rows) {
        double t = 0.0;
        for (int p = 0; p < EA_PARTS; p++) t = __dadd_rn(t, part[p][e]);
        z[(size_t)hq * lay.n_max + j0 + e] = (float)t;
    }
}

// Block reduce of one double (sum) or float (max) over the block; every thread gets the result.
static __device__ double block_sum(double x, double *smem) {
    smem[threadIdx.x] = x;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) smem[threadIdx.x] = __dadd_rn(smem[threadIdx.x], smem[threadIdx.x + s]);
        __syncthreads();
    }
    const double r = smem[0];
    __syncthreads();
    return r;
}

static __global__ void __launch_bounds__(EA_SOFTMAX_THREADS)
ea_softmax_kernel(const struct cuda_kv_layer layer, const struct cuda_ea_args a, const struct ea_layout lay, float *z) {
    const int hq = blockIdx.x, g = hq / (a.n_head / layer.n_head_kv);
    const int32_t n = layer.n[g], first = a.first[g];
    if (first >= n) return;
    __shared__ double red[EA_SOFTMAX_THREADS];
    float *row = z + (size_t)hq * lay.n_max;
    double top = -INFINITY;
    for (int32_t j = first + threadIdx.x; j < n; j += EA_SOFTMAX_THREADS) top = fmax(top, (double)row[j]);
    red[threadIdx.x] = top;
    __syncthreads();
    for (int s = EA_SOFTMAX_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] = fmax(red[threadIdx.x], red[threadIdx.x + s]);
        __syncthreads();
    }
    const float zmax = (float)red[0];
    __syncthreads();
    double sum = 0.0;
    for (int32_t j = first + threadIdx.x; j < n; j += EA_SOFTMAX_THREADS) {
        const float x = (float)exp((double)__fsub_rn(row[j], zmax));
        row[j] = x;
        sum = __dadd_rn(sum, (double)x);
    }
    sum = block_sum(sum, red);
    for (int32_t j = first + threadIdx.x; j < n; j += EA_SOFTMAX_THREADS) row[j] = (float)__ddiv_rn((double)row[j], sum);
}

static __global__ void __launch_bounds__(EA_SOFTMAX_THREADS)
ea_combine_kernel(const struct cuda_kv_layer layer, const struct cuda_ea_args a, const struct ea_layout lay,
                  const float *prob, float *scores) {
    const int g = blockIdx.y, G = a.n_head / layer.n_head_kv, d = layer.head_dim;
    const int32_t j = (int32_t)blockIdx.x * EA_SOFTMAX_THREADS + threadIdx.x;
    if (j >= layer.n[g]) return;
    float *out = scores + lay.off[g] + j;
    if (j < a.first[g]) {
        *out = INFINITY;
        return;
    }
    float s = 0.0f;
    for (int r = 0; r < G; r++) s = __fadd_rn(s, prob[(size_t)(g * G + r) * lay.n_max + j]);
    s = __fdiv_rn(s, (float)G);
    if (a.use_vnorm) {
        const void *v = kv_row(layer.v[g], layer.fmt_v, d, j);
        double vv = 0.0;
        for (int i = 0; i < d; i++) {
            const double x = (double)kv_load(v, layer.fmt_v, i);
            vv = __dadd_rn(vv, x * x);
        }
        s = (float)__dmul_rn(__dadd_rn((double)s, a.epsilon), sqrt(vv));
    }
    *out = s;
}

static int32_t ea_layout_of(const struct cuda_kv_layer *layer, struct ea_layout *lay) {
    memset(lay, 0, sizeof(*lay));   // every word set: a struct argument is copied whole
    int64_t total = 0;
    for (int g = 0; g < layer->n_head_kv; g++) {
        lay->off[g] = total;
        total += layer->n[g];
        lay->n_max = layer->n[g] > lay->n_max ? layer->n[g] : lay->n_max;
    }
    return lay->n_max;
}

extern "C" size_t cuda_ea_work_bytes(const struct cuda_kv_layer *layer, const struct cuda_ea_args *a) {
    struct ea_layout lay;
    return (size_t)a->n_head * (size_t)ea_layout_of(layer, &lay) * sizeof(float);
}

extern "C" int cuda_ea_supported(const struct cuda_kv_layer *layer, const struct cuda_ea_args *a) {
    return layer->head_dim >= 1 && layer->head_dim <= CUDA_EA_MAX_D && a->n_head >= layer->n_head_kv &&
           a->n_head % layer->n_head_kv == 0;
}

extern "C" void cuda_ea_scores(cuda_stream s, const struct cuda_kv_layer *layer, const struct cuda_ea_args *a,
                               float *scores, void *work) {
    if (!cuda_ea_supported(layer, a)) return;
    struct ea_layout lay;
    const int32_t n_max = ea_layout_of(layer, &lay);
    if (n_max == 0) return;
    float *z = (float *)work;
    int32_t most = 0;   // the most entries past the sinks of a list
    for (int g = 0; g < layer->n_head_kv; g++) {
        const int32_t past = layer->n[g] - a->first[g];
        most = past > most ? past : most;
    }
    if (most > 0) {
        const size_t smem = (size_t)EA_TILE * layer->head_dim * sizeof(float);
        const dim3 grid((unsigned)cuda_blocks_for(most, EA_TILE), (unsigned)a->n_head);
        ea_logits_kernel<<<grid, EA_THREADS, smem, s>>>(*layer, *a, lay, z);
        ea_softmax_kernel<<<a->n_head, EA_SOFTMAX_THREADS, 0, s>>>(*layer, *a, lay, z);
    }
    const dim3 grid((unsigned)cuda_blocks_for(n_max, EA_SOFTMAX_THREADS), (unsigned)layer->n_head_kv);
    ea_combine_kernel<<<grid, EA_SOFTMAX_THREADS, 0, s>>>(*layer, *a, lay, z, scores);
}
