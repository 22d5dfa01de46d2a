// entry-scores.cu - the scores of the policies that rank each entry by its own key and value
// (Knorm, KeyDiff, LagKV), for every list of a layer in one pass. Each score is formed as the
// CPU's scorer forms it (knorm.c, keydiff.c, lagkv.c): sums in double in the same order, with
// the _rn intrinsics where nvcc would otherwise fuse a multiply into an add, so that a score
// is the CPU's bit for bit (LagKV's softmax aside: the device's exp may differ from the host's
// in the last bit of a double).
//
// Knorm and KeyDiff: a thread per entry takes its key's squared norm in channel order.
// KeyDiff's anchor (the mean unit key) is a sum over the whole list in entry order, one thread
// per channel; then a thread per entry takes its cosine to it. LagKV: every entry scores 1 (or
// the short-list rule), then a block per scored partition: the reference's channel ranges, the
// entries' spreads, their softmax, and the ranks inside the partition.
#include "common.cuh"
#include "kv-rows.cuh"
#include "policy-kernels.h"

#define ENTRY_THREADS 256

struct entry_lists {
    struct cuda_list_layout lay;         // list g's scores start at lay.off[g]
    int32_t scored[CUDA_MAX_KV_HEADS];   // nonzero: list g is scored (it holds more than the budget)
};

// The squared norm of a stored key, channel by channel in double (each square is exact).
static __device__ __forceinline__ double key_sq(const void *row, int fmt, int d) {
    double sq = 0.0;
    for (int c = 0; c < d; c++) {
        const double x = (double)kv_load(row, fmt, c);
        sq = __dadd_rn(sq, __dmul_rn(x, x));
    }
    return sq;
}

// Knorm's score -|k_j| into scores, or KeyDiff's |k_j| into norms.
static __global__ void __launch_bounds__(ENTRY_THREADS)
key_norm_kernel(const struct cuda_kv_layer layer, const struct entry_lists e, float *scores, double *norms) {
    const int g = blockIdx.y;
    const int64_t j = (int64_t)blockIdx.x * ENTRY_THREADS + threadIdx.x;
    if (!e.scored[g] || j >= layer.n[g]) return;
    const double n = sqrt(key_sq(kv_row(layer.k[g], layer.fmt_k, layer.head_dim, j), layer.fmt_k, layer.head_dim));
    if (norms) norms[e.lay.off[g] + j] = n;
    else scores[e.lay.off[g] + j] = (float)-n;
}

// KeyDiff's anchor of list blockIdx.x: a[c] = mean_j k_j[c] / max(|k_j|, 1e-12), summed in entry
// order; then anchor[d] = max(|a|, 1e-8). Thread c takes channel c.
static __global__ void keydiff_anchor_kernel(const struct cuda_kv_layer layer, const struct entry_lists e,
                                             const double *norms, double *anchor) {
    const int g = blockIdx.x, d = layer.head_dim;
    if (!e.scored[g]) return;
    const int32_t n = layer.n[g];
    double *a = anchor + (size_t)g * (d + 1);
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        double acc = 0.0;
        for (int32_t j = 0; j < n; j++) {
            const double x = (double)kv_load(kv_row(layer.k[g], layer.fmt_k, d, j), layer.fmt_k, c);
            acc = __dadd_rn(acc, __ddiv_rn(x, fmax(norms[e.lay.off[g] + j], 1e-12)));
        }
        a[c] = __ddiv_rn(acc, (double)n);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double sq = 0.0;
        for (int c = 0; c < d; c++) sq = __dadd_rn(sq, __dmul_rn(a[c], a[c]));
        a[d] = fmax(sqrt(sq), 1e-8);
    }
}

// KeyDiff's score -cos(k_j, anchor).
static __global__ void __launch_bounds__(ENTRY_THREADS)
keydiff_score_kernel(const struct cuda_kv_layer layer, const struct entry_lists e, const double *norms,
                     const double *anchor, float *scores) {
    const int g = blockIdx.y, d = layer.head_dim;
    const int64_t j = (int64_t)blockIdx.x * ENTRY_THREADS + threadIdx.x;
    if (!e.scored[g] || j >= layer.n[g]) return;
    const double *a = anchor + (size_t)g * (d + 1);
    const void *row = kv_row(layer.k[g], layer.fmt_k, d, j);
    double dot = 0.0;
    for (int c = 0; c < d; c++) dot = __dadd_rn(dot, __dmul_rn((double)kv_load(row, layer.fmt_k, c), a[c]));
    scores[e.lay.off[g] + j] = (float)__ddiv_rn(-dot, __dmul_rn(fmax(norms[e.lay.off[g] + j], 1e-8), a[d]));
}

