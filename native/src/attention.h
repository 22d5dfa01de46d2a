// attention.h - attention of one query over one KV head's list.
#pragma once
#include "kv-cache.h"

// out = softmax(q . K^T / sqrt(d)) V over the first n entries of list l (head_dim d), with
// merged entries expanded into one logit per member (kv-cache.h). weights[j] receives the
// probability of entry j: the sum over its members. weights has room for n floats.
void attention_head(const float *q, const struct kv_list *l, int n, int d, float *weights, float *out);
