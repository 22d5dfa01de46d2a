// adakv.c - Ada-KV / Ada-SnapKV (docs/policies.md#adakv): SnapKV scores, but the heads of a
// layer share its budget: a joint top-k over all heads' candidates sets each head's count,
// blended with the uniform share by the safeguard alpha. A layer on the GPU is scored, ranked
// and selected there (ws_device_scores).
//
// Per layer, with B' = B - W and K = Hkv B' selectable entries:
//   c_h  = how many of the layer's joint top K (ties -> lower head, then lower position)
//          belong to head h;
//   x_h  = (1 - alpha) c_h + alpha B'       (FFY0/AdaKV code form, alpha = 0.2 default)
//   b_h  = floor(x_h), then the K - sum floor(x_h) leftover units go one each to the heads
//          with the largest fractional parts (ties -> lower head): largest remainder, so
//          sum b_h = K exactly;
//   b_h is capped at the head's candidates n_h; the excess goes to heads with room, lowest
//   head first (only on later prefill calls, when lists have different lengths);
//   head h keeps its own top b_h candidates plus the window.
// Choices: alpha in [0, 1] (argument alpha; 1 = uniform = SnapKV); the kvpress
// "protect" safeguard is not offered: kvpress's AdaKVPress first gives each head its own top
// int(alpha B) entries, then runs the joint selection over the rest, where this blends the
// counts, so at alpha > 0 a head's count may differ by a few entries. With alpha=0 both are
// the bare joint top-k and keep the same entries (tests/python/test_kvpress_existing.py).
// If all heads together have <= K candidates nothing
// is evicted. Scoring, defaults, schedule (end of a prefill call only, decode grows), ties and later prefill
// calls are as SnapKV.
#include "kv/policies/adakv.h"
#include "kv/policies/common/policy-make.h"
#include "core/error.h"
#include "model/model.h"

#include <math.h>
#include <stddef.h>
#include <stdlib.h>

extern const struct policy_ops policy_adakv;

#define ADAKV_KEYS "window, pool (max|avg), kernel, gqa (mean|max), alpha"

struct adakv {
    struct kv_policy base;
    struct ws_opts   o;
    double           alpha;
};

static const struct policy_opt adakv_opts[] = {
    { .key = "alpha", .type = POLICY_OPT_DOUBLE, .offset = offsetof(struct adakv, alpha), .lo = 0.0, .hi = 1.0 },
};

static void adakv_defaults(struct kv_policy *base) { ((struct adakv *)base)->alpha = 0.2; }

static const struct policy_maker adakv_maker = {
    .ops = &policy_adakv,
    .size = sizeof(struct adakv),
    .accepted = ADAKV_KEYS,
    .opts = adakv_opts,
    .n_opts = (int)(sizeof(adakv_opts) / sizeof(adakv_opts[0])),
    .window_opts = offsetof(struct adakv, o),
    .defaults = adakv_defaults,
};

static pykv_status adakv_init(const struct policy_config *cfg, struct kv_policy **out) {
    return policy_make(&adakv_maker, cfg, out);
}

// Per-head budgets b[h] from the joint counts c[h] (sum K), capped by n_cand[h].
static double safeguard(int64_t c, int64_t Bs, double alpha) {
    return (1.0 - alpha) * (double)c + alpha * (double)Bs;
}

static void adakv_head_budgets(int hkv, const int64_t *c, const int32_t *n_cand, int64_t Bs, double alpha, int64_t *b) {
    int64_t left = (int64_t)hkv * Bs;
    for (int h = 0; h < hkv; h++) {
        b[h] = (int64_t)floor(safeguard(c[h], Bs, alpha));
        left -= b[h];
    }
    while (left > 0) {   // largest remainder: one unit per pass to the largest fraction left
        int best = -1;
        double best_f = -1.0;
        for (int h = 0; h < hkv; h++) {
            double x = safeguard(c[h], Bs, alpha), f = x - floor(x);
            if (b[h] == (int64_t)floor(x) && f > best_f) { best = h; best_f = f; }
        }
        if (best < 0) break;
        b[best]++;
        left--;
    }
    int64_t excess = 0;
    for (int h = 0; h < hkv; h++)
        if (b[h] > n_cand[h]) { excess += b[h] - n_cand[h]; b[h] = n_cand[h]; }
    for (int h = 0; h < hkv && excess > 0; h++) {
        int64_t room = n_cand[h] - b[h];
        int64_t add = room < excess ? room : excess;
        b[h] += add;
        excess -= add;
    }
}

