// critical.h - CriticalKV's two-stage selection (docs/policies.md#criticalkv), shared by
// criticalkv (on SnapKV's scores) and criticaladakv (on Ada-KV's head budgets).
//
// A value's weight is what it can add to the layer's output: the L1 norm of W_o,h v_j (the
// output projection's columns of query head h applied to value j), averaged over the query
// heads of the value's KV head. A list that keeps b candidates (and its window) takes:
//   stage 1: its top b1 = floor((b + window) * first_stage_ratio) - window candidates by the
//            base score s_j (none when that is <= 0: the window is the base score's own top);
//   stage 2: the rest of the b by (s_j + epsilon) * weight_j.
#pragma once
#include <stdint.h>
#include "kv/policies/common/window-scores.h"

struct critical_opts {
    double epsilon;       // kvpress's default 1e-4
    double first_stage;   // first_stage_ratio, kvpress's default 0.5
};

#define CRITICAL_KEYS "epsilon, first_stage_ratio"

// The value weights of every candidate of the layer (st's layout: KV head g's n_cand[g]
// candidates at st->offset_kv[g]), from ev->wo (dequantized as needed), into w.
pykv_status critical_value_weights(const struct policy_event *ev, const struct ws_stats *st, float *w);
// The same for a layer on the GPU (critical-gpu.c), from its device copy of the projection
// (ev->wo_device) and its values where they are stored; only the weights come back. *done is
// 0 when the device cannot (the caller weighs them on the host).
pykv_status critical_value_weights_device(const struct policy_event *ev, const struct ws_stats *st, float *w,
                                          int *done);

// Keep b candidates of list g (scores s, weights w, n_cand of them) plus its `window` last
// entries, by the two stages above.
pykv_status critical_keep(const struct policy_event *ev, int32_t g, const float *s, const float *w, int32_t n_cand,
                          int64_t b, int32_t window, const struct critical_opts *o);
