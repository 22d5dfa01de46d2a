// state.c - a context's state as bytes (pykv_state_save / pykv_state_load): what a later
// context needs to continue exactly where this one stopped. Layout, native byte order:
//   "PYKVSTA1", u32 0x01020304 (byte order), i32 n_layer, n_head_kv, head_dim, n_vocab,
//   kv_f16, n_past, has_logits; the logits (n_vocab floats) when has_logits; then for each
//   (layer, KV head) list: i32 n, n positions, n keys and n values in the cache's type.
#include "context.h"
#include "error.h"
#include "model.h"

#include <stdlib.h>
#include <string.h>

static const char STATE_MAGIC[8] = { 'P', 'Y', 'K', 'V', 'S', 'T', 'A', '1' };
#define STATE_BYTE_ORDER 0x01020304u
enum { HEADER_I32 = 7 };   // n_layer .. has_logits

static pykv_status refuse_policy(const pykv_context *ctx, const char *what) {
    return pykv_error(PYKV_ERR_INVALID_ARG,
                      "%s: the '%s' policy keeps per-entry scores that a saved state does not hold; "
                      "only the full policy's state can be saved and loaded", what, ctx->policy->ops->name);
}

static size_t row_bytes(const struct kv_cache *c) {
    return (size_t)c->head_dim * (c->f16 ? 2 : 4);
}

static size_t list_bytes(const struct kv_cache *c, int32_t n) {
    return sizeof(int32_t) + (size_t)n * (sizeof(int32_t) + 2 * row_bytes(c));
}

static size_t header_bytes(void) {
    return sizeof(STATE_MAGIC) + sizeof(uint32_t) + HEADER_I32 * sizeof(int32_t);
}

pykv_status pykv_state_size(const pykv_context *ctx, size_t *size) {
    pykv_clear_error();
    if (!ctx || !size) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_state_size: NULL argument");
    *size = 0;
    if (!ctx->policy->ops->keeps_every_entry) return refuse_policy(ctx, "pykv_state_size");
    const struct kv_cache *c = &ctx->cache;
    size_t total = header_bytes() + (ctx->has_logits ? (size_t)ctx->model->hp.n_vocab * sizeof(float) : 0);
    for (int i = 0; i < c->n_layer * c->n_head_kv; i++) total += list_bytes(c, c->lists[i].n);
    *size = total;
    return PYKV_OK;
}

static void put(uint8_t **at, const void *src, size_t n) {
    if (n) memcpy(*at, src, n);
    *at += n;
}

pykv_status pykv_state_save(const pykv_context *ctx, void *dst, size_t size, size_t *written) {
    size_t need = 0;
    if (written) *written = 0;
    PYKV_TRY(pykv_state_size(ctx, &need));
    if (!dst || size < need)
        return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_state_save: the buffer has %zu bytes, the state needs %zu",
                          dst ? size : 0, need);
    const struct kv_cache *c = &ctx->cache;
    const int32_t n_vocab = ctx->model->hp.n_vocab;
    const uint32_t order = STATE_BYTE_ORDER;
    const int32_t head[HEADER_I32] = { c->n_layer, c->n_head_kv, c->head_dim, n_vocab, c->f16, ctx->n_past,
                                       ctx->has_logits };
    uint8_t *at = dst;
    put(&at, STATE_MAGIC, sizeof(STATE_MAGIC));
    put(&at, &order, sizeof(order));
    put(&at, head, sizeof(head));
    if (ctx->has_logits) put(&at, ctx->logits, (size_t)n_vocab * sizeof(float));
    for (int i = 0; i < c->n_layer * c->n_head_kv; i++) {
        const struct kv_list *l = &c->lists[i];
        put(&at, &l->n, sizeof(l->n));
        put(&at, l->pos, (size_t)l->n * sizeof(int32_t));
        put(&at, l->k, (size_t)l->n * row_bytes(c));
        put(&at, l->v, (size_t)l->n * row_bytes(c));
    }
    if (written) *written = (size_t)(at - (uint8_t *)dst);
    return PYKV_OK;
}

// Reads through a buffer that may be short or corrupt: every read is bounds-checked.
struct reader {
    const uint8_t *at;
    size_t         left;
};

static int take(struct reader *r, void *out, size_t n) {
    if (n > r->left) return 0;
    if (out && n) memcpy(out, r->at, n);
    r->at += n;
    r->left -= n;
    return 1;
}

static pykv_status corrupt(const char *why) {
    return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_state_load: not a usable state: %s", why);
}

