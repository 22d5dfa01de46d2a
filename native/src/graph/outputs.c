// outputs.c - every token's logits or hidden state for the caller (perplexity, prompt
// log-probabilities, embeddings), kept per decode call.
#include "graph/outputs.h"
#include "graph/context.h"
#include "core/error.h"

#include <stdlib.h>

static pykv_status grow(float **rows, int32_t *cap, int32_t n, int32_t width) {
    if (n <= *cap) return PYKV_OK;
    float *p = realloc(*rows, (size_t)n * (size_t)width * sizeof(float));
    if (!p) return pykv_error(PYKV_ERR_NOMEM, "out of memory keeping the outputs of %d tokens (%zu MiB)", n,
                              ((size_t)n * (size_t)width * sizeof(float)) >> 20);
    *rows = p;
    *cap = n;
    return PYKV_OK;
}

pykv_status outputs_reserve(struct token_outputs *o, int32_t n_tokens, int32_t n_vocab, int32_t n_embd) {
    if (o->logits_all) PYKV_TRY(grow(&o->logits, &o->cap_logits, n_tokens, n_vocab));
    if (o->embeddings) PYKV_TRY(grow(&o->embd, &o->cap_embd, n_tokens, n_embd));
    return PYKV_OK;
}

void outputs_free(struct token_outputs *o) {
    free(o->logits);
    free(o->embd);
    o->logits = o->embd = NULL;
    o->cap_logits = o->cap_embd = o->n = 0;
}

void outputs_write(pykv_context *ctx, int n) {
    struct token_outputs *o = &ctx->out;
    if (!o->logits_all && !o->embeddings) return;
    const pykv_model *m = ctx->model;
    const int dim = m->hp.n_embd;
    float *normed = o->embeddings ? o->embd + (size_t)o->n * dim : ctx->buf.xb;
    for (int t = 0; t < n; t++)
        rmsnorm(normed + (size_t)t * dim, ctx->buf.x + (size_t)t * dim, m->output_norm, dim, m->hp.rms_eps);
    if (o->logits_all)
        matmul(ctx->pool, o->logits + (size_t)o->n * m->hp.n_vocab, &m->output, normed, n, &ctx->buf.matmul);
    o->n += n;
}

// Switching an output off returns its memory; either switch forgets the last call's rows.
static void switch_output(struct token_outputs *o, int *flag, float **rows, int32_t *cap, int32_t on) {
    *flag = on != 0;
    if (!on) {
        free(*rows);
        *rows = NULL;
        *cap = 0;
    }
    o->n = 0;
}

pykv_status pykv_set_logits_all(pykv_context *ctx, int32_t on) {
    pykv_clear_error();
    if (!ctx) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_set_logits_all: ctx is NULL");
    PYKV_TRY(context_refuse_busy(ctx, "pykv_set_logits_all"));
    switch_output(&ctx->out, &ctx->out.logits_all, &ctx->out.logits, &ctx->out.cap_logits, on);
    return PYKV_OK;
}

pykv_status pykv_set_embeddings(pykv_context *ctx, int32_t on) {
    pykv_clear_error();
    if (!ctx) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_set_embeddings: ctx is NULL");
    PYKV_TRY(context_refuse_busy(ctx, "pykv_set_embeddings"));
    switch_output(&ctx->out, &ctx->out.embeddings, &ctx->out.embd, &ctx->out.cap_embd, on);
    return PYKV_OK;
}

const float *pykv_get_logits_all(const pykv_context *ctx, int32_t *n_rows) {
    int ok = ctx && ctx->out.logits_all && ctx->out.n > 0;
    if (n_rows) *n_rows = ok ? ctx->out.n : 0;
    return ok ? ctx->out.logits : NULL;
}

const float *pykv_get_embeddings(const pykv_context *ctx, int32_t *n_rows) {
    int ok = ctx && ctx->out.embeddings && ctx->out.n > 0;
    if (n_rows) *n_rows = ok ? ctx->out.n : 0;
    return ok ? ctx->out.embd : NULL;
}
