// pyramidkv.c - PyramidKV (docs/policies.md#pyramidkv): the SnapKV score and selection, with a
// per-layer budget that falls linearly with depth.
//
// Layer budgets (selectable entries per KV head, window excluded), with B' = B - W,
// N = sequence length, L layers:
//   bmin = floor(B' / beta); bmax = 2 B' - bmin;
//   if bmax >= N - W: bmax = N - W, bmin = 2 B' - bmax;
//   step = floor((bmax - bmin) / (L - 1)); b_l = bmax - l * step.
// Choices ([decide] / [ours]):
//  * With the floored step, sum b_l exceeds L B' by up to L(L-1)/2 entries (a surplus, not
//    a loss). The difference is settled one entry at a time,
//    round robin from layer 0 upwards (the lowest layers, which hold the most, give it
//    back), so the total is exactly L B'. A deficit would be handed out the same way,
//    never above N - W.
//  * Fallback to uniform (SnapKV) budgets when the pyramid is not defined: one layer.
//  * The pyramid spans the selectable B - W, each layer keeping its window on top (the
//    KVCache-Factory form). kvpress's PyramidKVPress spans the whole B with the window
//    inside each layer's count (counts from 2B - B/beta down to B/beta) and falls back to
//    uniform budgets when its smallest layer would hold fewer than W entries. Both keep
//    L B entries per KV head in all and rank by the same score, so per list the smaller
//    kept set lies inside the larger; at each layer's count here, kvpress's SnapKV keeps
//    the same entries (tests/python/test_kvpress_existing.py).
//  * beta (default 20, > 0) is the only extra argument; window, pool, kernel, gqa and all
//    other behaviour (end of a prefill call only, decode grows, question-agnostic calls, ties) are SnapKV's.
//  * On a later prefill call a list may hold fewer than b_l candidates: it keeps them all
//    (the total then stays below L B'; nothing is redistributed).
#include "kv/policies/common/policy-make.h"
#include "kv/policies/common/window-scores.h"
#include "core/error.h"
#include "model/model.h"

#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

extern const struct policy_ops policy_pyramidkv;

#define PYRAMID_KEYS "window, pool (max|avg), kernel, gqa (mean|max), beta"

struct pyramid {
    struct kv_policy base;
    struct ws_opts   o;
    double           beta;
};

static const struct policy_opt pyramid_opts[] = {
    { .key = "beta", .type = POLICY_OPT_DOUBLE, .offset = offsetof(struct pyramid, beta), .lo = 1e-6, .hi = 1e9 },
};

static void pyramid_defaults(struct kv_policy *base) { ((struct pyramid *)base)->beta = 20.0; }

static const struct policy_maker pyramid_maker = {
    .ops = &policy_pyramidkv,
    .size = sizeof(struct pyramid),
    .accepted = PYRAMID_KEYS,
    .opts = pyramid_opts,
    .n_opts = (int)(sizeof(pyramid_opts) / sizeof(pyramid_opts[0])),
    .window_opts = offsetof(struct pyramid, o),
    .defaults = pyramid_defaults,
};

static pykv_status pyramid_init(const struct policy_config *cfg, struct kv_policy **out) {
    return policy_make(&pyramid_maker, cfg, out);
}

// The selectable budgets b[0..L) for an average Bs = B - W and a cap = N - W (> Bs).
static void pyramid_budgets(int L, int64_t Bs, int64_t cap, double beta, int64_t *b) {
    if (L < 2) {   // no pyramid with one layer: uniform
        b[0] = Bs;
        return;
    }
    int64_t bmin = (int64_t)floor((double)Bs / beta);
    int64_t bmax = 2 * Bs - bmin;
    if (bmax >= cap) {
        bmax = cap;
        bmin = 2 * Bs - bmax;
    }
    const int64_t step = (bmax - bmin) / (L - 1);
    int64_t rem = (int64_t)L * Bs;
    for (int l = 0; l < L; l++) {
        b[l] = bmax - l * step;
        rem -= b[l];
    }
    // rem < 0: the floored step leaves a surplus (up to L(L-1)/2 entries); rem > 0 cannot
    // happen with integer steps but is handled the same way. Round robin from layer 0.
    while (rem != 0) {
        int moved = 0;
        for (int l = 0; l < L && rem != 0; l++) {
            if (rem < 0 && b[l] > 0) { b[l]--; rem++; moved = 1; }
            else if (rem > 0 && b[l] < cap) { b[l]++; rem--; moved = 1; }
        }
        if (!moved) break;
    }
}

static pykv_status pyramid_after_layer(struct kv_policy *base, const struct policy_event *ev) {
    struct pyramid *p = (struct pyramid *)base;
    if (!ws_is_prefill_end(ev)) return PYKV_OK;
    const int32_t B = ws_budget(&base->cfg, ev);
    PYKV_TRY(ws_check_budget("pyramidkv", B, p->o.window));
    if (ev->n_past <= B) return PYKV_OK;
    struct ws_window w = ws_window_of(ev, p->o.window);
    int64_t *budgets = malloc((size_t)ev->hp->n_layer * sizeof(int64_t));
    if (!budgets) return pykv_error(PYKV_ERR_NOMEM, "out of memory");
    pyramid_budgets(ev->hp->n_layer, (int64_t)B - w.protect, (int64_t)ev->n_past - w.protect, p->beta, budgets);
    const int64_t b = budgets[ev->layer];
    free(budgets);
    int any = 0;
    for (int g = 0; g < ev->hp->n_head_kv; g++) any |= kv_cache_list(ev->cache, ev->layer, g)->n - w.protect > b;
    if (!any) return PYKV_OK;

    return ws_layer_keep_top(ev, &p->o, w, b);
}

static int32_t pyramid_last_chunk_min(const struct kv_policy *base) { return ((const struct pyramid *)base)->o.window; }

const struct policy_ops policy_pyramidkv = {
    .name = "pyramidkv",
    .description = "PyramidKV: SnapKV scores with budgets that shrink linearly from the first layer to the last",
    .init = pyramid_init,
    .free = policy_free_state,
    .after_layer = pyramid_after_layer,
    .last_chunk_min = pyramid_last_chunk_min,
    .min_budget = ws_min_budget,
    .options = "window=32, pool=max, kernel=7, gqa=mean, beta=20, evict_every_chunk=0",
    .choose = "as snapkv, giving shallow layers more of the budget than deep ones",
    .default_budget_frac = POLICY_DEFAULT_BUDGET_FRAC,
    .default_budget_min = POLICY_DEFAULT_BUDGET_MIN,
    .budget_floor = POLICY_BUDGET_FLOOR,
    .device_lists = 1,
};
