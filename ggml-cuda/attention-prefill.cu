// attention-prefill.cu - a prefill chunk's causal attention (flash attention). Twin:
// attention_flash (native/src/cpu/attention-flash.c).
//
// Token t of the chunk, query head h, attends over the first n_before + t + 1 entries of
// list h / n_rep, n_before = n[g] - T (the chunk's keys are already appended). A block of
// attention-tile.cuh takes up to PREFILL_MAX_TOKENS consecutive tokens with the query heads of
// one KV head that fit (PREFILL_THREADS * PREFILL_EPT values of queries: 64 rows of 128), so
// each tile of keys and values staged in shared memory serves all of them; fewer tokens when
// the grid would otherwise be short of PREFILL_MIN_BLOCKS.
#include "attention-tile.cuh"

#include <string.h>

#define PREFILL_THREADS 256
#define PREFILL_EPT 32
#define PREFILL_MAX_TOKENS 64
// Blocks a launch should have at least (two per SM of an H100, as many as its registers let
// run at once): a model with few KV heads takes fewer tokens a block, so that a chunk's
// attention is not left to a few SMs. Each row's sums are the same whatever block it is in.
#define PREFILL_MIN_BLOCKS 256
// Shared memory a block may take: sm_86 and sm_89 give a block at most 99 KiB.
#define PREFILL_MAX_SMEM (96 * 1024)

extern "C" void cuda_attention_prefill(cuda_stream s, const struct cuda_kv_layer *layer, const float *q, int n_head, int T,
                                       float *out) {
    const int n_kv = layer->n_head_kv, d = layer->head_dim;
    if (n_kv <= 0 || n_head <= 0 || d <= 0 || T <= 0) return;
    const int max_values = PREFILL_THREADS * PREFILL_EPT;

    struct attn_args a;
    memset(&a, 0, sizeof(a));
    a.layer = *layer;
    a.q = q;
    a.out = out;
    a.n_head = n_head;
    a.n_rep = n_head / n_kv;
    a.T = T;
    attn_head_groups(a.n_rep, d, max_values, &a.heads_per_block, &a.n_hgroups);
    int tpb = max_values / d / a.heads_per_block;
    if (tpb > PREFILL_MAX_TOKENS) tpb = PREFILL_MAX_TOKENS;
    const int heads = n_kv * a.n_hgroups, tiles = (PREFILL_MIN_BLOCKS + heads - 1) / heads;   // token tiles wanted
    const int spread = (T + tiles - 1) / tiles;
    if (tpb > spread) tpb = spread;
    while (tpb > 1 && attn_smem_bytes(a.heads_per_block * tpb, d) > PREFILL_MAX_SMEM) tpb--;
    if (tpb < 1) tpb = 1;
    a.tokens_per_block = tpb;
    a.scale = 1.0f / sqrtf((float)d);

    const size_t smem = attn_smem_bytes(a.heads_per_block * tpb, d);
    void (*kernel)(const struct attn_args) = attn_tile_kernel<PREFILL_THREADS, PREFILL_EPT, false>;
    attn_allow_smem(kernel, smem);
    const dim3 grid((unsigned)(n_kv * a.n_hgroups), (unsigned)((T + tpb - 1) / tpb));
    kernel<<<grid, PREFILL_THREADS, smem, s>>>(a);
}
