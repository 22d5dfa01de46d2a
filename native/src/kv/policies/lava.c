// lava.c - LAVa (docs/policies.md#lava): value-scaled window scores ranked across the heads of
// a layer (dynamic head budgets) and layer budgets from the normalized entropy of those
// scores, allocated in a cascade during prefill. Decoding appends (the cache grows).
//
// At the end of a prefill call, in after_layer of layer m (last chunk):
//   s[h, j] = vbar_h * pool(reduce_group(mean_i A))      vbar_h = max_{j < n} ||V[h, j]||_1
//   p = s / sum(s) over the layer;  e_m = -sum p log(p + 1e-16) / ln(Hkv n)
//   the joint ranking of the layer's s (desc, ties -> lower head, then lower position) is
//   kept as head labels, s is kept per head (compacted with the list);
//   cascade=1: K_l = share of T = (B - W) L Hkv entries by e over layers 0..m, for every
//   l <= m (cascade=0: once, at m = L - 1); c_h = entries of head h in the first K_l of
//   layer l's ranking; b_h = (1 - alpha) c_h + alpha K_l / Hkv, floored, leftover units to
//   the largest fractions (fractions within 1e-9 are ties -> lower head: equal counts
//   give mathematically equal fractions), so sum b_h = K_l; capped at the head's
//   candidates with the excess to heads with room (lowest head first); each head keeps
//   its top min(b_h, current) entries by its stored s, plus the window.
// Choices ([decide] / [ours]):
//  * Defaults: W = 32, max pool 7, GQA max, alpha = 0.2 (the MGDDestiny/Lava floor),
//    cascade=1. Arguments: window, pool, kernel, gqa, alpha ([0, 1]), cascade (0|1).
//  * vbar over the candidates only (code form); entropy normalized by ln(Hkv n) (code
//    form; the shares are the same as the paper's), ln taken as 1 when Hkv n < 2. Scores
//    follow ws_layer_scores (mean -> GQA reduce -> pool) and are then scaled by vbar: with
//    the default max/max this equals the paper's mean -> pool -> x vbar -> GQA max exactly.
//  * Layer split: water-filling with layer caps = the layer's candidates (cake-budget.c),
//    floor + largest remainder at every cascade step (the selection holds exactly the
//    target at every step). A later step never re-grows a head: min(b_h, current). As in
//    the reference code, the cascade may therefore keep slightly fewer entries than
//    one-shot. A list is compacted to the selection at its layer's step, at the last, and
//    between them once it holds over 1.5x the selection (ws_cascade_keep_top).
//  * Safeguard rounding: largest remainder (exact layer totals) instead of the code's
//    round(); the same form as adakv.c.
//  * No eviction while the sequence holds <= B tokens; B > W required; a later prefill
//    call re-runs the allocation over the current lists; ties -> lower position.
#include "kv/policies/cake/cake-budget.h"
#include "kv/policies/common/policy-make.h"
#include "kv/policies/common/window-scores.h"
#include "core/error.h"
#include "model/model.h"

#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

extern const struct policy_ops policy_lava;

#define LAVA_KEYS "window, pool (max|avg), kernel, gqa (mean|max), alpha, cascade (0|1)"

struct lava_layer {
    int32_t                *n_orig;   // (Hkv) candidates when scored
    struct ws_cascade_list *heads;    // (Hkv) the candidates now, with their scores
    uint16_t               *rank;     // (sum n_orig) head of each entry of the joint ranking
};

struct lava {
    struct kv_policy   base;
    struct ws_opts     o;
    double             alpha;
    int32_t            cascade;
    int32_t            n_layer, n_head_kv;
    int                evicting;
    int64_t            total;      // (B - protect) L Hkv
    struct lava_layer *layers;
    double            *log_e;      // (n_layer)
    int64_t           *cap, *K;    // (n_layer)
};

static const struct policy_opt lava_opts[] = {
    { .key = "alpha", .type = POLICY_OPT_DOUBLE, .offset = offsetof(struct lava, alpha), .lo = 0.0, .hi = 1.0 },
    { .key = "cascade", .type = POLICY_OPT_INT, .offset = offsetof(struct lava, cascade), .lo = 0, .hi = 1 },
};

static void layer_free(struct lava_layer *ll, int hkv) {
    for (int g = 0; ll->heads && g < hkv; g++) ws_cascade_free(&ll->heads[g]);
    free(ll->heads); free(ll->n_orig); free(ll->rank);
    memset(ll, 0, sizeof(*ll));
}

static void drop_layers(struct lava *p) {
    for (int l = 0; l < p->n_layer; l++) layer_free(&p->layers[l], p->n_head_kv);
}

static void lava_free(struct kv_policy *base) {
    struct lava *p = (struct lava *)base;
    if (p->layers) drop_layers(p);
    free(p->layers); free(p->log_e); free(p->cap); free(p->K);
    free(p);
}

