// attention-tile.cuh - the flash-attention block shared by decode (attention-decode.cu) and
// prefill (attention-prefill.cu): one thread block takes a group of query rows of one KV head
// (heads_per_block of its query heads for tokens_per_block consecutive tokens) and streams a
// range of its list in tiles of ATTN_KEYS entries, staged in shared memory as floats, with an
// online softmax in float: per row a running max m, a running sum l of exp(s - m) and the
// unnormalised output o (in registers, EPT values per thread), rescaled by exp(m_old - m_new)
// as the max grows. Each key and value row is read from global memory once per block.
//
// Decode (one token): the range is a segment of the list (a block may take several in turn)
// and the block leaves the partial (m, l, o) of each query head for attention-decode.cu's
// merge. Prefill: the range is every entry the block's last token sees, each row masks the
// entries past its own causal limit (n_before + t + 1), and the block writes o / l. A merged
// entry (layer.members) weighs as the sum of its members' exponentials.
#pragma once
#include "common.cuh"
#include "kv-rows.cuh"

#define ATTN_KEYS 32   // entries per tile; one warp's lanes in the softmax step
static_assert(ATTN_KEYS == CUDA_WARP, "the softmax step gives lane j entry j of a tile");

// Decode segments: ceil(n / ATTN_SEGMENT) of them, at most ATTN_MAX_SEGMENTS, segment p
// being entries [start(p), start(p + 1)); a function of n alone, so the merge order (and the
// result) does not depend on the card. Never empty for n >= 1 (n >= count). Two tiles a
// segment: a decode block's time is a chain of tiles, each waiting on its key and value
// loads, so a long list is cut into many short chains that run side by side.
#define ATTN_SEGMENT 64
#define ATTN_MAX_SEGMENTS 256
static __host__ __device__ __forceinline__ int attn_segments(int32_t n) {
    const int s = (int)(((int64_t)n + ATTN_SEGMENT - 1) / ATTN_SEGMENT);
    return s < 1 ? 1 : s > ATTN_MAX_SEGMENTS ? ATTN_MAX_SEGMENTS : s;
}
static __host__ __device__ __forceinline__ int attn_segment_start(int32_t n, int n_seg, int p) {
    return (int)((int64_t)n * p / n_seg);
}

struct attn_args {
    struct cuda_kv_layer layer;
    const float *q;          // (T, n_head, head_dim)
    float       *out;        // prefill: as q
    float       *part_o;     // decode: (n_head, seg_stride, head_dim) unnormalised outputs
    float       *part_m;     // decode: (n_head, seg_stride) running maxima
    float       *part_l;     // decode: (n_head, seg_stride) sums of exp(s - m)
    int          n_head, n_rep, T;
    int          heads_per_block;    // query heads of one KV head per block
    int          n_hgroups;          // ceil(n_rep / heads_per_block)
    int          tokens_per_block;   // prefill; 1 for decode
    int          seg_stride;         // decode: the segments room per head in part_*
    float        scale;              // 1 / sqrt(head_dim)
};

// Shared memory of a block of `rows` query rows: the queries, a tile of keys and one of
// values (row stride head_dim + 1, so the lanes' reads of different entries hit different
// banks; loaded together, so that each tile waits on one round of loads), the tile's scores
// and each row's m, l and rescale factor. With head_dim a multiple of 4, the queries' rows
// and the scores' rows start 16 bytes apart (read as float4).
static inline size_t attn_smem_bytes(int rows, int d) {
    const size_t floats =
        (size_t)rows * d + 2 * (size_t)ATTN_KEYS * (d + 1) + (size_t)rows * ATTN_KEYS + 3 * (size_t)rows;
    return (floats * sizeof(float) + 15) / 16 * 16;
}

// Rows per pass of a warp in the scores step: each key value read from shared memory serves
// that many query rows.
#define ATTN_SCORE_ROWS 4

