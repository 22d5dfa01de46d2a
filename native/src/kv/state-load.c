// state-load.c - reading a saved state back (pykv_state_load, pykv_state_n_tokens). The
// whole buffer is checked against the context first, policy part included, so that a state
// that does not fit changes nothing; only then is the context replaced. Layout: state.h.
#include "kv/state.h"
#include "core/error.h"
#include "model/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static pykv_status corrupt(const char *why) {
    return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_state_load: not a usable state: %s", why);
}

// The magic, the byte order and the header's integers.
static pykv_status read_header(struct state_reader *r, int32_t *head) {
    char magic[STATE_MAGIC_LEN];
    uint32_t order = 0;
    if (!state_take(r, magic, sizeof(magic))) return corrupt("it does not start with pykv's state header");
    if (memcmp(magic, STATE_MAGIC_V1, sizeof(magic)) == 0)
        return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_state_load: the state was written by an earlier pykv (state "
                          "format 1), which this one does not read: evaluate its tokens again");
    if (memcmp(magic, STATE_MAGIC, sizeof(magic)) != 0) return corrupt("it does not start with pykv's state header");
    if (!state_take(r, &order, sizeof(order)) || order != STATE_BYTE_ORDER)
        return corrupt("it was written on a machine of another byte order");
    if (!state_take(r, head, HEADER_I32 * sizeof(int32_t))) return corrupt("its header is cut short");
    return PYKV_OK;
}

pykv_status pykv_state_n_tokens(const void *src, size_t size, int32_t *n_tokens) {
    pykv_clear_error();
    if ((!src && size) || !n_tokens) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_state_n_tokens: NULL argument");
    *n_tokens = 0;
    int32_t head[HEADER_I32];
    struct state_reader r = { src, size };
    PYKV_TRY(read_header(&r, head));
    if (head[H_N_PAST] < 0) return corrupt("its token count is negative");
    *n_tokens = head[H_N_PAST];
    return PYKV_OK;
}

// The state's policy identity against the context's.
static pykv_status check_identity(const pykv_context *ctx, struct state_reader *r) {
    int32_t len = -1;
    if (!state_take_i32(r, &len) || len < 0 || (size_t)len > r->left) return corrupt("its policy is cut short");
    const char *saved = (const char *)r->at;
    state_take(r, NULL, (size_t)len);
    size_t n = 0;
    char *mine = state_identity(ctx, &n);
    if (!mine) return PYKV_ERR_NOMEM;
    pykv_status st = PYKV_OK;
    if (n != (size_t)len || memcmp(saved, mine, n) != 0)
        st = pykv_error(PYKV_ERR_INVALID_ARG,
                        "pykv_state_load: the state was saved with the policy '%.*s'; this context has '%.*s' "
                        "(a state continues only in a context with the same policy and settings)",
                        len < 300 ? (int)len : 300, saved, (int)(n < 300 ? n : 300), mine);
    free(mine);
    return st;
}

// Whether the fp16 (f16) or fp32 values in the `bytes` at p are all finite: none has an
// exponent of all ones (inf or NaN). A NaN key would otherwise poison every later attention
// of its head. Eight bytes at a time: per lane, (x & exponent) + its lowest bit reaches the
// lane's sign bit exactly when the exponent is all ones, and never carries past the lane.
static int all_finite(const uint8_t *p, size_t bytes, int f16) {
    const uint64_t exponent = f16 ? 0x7C007C007C007C00u : 0x7F8000007F800000u;
    const uint64_t low = f16 ? 0x0400040004000400u : 0x0080000000800000u;
    const uint64_t sign = f16 ? 0x8000800080008000u : 0x8000000080000000u;
    uint64_t bad = 0;
    size_t i = 0;
    for (; i + 8 <= bytes; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        bad |= ((w & exponent) + low) & sign;
    }
    uint64_t w = 0;   // the last few bytes (whole values), the rest zero
    memcpy(&w, p + i, bytes - i);
    return !(bad | (((w & exponent) + low) & sign));
}