// LagKV's layout of a list of n entries (lagkv.c): `sink` entries, whole partitions of `lag`,
// then the rest; `short_rule` when it keeps its sinks and newest entries instead.
struct lag_plan {
    int32_t n_parts, end, short_rule;
};
static __device__ __forceinline__ struct lag_plan lag_plan_of(int32_t n, const struct cuda_entry_args &a) {
    struct lag_plan p;
    p.n_parts = n >= a.sink ? (n - a.sink) / a.lag : 0;
    p.end = a.sink + p.n_parts * a.lag;
    const int32_t tail = n - p.end + a.lag;
    p.short_rule = n < a.sink + 2 * a.lag || a.budget < a.sink + tail;
    return p;
}

// Every entry's score before the partitions are scored: 1, or for a short list the sinks 1 and
// then (j - sink) / (n - sink).
static __global__ void __launch_bounds__(ENTRY_THREADS)
lagkv_fill_kernel(const struct cuda_kv_layer layer, const struct entry_lists e, const struct cuda_entry_args a,
                  float *scores) {
    const int g = blockIdx.y;
    const int32_t n = layer.n[g];
    const int64_t j = (int64_t)blockIdx.x * ENTRY_THREADS + threadIdx.x;
    if (!e.scored[g] || j >= n) return;
    const int short_rule = lag_plan_of(n, a).short_rule;
    scores[e.lay.off[g] + j] = short_rule && j >= a.sink ? __fdiv_rn((float)(j - a.sink), (float)(n - a.sink)) : 1.0f;
}

// The softmax weights w[0 .. lag) of the partition starting at entry p0 of the rows (keys or
// values), each channel scaled by the range of the reference partition after it. lo, hi: d
// floats of shared memory; ex: lag + 1 doubles.
static __device__ void lag_weights(const void *rows, int fmt, int d, int32_t p0, int32_t lag, float *lo, float *hi,
                                   double *ex, float *w) {
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float l = 0.0f, h = 0.0f;
        for (int32_t j = p0 + lag; j < p0 + 2 * lag; j++) {
            const float x = kv_load(kv_row(rows, fmt, d, j), fmt, c);
            if (j == p0 + lag || x < l) l = x;
            if (j == p0 + lag || x > h) h = x;
        }
        lo[c] = l;
        hi[c] = h;
    }
    __syncthreads();
    for (int32_t i = threadIdx.x; i < lag; i += blockDim.x) {
        const void *row = kv_row(rows, fmt, d, p0 + i);
        double sum = 0.0;
        for (int c = 0; c < d; c++) {
            const double range = (double)hi[c] - lo[c];
            const double y = range > 0.0 ? __ddiv_rn((double)kv_load(row, fmt, c) - lo[c], range) : 0.0;
            sum = __dadd_rn(sum, y);
        }
        const double mean = __ddiv_rn(sum, (double)d);
        double sq = 0.0;
        for (int c = 0; c < d; c++) {
            const double range = (double)hi[c] - lo[c];
            const double y = range > 0.0 ? __ddiv_rn((double)kv_load(row, fmt, c) - lo[c], range) : 0.0;
            sq = __dadd_rn(sq, __dmul_rn(y - mean, y - mean));
        }
        w[i] = (float)(d > 1 ? sqrt(__ddiv_rn(sq, (double)(d - 1))) : 0.0);
    }
    __syncthreads();
    double *slot = ex + lag;   // the largest weight, then the exponentials' sum
    if (threadIdx.x == 0) {
        double top = -INFINITY;
        for (int32_t i = 0; i < lag; i++) top = w[i] > top ? w[i] : top;
        *slot = top;
    }
    __syncthreads();
    for (int32_t i = threadIdx.x; i < lag; i += blockDim.x) ex[i] = exp((double)w[i] - *slot);
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int32_t i = 0; i < lag; i++) t = __dadd_rn(t, ex[i]);
        *slot = t;
    }
    __syncthreads();
    for (int32_t i = threadIdx.x; i < lag; i += blockDim.x) w[i] = (float)__ddiv_rn(ex[i], *slot);
    __syncthreads();
}

// Partition blockIdx.x of list blockIdx.y, scored against the next: the mean of its key and
// value weights, or (cross = 0) its rank inside the partition / lag. Dynamic shared memory:
// lag + 1 doubles, 2 lag floats, 2 d floats.
static __global__ void lagkv_partition_kernel(const struct cuda_kv_layer layer, const struct entry_lists e,
                                              const struct cuda_entry_args a, float *scores) {
    const int g = blockIdx.y, d = layer.head_dim;
    const int32_t n = layer.n[g], lag = a.lag;
    if (!e.scored[g]) return;
    const struct lag_plan p = lag_plan_of(n, a);
    const int32_t p0 = a.sink + (int32_t)blockIdx.x * lag;
    if (p.short_rule || p0 + lag >= p.end) return;
    extern __shared__ double lag_smem[];
    double *ex = lag_smem;
    float *wk = (float *)(ex + lag + 1), *wv = wk + lag, *lo = wv + lag, *hi = lo + d;
    lag_weights(layer.k[g], layer.fmt_k, d, p0, lag, lo, hi, ex, wk);
    lag_weights(layer.v[g], layer.fmt_v, d, p0, lag, lo, hi, ex, wv);
    for (int32_t i = threadIdx.x; i < lag; i += blockDim.x) wk[i] = __fdiv_rn(__fadd_rn(wk[i], wv[i]), 2.0f);
    __syncthreads();
    float *out = scores + e.lay.off[g] + p0;
    for (int32_t i = threadIdx.x; i < lag; i += blockDim.x) {
        if (a.cross) {
            out[i] = wk[i];
            continue;
        }
        int32_t below = 0;   // ties: the lower index ranks lower
        for (int32_t k = 0; k < lag; k++) below += wk[k] < wk[i] || (wk[k] == wk[i] && k < i);
        out[i] = __fdiv_rn((float)below, (float)lag);
    }
}

