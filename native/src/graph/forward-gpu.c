// forward-gpu.c - the offloaded layers of the forward pass (forward-gpu.h).
//
// A layer reads as forward.c's CPU layer does: RMSNorm -> Q,K,V -> RoPE -> append K/V to each
// KV head's list -> attention over each list -> output projection -> residual -> RMSNorm ->
// SwiGLU FFN -> residual. Every step is a kernel on the context's stream; the host only
// keeps the lists' bookkeeping (lengths and positions) and waits once per chunk.
#include "graph/forward-gpu.h"
#include "core/error.h"
#include "model/offload.h"

#ifdef PYKV_CUDA
#include "ggml-cuda/device.h"
#include "ggml-cuda/kernels.h"

#include <stdio.h>
#include <stdlib.h>

// The head sizes the attention kernels take.
#define GPU_MAX_HEAD_DIM 256

struct gpu_run {
    cuda_stream stream;
    int         first_layer;
    void       *arena;     // one allocation holds every buffer below
    size_t      bytes;
    float      *x, *xb;    // (n_ubatch, n_embd)
    float      *q, *att;   // (n_ubatch, n_head * head_dim)
    float      *k, *v;     // (n_ubatch, n_head_kv * head_dim)
    float      *gate, *up; // (n_ubatch, n_ff)
    float      *rope_cs;   // (n_ubatch, n_rot)
    float      *logits;    // (n_vocab)
    void       *matmul_work;
    void       *attn_work;
};

int gpu_first_layer(const pykv_context *ctx) {
    return ctx->gpu ? ctx->gpu->first_layer : ctx->model->hp.n_layer;
}

// Why this context cannot run the model's GPU layers there, or NULL when it can.
static const char *gpu_refusal(const pykv_context *ctx, char *buf, size_t cap) {
    const struct hparams *hp = &ctx->model->hp;
    const struct policy_ops *ops = ctx->policy->ops;
    if (!ops->keeps_every_entry)
        snprintf(buf, cap, "the GPU layers run the full cache only: with the '%s' policy this context runs every "
                 "layer on the CPU", ops->name);
    else if (ctx->buf.matmul.exact)
        snprintf(buf, cap, "exact_matmul runs on the CPU: this context runs every layer there");
    else if (hp->n_head_kv > CUDA_MAX_KV_HEADS || hp->head_dim > GPU_MAX_HEAD_DIM || hp->head_dim % 32 != 0)
        snprintf(buf, cap, "the CUDA kernels take up to %d KV heads of up to %d values (a multiple of 32); this "
                 "model has %d of %d: every layer runs on the CPU", CUDA_MAX_KV_HEADS, GPU_MAX_HEAD_DIM,
                 hp->n_head_kv, hp->head_dim);
    else
        return NULL;
    return buf;
}

// Lay out (or, with base set, place) the buffers one after another, 256-byte aligned.
static size_t place_buffers(struct gpu_run *g, const pykv_context *ctx, char *base) {
    const struct hparams *hp = &ctx->model->hp;
    const size_t U = (size_t)ctx->n_ubatch, hd = (size_t)hp->head_dim;
    int64_t max_cols = hp->n_embd;
    if ((int64_t)hp->n_head * hp->head_dim > max_cols) max_cols = (int64_t)hp->n_head * hp->head_dim;
    if (hp->n_ff > max_cols) max_cols = hp->n_ff;
    const struct { void **at; size_t bytes; } bufs[] = {
        { (void **)&g->x, U * hp->n_embd * sizeof(float) },
        { (void **)&g->xb, U * hp->n_embd * sizeof(float) },
        { (void **)&g->q, U * hp->n_head * hd * sizeof(float) },
        { (void **)&g->att, U * hp->n_head * hd * sizeof(float) },
        { (void **)&g->k, U * hp->n_head_kv * hd * sizeof(float) },
        { (void **)&g->v, U * hp->n_head_kv * hd * sizeof(float) },
        { (void **)&g->gate, U * hp->n_ff * sizeof(float) },
        { (void **)&g->up, U * hp->n_ff * sizeof(float) },
        { (void **)&g->rope_cs, U * hp->n_rot * sizeof(float) },
        { (void **)&g->logits, (size_t)hp->n_vocab * sizeof(float) },
        { &g->matmul_work, cuda_matmul_work_bytes(max_cols, ctx->n_ubatch) },
        { &g->attn_work, cuda_attention_decode_work_bytes(hp->n_head, hp->head_dim, ctx->cache.max_entries) },
    };
    size_t used = 0;
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) {
        if (base) *bufs[i].at = base + used;
        used += (bufs[i].bytes + 255) / 256 * 256;
    }
    return used;
}