// The same for stored rows of any format: for Q8_0, every block's half scale.
static int rows_finite(const uint8_t *p, size_t bytes, int fmt) {
    if (fmt != KV_Q8_0) return all_finite(p, bytes, fmt == KV_F16);
    for (size_t b = 0; b + KV_Q8_BLOCK_BYTES <= bytes; b += KV_Q8_BLOCK_BYTES)
        if (!all_finite(p + b, 2, 1)) return 0;
    return 1;
}

// A header's cache formats (kv_formats_code) in words: "f16", or "q8_0 keys and f16 values".
static const char *formats_text(int32_t code, char *buf, size_t size) {
    int k, v;
    if (!kv_formats_of_code(code, &k, &v)) return "unknown";
    if (k == v) return kv_format_name(k);
    snprintf(buf, size, "%s keys and %s values", kv_format_name(k), kv_format_name(v));
    return buf;
}

// A list's n positions: each below n_past and none twice (`seen`: n_past bits, all clear, and
// left clear). A policy that keeps every entry holds every position in order, 0 .. n_past - 1
// (pykv_truncate cuts lists at their tails); an evicting one may hold its entries in any order
// (EMS puts a newer token in a slot it freed).
static pykv_status check_positions(struct state_reader *r, int32_t n, int all_in_order, int32_t n_past,
                                   uint8_t *seen) {
    if (all_in_order && n != n_past) return corrupt("a list of a policy that keeps every token lacks some");
    const uint8_t *first = r->at;
    pykv_status st = PYKV_OK;
    int32_t pos;
    for (int32_t j = 0; j < n && st == PYKV_OK; j++) {
        if (!state_take_i32(r, &pos)) return corrupt("its positions are cut short");
        if (pos < 0 || pos >= n_past) st = corrupt("a position is out of range");
        else if (all_in_order) st = pos == j ? PYKV_OK : corrupt("a list's positions are out of order");
        else if (seen[pos >> 3] & (1u << (pos & 7))) st = corrupt("a position appears twice in one list");
        else seen[pos >> 3] |= (uint8_t)(1u << (pos & 7));
    }
    for (const uint8_t *p = first; !all_in_order && p < r->at; p += sizeof(int32_t)) {   // clear what was set
        memcpy(&pos, p, sizeof(pos));
        if (pos >= 0 && pos < n_past) seen[pos >> 3] = 0;   // whole bytes: only this list set their bits
    }
    return st;
}

// One list's bytes: its length, positions and finite keys and values, and merged entries'
// counts and norms (counts at least 1, norms finite and not negative). Skips over them.
static pykv_status check_list(const pykv_context *ctx, struct state_reader *r, int32_t n_past, uint8_t *seen,
                              int32_t *n_out) {
    const struct kv_cache *c = &ctx->cache;
    int32_t n = -1, merged = -1;
    if (!state_take_i32(r, &n) || n < 0 || n > n_past || n > context_list_limit(ctx))
        return corrupt("a list length is out of range");
    if (!state_take_i32(r, &merged) || (merged != 0 && merged != 1)) return corrupt("a list's merged flag is bad");
    PYKV_TRY(check_positions(r, n, ctx->policy->ops->keeps_every_entry, n_past, seen));
    const uint8_t *keys = r->at;
    const size_t k_bytes = (size_t)n * kv_cache_key_bytes(c), v_bytes = (size_t)n * kv_cache_value_bytes(c);
    if (!state_take(r, NULL, k_bytes + v_bytes)) return corrupt("its keys and values are cut short");
    if (!rows_finite(keys, k_bytes, c->fmt_k) || !rows_finite(keys + k_bytes, v_bytes, c->fmt_v))
        return corrupt("a key or value is not finite");
    *n_out = n;
    if (!merged) return PYKV_OK;
    int64_t norms = 0;
    for (int32_t j = 0; j < n; j++) {
        int32_t m;
        if (!state_take_i32(r, &m) || m < 1 || m > n_past) return corrupt("a merged entry's member count is bad");
        if (m > 1) norms += m;
    }
    if (norms > n_past * (int64_t)n) return corrupt("a list's merged entries hold too many members");
    for (int64_t i = 0; i < norms; i++) {
        float x;
        if (!state_take(r, &x, sizeof(x))) return corrupt("a list's member norms are cut short");
        if (!isfinite(x) || x < 0.0f) return corrupt("a member norm is not a finite length");
    }
    return PYKV_OK;
}

