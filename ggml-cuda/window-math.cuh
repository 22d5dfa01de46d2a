// window-math.cuh - the per-element math of the observation-window scores (window-scores.cu),
// as __host__ __device__ functions so that tests/c/test_cuda_policy_host.cu runs them on the
// CPU against window-scores.c and window-select.c: which entries a window row sees, the dot
// product of a query with a key as a warp computes it, the merge of per-tile softmax sums,
// the column statistics (Welford in double, as ws_stats_compute), the GQA reduce and the
// pooling (the operations of ws_gqa_reduce and ws_pool1d, in their order, correctly rounded).
#pragma once
#include <math.h>
#include <stdint.h>

#include "common.cuh"
#include "kv-rows.cuh"

#define WIN_TJ 128          // list entries per block tile
#define WIN_RC 32           // window rows per chunk of a tile
#define WIN_THREADS 128     // threads per block of the tile kernels
#define WIN_MAX_D 512       // PYKV_MAX_HEAD_DIM
#define WIN_KREG (WIN_MAX_D / CUDA_WARP)   // key values a lane holds
static_assert(WIN_THREADS == WIN_TJ, "the statistics step gives thread i column i of a tile");
static_assert(WIN_TJ % CUDA_WARP == 0, "the row step gives a lane every 32nd entry of a tile");

// `#pragma unroll` for the device pass only (the host compiler does not know it); the key
// values stay in registers when the loops over them are unrolled.
#ifdef __CUDA_ARCH__
#define WIN_UNROLL _Pragma("unroll")
#else
#define WIN_UNROLL
#endif

// Candidates of a list of n entries whose last `protect` are the window.
static __host__ __device__ __forceinline__ int32_t win_n_cand(int32_t n, int32_t protect) {
    return n > protect ? n - protect : 0;
}
// The chunk token of window row r (0 <= r < rows) and the entries it sees: the query of chunk
// token t sees the first n - (T - 1 - t) entries (ws_softmax_row), t = T - rows + r.
static __host__ __device__ __forceinline__ int32_t win_token(int32_t T, int32_t rows, int32_t r) {
    return T - rows + r;
}
static __host__ __device__ __forceinline__ int32_t win_visible(int32_t n, int32_t rows, int32_t r) {
    return n - (rows - 1 - r);
}

// Lane `lane` of a warp holds key values lane, lane + 32, ... (below d) of a stored key row.
static __host__ __device__ __forceinline__ void win_lane_key(const void *krow, int fmt, int d, int lane, float *kreg) {
    WIN_UNROLL
    for (int c = 0; c < WIN_KREG; c++) {
        const int i = lane + CUDA_WARP * c;
        kreg[c] = i < d ? kv_load(krow, fmt, i) : 0.0f;
    }
}
// The lane's part of q . key (fused multiply-adds in c order); the warp sums the 32 parts
// with warp_sum's butterfly.
static __host__ __device__ __forceinline__ float win_lane_dot(const float *q, const float *kreg, int d, int lane) {
    float acc = 0.0f;
    WIN_UNROLL
    for (int c = 0; c < WIN_KREG; c++) {
        const int i = lane + CUDA_WARP * c;
        if (i < d) acc = fmaf(q[i], kreg[c], acc);
    }
    return acc;
}

// One row's softmax over several tiles: tile t left (m_t, s_t), its largest logit and
// sum of exp(x - m_t) (m_t = -inf, s_t = 0 when it saw nothing). The row's max M and sum
// L = sum_t s_t exp(m_t - M), in tile order.
static __host__ __device__ __forceinline__ void win_combine(const float2 *part, int n_tiles, float *M, float *L) {
    float m = -INFINITY;
    for (int t = 0; t < n_tiles; t++) m = part[t].x > m ? part[t].x : m;
    float l = 0.0f;
    if (m != -INFINITY)
        for (int t = 0; t < n_tiles; t++)
            if (part[t].x != -INFINITY) l += part[t].y * expf(part[t].x - m);
    *M = m;
    *L = l;
}

