// streamingllm.c - StreamingLLM (docs/policies.md#streamingllm): keep the first S entries (attention
// sinks) and the most recent R = B - S entries of every list; drop the middle.
//
// Choices ([decide] / [ours]):
//  * S = 4 by default (sink= or the policy argument sink=); R = B - S by default. A window=
//    (constructor or policy argument) sets R directly: S + R must not exceed B, and with
//    no budget given B = S + R (else the default budget applies). Requires B > S.
//  * Evicts in after_layer: at the end of every multi-token call (the whole prompt is
//    attended to in full first, chunk by chunk) and at every decode step (the list then
//    holds S + R + 1 entries and loses its oldest non-sink entry).
//  * Original positions are kept (no key re-rotation), as kvpress's StreamingLLMPress
//    (n_sink=4) does: the same kept entries.
//  * With a fractional budget, B is fixed at each prefill call from the sequence length
//    then; decode steps keep that B (saved states too); pykv_reset forgets it.
#include "kv/policies/common/policy-make.h"
#include "kv/policies/common/policy-state.h"
#include "kv/policies/common/window-scores.h"
#include "core/error.h"
#include "model/model.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

extern const struct policy_ops policy_streamingllm;

#define STREAMING_KEYS "sink, window (recent entries kept)"

struct streaming {
    struct kv_policy base;
    int32_t          sink;     // S
    int32_t          recent;   // R, or -1 = B - S
    int32_t          B;        // budget fixed by the last prefill (0 = not yet)
};

static const struct policy_opt streaming_opts[] = {
    { .key = "sink", .type = POLICY_OPT_INT, .offset = offsetof(struct streaming, sink), .lo = 0, .hi = 1 << 24 },
    { .key = "window", .type = POLICY_OPT_INT, .offset = offsetof(struct streaming, recent), .lo = 1, .hi = 1 << 24 },
};

static pykv_status merge(const char *what, int32_t from_cfg, int32_t *v) {
    if (from_cfg < 0) return PYKV_OK;
    if (*v >= 0 && *v != from_cfg)
        return pykv_error(PYKV_ERR_INVALID_ARG, "policy 'streamingllm': %s=%d and the policy argument %s=%d disagree",
                          what, from_cfg, what, *v);
    *v = from_cfg;
    return PYKV_OK;
}

static pykv_status check_sizes(const struct streaming *p, int32_t B) {
    if (B <= p->sink)
        return pykv_error(PYKV_ERR_INVALID_ARG, "policy 'streamingllm': the budget (%d entries per layer and KV head) "
                          "must be larger than the %d sink tokens it includes", B, p->sink);
    if (p->recent >= 0 && (int64_t)p->sink + p->recent > B)
        return pykv_error(PYKV_ERR_INVALID_ARG, "policy 'streamingllm': sink=%d plus window=%d exceed the budget %d",
                          p->sink, p->recent, B);
    return PYKV_OK;
}

// The constructor's sink= and window= against the arguments; a budget implied by them.
static pykv_status streaming_finish(struct kv_policy *base, const struct policy_config *cfg) {
    struct streaming *p = (struct streaming *)base;
    PYKV_TRY(merge("sink", cfg->sink, &p->sink));
    if (cfg->window == 0)
        return pykv_error(PYKV_ERR_INVALID_ARG, "policy 'streamingllm': window (recent entries) must be at least 1");
    PYKV_TRY(merge("window", cfg->window, &p->recent));
    if (p->sink < 0) p->sink = 4;
    if (policy_budget_is_default(cfg) && p->recent >= 0) p->B = p->sink + p->recent;   // implied by sink + window
    if (cfg->budget > 0) PYKV_TRY(check_sizes(p, cfg->budget));
    return PYKV_OK;
}

static void streaming_defaults(struct kv_policy *base) {
    struct streaming *p = (struct streaming *)base;
    p->sink = -1;
    p->recent = -1;
}

