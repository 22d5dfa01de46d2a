// cake-score.h - CAKE's per-layer scoring at the end of a prefill call (docs/policies.md#cake):
// the layer preference and the eviction indicator of every KV head.
#pragma once
#include <stdint.h>
#include "kv/policies/common/window-scores.h"

struct cake_layer {
    double   log_pref;   // log P_l = log(H_l) / tau1 + log(V_l) / tau2 (-inf when H or V is 0)
    double   H, V;       // spatial entropy and summed unbiased variance over the window
    // (n_head_kv) each KV head's candidates (list length - window) with their indicator as
    // the cascade's scores
    struct ws_cascade_list *heads;
};

// Score layer ev->layer with the window w: mean and variance from ws_stats_compute, the
// entropy from a second pass over the same rows (same softmax arithmetic), then
// I = pool(mean + gamma * var) per query head followed by the GQA reduction of o.
// `out` is filled (free with cake_layer_free).
pykv_status cake_score_layer(const struct policy_event *ev, struct ws_window w, const struct ws_opts *o,
                             double gamma, double tau1, double tau2, struct cake_layer *out);
void        cake_layer_free(struct cake_layer *cl, int32_t n_head_kv);