// The probability of logit x in a row of max M and 1 / sum inv_l (the CPU scales by the
// reciprocal of the sum too).
static __host__ __device__ __forceinline__ float win_prob(float x, float M, float inv_l) {
    return expf(x - M) * inv_l;
}

// Merged entries (EMS; cuda_kv_layer.members): entry j of a list stands for count[j] members
// whose key norms, ascending, are pool[at[j] ..]; member m's logit is norm_m * x, x the
// entry's logit (its stored key is the members' unit direction), as attention.c expands
// them. count NULL: the list holds no merged entries.
struct win_members {
    const int32_t *count, *at;
    const float   *pool;
};
static __host__ __device__ __forceinline__ struct win_members win_members_of(const struct cuda_kv_layer &layer,
                                                                             int g) {
    struct win_members mb = { layer.members[g], NULL, NULL };
    if (mb.count) {
        mb.at = mb.count + layer.members_cap[g];
        mb.pool = (const float *)(mb.at + layer.members_cap[g]);
    }
    return mb;
}
// The largest logit among entry j's members (norms ascend: it is at either end).
static __host__ __device__ __forceinline__ float win_entry_max(const struct win_members &mb, int64_t j, float x) {
    const int32_t cnt = mb.count ? mb.count[j] : 1;
    if (cnt <= 1) return x;
    const float *norm = mb.pool + mb.at[j];
    return fmaxf(kv_mul_rn(x, norm[0]), kv_mul_rn(x, norm[cnt - 1]));
}
// exp(x - M), or for a merged entry the sum over its members of exp(norm_m * x - M) in member order.
static __host__ __device__ __forceinline__ float win_entry_exp(const struct win_members &mb, int64_t j, float x,
                                                               float M) {
    const int32_t cnt = mb.count ? mb.count[j] : 1;
    if (cnt <= 1) return expf(x - M);
    const float *norm = mb.pool + mb.at[j];
    float e = 0.0f;
    for (int32_t i = 0; i < cnt; i++) e += expf(kv_mul_rn(norm[i], x) - M);
    return e;
}

// Welford's update with the k-th value (k >= 1) of a column, in double (ws_stats_compute).
static __host__ __device__ __forceinline__ void win_welford(double *mean, double *m2, float p, int k) {
    const double x = (double)p;
    const double d = x - *mean;
    *mean += d / (double)k;
    *m2 += d * (x - *mean);
}
static __host__ __device__ __forceinline__ float win_variance(double m2, int rows) {
    return rows > 1 ? (float)(m2 / (double)(rows - 1)) : 0.0f;
}

// ws_gqa_reduce at column j: rows r = 0 .. group - 1 of stride `stride`, folded in row order
// (max keeps the earlier value unless the later is larger), the mean divided once at the end.
static __host__ __device__ __forceinline__ float win_gqa_at(const float *rows, int64_t stride, int32_t group, int64_t j,
                                                            int max_mode) {
    float out = rows[j];
    for (int32_t r = 1; r < group; r++) {
        const float x = rows[(int64_t)r * stride + j];
        if (max_mode) out = x > out ? x : out;
        else out += x;
    }
    if (!max_mode && group > 1) out = kv_div_rn(out, (float)group);
    return out;
}

// ws_pool1d at output j of n: the window [j - kernel / 2, j + kernel / 2] cut to [0, n),
// max over it in order, or its sum in order divided by the whole kernel (padding counts).
static __host__ __device__ __forceinline__ float win_pool_at(const float *x, int32_t n, int32_t kernel, int avg,
                                                             int32_t j) {
    const int32_t r = kernel / 2;
    const int32_t a = j - r < 0 ? 0 : j - r, b = j + r >= n ? n - 1 : j + r;
    if (!avg) {
        float m = x[a];
        for (int32_t t = a + 1; t <= b; t++) m = x[t] > m ? x[t] : m;
        return m;
    }
    float s = 0.0f;
    for (int32_t t = a; t <= b; t++) s += x[t];
    return kv_div_rn(s, (float)kernel);
}