// The policy's own part: its length, then the policy's check of it (apply = 0); *policy is
// left at its bytes.
static pykv_status check_policy(pykv_context *ctx, struct state_reader *r, const int32_t *list_n,
                                struct state_reader *policy) {
    int64_t len = -1;
    if (!state_take(r, &len, sizeof(len)) || len < 0 || (uint64_t)len != r->left)
        return corrupt("the policy's part is not where the state ends");
    *policy = *r;
    const struct policy_ops *ops = ctx->policy->ops;
    if (!ops->state_read) return len == 0 ? PYKV_OK : corrupt("it holds policy state this policy does not keep");
    PYKV_TRY(ops->state_read(ctx->policy, &ctx->cache, list_n, r, 0));
    return r->left == 0 ? PYKV_OK : corrupt("the policy's part has bytes past its end");
}

// What a checked state holds for the load: its header's integers, the cache's counters,
// each list's length, a reader at the logits (the lists follow) and one at the policy's part.
struct checked_state {
    int32_t             head[HEADER_I32];
    int64_t             counters[2];
    int32_t            *list_n;
    struct state_reader body, policy;
};

// The whole buffer against this context, changing nothing.
static pykv_status check_state(pykv_context *ctx, const void *src, size_t size, struct checked_state *out) {
    int32_t *head = out->head, *list_n = out->list_n;
    int64_t *counters = out->counters;
    const struct kv_cache *c = &ctx->cache;
    struct state_reader r = { src, size };
    PYKV_TRY(read_header(&r, head));
    const int32_t want[5] = { c->n_layer, c->n_head_kv, c->head_dim, ctx->model->hp.n_vocab,
                              kv_formats_code(c->fmt_k, c->fmt_v) };
    if (memcmp(head, want, sizeof(want)) != 0) {
        char theirs[48], ours[48];
        return pykv_error(PYKV_ERR_INVALID_ARG,
                          "pykv_state_load: the state is of a model with %d layers, %d KV heads of %d, %d tokens "
                          "and a KV cache of %s; this context has %d, %d of %d, %d and %s",
                          head[0], head[1], head[2], head[3], formats_text(head[4], theirs, sizeof(theirs)),
                          want[0], want[1], want[2], want[3], formats_text(want[4], ours, sizeof(ours)));
    }
    const int32_t n_past = head[H_N_PAST], has_logits = head[H_HAS_LOGITS], single = head[H_SINGLE_RUN];
    if (n_past < 0 || (has_logits != 0 && has_logits != 1) || (has_logits && n_past == 0) ||
        (single != 0 && single != 1))
        return corrupt("its token count or a flag is out of range");
    if (n_past > context_position_limit(ctx))   // a cache-bounded context reads past n_ctx
        return pykv_error(PYKV_ERR_CONTEXT_FULL, "pykv_state_load: the state holds %d tokens, more than %s=%d",
                          n_past, ctx->cache_bounded ? "the last position" : "n_ctx", context_position_limit(ctx));
    if (!state_take(&r, counters, 2 * sizeof(*counters)) || counters[0] < 0 || counters[1] < 0)
        return corrupt("its cache counters are bad");
    PYKV_TRY(check_identity(ctx, &r));
    out->body = r;
    if (has_logits && !state_take(&r, NULL, (size_t)want[3] * sizeof(float))) return corrupt("its logits are cut short");
    uint8_t *seen = calloc((size_t)n_past / 8 + 1, 1);
    if (!seen) return pykv_error(PYKV_ERR_NOMEM, "out of memory checking a state");
    pykv_status st = PYKV_OK;
    for (int i = 0; i < c->n_layer * c->n_head_kv && st == PYKV_OK; i++)
        st = check_list(ctx, &r, n_past, seen, &list_n[i]);
    free(seen);
    PYKV_TRY(st);
    return check_policy(ctx, &r, list_n, &out->policy);
}

