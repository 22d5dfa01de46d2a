// attention-decode.cu - one token's attention (flash-decoding). Twins: attention_group and
// the CPU's split decode (attention_group_partial + attention_merge, graph/attention-schedule.c).
//
// Each list is cut into segments (attn_segments: a function of its length alone). A block of
// attention-tile.cuh takes (KV head g, segment) with all n_rep query heads of g, so each key
// and value row is read once, and leaves each head's partial (m, l, o) in work; a second
// kernel merges each head's segments in a fixed order, so the result does not depend on the
// number of SMs or on which block ran first.
#include "attention-tile.cuh"
#include "norm-quant.cuh"

#include <string.h>

#define DECODE_THREADS 128
#define DECODE_EPT 16   // query values per thread: n_rep * head_dim up to 2048 in one block
#define MERGE_THREADS 256
#define MERGE_WARPS (MERGE_THREADS / CUDA_WARP)
// Decode blocks per launch at most (about 8 per SM of an H100); past it a block takes
// several segments in turn.
#define DECODE_MAX_BLOCKS 1024

extern "C" int cuda_attention_segments(int32_t n) { return attn_segments(n); }

// work: part_o (n_head, S, head_dim), then part_m and part_l (n_head, S), S the segments of
// the longest list; the launch takes S from its own lists, which must not exceed max_n.
extern "C" size_t cuda_attention_decode_work_bytes(int n_head, int head_dim, int32_t max_n) {
    return (size_t)n_head * (size_t)attn_segments(max_n) * ((size_t)head_dim + 2) * sizeof(float);
}

// One block per query head: out = sum_p f[p] o[p] / sum_p f[p] l[p], f[p] = exp(m[p] - max m).
// The segments are spread over the threads by a rule of n_seg and the block size alone, and
// the pieces added in a fixed order, so the result does not depend on the card: the total
// takes segment p in lane p % 32 of the first warp, then warp_sum; output column c takes the
// segments p = i (mod G) in thread group i, G = MERGE_THREADS / head_dim of them, added in
// group order. With xq, the head's outputs are also written as Q8_1 blocks (the input of the
// output product), a warp a block as norm-quant.cu's kernels.
__global__ void __launch_bounds__(MERGE_THREADS)
attn_merge_kernel(const struct cuda_kv_layer layer, int n_rep, int seg_stride, const float *part_o,
                  const float *part_m, const float *part_l, float *out, dev_block_q8_1 *xq) {
    __shared__ float f[ATTN_MAX_SEGMENTS];
    __shared__ float red[MERGE_THREADS];
    __shared__ float warp_mx[MERGE_WARPS];
    __shared__ float inv_total;
    const int h = blockIdx.x, d = layer.head_dim, tid = threadIdx.x, lane = tid % CUDA_WARP, warp = tid / CUDA_WARP;
    const int n_seg = attn_segments(kv_list_len(layer, h / n_rep));
    const float *m = part_m + (size_t)h * seg_stride, *l = part_l + (size_t)h * seg_stride;
    const float *o = part_o + (size_t)h * seg_stride * d;
    float mx = -INFINITY;
    for (int p = tid; p < n_seg; p += MERGE_THREADS) mx = fmaxf(mx, m[p]);
    mx = warp_max(mx);
    if (lane == 0) warp_mx[warp] = mx;
    __syncthreads();
    mx = warp_mx[0];
    for (int w = 1; w < MERGE_WARPS; w++) mx = fmaxf(mx, warp_mx[w]);
    for (int p = tid; p < n_seg; p += MERGE_THREADS) f[p] = mx == -INFINITY ? 0.0f : expf(m[p] - mx);
    __syncthreads();
    if (warp == 0) {
        float part = 0.0f;
        for (int p = lane; p < n_seg; p += CUDA_WARP) part += f[p] * l[p];
        const float total = warp_sum(part);
        if (lane == 0) inv_total = total > 0.0f ? __frcp_rn(total) : 0.0f;   // an empty list: zeros
    }
    float *row = out + (size_t)h * d;
    if (d > MERGE_THREADS) {
        __syncthreads();
        for (int c = tid; c < d; c += MERGE_THREADS) {
            float acc = 0.0f;
            for (int p = 0; p < n_seg; p++) acc += f[p] * o[(size_t)p * d + c];
            row[c] = acc * inv_total;
        }
    } else {
        const int G = MERGE_THREADS / d, i = tid / d, c = tid - i * d;
        float acc = 0.0f;
        if (i < G)
            for (int p = i; p < n_seg; p += G) acc += f[p] * o[(size_t)p * d + c];
        red[tid] = acc;
        __syncthreads();
        if (tid < d) {
            float sum = red[tid];
            for (int k = 1; k < G; k++) sum += red[k * d + tid];
            row[tid] = sum * inv_total;
        }
    }
    if (xq) {   // head_dim a multiple of 32: the head's Q8_1 blocks are its own
        __syncthreads();   // the head's outputs, seen by every warp
        dev_block_q8_1 *y = xq + (size_t)h * (d / 32);
        for (int b = warp; b < d / 32; b += MERGE_WARPS) q8_1_quantize_warp(row[32 * b + lane], lane, y + b);
    }
}

extern "C" void cuda_attention_decode(cuda_stream s, const struct cuda_kv_layer *layer, const float *q, int n_head,
                                      float *out, void *xq, void *work) {
    const int n_kv = layer->n_head_kv, d = layer->head_dim;
    if (n_kv <= 0 || n_head <= 0 || d <= 0) return;
    int32_t max_n = layer->n_dev ? layer->n_bound : 0;   // device lengths: a grid for the longest possible
    for (int g = 0; !layer->n_dev && g < n_kv; g++) max_n = layer->n[g] > max_n ? layer->n[g] : max_n;
    const int S = attn_segments(max_n);

    struct attn_args a;
    memset(&a, 0, sizeof(a));
    a.layer = *layer;
    a.q = q;
    a.part_o = (float *)work;
    a.part_m = a.part_o + (size_t)n_head * S * d;
    a.part_l = a.part_m + (size_t)n_head * S;
    a.n_head = n_head;
    a.n_rep = n_head / n_kv;
    a.T = 1;
    attn_head_groups(a.n_rep, d, DECODE_THREADS * DECODE_EPT, &a.heads_per_block, &a.n_hgroups);
    a.tokens_per_block = 1;
    a.seg_stride = S;
    a.scale = 1.0f / sqrtf((float)d);

    const size_t smem = attn_smem_bytes(a.heads_per_block, d);
    void (*kernel)(const struct attn_args) = attn_tile_kernel<DECODE_THREADS, DECODE_EPT, true>;
    attn_allow_smem(kernel, smem);
    const int heads = n_kv * a.n_hgroups;
    int rows = DECODE_MAX_BLOCKS / heads;   // grid rows: each takes segments y, y + rows, ...
    rows = rows < 1 ? 1 : rows > S ? S : rows;
    kernel<<<dim3((unsigned)heads, (unsigned)rows), DECODE_THREADS, smem, s>>>(a);
    const int fused_q8 = xq && d % 32 == 0;
    attn_merge_kernel<<<n_head, MERGE_THREADS, 0, s>>>(*layer, a.n_rep, S, a.part_o, a.part_m, a.part_l, out,
                                                       fused_q8 ? (dev_block_q8_1 *)xq : NULL);
    if (xq && !fused_q8) cuda_quantize_q8_1(s, xq, out, (int64_t)n_head * d, 1);
}
