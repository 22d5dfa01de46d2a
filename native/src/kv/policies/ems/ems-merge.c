// ems-merge.c - EMS redundancy and merge rule (docs/policies.md#ems).
//
// R(i, c) = cos(k_i, k_c) * cos(v_i, v_c) on the keys as stored (post-RoPE; for a merged
// entry its unit direction k̂_e). [ours] A pair whose key cosine or value cosine is negative
// is never similar: its R is -|product| (the plain product of two negative cosines would
// pass tau and merge opposite directions).
// Merge (one-shot weighted average over all members, members include the centre):
//   k̂_e = normalize(sum_i w_i k̂_i), v_e = sum_i w_i v_i / sum_i w_i, member norms ||k_i||.
// A single token's weight is its s_Loc = lp + lc (floored at 1e-30 so that a zero local
// score still counts); a merged entry contributes its stored sum: wsum * kmag * k̂_e for the
// key, wsum * v_e for the value, so merging merged entries again equals the one-shot average
// over all their tokens (with the weights they had when first merged). Sums in double.
// Scores of the result: glo, lp, lc are the sums over the merged entries (the forward pass
// reports a merged entry's attention as its members' total mass). A zero key sum keeps the
// centre's own direction.
#include "kv/policies/ems/ems.h"
#include "cpu/attention.h"
#include "core/error.h"
#include "cpu/quant.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define EMS_W_FLOOR 1e-30f

// 1 / (|k| |v|) of a key and a value; 0 when either is zero (R is then 0).
static float inverse_norms(const float *k, const float *v, int32_t d) {
    const double nn = (double)dot_f32(k, k, d) * (double)dot_f32(v, v, d);
    return nn > 0.0 ? (float)(1.0 / sqrt(nn)) : 0.0f;
}

void ems_probe_init(struct ems_probe *p, const struct kv_list *l, int32_t d, int32_t i) {
    memcpy(p->k, kv_key_f32(l, i, d, p->k), (size_t)d * sizeof(float));
    memcpy(p->v, kv_value_f32(l, i, d, p->v), (size_t)d * sizeof(float));
    p->inv = inverse_norms(p->k, p->v, d);
}

// R from the probe's dot products with an entry's key and value and the entry's inverse
// norms: cos_k * cos_v = dk dv / (|k_i| |v_i| |k_c| |v_c|), no square root per entry.
static inline float redundancy_of(float dk, float dv, float inv_p, float inv_c) {
    const float r = dk * dv * inv_p * inv_c;
    return (dk < 0.0f || dv < 0.0f) ? -fabsf(r) : r;
}

float ems_redundancy(const struct kv_list *l, int32_t d, const struct ems_probe *p, int32_t c) {
    float tk[PYKV_MAX_HEAD_DIM], tv[PYKV_MAX_HEAD_DIM];
    const float *k = kv_key_f32(l, c, d, tk), *v = kv_value_f32(l, c, d, tv);
    return redundancy_of(dot_f32(p->k, k, d), dot_f32(p->v, v, d), p->inv, inverse_norms(k, v, d));
}

void ems_redundancy_all(const struct kv_list *l, struct ems_list *s, int32_t d, const struct ems_probe *p,
                        int32_t nc, float *r, float *tmp) {
    float tk[PYKV_MAX_HEAD_DIM], tv[PYKV_MAX_HEAD_DIM];
    for (int32_t c = 0; c < nc; c++)
        if (s->inv[c] < 0.0f) {
            const float *k = kv_key_f32(l, c, d, tk), *v = kv_value_f32(l, c, d, tv);
            s->inv[c] = inverse_norms(k, v, d);
        }
    attention_dots(p->k, l, 0, nc, d, r);
    attention_dots(p->v, l, 1, nc, d, tmp);
    for (int32_t c = 0; c < nc; c++) r[c] = redundancy_of(r[c], tmp[c], p->inv, s->inv[c]);
}