// dot[i] = q(row rb + i * NW) . kr for i < ATTN_SCORE_ROWS, each summed in column order (rows
// past R repeat row R - 1; their sums are not used). With d a multiple of 4, a row's queries
// are read 4 at a time, one 16-byte broadcast for the warp's lanes.
template <int NW>
static __device__ __forceinline__ void attn_dots(float dot[ATTN_SCORE_ROWS], const float *Qs, const float *kr, int d,
                                                 int rb, int R) {
    int q[ATTN_SCORE_ROWS];   // where each row starts in Qs
#pragma unroll
    for (int i = 0; i < ATTN_SCORE_ROWS; i++) {
        q[i] = min(rb + i * NW, R - 1) * d;
        dot[i] = 0.0f;
    }
    if (d % 4 == 0) {
        for (int c = 0; c < d; c += 4) {
            const float k0 = kr[c], k1 = kr[c + 1], k2 = kr[c + 2], k3 = kr[c + 3];
#pragma unroll
            for (int i = 0; i < ATTN_SCORE_ROWS; i++) {
                const float4 qv = *(const float4 *)(Qs + q[i] + c);
                dot[i] = fmaf(qv.x, k0, dot[i]);
                dot[i] = fmaf(qv.y, k1, dot[i]);
                dot[i] = fmaf(qv.z, k2, dot[i]);
                dot[i] = fmaf(qv.w, k3, dot[i]);
            }
        }
    } else {
        for (int c = 0; c < d; c++) {
            const float kc = kr[c];
#pragma unroll
            for (int i = 0; i < ATTN_SCORE_ROWS; i++) dot[i] = fmaf(Qs[q[i] + c], kc, dot[i]);
        }
    }
}

// Unit idx of an f16 tile (8 values: row j = idx / per_row, values 8 (idx % per_row) ..)
// into KV as floats.
static __device__ __forceinline__ void attn_put8(float *KV, int dp, int per_row, int idx, const uint4 v) {
    const int j = idx / per_row;
    const uint32_t w[4] = { v.x, v.y, v.z, v.w };
    float *dst = KV + j * dp + (idx - j * per_row) * 8;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        dst[2 * i] = f16_bits_to_float((uint16_t)(w[i] & 0xFFFFu));
        dst[2 * i + 1] = f16_bits_to_float((uint16_t)(w[i] >> 16));
    }
}

// Tile j0 of kt entries of list rows `base` (format fmt) into KV as floats. f16 rows of a
// multiple of 8 values are read 16 bytes at a time (the tile's rows lie back to back).
template <int NT>
static __device__ __forceinline__ void attn_stage(float *KV, const void *base, int fmt, int d, int j0, int kt) {
    const int dp = d + 1;
    if (fmt == CUDA_KV_F16 && d % 8 == 0) {
        const int per_row = d / 8;
        const uint4 *src = (const uint4 *)kv_row(base, fmt, d, j0);
        for (int idx = threadIdx.x; idx < kt * per_row; idx += NT) attn_put8(KV, dp, per_row, idx, src[idx]);
        return;
    }
    for (int idx = threadIdx.x; idx < kt * d; idx += NT) {
        const int j = idx / d, c = idx - j * d;
        KV[j * dp + c] = kv_load(kv_row(base, fmt, d, j0 + j), fmt, c);
    }
}