static const struct policy_maker streaming_maker = {
    .ops = &policy_streamingllm,
    .size = sizeof(struct streaming),
    .accepted = STREAMING_KEYS,
    .opts = streaming_opts,
    .n_opts = (int)(sizeof(streaming_opts) / sizeof(streaming_opts[0])),
    .defaults = streaming_defaults,
    .finish = streaming_finish,
};

static pykv_status streaming_init(const struct policy_config *cfg, struct kv_policy **out) {
    return policy_make(&streaming_maker, cfg, out);
}

// Nonzero when sink + window set the budget (no budget given).
static int implied_budget(const struct streaming *p) {
    return policy_budget_is_default(&p->base.cfg) && p->recent >= 0;
}

static int32_t budget_of(struct streaming *p, const struct policy_event *ev) {
    const struct policy_config *cfg = &p->base.cfg;
    if (implied_budget(p)) return p->B;   // sink + window
    if (ev->n_prompt > 1 || p->B == 0) p->B = ws_budget(cfg, ev);
    return p->B;
}

static pykv_status streaming_after_layer(struct kv_policy *base, const struct policy_event *ev) {
    struct streaming *p = (struct streaming *)base;
    if (ev->n_prompt > 1 && !ev->is_last_chunk) return PYKV_OK;
    const int32_t B = budget_of(p, ev);
    PYKV_TRY(check_sizes(p, B));
    const int32_t S = p->sink, R = p->recent >= 0 ? p->recent : B - S;
    for (int g = 0; g < ev->hp->n_head_kv; g++) {
        struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
        if (l->n <= S + R) continue;
        int32_t *keep = malloc((size_t)(S + R) * sizeof(int32_t));
        if (!keep) return pykv_error(PYKV_ERR_NOMEM, "out of memory compacting the KV cache");
        for (int32_t j = 0; j < S; j++) keep[j] = j;
        for (int32_t j = 0; j < R; j++) keep[S + j] = l->n - R + j;
        pykv_status st = kv_list_retain(ev->cache, l, keep, S + R);
        free(keep);
        PYKV_TRY(st);
    }
    return PYKV_OK;
}

// pykv_reset: the budget a fresh context starts with (sink + window when no budget is given).
static void streaming_reset(struct kv_policy *base) {
    struct streaming *p = (struct streaming *)base;
    p->B = implied_budget(p) ? p->sink + p->recent : 0;
}

// Saved state: the budget the last prefill fixed.
static void streaming_state_write(const struct kv_policy *base, const struct kv_cache *c, struct state_writer *w) {
    (void)c;
    state_put_i32(w, ((const struct streaming *)base)->B);
}

static pykv_status streaming_state_read(struct kv_policy *base, const struct kv_cache *c, const int32_t *list_n,
                                        struct state_reader *r, int apply) {
    (void)list_n;
    int32_t B;
    PYKV_TRY(policy_state_ints("streamingllm", "budget", r, &B, 1, 0, c->max_entries));
    if (apply) ((struct streaming *)base)->B = B;
    return PYKV_OK;
}

// The least budget: the sinks and one recent entry, or the sinks and the window asked for.
static int32_t streaming_min_budget(const struct kv_policy *base) {
    const struct streaming *p = (const struct streaming *)base;
    return p->sink + (p->recent > 0 ? p->recent : 1);
}

const struct policy_ops policy_streamingllm = {
    .name = "streamingllm",
    .description = "StreamingLLM: keep the first sink tokens and the most recent ones",
    .init = streaming_init,
    .free = policy_free_state,
    .after_layer = streaming_after_layer,
    .reset = streaming_reset,
    .state_write = streaming_state_write,
    .state_read = streaming_state_read,
    .min_budget = streaming_min_budget,
    .options = "sink=4, window=B-sink, evict_every_chunk=0",
    .choose = "the cheapest fixed memory for long chats where only the recent text matters; it forgets the "
              "middle of a long prompt",
    .default_budget_frac = POLICY_DEFAULT_BUDGET_FRAC,
    .default_budget_min = POLICY_DEFAULT_BUDGET_MIN,
    .budget_floor = POLICY_BUDGET_FLOOR,
    .device_lists = 1,
    .needs = POLICY_NEEDS_STEP_ROOM,
};
