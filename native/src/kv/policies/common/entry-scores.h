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

// How a layer on the GPU is scored, for the scorers the device has: ES_ON_HOST brings the
// layer's lists down and runs the scorer over them; ES_POSITIONS scores from the list itself
// (the scorer reads only positions, which stay in host memory); the others run the device's
// twin of the scorer (ggml-cuda/entry-scores.cu), select there, and only the chosen indices
// come back.
enum es_device_rule { ES_ON_HOST = 0, ES_POSITIONS, ES_KNORM, ES_KEYDIFF, ES_LAGKV };
struct es_device {
    enum es_device_rule rule;
    int32_t             sink, lag, cross;   // ES_LAGKV's options
};

// Score every list of ev->layer holding more than B entries (on the pool) and keep its top
// B; the other lists are left as they are. A layer on the GPU is scored as dev says (NULL:
// ES_ON_HOST) and evicted on the device.
pykv_status es_layer_keep_top(const struct kv_policy *p, const struct policy_event *ev, int32_t B, es_score_fn score,
                              const struct es_device *dev);
// The device's scoring and selection (entry-scores-gpu.c); *done is 0 when the device has no
// twin for these lists and arguments, and the caller scores on the host.
pykv_status es_layer_keep_top_device(const struct policy_event *ev, int32_t B, const struct es_device *dev, int *done);