static void lava_defaults(struct kv_policy *base) {
    struct lava *p = (struct lava *)base;
    p->alpha = 0.2;
    p->cascade = 1;
    p->o.gqa = WS_GQA_MAX;
}

static const struct policy_maker lava_maker = {
    .ops = &policy_lava,
    .size = sizeof(struct lava),
    .accepted = LAVA_KEYS,
    .opts = lava_opts,
    .n_opts = (int)(sizeof(lava_opts) / sizeof(lava_opts[0])),
    .window_opts = offsetof(struct lava, o),
    .defaults = lava_defaults,
};

static pykv_status lava_init(const struct policy_config *cfg, struct kv_policy **out) {
    return policy_make(&lava_maker, cfg, out);
}

static pykv_status lava_alloc(struct lava *p, const struct hparams *hp) {
    if (p->layers) return PYKV_OK;
    if (hp->n_head_kv > 65535) return pykv_error(PYKV_ERR_INVALID_ARG, "lava supports at most 65535 KV heads");
    p->n_layer = hp->n_layer;
    p->n_head_kv = hp->n_head_kv;
    const size_t L = (size_t)hp->n_layer;
    p->layers = calloc(L, sizeof(*p->layers));
    p->log_e = calloc(L, sizeof(double));
    p->cap = calloc(L, sizeof(int64_t));
    p->K = calloc(L, sizeof(int64_t));
    if (!p->layers || !p->log_e || !p->cap || !p->K) {
        free(p->layers); free(p->log_e); free(p->cap); free(p->K);
        p->layers = NULL; p->log_e = NULL; p->cap = NULL; p->K = NULL;
        return pykv_error(PYKV_ERR_NOMEM, "out of memory");
    }
    return PYKV_OK;
}

// Score layer ev->layer into ll; returns log e (normalized entropy) in *log_e.
static pykv_status lava_score(struct lava *p, const struct policy_event *ev, struct ws_window w,
                              struct lava_layer *ll, double *log_e) {
    const int hkv = p->n_head_kv;
    struct ws_stats st;
    float *s = NULL;
    PYKV_TRY(ws_layer_scores(ev, &p->o, w, &st, &s));
    int32_t *order = NULL;
    pykv_status rc;
    ll->n_orig = malloc((size_t)hkv * sizeof(int32_t));
    ll->heads = calloc((size_t)hkv, sizeof(*ll->heads));
    ll->rank = malloc((size_t)(st.total ? st.total : 1) * sizeof(uint16_t));
    order = malloc((size_t)(st.total ? st.total : 1) * sizeof(*order));
    float *vbars = malloc((size_t)hkv * sizeof(float));
    if (!ll->n_orig || !ll->heads || !ll->rank || !order || !vbars) goto nomem;
    rc = ws_value_l1_max(ev, st.n_cand, vbars);
    if (rc != PYKV_OK) goto fail;
    double sum = 0.0;
    for (int g = 0; g < hkv; g++) {
        const int32_t nc = st.n_cand[g];
        const float vbar = vbars[g];
        ll->n_orig[g] = nc;
        if (ws_cascade_init(&ll->heads[g], nc) != PYKV_OK) goto nomem;
        float *sg = s + st.offset_kv[g], *scaled = ll->heads[g].s;
        for (int32_t j = 0; j < nc; j++) {
            scaled[j] = sg[j] * vbar;
            sum += scaled[j];
            sg[j] = scaled[j];   // the layer's scaled scores, flat, for the joint ranking
        }
    }
    double ent = 0.0;
    if (sum > 0.0)
        for (int g = 0; g < hkv; g++)
            for (int32_t j = 0; j < st.n_cand[g]; j++) {
                const double q = ll->heads[g].s[j] / sum;
                ent -= q * log(q + 1e-16);
            }
    const double norm = st.total >= 2 ? log((double)st.total) : 1.0;
    *log_e = ent > 0.0 ? log(ent / norm) : -INFINITY;
    rc = ws_rank(s, st.total, order);
    if (rc != PYKV_OK) goto fail;
    for (int64_t i = 0; i < st.total; i++) {   // flat index -> head
        int h = 0;
        while (h + 1 < hkv && order[i] >= st.offset_kv[h + 1]) h++;
        ll->rank[i] = (uint16_t)h;
    }
    free(order); free(s); free(vbars);
    ws_stats_free(&st);
    return PYKV_OK;
nomem:
    rc = pykv_error(PYKV_ERR_NOMEM, "out of memory scoring layer %d for LAVa", ev->layer);
fail:
    free(order); free(s); free(vbars);
    ws_stats_free(&st);
    layer_free(ll, hkv);
    return rc;
}

