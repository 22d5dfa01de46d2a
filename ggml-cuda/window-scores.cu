// window-scores.cu - the observation-window scores of one layer (twins: ws_stats_compute and
// ws_layer_scores of native/src/kv/policies/common/window-scores.c; the math is in
// window-math.cuh). Four steps, each a fixed order of operations, so the result does not
// depend on the card:
//  1. partial_kernel, grid (tile of WIN_TJ entries, query head): the logits of the tile's
//     entries for the window rows (WIN_RC rows at a time, staged in shared memory; a warp per
//     entry, lanes over head_dim), and per row the tile's max and sum of exp over the entries
//     the row sees -> part (n_head, rows, n_tiles). A merged entry (EMS) counts as its
//     members (window-math.cuh), so its probability is their total, as attention.c has it.
//  2. combine_kernel, a thread per (query head, row): the row's max M and 1 / sum over its
//     tiles in tile order -> ml (n_head, rows).
//  3. stats_kernel, grid (tile of WIN_TJ candidates, query head): the same logits again, the
//     probabilities exp(x - M) / sum, and per candidate (a thread each) Welford's mean and
//     variance over the rows in row order -> mean, var (the ws_stats layout), and if asked
//     the sum of p log(p + 1e-10) -> ent.
//  4. reduce_kernel then pool_kernel, grid (candidates, KV head): GQA reduce of the means,
//     then pooling -> scores (per KV head).
#include "common.cuh"
#include "kv-rows.cuh"
#include "policy-kernels.h"
#include "window-math.cuh"

#define WIN_FLAT_THREADS 128   // threads per block of the per-element kernels (2 and 4)

struct win_params {
    struct cuda_kv_layer layer;
    int32_t      n_cand[CUDA_MAX_KV_HEADS];
    int64_t      offset_kv[CUDA_MAX_KV_HEADS];
    const float *q;
    const int32_t *vis;     // (rows, n_head_kv) or NULL (cuda_window_args.vis)
    float2      *part;      // (n_head, rows, n_tiles): per tile (max, sum of exp)
    float2      *ml;        // (n_head, rows): (M, 1 / L)
    float       *mean;      // total * group
    float       *var;       // total * group, or NULL
    double      *ent;       // total * group, or NULL (cuda_window_args.ent)
    int32_t      weight_seen;   // cuda_window_args.weight_seen
    float       *reduced;   // total: the GQA reduce before pooling
    float       *scores;    // total
    int32_t      n_head, group, T, rows, n_tiles;
    int32_t      pool, kernel, gqa;
    float        scale;     // 1 / sqrt(head_dim)
};

// Logits of entries j0 .. j0 + kt - 1 of query head h's list for window rows r0 .. r0 + rc - 1
// into P[rr][jl] (jl = j - j0). Warp w takes entries w, w + 4, ...: its lanes hold the key's
// values (win_lane_key), and for each row the lanes' parts of the dot are summed by the warp.
static __device__ __forceinline__ void tile_logits(const struct win_params &p, int h, const void *kbase, int j0,
                                                   int kt, int r0, int rc, float (*P)[WIN_TJ]) {
    const int d = p.layer.head_dim, fmt = p.layer.fmt_k;
    const int lane = threadIdx.x % CUDA_WARP, warp = threadIdx.x / CUDA_WARP;
    for (int jl = warp; jl < kt; jl += WIN_THREADS / CUDA_WARP) {
        float kreg[WIN_KREG];
        win_lane_key(kv_row(kbase, fmt, d, (int64_t)j0 + jl), fmt, d, lane, kreg);
        for (int rr = 0; rr < rc; rr++) {
            const float *q = p.q + ((size_t)win_token(p.T, p.rows, r0 + rr) * p.n_head + h) * d;
            const float dot = warp_sum(win_lane_dot(q, kreg, d, lane));
            if (lane == 0) P[rr][jl] = __fmul_rn(dot, p.scale);
        }
    }
}

