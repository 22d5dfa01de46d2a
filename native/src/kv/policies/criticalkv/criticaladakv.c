// criticaladakv.c - CriticalAdaKV (docs/policies.md#criticaladakv): Ada-KV's head budgets
// over SnapKV's scores, then CriticalKV's two-stage selection inside each head (critical.h).
// Paper: "Identify Critical KV Cache in LLM Inference from an Output Perturbation
// Perspective" (arXiv:2502.03805); kvpress's CriticalAdaKVPress(SnapKVPress).
//
// Per layer at the end of a prefill call, with budget B, window W and B' = B - W: head h's
// candidate count b_h is adakv's (adakv.h: a joint top-k of the layer's SnapKV scores
// blended with the uniform share by alpha); of its b_h, the first
// floor((b_h + W) * first_stage_ratio) - W (if any) are SnapKV's top, the rest the top of
// (s_j + epsilon) * weight_j. The window is always kept.
//
// Options: SnapKV's (window=32, pool=max, kernel=7, gqa=mean), alpha=0.2, epsilon=1e-4,
// first_stage_ratio=0.5.
//
// Choices:
//  * The head budgets are adakv's: its safeguard blends each head's joint count with the
//    uniform share, where kvpress first gives every head its own top int(alpha B) entries
//    (and forces them through both stages). With alpha=0 both are the bare joint top-k and
//    keep the same entries; at alpha > 0 a head's count may differ by a few entries.
//  * The window and the quantized projections as criticalkv.c; schedule, later prefill
//    calls and ties as adakv.
#include "kv/policies/criticalkv/critical.h"
#include "kv/policies/adakv.h"
#include "kv/policies/common/policy-make.h"
#include "core/error.h"
#include "model/model.h"

#include <stddef.h>
#include <stdlib.h>

extern const struct policy_ops policy_criticaladakv;

struct criticaladakv {
    struct kv_policy     base;
    struct ws_opts       o;
    struct critical_opts c;
    double               alpha;
};

static const struct policy_opt criticaladakv_opts[] = {
    { .key = "alpha", .type = POLICY_OPT_DOUBLE, .offset = offsetof(struct criticaladakv, alpha), .lo = 0.0, .hi = 1.0 },
    { .key = "epsilon", .type = POLICY_OPT_DOUBLE, .offset = offsetof(struct criticaladakv, c.epsilon), .lo = 0.0, .hi = 1e9 },
    { .key = "first_stage_ratio", .type = POLICY_OPT_DOUBLE, .offset = offsetof(struct criticaladakv, c.first_stage),
      .lo = 0.0, .hi = 1.0 },
};

static void criticaladakv_defaults(struct kv_policy *base) {
    struct criticaladakv *p = (struct criticaladakv *)base;
    p->alpha = 0.2;
    p->c.epsilon = 1e-4;
    p->c.first_stage = 0.5;
}

static const struct policy_maker criticaladakv_maker = {
    .ops = &policy_criticaladakv,
    .size = sizeof(struct criticaladakv),
    .accepted = "window, pool (max|avg), kernel, gqa (mean|max), alpha, " CRITICAL_KEYS,
    .opts = criticaladakv_opts,
    .n_opts = (int)(sizeof(criticaladakv_opts) / sizeof(criticaladakv_opts[0])),
    .window_opts = offsetof(struct criticaladakv, o),
    .defaults = criticaladakv_defaults,
};

static pykv_status criticaladakv_init(const struct policy_config *cfg, struct kv_policy **out) {
    return policy_make(&criticaladakv_maker, cfg, out);
}

static pykv_status criticaladakv_layer(const struct criticaladakv *p, const struct policy_event *ev,
                                       struct ws_window w, int64_t Bs) {
    struct ws_stats st;
    float *s = NULL;
    PYKV_TRY(ws_layer_scores(ev, &p->o, w, &st, &s));
    float *weights = malloc((size_t)(st.total ? st.total : 1) * sizeof(float));
    int64_t *b = calloc((size_t)st.n_head_kv, sizeof(int64_t));
    pykv_status rc = weights && b ? adakv_layer_budgets(&st, s, Bs, p->alpha, b)
                                  : pykv_error(PYKV_ERR_NOMEM, "out of memory scoring layer %d", ev->layer);
    if (rc == PYKV_OK) rc = critical_value_weights(ev, &st, weights);
    for (int g = 0; g < st.n_head_kv && rc == PYKV_OK; g++)
        rc = critical_keep(ev, g, s + st.offset_kv[g], weights + st.offset_kv[g], st.n_cand[g], b[g], w.protect, &p->c);
    free(b);
    free(weights);
    free(s);
    ws_stats_free(&st);
    return rc;
}

static pykv_status criticaladakv_after_layer(struct kv_policy *base, const struct policy_event *ev) {
    const struct criticaladakv *p = (const struct criticaladakv *)base;
    if (!ws_is_prefill_end(ev)) return PYKV_OK;
    const int32_t B = ws_budget(&base->cfg, ev);
    PYKV_TRY(ws_check_budget("criticaladakv", B, p->o.window));
    if (ev->n_past <= B) return PYKV_OK;
    const struct ws_window w = ws_window_of(ev, p->o.window);
    const int64_t Bs = (int64_t)B - w.protect;
    int64_t total = 0;
    for (int g = 0; g < ev->hp->n_head_kv; g++) {
        const int32_t n = kv_cache_list(ev->cache, ev->layer, g)->n - w.protect;
        total += n > 0 ? n : 0;
    }
    if (total <= (int64_t)ev->hp->n_head_kv * Bs) return PYKV_OK;
    return criticaladakv_layer(p, ev, w, Bs);
}

static int32_t criticaladakv_last_chunk_min(const struct kv_policy *base) {
    return ((const struct criticaladakv *)base)->o.window;
}

const struct policy_ops policy_criticaladakv = {
    .name = "criticaladakv",
    .description = "CriticalAdaKV: Ada-KV's head budgets, each head's entries chosen by CriticalKV's two stages "
                   "(SnapKV's scores, then weighted by ||W_o v||_1)",
    .init = criticaladakv_init,
    .free = policy_free_state,
    .after_layer = criticaladakv_after_layer,
    .last_chunk_min = criticaladakv_last_chunk_min,
    .min_budget = ws_min_budget,
    .options = "window=32, pool=max, kernel=7, gqa=mean, alpha=0.2, epsilon=1e-4, first_stage_ratio=0.5, "
               "evict_every_chunk=0",
    .choose = "as adakv, keeping within each head the entries whose values change the output most",
    .default_budget_frac = POLICY_DEFAULT_BUDGET_FRAC,
    .default_budget_min = POLICY_DEFAULT_BUDGET_MIN,
    .budget_floor = POLICY_BUDGET_FLOOR,
    .device_lists = 1,
};