// The tile's keys into K and values into V. Both f16 (rows of a multiple of 8 values): a
// thread's loads of both go out before any of its stores, ATTN_STAGE_LOADS of each at a time,
// so the tile waits on one round of loads (a loop of load then store, whose trip count is not
// known when compiling, would wait on each load in turn).
#define ATTN_STAGE_LOADS 2
template <int NT>
static __device__ __forceinline__ void attn_stage_kv(float *K, float *V, const struct cuda_kv_layer &layer, int g,
                                                     int j0, int kt) {
    const int d = layer.head_dim, dp = d + 1;
    if (layer.fmt_k != CUDA_KV_F16 || layer.fmt_v != CUDA_KV_F16 || d % 8 != 0) {
        attn_stage<NT>(K, layer.k[g], layer.fmt_k, d, j0, kt);
        attn_stage<NT>(V, layer.v[g], layer.fmt_v, d, j0, kt);
        return;
    }
    const int per_row = d / 8, units = kt * per_row;
    const uint4 *ks = (const uint4 *)kv_row(layer.k[g], CUDA_KV_F16, d, j0);
    const uint4 *vs = (const uint4 *)kv_row(layer.v[g], CUDA_KV_F16, d, j0);
    for (int at = threadIdx.x; at < units; at += NT * ATTN_STAGE_LOADS) {
        uint4 kr[ATTN_STAGE_LOADS], vr[ATTN_STAGE_LOADS];
#pragma unroll
        for (int i = 0; i < ATTN_STAGE_LOADS; i++)
            if (at + i * NT < units) {
                kr[i] = ks[at + i * NT];
                vr[i] = vs[at + i * NT];
            }
#pragma unroll
        for (int i = 0; i < ATTN_STAGE_LOADS; i++)
            if (at + i * NT < units) {
                attn_put8(K, dp, per_row, at + i * NT, kr[i]);
                attn_put8(V, dp, per_row, at + i * NT, vr[i]);
            }
    }
}

// acc[k] = acc[k] * C[r] + sum_j S[r][j] V[j][c] for the thread's outputs idx = tid + k * NT
// < R * d, (r, c) = (idx / d, idx % d), j < kt in order. When d divides NT, a thread's outputs
// share one column c: each value read serves all of them, and each row's probabilities are
// read 4 at a time (16-byte broadcasts) when d is a multiple of 4.
template <int NT, int EPT>
static __device__ __forceinline__ void attn_accumulate(float acc[EPT], const float *S, const float *C, const float *KV,
                                                       int d, int R, int kt) {
    const int dp = d + 1;
    if (NT % d != 0) {
#pragma unroll
        for (int k = 0; k < EPT; k++) {
            const int idx = threadIdx.x + k * NT;
            if (idx < R * d) {
                const int r = idx / d, c = idx - r * d;
                const float *pr = S + (size_t)r * ATTN_KEYS;
                float o = acc[k] * C[r];
                for (int j = 0; j < kt; j++) o = fmaf(pr[j], KV[j * dp + c], o);
                acc[k] = o;
            }
        }
        return;
    }
    const int c = threadIdx.x % d, r0 = threadIdx.x / d, rstep = NT / d;
#pragma unroll
    for (int k = 0; k < EPT; k++)
        if (r0 + k * rstep < R) acc[k] *= C[r0 + k * rstep];
    int j = 0;
    if (d % 4 == 0) {
        for (; j + 4 <= kt; j += 4) {
            const float v0 = KV[j * dp + c], v1 = KV[(j + 1) * dp + c], v2 = KV[(j + 2) * dp + c],
                        v3 = KV[(j + 3) * dp + c];
#pragma unroll
            for (int k = 0; k < EPT; k++) {
                const int r = r0 + k * rstep;
                if (r < R) {
                    const float4 p = *(const float4 *)(S + (size_t)r * ATTN_KEYS + j);
                    float o = acc[k];
                    o = fmaf(p.x, v0, o);
                    o = fmaf(p.y, v1, o);
                    o = fmaf(p.z, v2, o);
                    acc[k] = fmaf(p.w, v3, o);
                }
            }
        }
    }
    for (; j < kt; j++) {
        const float v = KV[j * dp + c];
#pragma unroll
        for (int k = 0; k < EPT; k++) {
            const int r = r0 + k * rstep;
            if (r < R) acc[k] = fmaf(S[(size_t)r * ATTN_KEYS + j], v, acc[k]);
        }
    }
}