// The lists scored and their offsets; returns the most entries of a scored list (0: none).
static int32_t entry_lists_of(const struct cuda_kv_layer *layer, int32_t budget, struct entry_lists *e) {
    memset(e, 0, sizeof(*e));   // every word set: a struct argument is copied whole
    e->lay = cuda_list_layout_of(layer->n, layer->n_head_kv);
    int32_t most = 0;
    for (int g = 0; g < layer->n_head_kv; g++) {
        e->scored[g] = layer->n[g] > budget;
        if (e->scored[g] && layer->n[g] > most) most = layer->n[g];
    }
    return most;
}

static size_t lagkv_smem_bytes(int32_t lag, int d) {
    return (size_t)(lag + 1) * sizeof(double) + 2 * (size_t)lag * sizeof(float) + 2 * (size_t)d * sizeof(float);
}

extern "C" size_t cuda_entry_work_bytes(const struct cuda_kv_layer *layer, const struct cuda_entry_args *a) {
    if (a->rule != CUDA_ENTRY_KEYDIFF) return 0;
    const int64_t total = cuda_list_layout_of(layer->n, layer->n_head_kv).total;
    return cuda_align((size_t)total * sizeof(double)) + (size_t)layer->n_head_kv * (layer->head_dim + 1) * sizeof(double);
}

extern "C" int cuda_entry_supported(const struct cuda_kv_layer *layer, const struct cuda_entry_args *a) {
    if (layer->head_dim < 1 || layer->head_dim > CUDA_ENTRY_MAX_D) return 0;
    if (a->rule == CUDA_ENTRY_KNORM || a->rule == CUDA_ENTRY_KEYDIFF) return 1;
    return a->rule == CUDA_ENTRY_LAGKV && a->lag >= 2 && a->lag <= CUDA_LAGKV_MAX_LAG && a->sink >= 0;
}

extern "C" void cuda_entry_scores(cuda_stream s, const struct cuda_kv_layer *layer, const struct cuda_entry_args *a,
                                  float *scores, void *work) {
    if (!cuda_entry_supported(layer, a)) return;
    struct entry_lists e;
    const int32_t most = entry_lists_of(layer, a->budget, &e);
    if (most == 0) return;
    const dim3 per_entry((unsigned)cuda_blocks_for(most, ENTRY_THREADS), (unsigned)layer->n_head_kv);
    if (a->rule == CUDA_ENTRY_KNORM) {
        key_norm_kernel<<<per_entry, ENTRY_THREADS, 0, s>>>(*layer, e, scores, (double *)NULL);
    } else if (a->rule == CUDA_ENTRY_KEYDIFF) {
        double *norms = (double *)work;
        double *anchor = (double *)((char *)work + cuda_align((size_t)e.lay.total * sizeof(double)));
        key_norm_kernel<<<per_entry, ENTRY_THREADS, 0, s>>>(*layer, e, (float *)NULL, norms);
        const int threads = layer->head_dim < 128 ? 32 * ((layer->head_dim + 31) / 32) : 128;
        keydiff_anchor_kernel<<<layer->n_head_kv, threads, 0, s>>>(*layer, e, norms, anchor);
        keydiff_score_kernel<<<per_entry, ENTRY_THREADS, 0, s>>>(*layer, e, norms, anchor, scores);
    } else {
        lagkv_fill_kernel<<<per_entry, ENTRY_THREADS, 0, s>>>(*layer, e, *a, scores);
        const int32_t parts = (most - a->sink) / a->lag;   // partitions of the longest list; the last is unscored
        if (parts < 2) return;
        const size_t smem = lagkv_smem_bytes(a->lag, layer->head_dim);
        const int threads = a->lag < ENTRY_THREADS ? 32 * ((a->lag + 31) / 32) : ENTRY_THREADS;
        const dim3 grid((unsigned)(parts - 1), (unsigned)layer->n_head_kv);
        lagkv_partition_kernel<<<grid, threads, smem, s>>>(*layer, e, *a, scores);
    }
}