pykv_status gpu_run_init(pykv_context *ctx) {
    const struct model_gpu *mg = ctx->model->gpu;
    if (!mg) return PYKV_OK;
    char why[256];
    if (gpu_refusal(ctx, why, sizeof(why))) {
        policy_notice(&ctx->notices, NOTICE_GPU, "%s", why);
        return PYKV_OK;
    }
    PYKV_TRY(cuda_set_device(mg->device));
    struct gpu_run *g = calloc(1, sizeof(*g));
    if (!g) return pykv_error(PYKV_ERR_NOMEM, "out of memory");
    g->first_layer = mg->first_layer;
    g->bytes = place_buffers(g, ctx, NULL);
    pykv_status st = cuda_alloc(&g->arena, g->bytes, "the context's activations");
    if (st == PYKV_OK) st = cuda_stream_create(&g->stream);
    if (st != PYKV_OK) {
        cuda_free(g->arena);
        free(g);
        return st;
    }
    place_buffers(g, ctx, g->arena);
    ctx->gpu = g;
    kv_cache_set_device(&ctx->cache, g->first_layer, mg->device);
    return PYKV_OK;
}

void gpu_run_free(pykv_context *ctx) {
    struct gpu_run *g = ctx->gpu;
    if (!g) return;
    cuda_stream_sync(g->stream);
    cuda_stream_destroy(g->stream);
    cuda_free(g->arena);
    cuda_pool_trim();   // the memory the cache's lists were freed into goes back to the device
    free(g);
    ctx->gpu = NULL;
}

static void matmul_gpu(struct gpu_run *g, float *out, const struct gpu_tensor *w, const float *x, int T) {
    cuda_matmul(g->stream, out, w->data, w->type, w->ne[0], w->ne[1], x, T, g->matmul_work);
}

// The layer's lists as the kernels take them, with their current lengths.
static void kv_layer_view(pykv_context *ctx, int layer, struct cuda_kv_layer *kl) {
    const struct kv_cache *c = &ctx->cache;
    kl->n_head_kv = c->n_head_kv;
    kl->head_dim = c->head_dim;
    kl->fmt_k = c->fmt_k;
    kl->fmt_v = c->fmt_v;
    for (int h = 0; h < c->n_head_kv; h++) {
        const struct kv_list *l = &c->lists[(size_t)layer * c->n_head_kv + h];
        kl->k[h] = l->k;
        kl->v[h] = l->v;
        kl->n[h] = l->n;
    }
}

