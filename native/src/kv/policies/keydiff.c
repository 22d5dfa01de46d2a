// keydiff.c - KeyDiff (docs/policies.md#keydiff): at the end of each prefill call every list
// keeps the B entries whose keys are least similar to the list's mean key direction.
//
// Paper: "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
// Resource-Constrained Environments" (Park et al., arXiv:2504.15364). The anchor of a list
// is the mean of its unit keys, a = mean_j k_j / ||k_j||; entry j scores -cos(k_j, a) (stored,
// post-RoPE keys, as kvpress's KeyDiffPress). No query and no attention are read:
// question-agnostic.
//
// Options: none of its own (evict_every_chunk=0 as every evicting policy).
// Schedule: as Knorm (kvpress protects no entry): the last chunk of a multi-token call cuts
// every list longer than B to its top B (ties -> lower position); decode steps append
// without eviction. evict_every_chunk=1 reads the prompt block by block as the paper does
// (n_batch tokens a block; kvpress's BlockPress simulates that with blocks that start after
// the first B tokens, so its cuts fall elsewhere).
// A zero key or a zero anchor has cosine 0 (norms floored at 1e-12 and 1e-8, as torch's
// normalize and cosine_similarity).
#include "kv/policies/common/entry-scores.h"
#include "kv/policies/common/policy-make.h"
#include "kv/policies/common/window-scores.h"
#include "core/error.h"
#include "model/model.h"

#include <math.h>

extern const struct policy_ops policy_keydiff;

static const struct policy_maker keydiff_maker = {
    .ops = &policy_keydiff,
    .size = sizeof(struct kv_policy),
    .accepted = "evict_every_chunk",
};

static pykv_status keydiff_init(const struct policy_config *cfg, struct kv_policy **out) {
    return policy_make(&keydiff_maker, cfg, out);
}

static double norm_of(const float *x, int32_t d) {
    double sq = 0.0;
    for (int32_t c = 0; c < d; c++) sq += (double)x[c] * x[c];
    return sqrt(sq);
}

static void keydiff_score(const struct kv_policy *p, const struct policy_event *ev, int32_t g, const struct kv_list *l,
                          float *s, float *tmp) {
    (void)p; (void)g;
    const int32_t d = ev->hp->head_dim;
    double anchor[PYKV_MAX_HEAD_DIM] = { 0 };
    for (int32_t j = 0; j < l->n; j++) {
        const float *k = kv_key_f32(l, j, d, tmp);
        const double n = fmax(norm_of(k, d), 1e-12);
        for (int32_t c = 0; c < d; c++) anchor[c] += k[c] / n;
    }
    double a_sq = 0.0;
    for (int32_t c = 0; c < d; c++) {
        anchor[c] /= l->n;
        a_sq += anchor[c] * anchor[c];
    }
    const double a_norm = fmax(sqrt(a_sq), 1e-8);
    for (int32_t j = 0; j < l->n; j++) {
        const float *k = kv_key_f32(l, j, d, tmp);
        double dot = 0.0;
        for (int32_t c = 0; c < d; c++) dot += k[c] * anchor[c];
        s[j] = (float)(-dot / (fmax(norm_of(k, d), 1e-8) * a_norm));
    }
}

static pykv_status keydiff_after_layer(struct kv_policy *base, const struct policy_event *ev) {
    if (!ws_is_prefill_end(ev)) return PYKV_OK;
    static const struct es_device on_device = { .rule = ES_KEYDIFF };
    return es_layer_keep_top(base, ev, ws_budget(&base->cfg, ev), keydiff_score, &on_device);
}

const struct policy_ops policy_keydiff = {
    .name = "keydiff",
    .description = "KeyDiff: each KV head keeps the keys least similar to its mean key direction",
    .init = keydiff_init,
    .free = policy_free_state,
    .after_layer = keydiff_after_layer,
    .options = "evict_every_chunk=0",
    .choose = "a question-agnostic cache without attention scores: keeps the distinctive keys, "
              "with evict_every_chunk=1 the paper's block-wise form",
    .default_budget_frac = POLICY_DEFAULT_BUDGET_FRAC,
    .default_budget_min = POLICY_DEFAULT_BUDGET_MIN,
    .budget_floor = POLICY_BUDGET_FLOOR,
    .device_lists = 1,
};
