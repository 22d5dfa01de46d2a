// forward.c - the forward pass of the llama architecture over one chunk of tokens.
//
// Reads top to bottom as the math (llama2.c style): embed, then per layer
// { RMSNorm -> Q,K,V -> RoPE -> append K/V to each KV head's list -> attention over each
// head's list -> output projection -> residual -> RMSNorm -> SwiGLU FFN -> residual },
// final norm, classifier. Only the matrix multiplies and attention run on the pool.
#include "attention.h"
#include "context.h"
#include "error.h"
#include "ops.h"
#include "quant.h"

#include <math.h>
#include <string.h>

struct attention_job {
    pykv_context *ctx;
    int           layer;
    int           T;
};

// The query heads of token t that share KV head g, in tiles of ATTENTION_TILE: each tile
// reads the list once (attention_group). Leaves the last tile's weights in scores.
static void attend_group(pykv_context *ctx, int layer, int T, int g, int t, float *scores,
                         void (*each_tile)(pykv_context *, int h0, int nq, int n, const float *w)) {
    const struct hparams *hp = &ctx->model->hp;
    const int n_rep = hp->n_head / hp->n_head_kv, hd = hp->head_dim;
    const struct kv_list *l = kv_cache_list(&ctx->cache, layer, g);
    const int n = l->n - (T - 1 - t);   // this token and everything before it
    for (int r0 = 0; r0 < n_rep; r0 += ATTENTION_TILE) {
        const int nq = n_rep - r0 < ATTENTION_TILE ? n_rep - r0 : ATTENTION_TILE;
        const size_t row = ((size_t)t * hp->n_head + (size_t)g * n_rep + r0) * hd;
        attention_group(ctx->buf.q + row, nq, l, n, hd, scores, ctx->buf.att + row);
        if (each_tile) each_tile(ctx, g * n_rep + r0, nq, n, scores);
    }
}

// One item per (token, KV head), split evenly across the pool.
static void attention_task(void *arg, int ith, int nth) {
    const struct attention_job *job = arg;
    pykv_context *ctx = job->ctx;
    const int n_kv = ctx->model->hp.n_head_kv;
    float *scores = ctx->buf.scores + (size_t)ith * ctx->buf.scores_stride;
    long i0, i1;
    split_range((long)n_kv * job->T, ith, nth, &i0, &i1);
    for (long i = i0; i < i1; i++) attend_group(ctx, job->layer, job->T, (int)(i % n_kv), (int)(i / n_kv), scores, NULL);
}

// colsum[h][j] += the attention query head h pays entry j.
static void add_colsums(pykv_context *ctx, int h0, int nq, int n, const float *w) {
    for (int r = 0; r < nq; r++) {
        float *colsum = ctx->buf.attn_colsum + (size_t)(h0 + r) * ctx->n_ctx;
        for (int j = 0; j < n; j++) colsum[j] += w[(size_t)r * n + j];
    }
}

// For policies that score by accumulated attention (H2O): one item per KV head, whose
// tokens run in order, summing the attention each entry receives into colsum[h][j]. The
// sums then do not depend on how the work is spread over threads.
static void attention_colsum_task(void *arg, int ith, int nth) {
    const struct attention_job *job = arg;
    pykv_context *ctx = job->ctx;
    const struct hparams *hp = &ctx->model->hp;
    const int n_rep = hp->n_head / hp->n_head_kv;
    float *scores = ctx->buf.scores + (size_t)ith * ctx->buf.scores_stride;
    long g0, g1;
    split_range(hp->n_head_kv, ith, nth, &g0, &g1);
    for (long g = g0; g < g1; g++) {
        const int n_list = kv_cache_list(&ctx->cache, job->layer, (int)g)->n;
        for (int r = 0; r < n_rep; r++)
            memset(ctx->buf.attn_colsum + ((size_t)g * n_rep + r) * ctx->n_ctx, 0, (size_t)n_list * sizeof(float));
        for (int t = 0; t < job->T; t++) attend_group(ctx, job->layer, job->T, (int)g, t, scores, add_colsums);
    }
}

static void append_kv(pykv_context *ctx, int layer, int T) {
    const struct hparams *hp = &ctx->model->hp;
    const int hd = hp->head_dim;
    for (int g = 0; g < hp->n_head_kv; g++) {
        struct kv_list *l = kv_cache_list(&ctx->cache, layer, g);
        for (int t = 0; t < T; t++) {
            size_t off = ((size_t)t * hp->n_head_kv + g) * hd;
            kv_list_push(&ctx->cache, l, ctx->buf.k + off, ctx->buf.v + off, ctx->n_past + t);
        }
    }
}