pykv_status gpu_forward_layer(pykv_context *ctx, int layer, int T, int n_probe) {
    struct gpu_run *g = ctx->gpu;
    const pykv_model *m = ctx->model;
    const struct hparams *hp = &m->hp;
    const struct gpu_layer *w = model_gpu_layer(m, layer);
    const cuda_stream s = g->stream;
    const int dim = hp->n_embd, hd = hp->head_dim;
    if (layer == g->first_layer) {
        PYKV_TRY(cuda_set_device(m->gpu->device));   // the calling thread may not have chosen it yet
        PYKV_TRY(cuda_upload_async(g->x, ctx->buf.x, (size_t)T * dim * sizeof(float), s));
        PYKV_TRY(cuda_upload_async(g->rope_cs, ctx->buf.rope_cs, (size_t)T * hp->n_rot * sizeof(float), s));
    }

    // attention
    cuda_rmsnorm(s, g->xb, g->x, w->attn_norm, dim, T, hp->rms_eps);
    matmul_gpu(g, g->q, &w->wq, g->xb, T);
    matmul_gpu(g, g->k, &w->wk, g->xb, T);
    matmul_gpu(g, g->v, &w->wv, g->xb, T);
    cuda_rope(s, g->q, T, hp->n_head, hd, hp->n_rot, g->rope_cs);
    cuda_rope(s, g->k, T, hp->n_head_kv, hd, hp->n_rot, g->rope_cs);
    struct cuda_kv_layer kl;
    kv_layer_view(ctx, layer, &kl);
    cuda_kv_append(s, &kl, g->k, g->v, T);
    for (int h = 0; h < hp->n_head_kv; h++) {
        kv_list_push_positions(kv_cache_list(&ctx->cache, layer, h), ctx->n_past, T);
        kl.n[h] += T;
    }
    if (T == 1) cuda_attention_decode(s, &kl, g->q, hp->n_head, g->att, g->attn_work);
    else cuda_attention_prefill(s, &kl, g->q, hp->n_head, T, g->att);
    for (int h = 0; n_probe && h < hp->n_head_kv; h++) {   // the probe's K/V are never kept
        struct kv_list *l = kv_cache_list(&ctx->cache, layer, h);
        kv_list_truncate(&ctx->cache, l, l->n - n_probe);
    }
    matmul_gpu(g, g->xb, &w->wo, g->att, T);
    cuda_add(s, g->x, g->xb, (int64_t)T * dim);

    // feed-forward
    cuda_rmsnorm(s, g->xb, g->x, w->ffn_norm, dim, T, hp->rms_eps);
    matmul_gpu(g, g->gate, &w->w_gate, g->xb, T);
    matmul_gpu(g, g->up, &w->w_up, g->xb, T);
    cuda_swiglu(s, g->gate, g->gate, g->up, (int64_t)T * hp->n_ff);
    matmul_gpu(g, g->xb, &w->w_down, g->gate, T);
    cuda_add(s, g->x, g->xb, (int64_t)T * dim);
    return cuda_check("a layer on the GPU");
}

pykv_status gpu_finish_chunk(pykv_context *ctx, int T, int want_x, int want_logits, int *logits_done) {
    struct gpu_run *g = ctx->gpu;
    const struct model_gpu *mg = ctx->model->gpu;
    const struct hparams *hp = &ctx->model->hp;
    const int dim = hp->n_embd;
    *logits_done = 0;
    if (want_logits && mg->output) {
        float *last = g->x + (size_t)(T - 1) * dim;
        cuda_rmsnorm(g->stream, g->xb, last, mg->output_norm, dim, 1, hp->rms_eps);
        matmul_gpu(g, g->logits, &mg->out, g->xb, 1);
        PYKV_TRY(cuda_download_async(ctx->logits, g->logits, (size_t)hp->n_vocab * sizeof(float), g->stream));
        *logits_done = 1;
    }
    if (want_x) PYKV_TRY(cuda_download_async(ctx->buf.x, g->x, (size_t)T * dim * sizeof(float), g->stream));
    PYKV_TRY(cuda_check("the output on the GPU"));
    return cuda_stream_sync(g->stream);
}

#else   // a build without CUDA: no context has GPU layers

pykv_status gpu_run_init(pykv_context *ctx) {
    (void)ctx;
    return PYKV_OK;
}
void gpu_run_free(pykv_context *ctx) { (void)ctx; }
int gpu_first_layer(const pykv_context *ctx) { return ctx->model->hp.n_layer; }
pykv_status gpu_forward_layer(pykv_context *ctx, int layer, int T, int n_probe) {
    (void)ctx; (void)layer; (void)T; (void)n_probe;
    return pykv_error(PYKV_ERR_UNSUPPORTED, "this build of pykv has no CUDA backend");
}
pykv_status gpu_finish_chunk(pykv_context *ctx, int T, int want_x, int want_logits, int *logits_done) {
    (void)ctx; (void)T; (void)want_x; (void)want_logits;
    *logits_done = 0;
    return pykv_error(PYKV_ERR_UNSUPPORTED, "this build of pykv has no CUDA backend");
}

#endif
