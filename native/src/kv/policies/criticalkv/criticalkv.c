// criticalkv.c - CriticalKV on SnapKV (docs/policies.md#criticalkv): SnapKV's window scores,
// reweighted by how much each value can change the layer's output, in two stages
// (critical.h). Paper: "Identify Critical KV Cache in LLM Inference from an Output
// Perturbation Perspective" (arXiv:2502.03805); kvpress's CriticalKVPress(SnapKVPress).
//
// Per layer at the end of a prefill call, with budget B and window W: the window is kept;
// of the B - W candidates, the first floor(B * first_stage_ratio) - W (if any) are SnapKV's
// top, the rest the top of (s_j + epsilon) * weight_j, weight_j = the mean over the KV
// head's query heads of ||W_o,h v_j||_1.
//
// Options: SnapKV's (window=32, pool=max, kernel=7, gqa=mean, as the snapkv policy; kvpress's
// SnapKVPress takes window 64, average pooling, kernel 5: pass them to match it),
// epsilon=1e-4, first_stage_ratio=0.5 (kvpress's defaults).
//
// Choices:
//  * The window is always kept, as in snapkv. kvpress pads the window's base scores above
//    every candidate's, so they fill its first stage, and when that stage is smaller than
//    the window the window's remaining entries go through the second stage, where a window
//    value with a weight far below a candidate's could lose its place.
//  * Quantized output projections are dequantized (once per layer and prefill call); the
//    weights use those dequantized values, as the forward pass does.
//  * Schedule, later prefill calls, ties and the budget rules are snapkv's.
#include "kv/policies/criticalkv/critical.h"
#include "kv/policies/common/policy-make.h"
#include "core/error.h"
#include "model/model.h"

#include <stddef.h>
#include <stdlib.h>

extern const struct policy_ops policy_criticalkv;

struct criticalkv {
    struct kv_policy     base;
    struct ws_opts       o;
    struct critical_opts c;
};

static const struct policy_opt criticalkv_opts[] = {
    { .key = "epsilon", .type = POLICY_OPT_DOUBLE, .offset = offsetof(struct criticalkv, c.epsilon), .lo = 0.0, .hi = 1e9 },
    { .key = "first_stage_ratio", .type = POLICY_OPT_DOUBLE, .offset = offsetof(struct criticalkv, c.first_stage),
      .lo = 0.0, .hi = 1.0 },
};

static void criticalkv_defaults(struct kv_policy *base) {
    struct criticalkv *p = (struct criticalkv *)base;
    p->c.epsilon = 1e-4;
    p->c.first_stage = 0.5;
}

static const struct policy_maker criticalkv_maker = {
    .ops = &policy_criticalkv,
    .size = sizeof(struct criticalkv),
    .accepted = "window, pool (max|avg), kernel, gqa (mean|max), " CRITICAL_KEYS,
    .opts = criticalkv_opts,
    .n_opts = (int)(sizeof(criticalkv_opts) / sizeof(criticalkv_opts[0])),
    .window_opts = offsetof(struct criticalkv, o),
    .defaults = criticalkv_defaults,
};

static pykv_status criticalkv_init(const struct policy_config *cfg, struct kv_policy **out) {
    return policy_make(&criticalkv_maker, cfg, out);
}

static pykv_status criticalkv_layer(const struct criticalkv *p, const struct policy_event *ev, struct ws_window w,
                                    int64_t b) {
    struct ws_stats st;
    float *s = NULL;
    PYKV_TRY(ws_layer_scores(ev, &p->o, w, &st, &s));
    float *weights = malloc((size_t)(st.total ? st.total : 1) * sizeof(float));
    pykv_status rc = weights ? critical_value_weights(ev, &st, weights)
                             : pykv_error(PYKV_ERR_NOMEM, "out of memory scoring layer %d", ev->layer);
    for (int g = 0; g < st.n_head_kv && rc == PYKV_OK; g++)
        rc = critical_keep(ev, g, s + st.offset_kv[g], weights + st.offset_kv[g], st.n_cand[g], b, w.protect, &p->c);
    free(weights);
    free(s);
    ws_stats_free(&st);
    return rc;
}

static pykv_status criticalkv_after_layer(struct kv_policy *base, const struct policy_event *ev) {
    const struct criticalkv *p = (const struct criticalkv *)base;
    if (!ws_is_prefill_end(ev)) return PYKV_OK;
    const int32_t B = ws_budget(&base->cfg, ev);
    PYKV_TRY(ws_check_budget("criticalkv", B, p->o.window));
    if (ev->n_past <= B) return PYKV_OK;
    int any = 0;
    for (int g = 0; g < ev->hp->n_head_kv; g++) any |= kv_cache_list(ev->cache, ev->layer, g)->n > B;
    if (!any) return PYKV_OK;
    const struct ws_window w = ws_window_of(ev, p->o.window);
    return criticalkv_layer(p, ev, w, (int64_t)B - w.protect);
}

static int32_t criticalkv_last_chunk_min(const struct kv_policy *base) {
    return ((const struct criticalkv *)base)->o.window;
}

const struct policy_ops policy_criticalkv = {
    .name = "criticalkv",
    .description = "CriticalKV: SnapKV's scores reweighted by each value's effect on the layer's output "
                   "(||W_o v||_1), in two stages",
    .init = criticalkv_init,
    .free = policy_free_state,
    .after_layer = criticalkv_after_layer,
    .last_chunk_min = criticalkv_last_chunk_min,
    .min_budget = ws_min_budget,
    .options = "window=32, pool=max, kernel=7, gqa=mean, epsilon=1e-4, first_stage_ratio=0.5, evict_every_chunk=0",
    .choose = "as snapkv (the question at the end of the prompt), keeping the entries whose values change the "
              "output most",
    .default_budget_frac = POLICY_DEFAULT_BUDGET_FRAC,
    .default_budget_min = POLICY_DEFAULT_BUDGET_MIN,
    .budget_floor = POLICY_BUDGET_FLOOR,
    .device_lists = 1,
};
