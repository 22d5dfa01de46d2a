// adakv.h - Ada-KV's cross-head budget split (adakv.c), shared with criticaladakv.
#pragma once
#include <stdint.h>
#include "kv/policies/common/window-scores.h"

// The candidates each KV head of a layer keeps under Ada-KV's rule (adakv.c's header): from
// the layer's scores s (st->total floats, KV head h at st->offset_kv[h]), Bs candidates per
// head on average and the safeguard alpha, b[h] for every head (sum Hkv Bs, each at most
// st->n_cand[h]).
pykv_status adakv_layer_budgets(const struct ws_stats *st, const float *s, int64_t Bs, double alpha, int64_t *b);