// Head budgets of a layer for K entries: prefix counts, safeguard, largest remainder, caps.
static void head_budgets(const struct lava_layer *ll, int hkv, int64_t K, double alpha, int64_t *c, int64_t *b) {
    memset(c, 0, (size_t)hkv * sizeof(int64_t));
    for (int64_t i = 0; i < K; i++) c[ll->rank[i]]++;
    const double share = alpha * (double)K / hkv;
    int64_t left = K;
    for (int h = 0; h < hkv; h++) {
        b[h] = (int64_t)floor((1.0 - alpha) * (double)c[h] + share);
        left -= b[h];
    }
    while (left > 0) {
        int best = -1;
        double best_f = -1.0;
        for (int h = 0; h < hkv; h++) {
            const double x = (1.0 - alpha) * (double)c[h] + share, f = x - floor(x);
            if (b[h] == (int64_t)floor(x) && f > best_f + 1e-9) { best = h; best_f = f; }
        }
        if (best < 0) break;
        b[best]++;
        left--;
    }
    int64_t excess = 0;
    for (int h = 0; h < hkv; h++)
        if (b[h] > ll->n_orig[h]) { excess += b[h] - ll->n_orig[h]; b[h] = ll->n_orig[h]; }
    for (int h = 0; h < hkv && excess > 0; h++) {
        const int64_t room = ll->n_orig[h] - b[h], add = room < excess ? room : excess;
        b[h] += add;
        excess -= add;
    }
}

// Shrink layer l to K entries: each head keeps its top min(b_h, current) by its stored
// scores; the lists are compacted when apply is set (ws_cascade_keep_top).
static pykv_status shrink_layer(struct lava *p, const struct policy_event *ev, int l, int64_t K, int apply) {
    struct lava_layer *ll = &p->layers[l];
    const int hkv = p->n_head_kv;
    int64_t *c = malloc((size_t)hkv * sizeof(int64_t)), *b = malloc((size_t)hkv * sizeof(int64_t));
    pykv_status rc = c && b ? PYKV_OK : pykv_error(PYKV_ERR_NOMEM, "out of memory shrinking layer %d", l);
    if (rc == PYKV_OK) head_budgets(ll, hkv, K, p->alpha, c, b);
    struct policy_event evl = *ev;
    evl.layer = l;
    for (int g = 0; g < hkv && rc == PYKV_OK; g++)
        rc = ws_cascade_keep_top(&evl, g, &ll->heads[g], b[g], apply);
    free(c); free(b);
    return rc;
}

static pykv_status lava_after_layer(struct kv_policy *base, const struct policy_event *ev) {
    struct lava *p = (struct lava *)base;
    if (!ws_is_prefill_end(ev)) return PYKV_OK;
    const int m = ev->layer, L = ev->hp->n_layer;
    PYKV_TRY(lava_alloc(p, ev->hp));
    struct ws_window w = ws_window_of(ev, p->o.window);
    if (m == 0) {
        drop_layers(p);
        const int32_t B = ws_budget(&base->cfg, ev);
        PYKV_TRY(ws_check_budget("lava", B, p->o.window));
        p->evicting = ev->n_past > B;
        p->total = ((int64_t)B - w.protect) * L * p->n_head_kv;
    }
    if (!p->evicting) return PYKV_OK;

    PYKV_TRY(lava_score(p, ev, w, &p->layers[m], &p->log_e[m]));
    p->cap[m] = 0;
    for (int g = 0; g < p->n_head_kv; g++) p->cap[m] += p->layers[m].n_orig[g];
    const int last = m == L - 1;
    if (!p->cascade && !last) return PYKV_OK;
    PYKV_TRY(cake_share(m + 1, p->log_e, p->cap, p->total, CAKE_SHARE_FINAL, p->K));
    // compacted at the layer's own step and the last (and between when 1.5x the selection)
    for (int l = 0; l <= m; l++) PYKV_TRY(shrink_layer(p, ev, l, p->K[l], l == m || last));
    if (last) drop_layers(p);
    return PYKV_OK;
}

static int32_t lava_last_chunk_min(const struct kv_policy *base) { return ((const struct lava *)base)->o.window; }

const struct policy_ops policy_lava = {
    .name = "lava",
    .description = "LAVa: value-scaled window scores with head budgets from a joint top-k and layer budgets "
                   "from score entropy, cascaded during prefill",
    .init = lava_init,
    .free = lava_free,
    .after_layer = lava_after_layer,
    .last_chunk_min = lava_last_chunk_min,
    .min_budget = ws_min_budget,
    .options = "window=32, pool=max, kernel=7, gqa=max, alpha=0.2, cascade=1, evict_every_chunk=0",
    .choose = "as adakv, with budgets moved between layers too; among the closest to the full cache",
    .default_budget_frac = POLICY_DEFAULT_BUDGET_FRAC,
    .default_budget_min = POLICY_DEFAULT_BUDGET_MIN,
    .budget_floor = POLICY_BUDGET_FLOOR,
    .device_lists = 1,
};
