// sampler-typical.c - locally typical sampling (Meister et al. 2022; llama.cpp's typical_p):
// keep the tokens whose surprise -log p is closest to the distribution's entropy, nearest
// first, until their probability mass exceeds p.
#include "sample/sampler.h"

#include <math.h>
#include <stdlib.h>

static int by_position(const void *a, const void *b) {
    const struct sampler_cand *x = a, *y = b;
    return (x->id > y->id) - (x->id < y->id);
}

int32_t sampler_typical(struct sampler_cand *c, int32_t n, float p, struct sampler_cand *scratch) {
    double max_logit = c[0].logit;
    for (int32_t i = 1; i < n; i++) if (c[i].logit > max_logit) max_logit = c[i].logit;
    double total = 0.0;
    for (int32_t i = 0; i < n; i++) total += exp((double)c[i].logit - max_logit);
    double log_norm = max_logit + log(total);   // log p_i = logit_i - log_norm

    double entropy = 0.0;   // -sum p log p, over the tokens that have any probability
    for (int32_t i = 0; i < n; i++) {
        double log_p = (double)c[i].logit - log_norm;
        if (isfinite(log_p)) entropy -= exp(log_p) * log_p;
    }
    // Rank by nearness to the entropy: "logit" = -|surprise - entropy|, "id" = position in c,
    // so that sampler_select_top puts the nearest first (ties: the earlier candidate).
    for (int32_t i = 0; i < n; i++) {
        double log_p = (double)c[i].logit - log_norm;
        scratch[i].logit = isfinite(log_p) ? (float)-fabs(-log_p - entropy) : -INFINITY;
        scratch[i].id = i;
    }
    // Take the nearest in rank order until the mass exceeds p, ranking a growing prefix
    // instead of sorting every token: a few hundred usually suffice.
    int32_t kept = 0, n_ranked = 0;
    double mass = 0.0;
    while (kept < n) {
        if (kept == n_ranked) sampler_sort_more(scratch, n, &n_ranked);
        mass += exp((double)c[scratch[kept].id].logit - log_norm);
        kept++;
        if (mass > (double)p) break;
    }
    // Compact the kept candidates to the front in their original order (positions ascending,
    // so every move goes down and nothing kept is overwritten first).
    qsort(scratch, (size_t)kept, sizeof(*scratch), by_position);
    for (int32_t i = 0; i < kept; i++) c[i] = c[scratch[i].id];
    return kept;
}
