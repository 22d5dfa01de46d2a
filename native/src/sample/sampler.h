// sampler.h - candidate ordering helpers behind the sampler (exposed for the C unit tests).
#pragma once
#include <stdint.h>

// One candidate token: its (possibly penalised) logit and id.
struct sampler_cand {
    float   logit;
    int32_t id;
};

// Candidate a ranks before b: higher logit first, lower id on ties (a strict total order).
static inline int sampler_cand_before(const struct sampler_cand *a, const struct sampler_cand *b) {
    return a->logit > b->logit || (a->logit == b->logit && a->id < b->id);
}

// Move the k best of c[0..n) to c[0..k), in rank order; the rest end in c[k..n) unordered.
// O(n + k log k) on average (quickselect, then a sort of the k).
void sampler_select_top(struct sampler_cand *c, int32_t n, int32_t k);

// Grow the rank-ordered prefix c[0..*n_sorted) of c[0..n) geometrically (to 64, 256, 1024,
// ...): for loops that walk the candidates best first and usually stop early.
void sampler_sort_more(struct sampler_cand *c, int32_t n, int32_t *n_sorted);

// Mirostat version 1 or 2 over c[0..n) (logits before temperature; reorders c): the token
// drawn with u in [0, 1), and *mu moved toward the target surprise tau (sampler-mirostat.c).
int32_t sampler_mirostat(struct sampler_cand *c, int32_t n, int32_t n_vocab, int version, float temperature,
                         float tau, float eta, float *mu, double u);

// Locally typical sampling over c[0..n) (logits before temperature; scratch holds n): keeps,
// in c[0..kept) in their original order, the tokens nearest the entropy in surprise until
// their mass exceeds p, as llama.cpp's typical_p. Returns kept (>= 1) (sampler-typical.c).
int32_t sampler_typical(struct sampler_cand *c, int32_t n, float p, struct sampler_cand *scratch);
