// value-norms.cu - the largest L1 norm among the first rows of every value list of a layer
// (LAVa's vbar, which scales each KV head's window scores). A thread sums one row in index
// order with correctly rounded adds, as the host's loop does, so each norm is the CPU's bit
// for bit; the maximum, which no order changes, is an atomicMax on the norm's bits (norms are
// never negative, so their bits order as their values).
#include "common.cuh"
#include "kv-rows.cuh"
#include "policy-kernels.h"

#define NORM_THREADS 256

struct norm_rows {
    int32_t rows[CUDA_MAX_KV_HEADS];
};

static __global__ void __launch_bounds__(NORM_THREADS)
value_l1_max_kernel(const struct cuda_kv_layer layer, const struct norm_rows r, uint32_t *out) {
    const int g = blockIdx.y;
    const int64_t j = (int64_t)blockIdx.x * NORM_THREADS + threadIdx.x;
    if (j >= r.rows[g]) return;
    const void *row = kv_row(layer.v[g], layer.fmt_v, layer.head_dim, j);
    float n1 = 0.0f;
    for (int i = 0; i < layer.head_dim; i++) n1 = __fadd_rn(n1, fabsf(kv_load(row, layer.fmt_v, i)));
    if (n1 > 0.0f) atomicMax(out + g, f32_bits(n1));   // NaN is never larger, as on the host
}

extern "C" void cuda_value_l1_max(cuda_stream s, const struct cuda_kv_layer *layer, const int32_t *rows, float *out) {
    struct norm_rows r = { { 0 } };   // every word set: a struct argument is copied whole
    int32_t most = 0;
    for (int g = 0; g < layer->n_head_kv; g++) {
        r.rows[g] = rows[g] < 0 ? 0 : rows[g];
        most = r.rows[g] > most ? r.rows[g] : most;
    }
    cudaMemsetAsync(out, 0, (size_t)layer->n_head_kv * sizeof(float), s);   // 0.0f: the norm of no row
    if (most == 0) return;
    const dim3 grid((unsigned)((most + NORM_THREADS - 1) / NORM_THREADS), (unsigned)layer->n_head_kv);
    value_l1_max_kernel<<<grid, NORM_THREADS, 0, s>>>(*layer, r, (uint32_t *)out);
}
