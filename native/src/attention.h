// attention.h - attention of queries over one KV head's list.
#pragma once
#include "kv-cache.h"

// out = softmax(q . K^T / sqrt(d)) V over the first n entries of list l (head_dim d), with
// merged entries expanded into one logit per member (kv-cache.h). weights[j] receives the
// probability of entry j: the sum over its members. weights has room for n floats.
void attention_head(const float *q, const struct kv_list *l, int n, int d, float *weights, float *out);

// The queries of one token that share a KV head (GQA): nq <= ATTENTION_TILE query vectors,
// consecutive in q (nq * d floats), attend over the same first n entries of l; out gets
// nq * d floats and weights nq rows of n probabilities. The tile streams each key and value
// row once for all its queries. Merged lists take attention_head per query.
#define ATTENTION_TILE 4
void attention_group(const float *q, int nq, const struct kv_list *l, int n, int d, float *weights, float *out);