// The entries window row r of KV head g sees.
static __device__ __forceinline__ int32_t row_visible(const struct win_params &p, int g, int r) {
    return p.vis ? p.vis[(size_t)r * p.layer.n_head_kv + g] : win_visible(p.layer.n[g], p.rows, r);
}

static __global__ void __launch_bounds__(WIN_THREADS) partial_kernel(const struct win_params p) {
    __shared__ float P[WIN_RC][WIN_TJ];
    const int h = blockIdx.y, g = h / p.group, tile = blockIdx.x;
    const int32_t n = p.layer.n[g];
    const int j0 = tile * WIN_TJ;
    if (p.n_cand[g] <= 0 || j0 >= n) return;
    const int kt = min(WIN_TJ, n - j0);
    const int lane = threadIdx.x % CUDA_WARP, warp = threadIdx.x / CUDA_WARP;
    const struct win_members mb = win_members_of(p.layer, g);
    for (int r0 = 0; r0 < p.rows; r0 += WIN_RC) {
        const int rc = min(WIN_RC, p.rows - r0);
        tile_logits(p, h, p.layer.k[g], j0, kt, r0, rc, P);
        __syncthreads();
        for (int rr = warp; rr < rc; rr += WIN_THREADS / CUDA_WARP) {
            const int r = r0 + rr;
            const int vis = min(kt, row_visible(p, g, r) - j0);   // entries of the tile row r sees
            float m = -INFINITY;
            for (int jl = lane; jl < vis; jl += CUDA_WARP) m = fmaxf(m, win_entry_max(mb, j0 + jl, P[rr][jl]));
            m = warp_max(m);
            float s = 0.0f;
            if (m != -INFINITY)
                for (int jl = lane; jl < vis; jl += CUDA_WARP) s += win_entry_exp(mb, j0 + jl, P[rr][jl], m);
            s = warp_sum(s);
            if (lane == 0) p.part[((size_t)h * p.rows + r) * p.n_tiles + tile] = make_float2(m, s);
        }
        __syncthreads();
    }
}

static __global__ void __launch_bounds__(WIN_FLAT_THREADS) combine_kernel(const struct win_params p) {
    const int64_t i = (int64_t)blockIdx.x * WIN_FLAT_THREADS + threadIdx.x;
    if (i >= (int64_t)p.n_head * p.rows) return;
    const int h = (int)(i / p.rows), r = (int)(i % p.rows), g = h / p.group;
    if (p.n_cand[g] <= 0) return;
    const int32_t vis = row_visible(p, g, r);
    const int n_tiles = vis > 0 ? (vis + WIN_TJ - 1) / WIN_TJ : 0;   // every one of them has an entry row r sees
    float M, L;
    win_combine(p.part + (size_t)i * p.n_tiles, n_tiles, &M, &L);
    p.ml[i] = make_float2(M, L > 0.0f ? kv_div_rn(1.0f, L) : 0.0f);
}

