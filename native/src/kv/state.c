// state.c - a context's state as bytes (pykv_state_size / pykv_state_save): what a later
// context needs to continue exactly where this one stopped, with any policy: the cache's
// entries (merged ones too), the logits, and the policy's own state. Layout: state.h;
// reading it back: state-load.c.
#include "kv/state.h"
#include "core/error.h"
#include "model/model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char STATE_MAGIC[STATE_MAGIC_LEN] = { 'P', 'Y', 'K', 'V', 'S', 'T', 'A', '2' };
const char STATE_MAGIC_V1[STATE_MAGIC_LEN] = { 'P', 'Y', 'K', 'V', 'S', 'T', 'A', '1' };

// FNV-1a over the probe's tokens: the identity names the probe without listing it.
static uint32_t probe_hash(const pykv_token *t, int32_t n) {
    uint32_t h = 2166136261u;
    const uint8_t *b = (const uint8_t *)t;
    for (size_t i = 0; i < (size_t)n * sizeof(*t); i++) h = (h ^ b[i]) * 16777619u;
    return h;
}

static size_t identity(const pykv_context *ctx, char *buf, size_t cap) {
    const struct kv_policy *p = ctx->policy;
    const struct policy_config *cfg = &p->cfg;
    if (p->ops->keeps_every_entry) return (size_t)snprintf(buf, cap, "%s", p->ops->name);
    char probe[48] = "";
    if (p->ops->probe_len && ctx->n_probe_set > 0)
        snprintf(probe, sizeof(probe), " probe=%d tokens #%08x", ctx->n_probe_set,
                 probe_hash(ctx->probe, ctx->n_probe_set));
    return (size_t)snprintf(buf, cap, "%s budget=%d budget_frac=%.9g window=%d sink=%d args=%s%s", p->ops->name,
                            cfg->budget, (double)cfg->budget_frac, cfg->window, cfg->sink,
                            cfg->args ? cfg->args : "", probe);
}

char *state_identity(const pykv_context *ctx, size_t *len) {
    *len = identity(ctx, NULL, 0);
    char *text = malloc(*len + 1);
    if (text) identity(ctx, text, *len + 1);
    else pykv_error(PYKV_ERR_NOMEM, "out of memory for a state's policy identity");
    return text;
}

// Whether any entry of the list stands for more than one token.
static int32_t has_merged(const struct kv_list *l) {
    for (int32_t j = 0; l->n_members && j < l->n; j++)
        if (l->n_members[j] > 1) return 1;
    return 0;
}

// A list's keys (values = 0) or values, copied from wherever they are stored (GPU memory for
// an offloaded layer's list).
static pykv_status put_rows(struct state_writer *w, const struct kv_cache *c, const struct kv_list *l, int values) {
    const size_t bytes = (size_t)l->n * (values ? kv_cache_value_bytes(c) : kv_cache_key_bytes(c));
    if (w->at) {
        PYKV_TRY(kv_list_read_rows(c, l, values, l->n, w->at));
        w->at += bytes;
    }
    w->n += bytes;
    return PYKV_OK;
}

static pykv_status write_list(struct state_writer *w, const struct kv_cache *c, const struct kv_list *l) {
    const int32_t merged = has_merged(l);
    state_put_i32(w, l->n);
    state_put_i32(w, merged);
    state_put(w, l->pos, (size_t)l->n * sizeof(int32_t));
    PYKV_TRY(put_rows(w, c, l, 0));
    PYKV_TRY(put_rows(w, c, l, 1));
    if (!merged) return PYKV_OK;
    state_put(w, l->n_members, (size_t)l->n * sizeof(int32_t));
    for (int32_t j = 0; j < l->n; j++)
        if (l->n_members[j] > 1) state_put(w, kv_member_norms(l, j), (size_t)l->n_members[j] * sizeof(float));
    return PYKV_OK;
}

// The whole state through w (which may only count). The identity is `id` (id_len bytes).
static pykv_status write_state(const pykv_context *ctx, struct state_writer *w, const char *id, int32_t id_len) {
    const struct kv_cache *c = &ctx->cache;
    const int32_t n_vocab = ctx->model->hp.n_vocab;
    const uint32_t order = STATE_BYTE_ORDER;
    const int32_t head[HEADER_I32] = { c->n_layer, c->n_head_kv, c->head_dim, n_vocab, kv_formats_code(c->fmt_k, c->fmt_v),
                                       ctx->n_past,
                                       ctx->has_logits, ctx->single_run };
    const int64_t counters[2] = { c->evicted, c->merged };
    state_put(w, STATE_MAGIC, sizeof(STATE_MAGIC));
    state_put(w, &order, sizeof(order));
    state_put(w, head, sizeof(head));
    state_put(w, counters, sizeof(counters));
    state_put_i32(w, id_len);
    state_put(w, id, (size_t)id_len);
    if (ctx->has_logits) state_put(w, ctx->logits, (size_t)n_vocab * sizeof(float));
    for (int i = 0; i < c->n_layer * c->n_head_kv; i++) PYKV_TRY(write_list(w, c, &c->lists[i]));

    const struct kv_policy *p = ctx->policy;
    struct state_writer count = { NULL, 0 };
    if (p->ops->state_write) p->ops->state_write(p, c, &count);
    const int64_t policy_bytes = (int64_t)count.n;
    state_put(w, &policy_bytes, sizeof(policy_bytes));
    if (p->ops->state_write) p->ops->state_write(p, c, w);
    return PYKV_OK;
}

// The whole state written at dst, or only counted when dst is NULL; *n gets its size.
static pykv_status put_state(const pykv_context *ctx, uint8_t *dst, size_t *n) {
    size_t id_len = 0;
    char *id = state_identity(ctx, &id_len);
    if (!id) return PYKV_ERR_NOMEM;
    struct state_writer w = { dst, 0 };
    const pykv_status st = write_state(ctx, &w, id, (int32_t)id_len);
    free(id);
    *n = w.n;
    return st;
}

pykv_status pykv_state_size(const pykv_context *ctx, size_t *size) {
    pykv_clear_error();
    if (!ctx || !size) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_state_size: NULL argument");
    *size = 0;
    return put_state(ctx, NULL, size);
}

pykv_status pykv_state_save(const pykv_context *ctx, void *dst, size_t size, size_t *written) {
    size_t need = 0;
    if (written) *written = 0;
    PYKV_TRY(pykv_state_size(ctx, &need));
    if (!dst || size < need)
        return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_state_save: the buffer has %zu bytes, the state needs %zu",
                          dst ? size : 0, need);
    size_t n = 0;
    PYKV_TRY(put_state(ctx, dst, &n));
    if (written) *written = n;
    return PYKV_OK;
}