// The magic, the byte order and the header's integers (n_layer .. has_logits).
static pykv_status read_header(struct reader *r, int32_t *head) {
    char magic[sizeof(STATE_MAGIC)];
    uint32_t order = 0;
    if (!take(r, magic, sizeof(magic)) || memcmp(magic, STATE_MAGIC, sizeof(magic)) != 0)
        return corrupt("it does not start with pykv's state header");
    if (!take(r, &order, sizeof(order)) || order != STATE_BYTE_ORDER)
        return corrupt("it was written on a machine of another byte order");
    if (!take(r, head, HEADER_I32 * sizeof(int32_t))) return corrupt("its header is cut short");
    return PYKV_OK;
}

pykv_status pykv_state_n_tokens(const void *src, size_t size, int32_t *n_tokens) {
    pykv_clear_error();
    if ((!src && size) || !n_tokens) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_state_n_tokens: NULL argument");
    *n_tokens = 0;
    int32_t head[HEADER_I32];
    struct reader r = { src, size };
    PYKV_TRY(read_header(&r, head));
    if (head[5] < 0) return corrupt("its token count is negative");
    *n_tokens = head[5];
    return PYKV_OK;
}

// The whole buffer against this context, changing nothing: its header, then every list's
// length and positions, and that the bytes end exactly with the last list.
static pykv_status check_state(const pykv_context *ctx, const void *src, size_t size, int32_t *head) {
    const struct kv_cache *c = &ctx->cache;
    struct reader r = { src, size };
    PYKV_TRY(read_header(&r, head));
    const int32_t want[5] = { c->n_layer, c->n_head_kv, c->head_dim, ctx->model->hp.n_vocab, c->f16 };
    if (memcmp(head, want, sizeof(want)) != 0)
        return pykv_error(PYKV_ERR_INVALID_ARG,
                          "pykv_state_load: the state is of a model with %d layers, %d KV heads of %d, %d tokens "
                          "and an %s cache; this context has %d, %d of %d, %d and %s",
                          head[0], head[1], head[2], head[3], head[4] ? "f16" : "f32", want[0], want[1], want[2],
                          want[3], want[4] ? "f16" : "f32");
    const int32_t n_past = head[5], has_logits = head[6];
    if (n_past < 0 || (has_logits != 0 && has_logits != 1) || (has_logits && n_past == 0))
        return corrupt("its token count or logits flag is out of range");
    if (n_past > ctx->n_ctx)
        return pykv_error(PYKV_ERR_CONTEXT_FULL, "pykv_state_load: the state holds %d tokens, more than n_ctx=%d",
                          n_past, ctx->n_ctx);
    if (has_logits && !take(&r, NULL, (size_t)want[3] * sizeof(float))) return corrupt("its logits are cut short");
    for (int i = 0; i < c->n_layer * c->n_head_kv; i++) {
        int32_t n = -1;
        if (!take(&r, &n, sizeof(n)) || n < 0 || n > n_past) return corrupt("a list length is out of range");
        for (int32_t j = 0; j < n; j++) {
            int32_t pos;
            if (!take(&r, &pos, sizeof(pos)) || pos < 0 || pos >= n_past) return corrupt("a position is out of range");
        }
        if (!take(&r, NULL, 2 * (size_t)n * row_bytes(c))) return corrupt("its keys and values are cut short");
    }
    if (r.left) return corrupt("it has bytes past the last list");
    return PYKV_OK;
}

pykv_status pykv_state_load(pykv_context *ctx, const void *src, size_t size) {
    pykv_clear_error();
    if (!ctx || (!src && size)) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_state_load: NULL argument");
    if (!ctx->policy->ops->keeps_every_entry) return refuse_policy(ctx, "pykv_state_load");
    int32_t head[HEADER_I32];
    PYKV_TRY(check_state(ctx, src, size, head));

    struct kv_cache *c = &ctx->cache;
    const int32_t n_vocab = head[3];
    struct reader r = { (const uint8_t *)src + header_bytes(), size - header_bytes() };
    pykv_reset(ctx);
    if (head[6]) take(&r, ctx->logits, (size_t)n_vocab * sizeof(float));
    for (int i = 0; i < c->n_layer * c->n_head_kv; i++) {
        struct kv_list *l = &c->lists[i];
        int32_t n = 0;
        take(&r, &n, sizeof(n));   // checked above
        pykv_status status = kv_list_reserve(c, l, n);
        if (status != PYKV_OK) {
            pykv_reset(ctx);
            return status;
        }
        take(&r, l->pos, (size_t)n * sizeof(int32_t));
        take(&r, l->k, (size_t)n * row_bytes(c));
        take(&r, l->v, (size_t)n * row_bytes(c));
        l->n = n;
    }
    ctx->n_past = head[5];
    ctx->has_logits = head[6];
    return PYKV_OK;
}