// One block's range of one KV head's list, entries [j0, j_end): query rows of tokens t0 ..
// t0 + ntok - 1 and heads i0 .. i0 + nh - 1 of KV head g, token t seeing the first n_before +
// t + 1 entries. Decode leaves segment seg's partials, prefill the normalised outputs.
template <int NT, int EPT, bool DECODE>
static __device__ __forceinline__ void attn_range(const struct attn_args &a, float *smem, int g, int i0, int nh,
                                                  int seg, int j0, int j_end, int t0, int ntok, int n_before) {
    const int d = a.layer.head_dim, dp = d + 1;
    const int R = ntok * nh;   // row r: token t0 + r / nh, query head g * n_rep + i0 + r % nh
    float *Qs = smem, *K = Qs + (size_t)R * d, *V = K + (size_t)ATTN_KEYS * dp;
    float *S = V + (size_t)ATTN_KEYS * dp, *M = S + (size_t)R * ATTN_KEYS, *L = M + R, *C = L + R;

    for (int idx = threadIdx.x; idx < R * d; idx += NT) {
        const int r = idx / d, c = idx - r * d;
        const int t = t0 + r / nh, h = g * a.n_rep + i0 + r % nh;
        Qs[idx] = a.q[((size_t)t * a.n_head + h) * d + c];
    }
    for (int r = threadIdx.x; r < R; r += NT) {
        M[r] = -INFINITY;
        L[r] = 0.0f;
    }
    float acc[EPT];
#pragma unroll
    for (int k = 0; k < EPT; k++) acc[k] = 0.0f;
    // no barrier here: the first tile's loads go out with the queries', and the tile's barrier
    // covers both (without a tile, each thread reads back only the m and l it set)

    constexpr int NW = NT / CUDA_WARP;
    const int warp = threadIdx.x / CUDA_WARP, lane = threadIdx.x % CUDA_WARP;
    const int32_t *members = a.layer.members[g], *member_at = members + a.layer.members_cap[g];
    const float *member_pool = (const float *)(member_at + a.layer.members_cap[g]);
    for (; j0 < j_end; j0 += ATTN_KEYS) {
        const int kt = min(ATTN_KEYS, j_end - j0);
        attn_stage_kv<NT>(K, V, a.layer, g, j0, kt);
        __syncthreads();
        // scores: lane j takes entry j of the tile (the lanes read 32 different key rows), warp
        // w the rows w, w + NW, ... ATTN_SCORE_ROWS at a time (their queries broadcast)
        for (int rb = warp; rb < R; rb += NW * ATTN_SCORE_ROWS) {
            float dot[ATTN_SCORE_ROWS];
            attn_dots<NW>(dot, Qs, K + (size_t)lane * dp, d, rb, R);
#pragma unroll
            for (int i = 0; i < ATTN_SCORE_ROWS; i++) {
                const int r = rb + i * NW;
                if (r >= R) break;
                const int vis = n_before + t0 + r / nh + 1;   // entries row r sees
                S[r * ATTN_KEYS + lane] = lane < kt && j0 + lane < vis ? dot[i] * a.scale : -INFINITY;
            }
        }
        __syncthreads();
        // online softmax, a warp per row: S becomes exp(s - m_new), C the rescale of the old;
        // a merged entry's S is the sum over its members of exp(norm * s - m_new)
        for (int r = warp; r < R; r += NT / CUDA_WARP) {
            const float s = S[r * ATTN_KEYS + lane];
            int cnt = 1;
            const float *norm = NULL;
            if (members && s != -INFINITY) {
                cnt = members[j0 + lane];
                if (cnt > 1) norm = member_pool + member_at[j0 + lane];
            }
            const float top = norm ? fmaxf(norm[0] * s, norm[cnt - 1] * s) : s;   // norms ascend
            const float m_old = M[r], m_new = fmaxf(m_old, warp_max(top));
            float p = 0.0f;
            if (norm)
                for (int i = 0; i < cnt; i++) p += expf(norm[i] * s - m_new);
            else if (s != -INFINITY)
                p = expf(s - m_new);
            const float sum = warp_sum(p);
            S[r * ATTN_KEYS + lane] = p;
            if (lane == 0) {
                const float corr = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
                C[r] = corr;
                L[r] = L[r] * corr + sum;
                M[r] = m_new;
            }
        }
        __syncthreads();
        attn_accumulate<NT, EPT>(acc, S, C, V, d, R, kt);
        __syncthreads();   // before the next tile overwrites K, V and S
    }

    if (DECODE) {
#pragma unroll
        for (int k = 0; k < EPT; k++) {
            const int idx = threadIdx.x + k * NT;
            if (idx < R * d) {
                const int r = idx / d, c = idx - r * d, h = g * a.n_rep + i0 + r;
                a.part_o[((size_t)h * a.seg_stride + seg) * d + c] = acc[k];
            }
        }
        for (int r = threadIdx.x; r < R; r += NT) {
            const size_t slot = (size_t)(g * a.n_rep + i0 + r) * a.seg_stride + seg;
            a.part_m[slot] = M[r];
            a.part_l[slot] = L[r];
        }
    } else {
#pragma unroll
        for (int k = 0; k < EPT; k++) {
            const int idx = threadIdx.x + k * NT;
            if (idx < R * d) {
                const int r = idx / d, c = idx - r * d;
                const int t = t0 + r / nh, h = g * a.n_rep + i0 + r % nh;
                a.out[((size_t)t * a.n_head + h) * d + c] = acc[k] * __frcp_rn(L[r]);
            }
        }
    }
}