static __global__ void __launch_bounds__(WIN_THREADS) stats_kernel(const struct win_params p) {
    __shared__ float P[WIN_RC][WIN_TJ];
    const int h = blockIdx.y, g = h / p.group;
    const int32_t nc = p.n_cand[g];
    const int j0 = blockIdx.x * WIN_TJ;
    if (j0 >= nc) return;
    const int kt = min(WIN_TJ, nc - j0);
    const int jl = threadIdx.x;
    const float2 *ml = p.ml + (size_t)h * p.rows;
    const struct win_members mb = win_members_of(p.layer, g);
    double mu = 0.0, m2 = 0.0, ent = 0.0, weighted = 0.0;
    for (int r0 = 0; r0 < p.rows; r0 += WIN_RC) {
        const int rc = min(WIN_RC, p.rows - r0);
        tile_logits(p, h, p.layer.k[g], j0, kt, r0, rc, P);
        __syncthreads();
        if (jl < kt)   // a candidate: every window row sees it (rows <= protect), or with vis the rows that do
            for (int rr = 0; rr < rc; rr++) {
                const float2 f = ml[r0 + rr];
                const int seen = !p.vis || j0 + jl < row_visible(p, g, r0 + rr);
                const float prob = seen ? win_entry_exp(mb, j0 + jl, P[rr][jl], f.x) * f.y : 0.0f;
                win_welford(&mu, &m2, prob, r0 + rr + 1);
                if (p.weight_seen) weighted += (double)row_visible(p, g, r0 + rr) * (double)prob;
                if (p.ent) ent += (double)prob * log((double)prob + 1e-10);
            }
        __syncthreads();
    }
    if (jl >= kt) return;
    const int64_t at = p.offset_kv[g] * p.group + (int64_t)(h - g * p.group) * nc + j0 + jl;
    p.mean[at] = p.weight_seen ? (float)(weighted / (double)p.rows) : (float)mu;
    if (p.var) p.var[at] = win_variance(m2, p.rows);
    if (p.ent) p.ent[at] = ent;
}

// grid (candidate tiles, KV head); out: p.reduced, or p.scores directly when kernel is 1.
static __global__ void __launch_bounds__(WIN_FLAT_THREADS) reduce_kernel(const struct win_params p, float *out) {
    const int g = blockIdx.y;
    const int64_t j = (int64_t)blockIdx.x * WIN_FLAT_THREADS + threadIdx.x;
    const int32_t nc = p.n_cand[g];
    if (j >= nc) return;
    out[p.offset_kv[g] + j] = win_gqa_at(p.mean + p.offset_kv[g] * p.group, nc, p.group, j, p.gqa == 1);
}

static __global__ void __launch_bounds__(WIN_FLAT_THREADS) pool_kernel(const struct win_params p) {
    const int g = blockIdx.y;
    const int64_t j = (int64_t)blockIdx.x * WIN_FLAT_THREADS + threadIdx.x;
    const int32_t nc = p.n_cand[g];
    if (j >= nc) return;
    p.scores[p.offset_kv[g] + j] = win_pool_at(p.reduced + p.offset_kv[g], nc, p.kernel, p.pool == 1, (int32_t)j);
}

extern "C" int64_t cuda_window_layout(const struct cuda_kv_layer *layer, int32_t protect, int32_t *n_cand,
                                      int64_t *offset_kv) {
    int64_t total = 0;
    for (int g = 0; g < layer->n_head_kv; g++) {
        const int32_t nc = win_n_cand(layer->n[g], protect);
        if (n_cand) n_cand[g] = nc;
        if (offset_kv) offset_kv[g] = total;
        total += nc;
    }
    return total;
}

// The sizes a launch works with: tiles of the longest list that has candidates, the most
// candidates of a list, and the work sections (each 256-byte aligned).
struct win_plan {
    int32_t n_tiles, nc_max;
    int64_t total;
    size_t  part_at, ml_at, mean_at, reduced_at, bytes;
};

static int win_valid(const struct cuda_kv_layer *layer, const struct cuda_window_args *a) {
    const int d = layer->head_dim, n_kv = layer->n_head_kv;
    if (n_kv <= 0 || n_kv > CUDA_MAX_KV_HEADS || a->n_head <= 0 || a->n_head % n_kv != 0) return 0;
    if (d <= 0 || d > WIN_MAX_D || (layer->fmt_k == CUDA_KV_Q8_0 && d % CUDA_KV_Q8_BLOCK != 0)) return 0;
    if (a->rows < 1 || a->rows > a->T) return 0;
    if (a->vis ? a->protect != 0 : a->rows > a->protect) return 0;
    return a->kernel >= 1 && a->kernel % 2 == 1;
}

