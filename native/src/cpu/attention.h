// attention.h - attention of queries over one KV head's list.
#pragma once
#include "kv/kv-cache.h"

// out = softmax(q . K^T / sqrt(d)) V over the first n entries of list l (head_dim d), with
// merged entries expanded into one logit per member (kv-cache.h). weights[j] receives the
// probability of entry j: the sum over its members. weights has room for n floats.
void attention_head(const float *q, const struct kv_list *l, int n, int d, float *weights, float *out);

// The queries of one token that share a KV head (GQA): nq <= ATTENTION_TILE query vectors,
// consecutive in q (nq * d floats), attend over the same first n entries of l; out gets
// nq * d floats and weights nq rows of n probabilities. The tile streams each key and value
// row once for all its queries, merged lists included.
#define ATTENTION_TILE 4
void attention_group(const float *q, int nq, const struct kv_list *l, int n, int d, float *weights, float *out);
// The weights alone (nq rows of n), for policies that read each entry's attention: the same
// values attention_group leaves in weights.
void attention_weights(const float *q, int nq, const struct kv_list *l, int n, int d, float *weights);

// ---- Attention without a weights row (the forward pass's paths when no policy needs the
// per-entry weights) ----

// Prefill (attention-flash.c): a block of n_tok consecutive query tokens, each with its
// n_rep query heads (row h of token i at q + i * q_stride + h * d), over one list; token i
// sees the first n_vis0 + i entries. The rows share every block of FLASH_KEYS entries
// (online softmax); out takes the rows at the same offsets (out_stride between tokens).
// work: flash_work_floats(d, n_rep) floats; n_tok <= flash_tokens_per_block(n_rep).
#define FLASH_KEYS 32
#define FLASH_ROWS 48   // query rows per block (at least one token's)
int    flash_tokens_per_block(int n_rep);
size_t flash_work_floats(int d, int n_rep);
void   attention_flash(const float *q, size_t q_stride, int n_tok, int n_rep, int n_vis0, const struct kv_list *l,
                       int d, float *out, size_t out_stride, float *work);
void   attention_flash_scalar(const float *q, size_t q_stride, int n_tok, int n_rep, int n_vis0,
                              const struct kv_list *l, int d, float *out, size_t out_stride, float *work);

// Prefill takes lists without merged entries only.
// Decode (split lists, merged entries expanded): nq <= ATTENTION_TILE query rows over
// entries [j0, j1) of l only.
// Leaves per row the largest logit in m, the sum of exp(logit - m) in lsum and the
// unnormalised output sum_j exp(logit_j - m) v_j in out (nq * d). w: nq * (j1 - j0) floats.
void attention_group_partial(const float *q, int nq, const struct kv_list *l, int j0, int j1, int d, float *w,
                             float *out, float *m, float *lsum);
// One query row's output from n_part <= ATTENTION_MAX_PARTS such partials (m, lsum: n_part
// each; o: n_part * d).
#define ATTENTION_MAX_PARTS 64
void attention_merge(int n_part, const float *m, const float *lsum, const float *o, int d, float *out);
// The factors attention_merge weighs the partials with: f[p] = exp(m[p] - max m); returns
// the normaliser sum_p f[p] lsum[p] (partial p's share of the softmax is f[p] / total).
double attention_merge_scales(int n_part, const float *m, const float *lsum, float *f);

// out[j] = x . key j (values = 0) or x . value j (values = 1) for the first n entries of l,
// as stored (EMS's similarity of one entry to every other).
void attention_dots(const float *x, const struct kv_list *l, int values, int n, int d, float *out);

// Tests: nonzero makes this file's kernels take their scalar paths, to check the SIMD ones
// against them. Not thread-safe; never set by the library.
void attention_force_scalar(int on);
