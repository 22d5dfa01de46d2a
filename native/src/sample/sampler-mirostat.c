// sampler-mirostat.c - Mirostat (Basu et al. 2021), as llama.cpp's samplers: keep the
// surprise of the drawn tokens (-log2 p) near a target tau by truncating the distribution
// at a threshold mu that learns from each draw.
//   version 1: estimate the Zipf exponent s of the sorted probabilities from the top 100,
//              keep the k = ((eps * 2^mu) / (1 - N^-eps))^(1/s) most likely (eps = s - 1);
//   version 2: keep the tokens whose surprise is at most mu.
// Then draw from the kept tokens renormalised and move mu by eta * (tau - surprise).
#include "sample/sampler.h"

#include <math.h>

#define MIROSTAT_M 100   // tokens version 1 estimates the exponent from

// Softmax weights of c[0..n) at temperature t, relative to the largest logit.
static double weight(const struct sampler_cand *c, float max_logit, double inv_t) {
    return exp(((double)c->logit - (double)max_logit) * inv_t);
}

static int32_t mirostat1_keep(struct sampler_cand *c, int32_t n, int32_t n_vocab, double inv_t, float mu) {
    int32_t m = n < MIROSTAT_M ? n : MIROSTAT_M;
    sampler_select_top(c, n, m);
    double num = 0.0, den = 0.0;
    for (int32_t i = 0; i + 1 < m; i++) {
        double p0 = weight(&c[i], c[0].logit, inv_t), p1 = weight(&c[i + 1], c[0].logit, inv_t);
        if (!(p1 > 0.0)) break;   // banned tokens (-inf) carry no slope
        double t = log((double)(i + 2) / (double)(i + 1));
        num += t * log(p0 / p1);
        den += t * t;
    }
    if (!(den > 0.0) || !(num > 0.0)) return 1;   // flat or degenerate: keep the best
    double s = num / den, eps = s - 1.0;
    double k = pow(eps * exp2((double)mu) / (1.0 - pow((double)n_vocab, -eps)), 1.0 / s);
    if (!(k >= 1.0)) return 1;
    if (k >= (double)n) return n;
    int32_t kept = (int32_t)k;
    if (kept > m) sampler_select_top(c + m, n - m, kept - m);   // the rest of the top-k, in order
    return kept;
}

// Version 2: tokens with -log2 p <= mu, i.e. weight >= 2^-mu * total; at least the best.
static int32_t mirostat2_keep(struct sampler_cand *c, int32_t n, double inv_t, float mu) {
    float max_logit = c[0].logit;
    for (int32_t i = 1; i < n; i++) if (sampler_cand_before(&c[i], &c[0])) {
        struct sampler_cand tmp = c[0];
        c[0] = c[i];
        c[i] = tmp;
        max_logit = c[0].logit;
    }
    double total = 0.0;
    for (int32_t i = 0; i < n; i++) total += weight(&c[i], max_logit, inv_t);
    double floor_w = exp2(-(double)mu) * total;
    int32_t kept = 1;   // c[0] is the best: always kept
    for (int32_t i = 1; i < n; i++) {
        if (weight(&c[i], max_logit, inv_t) >= floor_w) c[kept++] = c[i];
    }
    return kept;
}

int32_t sampler_mirostat(struct sampler_cand *c, int32_t n, int32_t n_vocab, int version, float temperature,
                            float tau, float eta, float *mu, double u) {
    double inv_t = 1.0 / (double)temperature;
    int32_t kept = version == 1 ? mirostat1_keep(c, n, n_vocab, inv_t, *mu) : mirostat2_keep(c, n, inv_t, *mu);
    float max_logit = c[0].logit;   // both versions leave the best first
    double total = 0.0;
    for (int32_t i = 0; i < kept; i++) total += weight(&c[i], max_logit, inv_t);
    double target = u * total, cum = 0.0;
    int32_t pick = -1, last_nonzero = 0;
    for (int32_t i = 0; i < kept && pick < 0; i++) {
        double w = weight(&c[i], max_logit, inv_t);
        if (w > 0.0) last_nonzero = i;
        cum += w;
        if (target < cum) pick = i;
    }
    if (pick < 0) pick = last_nonzero;   // rounding put target at the very top
    double surprise = -log2(weight(&c[pick], max_logit, inv_t) / total);
    *mu -= eta * (float)(surprise - (double)tau);
    return c[pick].id;
}
