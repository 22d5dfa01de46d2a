// knorm.c - Knorm (docs/policies.md#knorm): at the end of each prefill call every list keeps
// the B entries whose keys have the smallest L2 norm.
//
// Paper: "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"
// (Devoto et al., arXiv:2406.11430). The score is -||k_j|| of the stored (post-RoPE) key;
// RoPE rotates pairs of channels, so the norm is the pre-RoPE key's as well. It reads no
// query and no attention: question-agnostic, and the cheapest scored policy.
//
// Options: none of its own (evict_every_chunk=0 as every evicting policy).
// Schedule: as SnapKV without a window (kvpress's KnormPress protects no entry): in
// after_layer of the last chunk of a multi-token call, every list longer than B is cut to
// its top B (ties -> lower position); decode steps append without eviction; a later
// prefill call scores the whole list again.
#include "kv/policies/common/entry-scores.h"
#include "kv/policies/common/policy-make.h"
#include "kv/policies/common/window-scores.h"
#include "core/error.h"
#include "model/model.h"

#include <math.h>

extern const struct policy_ops policy_knorm;

static const struct policy_maker knorm_maker = {
    .ops = &policy_knorm,
    .size = sizeof(struct kv_policy),
    .accepted = "evict_every_chunk",
};

static pykv_status knorm_init(const struct policy_config *cfg, struct kv_policy **out) {
    return policy_make(&knorm_maker, cfg, out);
}

static void knorm_score(const struct kv_policy *p, const struct policy_event *ev, int32_t g, const struct kv_list *l,
                        float *s, float *tmp) {
    (void)p; (void)g;
    const int32_t d = ev->hp->head_dim;
    for (int32_t j = 0; j < l->n; j++) {
        const float *k = kv_key_f32(l, j, d, tmp);
        double sq = 0.0;
        for (int32_t c = 0; c < d; c++) sq += (double)k[c] * k[c];
        s[j] = (float)-sqrt(sq);
    }
}

static pykv_status knorm_after_layer(struct kv_policy *base, const struct policy_event *ev) {
    if (!ws_is_prefill_end(ev)) return PYKV_OK;
    static const struct es_device on_device = { .rule = ES_KNORM };
    return es_layer_keep_top(base, ev, ws_budget(&base->cfg, ev), knorm_score, &on_device);
}

const struct policy_ops policy_knorm = {
    .name = "knorm",
    .description = "Knorm: each KV head keeps the entries whose keys have the smallest L2 norm",
    .init = knorm_init,
    .free = policy_free_state,
    .after_layer = knorm_after_layer,
    .options = "evict_every_chunk=0",
    .choose = "the cheapest question-agnostic baseline: no attention is computed, only key norms",
    .default_budget_frac = POLICY_DEFAULT_BUDGET_FRAC,
    .default_budget_min = POLICY_DEFAULT_BUDGET_MIN,
    .budget_floor = POLICY_BUDGET_FLOOR,
    .device_lists = 1,
};
