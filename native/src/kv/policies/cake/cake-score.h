// cake-score.h - CAKE's per-layer scoring at the end of a prefill call (docs/policies.md#cake):
// the layer preference and the eviction indicator of every KV head.
#pragma once
#include <stdint.h>
#include "kv/policies/common/window-scores.h"

struct cake_layer {
    double   log_pref;   // log P_l = log(H_l) / tau1 + log(V_l) / tau2 (-inf when H or V is 0)
    double   H, V;       // spatial entropy and summed unbiased variance over the window
    int32_t *n_cand;     // (n_head_kv) candidates per KV head (list length - window)
    float  **ind;        // (n_head_kv) indicator per candidate
    int32_t **row;       // (n_head_kv) the list row of each candidate (ws_cascade_keep_top)
    int32_t *list_cand;  // (n_head_kv) candidates the list itself holds
};

// Score layer ev->layer with the window w: mean and variance from ws_stats_compute, the
// entropy from a second pass over the same rows (same softmax arithmetic), then
// I = pool(mean + gamma * var) per query head followed by the GQA reduction of o.
// `out` is filled (free with cake_layer_free).
pykv_status cake_score_layer(const struct policy_event *ev, struct ws_window w, const struct ws_opts *o,
                             double gamma, double tau1, double tau2, struct cake_layer *out);
void        cake_layer_free(struct cake_layer *cl, int32_t n_head_kv);
