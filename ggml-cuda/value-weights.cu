// value-weights.cu - CriticalKV's value weights (twin: critical_value_weights of
// native/src/kv/policies/criticalkv/critical.c): for query head h and candidate j of its list,
// sum over the output rows r of |W_o[r, h's columns] . v_j|, then per KV head the mean over its
// query heads. A block takes VW_CANDS candidates of one query head, their values as floats in
// shared memory, and streams W_o's rows for that head through shared memory VW_ROWS at a time;
// each thread takes one candidate and VW_ROWS / VW_GROUPS rows of each stage, and the groups'
// sums are added in a fixed order. Sums in float, in another order than the CPU's blocks.
#include <math.h>

#include "common.cuh"
#include "kv-rows.cuh"
#include "policy-kernels.h"

#define VW_CANDS 32
#define VW_ROWS 32
#define VW_THREADS 256
#define VW_GROUPS (VW_THREADS / VW_CANDS)   // row groups: each thread VW_ROWS / VW_GROUPS rows a stage

static __global__ void __launch_bounds__(VW_THREADS)
value_weights_kernel(const struct cuda_kv_layer layer, const struct cuda_vw_args a, const struct cuda_list_layout lay,
                     float *per_head) {
    const int hq = blockIdx.y, G = a.n_head / layer.n_head_kv, g = hq / G, d = layer.head_dim;
    const int32_t nc = a.n_cand[g], j0 = (int32_t)blockIdx.x * VW_CANDS;
    if (j0 >= nc) return;
    extern __shared__ float vw_smem[];
    float *v = vw_smem, *w = vw_smem + (size_t)VW_CANDS * d;   // (VW_CANDS, d), (VW_ROWS, d)
    const int32_t cands = nc - j0 < VW_CANDS ? nc - j0 : VW_CANDS;
    for (int x = threadIdx.x; x < VW_CANDS * d; x += VW_THREADS)
        v[x] = x / d < cands ? kv_load(kv_row(layer.v[g], layer.fmt_v, d, j0 + x / d), layer.fmt_v, x % d) : 0.0f;
    const int c = threadIdx.x % VW_CANDS, grp = threadIdx.x / VW_CANDS;
    const float *vc = v + (size_t)c * d;
    const size_t row_len = (size_t)a.n_head * d;
    float acc = 0.0f;
    for (int r0 = 0; r0 < a.n_embd; r0 += VW_ROWS) {
        __syncthreads();   // the values are in; the last stage's rows are used
        for (int x = threadIdx.x; x < VW_ROWS * d; x += VW_THREADS) {
            const int r = r0 + x / d;
            w[x] = r < a.n_embd ? a.wo[(size_t)r * row_len + (size_t)hq * d + x % d] : 0.0f;
        }
        __syncthreads();
        for (int k = grp; k < VW_ROWS; k += VW_GROUPS) {
            const float *wr = w + (size_t)k * d;
            float dot = 0.0f;
            for (int i = 0; i < d; i++) dot = fmaf(wr[i], vc[i], dot);
            acc += fabsf(dot);   // rows past n_embd are zeros
        }
    }
    __shared__ float part[VW_GROUPS][VW_CANDS];
    part[grp][c] = acc;
    __syncthreads();
    if (grp == 0 && c < cands) {
        float t = 0.0f;
        for (int k = 0; k < VW_GROUPS; k++) t += part[k][c];
        per_head[(size_t)hq * lay.n_max + j0 + c] = t;
    }
}

// w[off[g] + j] = the mean of list g's query heads' weights, in head order.
static __global__ void value_weights_mean_kernel(const struct cuda_kv_layer layer, const struct cuda_vw_args a,
                                                 const struct cuda_list_layout lay, const float *per_head, float *w) {
    const int g = blockIdx.y, G = a.n_head / layer.n_head_kv;
    const int32_t j = (int32_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= a.n_cand[g]) return;
    float s = 0.0f;
    for (int r = 0; r < G; r++) s = __fadd_rn(s, per_head[(size_t)(g * G + r) * lay.n_max + j]);
    w[lay.off[g] + j] = __fdiv_rn(s, (float)G);
}

extern "C" int cuda_value_weights_supported(const struct cuda_kv_layer *layer, const struct cuda_vw_args *a) {
    return layer->head_dim >= 1 && layer->head_dim <= CUDA_VW_MAX_D && a->n_embd >= 1 &&
           a->n_head >= layer->n_head_kv && a->n_head % layer->n_head_kv == 0;
}

extern "C" size_t cuda_value_weights_work_bytes(const struct cuda_kv_layer *layer, const struct cuda_vw_args *a) {
    return (size_t)a->n_head * cuda_list_layout_of(a->n_cand, layer->n_head_kv).n_max * sizeof(float);
}

extern "C" void cuda_value_weights(cuda_stream s, const struct cuda_kv_layer *layer, const struct cuda_vw_args *a,
                                   float *w, void *work) {
    if (!cuda_value_weights_supported(layer, a)) return;
    const struct cuda_list_layout lay = cuda_list_layout_of(a->n_cand, layer->n_head_kv);   // the candidates'
    if (lay.n_max == 0) return;
    float *per_head = (float *)work;
    const size_t smem = (size_t)(VW_CANDS + VW_ROWS) * layer->head_dim * sizeof(float);
    const dim3 grid((unsigned)cuda_blocks_for(lay.n_max, VW_CANDS), (unsigned)a->n_head);
    value_weights_kernel<<<grid, VW_THREADS, smem, s>>>(*layer, *a, lay, per_head);
    const dim3 mean_grid((unsigned)cuda_blocks_for(lay.n_max, 256), (unsigned)layer->n_head_kv);
    value_weights_mean_kernel<<<mean_grid, 256, 0, s>>>(*layer, *a, lay, per_head, w);
}