// grid.x: KV head g * n_hgroups + head group. Decode: block y takes segments y, y + gridDim.y,
// ... of its list (the segments are a function of the list's length, so the grid does not
// change the result). Prefill: block y a token tile (the latest tokens, which see the most
// entries, first). NT threads, EPT output values each: heads_per_block * tokens_per_block *
// head_dim <= NT * EPT (the launchers see to it).
template <int NT, int EPT, bool DECODE>
static __global__ void __launch_bounds__(NT) attn_tile_kernel(const struct attn_args a) {
    extern __shared__ __align__(16) float smem[];
    const int g = blockIdx.x / a.n_hgroups, i0 = (blockIdx.x % a.n_hgroups) * a.heads_per_block;
    const int nh = min(a.heads_per_block, a.n_rep - i0);
    const int n = kv_list_len(a.layer, g);
    if (DECODE) {
        const int n_seg = attn_segments(n);
        for (int seg = blockIdx.y; seg < n_seg; seg += gridDim.y) {
            // the one row sees every entry below the segment's end
            const int j0 = attn_segment_start(n, n_seg, seg), j_end = attn_segment_start(n, n_seg, seg + 1);
            attn_range<NT, EPT, true>(a, smem, g, i0, nh, seg, j0, j_end, 0, 1, j_end - 1);
            __syncthreads();   // before the next segment's queries and running sums
        }
    } else {
        const int t0 = (gridDim.y - 1 - blockIdx.y) * a.tokens_per_block, ntok = min(a.tokens_per_block, a.T - t0);
        const int n_before = n - a.T, j_end = n_before + t0 + ntok;   // what the block's last token sees
        attn_range<NT, EPT, false>(a, smem, g, i0, nh, 0, 0, j_end, t0, ntok, n_before);
    }
}

// Query heads per block (and so head groups per KV head) for blocks whose query rows hold at
// most max_values values of one token: as many of the n_rep heads as fit, at least one.
static inline void attn_head_groups(int n_rep, int d, int max_values, int *heads_per_block, int *n_hgroups) {
    int nh = max_values / d;
    if (nh < 1) nh = 1;
    if (nh > n_rep) nh = n_rep;
    *heads_per_block = nh;
    *n_hgroups = (n_rep + nh - 1) / nh;
}

// Dynamic shared memory over the default 48 KiB needs the kernel's opt-in (the launch
// reports the error if the card has less).
template <typename K>
static inline void attn_allow_smem(K kernel, size_t bytes) {
    if (bytes > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}
