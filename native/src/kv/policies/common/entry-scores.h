// entry-scores.h - the step of the policies that score each entry on its own (knorm, keydiff,
// random, lagkv): every list of a layer gets one score per entry, then every list longer
// than the budget keeps its highest-scored entries (ties -> the lower position).
#pragma once
#include <stdint.h>
#include "kv/policy.h"

// Scores the l->n entries of list l (KV head g of ev->layer) into s; tmp has room for 2 * l->n
// floats of scratch. Runs on a pool thread, calls for different lists at the same time, so
// it reads the policy's state and the cache and writes only s and tmp.
typedef void (*es_score_fn)(const struct kv_policy *p, const struct policy_event *ev, int32_t g,
                            const struct kv_list *l, float *s, float *tmp);

// Score every list of ev->layer holding more than B entries (on the pool) and keep its top
// B; the other lists are left as they are. A layer on the GPU is scored from a copy of its
// lists in host memory (l then points there), and evicted on the device.
pykv_status es_layer_keep_top(const struct kv_policy *p, const struct policy_event *ev, int32_t B, es_score_fn score);