pykv_status forward_chunk(pykv_context *ctx, const pykv_token *tokens, int T, int n_probe, int want_logits) {
    const pykv_model *m = ctx->model;
    const struct hparams *hp = &m->hp;
    struct scratch *b = &ctx->buf;
    const int dim = hp->n_embd, hd = hp->head_dim;
    const int q_dim = hp->n_head * hd, kv_dim = hp->n_head_kv * hd;

    for (int l = 0; l < hp->n_layer * hp->n_head_kv; l++)
        PYKV_TRY(kv_list_reserve(&ctx->cache, &ctx->cache.lists[l], T));

    for (int t = 0; t < T; t++) PYKV_TRY(tensor_get_row(&m->tok_embd, tokens[t], b->x + (size_t)t * dim));

    for (int layer = 0; layer < hp->n_layer; layer++) {
        const struct layer_weights *w = &m->layers[layer];
        if (atomic_load_explicit(&ctx->cancel, memory_order_relaxed))
            return pykv_error(PYKV_ERR_CANCELLED, "cancelled");

        // attention
        for (int t = 0; t < T; t++) rmsnorm(b->xb + (size_t)t * dim, b->x + (size_t)t * dim, w->attn_norm, dim, hp->rms_eps);
        float *qkv[3] = { b->q, b->k, b->v };
        const struct tensor *w_qkv[3] = { &w->wq, &w->wk, &w->wv };
        matmul_many(ctx->pool, 3, qkv, w_qkv, b->xb, T, &b->matmul);
        for (int t = 0; t < T; t++) {
            rope(b->q + (size_t)t * q_dim, hp->n_head, hd, hp->n_rot, ctx->n_past + t, b->rope_inv_freq);
            rope(b->k + (size_t)t * kv_dim, hp->n_head_kv, hd, hp->n_rot, ctx->n_past + t, b->rope_inv_freq);
        }
        append_kv(ctx, layer, T);
        struct attention_job job = { ctx, layer, T };
        threadpool_run(ctx->pool, b->attn_colsum ? attention_colsum_task : attention_task, &job);
        matmul(ctx->pool, b->xb, &w->wo, b->att, T, &b->matmul);
        for (size_t i = 0; i < (size_t)T * dim; i++) b->x[i] += b->xb[i];

        // feed-forward
        for (int t = 0; t < T; t++) rmsnorm(b->xb + (size_t)t * dim, b->x + (size_t)t * dim, w->ffn_norm, dim, hp->rms_eps);
        float *gate_up[2] = { b->gate, b->up };
        const struct tensor *w_gate_up[2] = { &w->w_gate, &w->w_up };
        matmul_many(ctx->pool, 2, gate_up, w_gate_up, b->xb, T, &b->matmul);
        swiglu(b->gate, b->gate, b->up, T * hp->n_ff);
        matmul(ctx->pool, b->xb, &w->w_down, b->gate, T, &b->matmul);
        for (size_t i = 0; i < (size_t)T * dim; i++) b->x[i] += b->xb[i];

        if (ctx->policy->ops->after_layer) {
            struct policy_event ev = ctx->event;
            ev.layer = layer;
            ev.n_past = ctx->n_past + T - n_probe;
            ev.n_probe = n_probe;
            ev.rope_inv_freq = b->rope_inv_freq;
            ev.q = b->q;
            ev.T = T;
            ev.attn_colsum = b->attn_colsum;
            ev.attn_colsum_stride = ctx->n_ctx;
            PYKV_TRY(ctx->policy->ops->after_layer(ctx->policy, &ev));
        }
        for (int g = 0; n_probe && g < hp->n_head_kv; g++) {   // the probe's K/V are never kept
            struct kv_list *l = kv_cache_list(&ctx->cache, layer, g);
            kv_list_truncate(&ctx->cache, l, l->n - n_probe);
        }
    }

    if (want_logits) {
        rmsnorm(b->xb, b->x + (size_t)(T - 1) * dim, m->output_norm, dim, hp->rms_eps);
        matmul(ctx->pool, ctx->logits, &m->output, b->xb, 1, &b->matmul);
        ctx->has_logits = 1;
    }
    return PYKV_OK;
}