static void win_make_plan(const struct cuda_kv_layer *layer, const struct cuda_window_args *a, struct win_plan *pl) {
    int32_t n_max = 0;
    pl->nc_max = 0;
    pl->total = 0;
    for (int g = 0; g < layer->n_head_kv; g++) {
        const int32_t nc = win_n_cand(layer->n[g], a->protect);
        if (nc > 0 && layer->n[g] > n_max) n_max = layer->n[g];
        if (nc > pl->nc_max) pl->nc_max = nc;
        pl->total += nc;
    }
    pl->n_tiles = (n_max + WIN_TJ - 1) / WIN_TJ;
    const size_t group = (size_t)(a->n_head / layer->n_head_kv);
    const size_t head_rows = (size_t)a->n_head * (size_t)a->rows;
    pl->part_at = 0;
    pl->ml_at = cuda_align(head_rows * (size_t)pl->n_tiles * sizeof(float2));
    pl->mean_at = pl->ml_at + cuda_align(head_rows * sizeof(float2));
    pl->reduced_at = pl->mean_at + cuda_align((size_t)pl->total * group * sizeof(float));
    pl->bytes = pl->reduced_at + cuda_align((size_t)pl->total * sizeof(float));
}

extern "C" size_t cuda_window_work_bytes(const struct cuda_kv_layer *layer, const struct cuda_window_args *a) {
    if (!win_valid(layer, a)) return 0;
    struct win_plan pl;
    win_make_plan(layer, a, &pl);
    return pl.bytes;
}

extern "C" void cuda_window_scores(cuda_stream s, const struct cuda_kv_layer *layer, const float *q,
                                   const struct cuda_window_args *a, float *scores, float *mean, float *var,
                                   void *work) {
    if (!win_valid(layer, a)) return;
    struct win_plan pl;
    win_make_plan(layer, a, &pl);
    if (pl.total == 0) return;
    struct win_params p;
    memset(&p, 0, sizeof(p));
    p.layer = *layer;
    cuda_window_layout(layer, a->protect, p.n_cand, p.offset_kv);
    char *w = (char *)work;
    p.q = q;
    p.vis = a->vis;
    p.part = (float2 *)(w + pl.part_at);
    p.ml = (float2 *)(w + pl.ml_at);
    p.mean = mean ? mean : (float *)(w + pl.mean_at);
    p.var = var;
    p.ent = a->ent;
    p.weight_seen = a->vis ? a->weight_seen : 0;
    p.reduced = (float *)(w + pl.reduced_at);
    p.scores = scores;
    p.n_head = a->n_head;
    p.group = a->n_head / layer->n_head_kv;
    p.T = a->T;
    p.rows = a->rows;
    p.n_tiles = pl.n_tiles;
    p.pool = a->pool;
    p.kernel = a->kernel;
    p.gqa = a->gqa;
    p.scale = 1.0f / sqrtf((float)layer->head_dim);   // on the host: the CPU's rounding

    const int cand_tiles = (pl.nc_max + WIN_TJ - 1) / WIN_TJ;
    partial_kernel<<<dim3((unsigned)pl.n_tiles, (unsigned)a->n_head), WIN_THREADS, 0, s>>>(p);
    combine_kernel<<<cuda_blocks_for((int64_t)a->n_head * a->rows, WIN_FLAT_THREADS), WIN_FLAT_THREADS, 0, s>>>(p);
    stats_kernel<<<dim3((unsigned)cand_tiles, (unsigned)a->n_head), WIN_THREADS, 0, s>>>(p);
    if (!scores) return;
    const dim3 grid((unsigned)cuda_blocks_for(pl.nc_max, WIN_FLAT_THREADS), (unsigned)layer->n_head_kv);
    reduce_kernel<<<grid, WIN_FLAT_THREADS, 0, s>>>(p, a->kernel == 1 ? scores : p.reduced);
    if (a->kernel > 1) pool_kernel<<<grid, WIN_FLAT_THREADS, 0, s>>>(p);
}