pykv_status adakv_layer_budgets(const struct ws_stats *st, const float *s, int64_t Bs, double alpha, int64_t *b) {
    const int hkv = st->n_head_kv;
    const int64_t K = (int64_t)hkv * Bs;
    int64_t *idx = malloc((size_t)(K > 0 ? K : 1) * sizeof(int64_t));
    int64_t *c = calloc((size_t)hkv, sizeof(int64_t));
    pykv_status rc = PYKV_OK;
    if (!idx || !c) {
        rc = pykv_error(PYKV_ERR_NOMEM, "out of memory");
        goto done;
    }
    int64_t n = 0;
    rc = ws_select_top(s, st->total, K, idx, &n);   // flat index = offset_kv[h] + j
    if (rc != PYKV_OK) goto done;
    for (int64_t i = 0, h = 0; i < n; i++) {
        while (h + 1 < hkv && idx[i] >= st->offset_kv[h + 1]) h++;
        c[h]++;
    }
    adakv_head_budgets(hkv, c, st->n_cand, Bs, alpha, b);
done:
    free(idx); free(c);
    return rc;
}

static pykv_status adakv_layer(const struct policy_event *ev, const struct ws_stats *st, const float *s,
                               int64_t Bs, double alpha) {
    int64_t *b = calloc((size_t)st->n_head_kv, sizeof(int64_t));
    if (!b) return pykv_error(PYKV_ERR_NOMEM, "out of memory");
    pykv_status rc = adakv_layer_budgets(st, s, Bs, alpha, b);
    for (int h = 0; h < st->n_head_kv && rc == PYKV_OK; h++)
        rc = ws_keep_top(ev, h, s + st->offset_kv[h], st->n_cand[h], b[h]);
    free(b);
    return rc;
}

// A layer on the GPU: scores, joint count and each head's top-k there; only the counts and
// the chosen indices come back.
static pykv_status adakv_layer_device(const struct policy_event *ev, const struct ws_opts *o, struct ws_window w,
                                      int64_t Bs, double alpha) {
    struct ws_device_scores ds;
    PYKV_TRY(ws_device_scores_make(ev, o, w, &ds));
    const int hkv = ds.n_head_kv;
    int64_t *c = calloc((size_t)hkv, sizeof(int64_t)), *b = calloc((size_t)hkv, sizeof(int64_t));
    pykv_status rc = c && b ? ws_device_joint_counts(&ds, (int64_t)hkv * Bs, c)
                            : pykv_error(PYKV_ERR_NOMEM, "out of memory");
    if (rc == PYKV_OK) {
        adakv_head_budgets(hkv, c, ds.n_cand, Bs, alpha, b);
        rc = ws_device_keep_top(&ds, b);
    }
    free(c); free(b);
    ws_device_scores_free(&ds);
    return rc;
}

static pykv_status adakv_after_layer(struct kv_policy *base, const struct policy_event *ev) {
    struct adakv *p = (struct adakv *)base;
    if (!ws_is_prefill_end(ev)) return PYKV_OK;
    const int32_t B = ws_budget(&base->cfg, ev);
    PYKV_TRY(ws_check_budget("adakv", B, p->o.window));
    if (ev->n_past <= B) return PYKV_OK;
    struct ws_window w = ws_window_of(ev, p->o.window);
    const int64_t Bs = (int64_t)B - w.protect;
    int64_t total = 0;
    for (int g = 0; g < ev->hp->n_head_kv; g++) {
        int32_t n = kv_cache_list(ev->cache, ev->layer, g)->n - w.protect;
        total += n > 0 ? n : 0;
    }
    if (total <= (int64_t)ev->hp->n_head_kv * Bs) return PYKV_OK;

    if (ev->q_device) return adakv_layer_device(ev, &p->o, w, Bs, p->alpha);
    struct ws_stats st;
    float *s = NULL;
    PYKV_TRY(ws_layer_scores(ev, &p->o, w, &st, &s));
    pykv_status rc = adakv_layer(ev, &st, s, Bs, p->alpha);
    free(s);
    ws_stats_free(&st);
    return rc;
}

static int32_t adakv_last_chunk_min(const struct kv_policy *base) { return ((const struct adakv *)base)->o.window; }

const struct policy_ops policy_adakv = {
    .name = "adakv",
    .description = "Ada-KV (Ada-SnapKV): SnapKV scores with head-wise budgets from a joint top-k over each layer",
    .init = adakv_init,
    .free = policy_free_state,
    .after_layer = adakv_after_layer,
    .last_chunk_min = adakv_last_chunk_min,
    .min_budget = ws_min_budget,
    .options = "window=32, pool=max, kernel=7, gqa=mean, alpha=0.2, evict_every_chunk=0",
    .choose = "as snapkv, letting the heads of a layer share the budget unevenly; among the closest to the "
              "full cache",
    .default_budget_frac = POLICY_DEFAULT_BUDGET_FRAC,
    .default_budget_min = POLICY_DEFAULT_BUDGET_MIN,
    .budget_floor = POLICY_BUDGET_FLOOR,
    .device_lists = 1,
};