// Add entry e's weighted key direction and value to the sums; append its member norms.
static void accumulate(const struct kv_list *l, const struct ems_list *s, int32_t d, const struct ems_rows *rows,
                       int32_t e, double *ks, double *vs, double *W, float *norms, int32_t *nn) {
    float tk[PYKV_MAX_HEAD_DIM], tv[PYKV_MAX_HEAD_DIM];
    const float *k = rows->row(rows->arg, e, 0, tk), *v = rows->row(rows->arg, e, 1, tv);
    const float *mn = kv_member_norms(l, e);
    if (mn) {
        const double we = s->wsum[e], km = s->kmag[e];
        for (int32_t i = 0; i < d; i++) { ks[i] += we * km * k[i]; vs[i] += we * v[i]; }
        *W += we;
        memcpy(norms + *nn, mn, (size_t)l->n_members[e] * sizeof(float));
        *nn += l->n_members[e];
        return;
    }
    double nrm = 0.0;
    for (int32_t i = 0; i < d; i++) nrm += (double)k[i] * k[i];
    nrm = sqrt(nrm);
    const float loc = s->lp[e] + s->lc[e];
    const double w = loc > EMS_W_FLOOR ? loc : EMS_W_FLOOR;
    if (nrm > 0.0) for (int32_t i = 0; i < d; i++) ks[i] += w * k[i] / nrm;
    for (int32_t i = 0; i < d; i++) vs[i] += w * v[i];
    *W += w;
    norms[(*nn)++] = (float)nrm;
}

pykv_status ems_merge_rows(struct kv_cache *cache, struct kv_list *l, struct ems_list *s, int32_t d, int32_t c,
                           const int32_t *src, int32_t n_src, const struct ems_rows *rows, float *k, float *v) {
    int32_t total = ems_members(l, c);
    for (int32_t t = 0; t < n_src; t++) total += ems_members(l, src[t]);
    double *ks = calloc((size_t)2 * d, sizeof(double));
    float *norms = malloc((size_t)total * sizeof(float));
    if (!ks || !norms) {
        free(ks); free(norms);
        return pykv_error(PYKV_ERR_NOMEM, "ems: out of memory merging KV entries");
    }
    double *vs = ks + d, W = 0.0;
    int32_t nn = 0;
    accumulate(l, s, d, rows, c, ks, vs, &W, norms, &nn);
    for (int32_t t = 0; t < n_src; t++) {
        const int32_t e = src[t];
        accumulate(l, s, d, rows, e, ks, vs, &W, norms, &nn);
        s->glo[c] += s->glo[e];
        s->lp[c] += s->lp[e];
        s->lc[c] += s->lc[e];
    }
    double kn = 0.0;
    for (int32_t i = 0; i < d; i++) kn += ks[i] * ks[i];
    kn = sqrt(kn);
    if (kn > 0.0) {
        for (int32_t i = 0; i < d; i++) k[i] = (float)(ks[i] / kn);
    } else {   // degenerate: keep the centre's direction
        const float *kc = rows->row(rows->arg, c, 0, k);
        if (kc != k) memcpy(k, kc, (size_t)d * sizeof(float));
        double cn = 0.0;
        for (int32_t i = 0; i < d; i++) cn += (double)k[i] * k[i];
        cn = sqrt(cn);
        if (cn > 0.0) for (int32_t i = 0; i < d; i++) k[i] = (float)(k[i] / cn);
    }
    for (int32_t i = 0; i < d; i++) v[i] = (float)(vs[i] / W);
    s->inv[c] = -1.0f;
    s->wsum[c] = (float)W;
    s->kmag[c] = (float)(kn / W);
    pykv_status st = kv_list_enable_members(cache, l);
    if (st == PYKV_OK) st = kv_list_set_members(cache, l, c, norms, total);
    free(ks);
    free(norms);
    return st;
}

struct list_rows { const struct kv_list *l; int32_t d; };

static const float *host_row(const void *arg, int32_t e, int values, float *tmp) {
    const struct list_rows *r = arg;
    return values ? kv_value_f32(r->l, e, r->d, tmp) : kv_key_f32(r->l, e, r->d, tmp);
}

pykv_status ems_merge_into(struct kv_cache *cache, struct kv_list *l, struct ems_list *s, int32_t d, int32_t c,
                           const int32_t *src, int32_t n_src) {
    const struct list_rows lr = { l, d };
    const struct ems_rows rows = { host_row, &lr };
    float k[PYKV_MAX_HEAD_DIM], v[PYKV_MAX_HEAD_DIM];
    const pykv_status st = ems_merge_rows(cache, l, s, d, c, src, n_src, &rows, k, v);
    if (st == PYKV_OK) kv_list_set_kv(l, c, k, v, d);
    return st;
}