// A list's keys (values = 0) or values from checked bytes, to wherever they are stored.
static pykv_status take_rows(struct state_reader *r, struct kv_cache *c, struct kv_list *l, int values, int32_t n) {
    const size_t bytes = (size_t)n * (values ? kv_cache_value_bytes(c) : kv_cache_key_bytes(c));
    if (bytes > r->left) return pykv_error(PYKV_ERR_INTERNAL, "a checked state ended early");
    PYKV_TRY(kv_list_write_rows(c, l, values, n, r->at));
    state_take(r, NULL, bytes);
    return PYKV_OK;
}

// Fill an empty list from checked bytes.
static pykv_status load_list(struct kv_cache *c, struct kv_list *l, struct state_reader *r) {
    int32_t n = 0, merged = 0;
    state_take_i32(r, &n);
    state_take_i32(r, &merged);
    PYKV_TRY(kv_list_reserve(c, l, n));
    state_take(r, l->pos, (size_t)n * sizeof(int32_t));
    PYKV_TRY(take_rows(r, c, l, 0, n));
    PYKV_TRY(take_rows(r, c, l, 1, n));
    l->n = n;
    if (!merged) return PYKV_OK;
    PYKV_TRY(kv_list_enable_members(c, l));
    int32_t *counts = malloc((size_t)(n ? n : 1) * sizeof(int32_t));
    if (!counts) return pykv_error(PYKV_ERR_NOMEM, "out of memory loading merged KV entries");
    state_take(r, counts, (size_t)n * sizeof(int32_t));
    pykv_status st = PYKV_OK;
    for (int32_t j = 0; j < n && st == PYKV_OK; j++) {
        if (counts[j] == 1) continue;
        st = kv_list_set_members(c, l, j, (const float *)r->at, counts[j]);   // copies the norms
        state_take(r, NULL, (size_t)counts[j] * sizeof(float));
    }
    free(counts);
    return st;
}

pykv_status pykv_state_load(pykv_context *ctx, const void *src, size_t size) {
    pykv_clear_error();
    if (!ctx || (!src && size)) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_state_load: NULL argument");
    PYKV_TRY(context_refuse_busy(ctx, "pykv_state_load"));
    struct kv_cache *c = &ctx->cache;
    struct checked_state s = { .list_n = malloc((size_t)c->n_layer * c->n_head_kv * sizeof(int32_t)) };
    if (!s.list_n) return pykv_error(PYKV_ERR_NOMEM, "out of memory loading a state");
    pykv_status st = check_state(ctx, src, size, &s);
    if (st != PYKV_OK) {
        free(s.list_n);
        return st;
    }

    // Checked: from here on only memory can fail, and then the context is left empty.
    pykv_reset(ctx);
    if (s.head[H_HAS_LOGITS]) state_take(&s.body, ctx->logits, (size_t)s.head[H_N_VOCAB] * sizeof(float));
    for (int i = 0; i < c->n_layer * c->n_head_kv && st == PYKV_OK; i++) st = load_list(c, &c->lists[i], &s.body);
    if (st == PYKV_OK && ctx->policy->ops->state_read)
        st = ctx->policy->ops->state_read(ctx->policy, c, s.list_n, &s.policy, 1);
    free(s.list_n);
    if (st != PYKV_OK) {
        pykv_reset(ctx);
        return st;
    }
    c->evicted = s.counters[0];
    c->merged = s.counters[1];
    ctx->n_past = s.head[H_N_PAST];
    ctx->has_logits = s.head[H_HAS_LOGITS];
    ctx->single_run = s.head[H_SINGLE_RUN];
    return PYKV_OK;
}
