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

static __global__ void __launch_bounds__(EA_THREADS)
ea_logits_kernel(const struct cuda_kv_layer layer, const struct cuda_ea_args a, const struct cuda_list_layout lay,
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

// The sum of one double per thread over the block (a tree in a fixed order); every thread gets it.
static __device__ double block_sum(double x, double *smem) {
    smem[threadIdx.x] = x;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) smem[threadIdx.x] = __dadd_rn(smem[threadIdx.x], smem[threadIdx.x + s]);
        __syncthreads();
    }
    const double r = smem[0];
    __syncthreads();
    return r;
}

static __global__ void __launch_bounds__(EA_SOFTMAX_THREADS)
ea_softmax_kernel(const struct cuda_kv_layer layer, const struct cuda_ea_args a, const struct cuda_list_layout lay, float *z) {
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
        if ((int)threadIdx.x < s) red[threadIdx.x] = fmax(red[threadIdx.x], red[threadIdx.x + s]);
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
ea_combine_kernel(const struct cuda_kv_layer layer, const struct cuda_ea_args a, const struct cuda_list_layout lay,
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

extern "C" size_t cuda_ea_work_bytes(const struct cuda_kv_layer *layer, const struct cuda_ea_args *a) {
    return (size_t)a->n_head * (size_t)cuda_list_layout_of(layer->n, layer->n_head_kv).n_max * sizeof(float);
}

extern "C" int cuda_ea_supported(const struct cuda_kv_layer *layer, const struct cuda_ea_args *a) {
    return layer->head_dim >= 1 && layer->head_dim <= CUDA_EA_MAX_D && a->n_head >= layer->n_head_kv &&
           a->n_head % layer->n_head_kv == 0;
}

extern "C" void cuda_ea_scores(cuda_stream s, const struct cuda_kv_layer *layer, const struct cuda_ea_args *a,
                               float *scores, void *work) {
    if (!cuda_ea_supported(layer, a)) return;
    const struct cuda_list_layout lay = cuda_list_layout_of(layer->n, layer->n_head_kv);   // z's rows: n_max long
    const int32_t n_max = lay.n_max;
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

// ---- the query statistics ----

// Channel c of query head h of chunk row t with the forward pass's rotation undone (cs: the
// row's cos, sin pairs), in the CPU's float operations.
static __device__ __forceinline__ float ea_unrotated(const float *q, const float *cs, int n_rot, int c) {
    if (c >= n_rot) return q[c];
    const int i = c / 2;
    const float a = q[2 * i], b = q[2 * i + 1], co = cs[2 * i], si = cs[2 * i + 1];
    return c % 2 == 0 ? __fadd_rn(__fmul_rn(a, co), __fmul_rn(b, si)) : __fsub_rn(__fmul_rn(b, co), __fmul_rn(a, si));
}

// Block h: each channel's mean over the chunk's rows (double, in row order) into cm, and the
// rows' deviations from it (float) into x, (d, rows) per head.
static __global__ void ea_center_kernel(const float *q, const struct cuda_ea_chunk c, double *cm, float *x) {
    const int h = blockIdx.x;
    for (int ch = threadIdx.x; ch < c.d; ch += blockDim.x) {
        double sum = 0.0;
        for (int32_t r = 0; r < c.rows; r++) {
            const float *row = q + ((size_t)(c.t0 + r) * c.n_head + h) * c.d;
            sum = __dadd_rn(sum, (double)ea_unrotated(row, c.cs + (size_t)r * c.n_rot, c.n_rot, ch));
        }
        const double mean = __ddiv_rn(sum, (double)c.rows);
        cm[(size_t)h * c.d + ch] = mean;
        float *out = x + ((size_t)h * c.d + ch) * c.rows;
        for (int32_t r = 0; r < c.rows; r++) {
            const float *row = q + ((size_t)(c.t0 + r) * c.n_head + h) * c.d;
            out[r] = (float)__dsub_rn((double)ea_unrotated(row, c.cs + (size_t)r * c.n_rot, c.n_rot, ch), mean);
        }
    }
}

#define EA_OUTER 16   // outer-product tile: EA_OUTER x EA_OUTER elements a block
#define EA_SPAN 32    // rows staged at a time

// m2 of head blockIdx.z, element (i, j): += the chunk's sum over rows of x_i x_j (float, in row
// order) + (cm_i - mean_i)(cm_j - mean_j) na nb / n, as the CPU's pairwise merge.
static __global__ void __launch_bounds__(EA_OUTER * EA_OUTER)
ea_outer_kernel(const struct cuda_ea_chunk c, const double *cm, const float *x, const double *mean, double *m2) {
    const int h = blockIdx.z, d = c.d, tx = threadIdx.x % EA_OUTER, ty = threadIdx.x / EA_OUTER;
    const int i = blockIdx.y * EA_OUTER + ty, j = blockIdx.x * EA_OUTER + tx;
    __shared__ float xi[EA_OUTER][EA_SPAN + 1], xj[EA_OUTER][EA_SPAN + 1];
    const float *xh = x + (size_t)h * d * c.rows;
    float acc = 0.0f;
    for (int32_t r0 = 0; r0 < c.rows; r0 += EA_SPAN) {
        for (int k = threadIdx.x; k < EA_OUTER * EA_SPAN; k += EA_OUTER * EA_OUTER) {
            const int row = k / EA_SPAN, r = r0 + k % EA_SPAN;
            const int ci = blockIdx.y * EA_OUTER + row, cj = blockIdx.x * EA_OUTER + row;
            xi[row][k % EA_SPAN] = ci < d && r < c.rows ? xh[(size_t)ci * c.rows + r] : 0.0f;
            xj[row][k % EA_SPAN] = cj < d && r < c.rows ? xh[(size_t)cj * c.rows + r] : 0.0f;
        }
        __syncthreads();
        const int span = c.rows - r0 < EA_SPAN ? c.rows - r0 : EA_SPAN;
        for (int r = 0; r < span; r++) acc = fmaf(xi[ty][r], xj[tx][r], acc);
        __syncthreads();
    }
    if (i >= d || j >= d) return;
    const double na = (double)c.count, nb = (double)c.rows, n = na + nb;
    const double di = __dsub_rn(cm[(size_t)h * d + i], mean[(size_t)h * d + i]);
    const double dj = __dsub_rn(cm[(size_t)h * d + j], mean[(size_t)h * d + j]);
    const double t = __ddiv_rn(__dmul_rn(__dmul_rn(__dmul_rn(di, dj), na), nb), n);
    double *m = m2 + ((size_t)h * d + i) * d + j;
    *m = __dadd_rn(*m, __dadd_rn((double)acc, t));
}

// mean += (cm - mean) nb / n, once every m2 element has read the old mean.
static __global__ void ea_mean_kernel(const struct cuda_ea_chunk c, const double *cm, double *mean) {
    const int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= (int64_t)c.n_head * c.d) return;
    const double nb = (double)c.rows, n = (double)c.count + nb;
    mean[k] = __dadd_rn(mean[k], __ddiv_rn(__dmul_rn(__dsub_rn(cm[k], mean[k]), nb), n));
}

extern "C" size_t cuda_ea_chunk_work_bytes(const struct cuda_ea_chunk *c) {
    const size_t centred = (size_t)c->n_head * c->d * (size_t)c->rows * sizeof(float);
    return cuda_align((size_t)c->n_head * c->d * sizeof(double)) + centred;
}

extern "C" void cuda_ea_stats_chunk(cuda_stream s, const float *q, const struct cuda_ea_chunk *c, double *mean,
                                    double *m2, void *work) {
    if (c->rows <= 0 || c->d < 1 || c->d > CUDA_EA_MAX_D || c->n_rot > c->d) return;
    double *cm = (double *)work;
    float *x = (float *)((char *)work + cuda_align((size_t)c->n_head * c->d * sizeof(double)));
    const int threads = c->d < 128 ? 32 * ((c->d + 31) / 32) : 128;
    ea_center_kernel<<<c->n_head, threads, 0, s>>>(q, *c, cm, x);
    const int tiles = (c->d + EA_OUTER - 1) / EA_OUTER;
    ea_outer_kernel<<<dim3(tiles, tiles, c->n_head), EA_OUTER * EA_OUTER, 0, s>>>(*c, cm, x, mean, m2);
    ea_mean_kernel<<<cuda_blocks_for((int64_t)c->n_head * c->d, 256), 256, 0, s>>>(*c, cm, mean);
}
