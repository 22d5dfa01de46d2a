// forward.c - the forward pass of the llama architecture over one chunk of tokens.
//
// Reads top to bottom as the math (llama2.c style): embed, then per layer
// { RMSNorm -> Q,K,V -> RoPE -> append K/V to each KV head's list -> attention over each
// head's list (a decode step: the policy's decode_list on each list as it finishes) -> the
// policy's after_layer hook -> output projection -> residual -> RMSNorm -> SwiGLU FFN ->
// residual }, final norm, classifier. Only the matrix multiplies, attention
// and the policies' scoring run on the pool (the attention's schedule: attention-schedule.c).
// Layers offloaded to the GPU (the model's last ones) take the same steps in forward-gpu.c.
#include "graph/attention-schedule.h"
#include "graph/context.h"
#include "graph/forward-gpu.h"
#include "core/error.h"
#include "cpu/ops.h"
#include "cpu/quant.h"
#include "model/offload.h"

#include <stdatomic.h>

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
    for (int t = 0; t < T; t++) rope_angles(b->rope_cs + (size_t)t * hp->n_rot, hp->n_rot, ctx->n_past + t, b->rope_inv_freq);

    // A chunk stops only where rolling it back (dropping what it appended) restores the
    // cache and the policy: before its first layer, or between any two layers when the
    // policy has no per-layer hook (one may already have scored, evicted from or merged
    // into the lists of the layers before), or when the chunk is all probe (a scoring pass,
    // which leaves no entry behind).
    const struct policy_ops *ops = ctx->policy->ops;
    const int per_layer_hooks = (ops->after_layer || ops->decode_list) && n_probe < T;
    const int first_gpu = gpu_first_layer(ctx);
    // the residual stream comes back from the GPU unless only the logits are wanted and the
    // classifier is there too
    const int gpu_want_x = ctx->out.logits_all || ctx->out.embeddings || (want_logits && !(m->gpu && m->gpu->output));
    for (int layer = 0; layer < hp->n_layer; layer++) {
        const struct layer_weights *w = &m->layers[layer];
        if ((layer == 0 || !per_layer_hooks) && atomic_load_explicit(&ctx->cancel, memory_order_relaxed))
            return pykv_error(PYKV_ERR_CANCELLED, "cancelled");
        if (layer == first_gpu) {   // this layer and the ones after it run on the GPU
            int logits_done = 0;
            PYKV_TRY(gpu_forward_layers(ctx, T, n_probe, gpu_want_x, want_logits, &logits_done));
            if (logits_done) {
                ctx->has_logits = 1;
                want_logits = 0;
            }
            break;
        }

        // attention
        for (int t = 0; t < T; t++) rmsnorm(b->xb + (size_t)t * dim, b->x + (size_t)t * dim, w->attn_norm, dim, hp->rms_eps);
        float *qkv[3] = { b->q, b->k, b->v };
        const struct tensor *w_qkv[3] = { &w->wq, &w->wk, &w->wv };
        matmul_many(ctx->pool, 3, qkv, w_qkv, b->xb, T, &b->matmul, MATMUL_SHORT_FLOAT);
        for (int t = 0; t < T; t++) {
            const float *cs = b->rope_cs + (size_t)t * hp->n_rot;
            rope_rotate(b->q + (size_t)t * q_dim, hp->n_head, hd, hp->n_rot, cs);
            rope_rotate(b->k + (size_t)t * kv_dim, hp->n_head_kv, hd, hp->n_rot, cs);
        }
        append_kv(ctx, layer, T);
        // the policy's hooks run while the layer's lists are still in cache (they read no
        // more than the attention; the layer's output does not depend on them)
        struct policy_event ev = ctx->event;
        ev.layer = layer;
        ev.n_past = ctx->n_past + T - n_probe;
        ev.q = b->q;
        ev.probe.n = n_probe;
        ev.probe.q = n_probe ? b->q + (size_t)(T - n_probe) * q_dim : NULL;
        ev.probe.rope_inv_freq = b->rope_inv_freq;
        ev.T = T;
        ev.wo = &w->wo;
        const int prefill_sums = T > 1 && (ops->needs & POLICY_NEEDS_ATTENTION_SUMS);   // decode steps write them anyway
        ev.attn_colsum = T == 1 || prefill_sums ? b->attn_colsum : NULL;
        ev.attn_colsum_stride = (int32_t)b->colsum_stride;
        // a decode step (a one-token call, not a one-token chunk of a prompt) evicts each list
        // as it finishes
        const int per_list = T == 1 && ev.n_prompt == 1 && ops->decode_list;
        if (per_list && ops->after_layer) PYKV_TRY(ops->after_layer(ctx->policy, &ev));
        if (T == 1) PYKV_TRY(decode_attention(ctx, layer, per_list ? &ev : NULL));
        else prefill_attention(ctx, layer, T);
        if (prefill_sums) prefill_attention_sums(ctx, layer, T);   // every entry's attention: a second pass
        if (!per_list && ops->after_layer) PYKV_TRY(ops->after_layer(ctx->policy, &ev));
        for (int g = 0; n_probe && g < hp->n_head_kv; g++) {   // the probe's K/V are never kept
            struct kv_list *l = kv_cache_list(&ctx->cache, layer, g);
            kv_list_truncate(&ctx->cache, l, l->n - n_probe);
        }
        matmul(ctx->pool, b->xb, &w->wo, b->att, T, &b->matmul);
        for (size_t i = 0; i < (size_t)T * dim; i++) b->x[i] += b->xb[i];

        // feed-forward
        for (int t = 0; t < T; t++) rmsnorm(b->xb + (size_t)t * dim, b->x + (size_t)t * dim, w->ffn_norm, dim, hp->rms_eps);
        float *gate_up[2] = { b->gate, b->up };
        const struct tensor *w_gate_up[2] = { &w->w_gate, &w->w_up };
        matmul_many(ctx->pool, 2, gate_up, w_gate_up, b->xb, T, &b->matmul, MATMUL_SHORT_INT8);
        swiglu(b->gate, b->gate, b->up, T * hp->n_ff);
        matmul(ctx->pool, b->xb, &w->w_down, b->gate, T, &b->matmul);
        for (size_t i = 0; i < (size_t)T * dim; i++) b->x[i] += b->xb[i];
    }

    outputs_write(ctx, T - n_probe);
    if (want_logits) {
        rmsnorm(b->xb, b->x + (size_t)(T - 1) * dim, m->output_norm, dim, hp->rms_eps);
        matmul(ctx->pool, ctx->logits, &m->output, b->xb, 1, &b->matmul);
        ctx->has_logits = 1;
    }
    return PYKV_OK;
}
