// sampler-typical.c - locally typical sampling (Meister et al. 2022; llama.cpp's typical_p):
// keep the tokens whose surprise -log p is closest to the distribution's entropy, nearest
// first, until their probability mass exceeds p.
#include "sampler.h"

#include <math.h>
#include <stdlib.h>

static int by_shift(const void *a, const void *b) {
    const struct sampler_shift *x = a, *y = b;
    if (x->shift != y->shift) return x->shift < y->shift ? -1 : 1;
    return (x->pos > y->pos) - (x->pos < y->pos);   // ties: the earlier candidate first
}

static int by_pos(const void *a, const void *b) {
    const struct sampler_shift *x = a, *y = b;
    return (x->pos > y->pos) - (x->pos < y->pos);
}

int32_t sampler_typical(struct sampler_cand *c, int32_t n, float p, struct sampler_shift *scratch) {
    double max_logit = c[0].logit;
    for (int32_t i = 1; i < n; i++) if (c[i].logit > max_logit) max_logit = c[i].logit;
    double total = 0.0;
    for (int32_t i = 0; i < n; i++) total += exp((double)c[i].logit - max_logit);
    double log_total = log(total);

    double entropy = 0.0;   // -sum p log p, over the tokens that have any probability
    for (int32_t i = 0; i < n; i++) {
        double log_p = (double)c[i].logit - max_logit - log_total;
        if (isfinite(log_p)) entropy -= exp(log_p) * log_p;
    }
    for (int32_t i = 0; i < n; i++) {
        double log_p = (double)c[i].logit - max_logit - log_total;
        scratch[i].shift = isfinite(log_p) ? fabs(-log_p - entropy) : INFINITY;
        scratch[i].pos = i;
    }
    qsort(scratch, (size_t)n, sizeof(*scratch), by_shift);

    int32_t kept = n;
    double mass = 0.0;
    for (int32_t i = 0; i < n; i++) {
        mass += exp((double)c[scratch[i].pos].logit - max_logit - log_total);
        if (mass > (double)p) {
            kept = i + 1;
            break;
        }
    }
    // Compact the kept candidates to the front in their original order (positions ascending,
    // so every move goes down and nothing kept is overwritten first).
    qsort(scratch, (size_t)kept, sizeof(*scratch), by_pos);
    for (int32_t i = 0; i < kept; i++) c[i] = c[scratch[i].pos];
    return kept;
}
