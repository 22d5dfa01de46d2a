// cake.c - CAKE (docs/policies.md#cake): layer budgets from each layer's attention preference,
// allocated in a cascade during prefill, mean + gamma*variance token indicator, and a
// fixed cache size during decoding.
//
// At the end of a prefill call, in after_layer of layer m (last chunk):
//   1. score layer m (cake-score.c): P_m = H_m^(1/tau1) V_m^(1/tau2) and the indicator
//      I = mean + gamma var -> max pool 7 (per query head) -> GQA mean, per KV head;
//   2. cascade=1: split T = (B - W) L over layers 0..m by P (cake-budget.c) and shrink every
//      layer l <= m to its share, re-selecting by its stored indicator (compacted with the
//      list, never recomputed). cascade=0: keep everything until m = L - 1, then split once.
// Choices ([decide] / [ours]):
//  * Defaults: W = 32, gamma = 200, tau1 = tau2 = 1 (the cakekv fallback; the paper tunes
//    tau per model, so no universal value exists), max pool kernel 7, GQA mean, cascade=1,
//    decode_evict=fixed. Arguments: window, pool, kernel, gqa, gamma (>= 0), tau1, tau2
//    (> 0), cascade (0|1), decode_evict (fixed|none).
//  * The pool runs over the candidates only (window excluded, PyTorch zero padding), per
//    query head, before the GQA mean (the cakekv order). [decide] Max pooling with kernel 7
//    (snapkv's), not cakekv's average pooling with kernel 5: on small models the average
//    smooths a short fact (a five-digit passkey) below its neighbours and loses it
//    (BENCHMARKS.md, the needle's development samples); pool=avg,kernel=5 restores cakekv's.
//  * The split is water-filling (proportional redistribution of the excess of layers
//    capped at their candidate count), not cakekv's even spread, so the real shares only
//    shrink as layers are added (Prop. 1 holds exactly). Intermediate cascade steps shrink
//    to an upper bound floor(x (1 + 1e-9)) + 1 of the final budget; the last layer uses
//    floor + largest remainder (sum exactly (B - W) L, or every candidate when fewer).
//    Hence every shrink keeps a superset of the final selection and cascade=1 ends with
//    exactly the kept sets of cascade=0 (Thm. 1). A list is compacted at its layer's step,
//    at the last, and between them whenever it holds over 1.5x its current share; the other
//    steps narrow its selection in host memory (ws_cascade_keep_top): the same sets, with a
//    few compactions per list instead of one per later layer.
//  * log P = log H / tau1 + log V / tau2; a layer with H = 0 or V = 0 has P = 0 (budget 0:
//    only its window); if every layer has P = 0 the split is equal.
//  * All KV heads of a layer share b_l (capped by the head's candidates); ties -> lower
//    position. No eviction while the sequence holds <= B tokens (B from budget or the
//    fraction of the sequence at the end of the call); B > W is required.
//  * A later multi-token call is a new prefill: it re-runs the allocation over the current
//    lists (its window = its last min(W, tokens) tokens).
//  * Decode (decode_evict=fixed): the list size of layer l is frozen at the end of the
//    prefill call (b_l + window; B for every layer when the prompt was not compressed;
//    before any prefill call and after pykv_reset, B when the budget is absolute, none
//    when it is a fraction). Saved states keep the frozen sizes.
//    In a decode step, as soon as a list has attended (decode_list), a list longer than its
//    size S keeps its top S - Wd of the first n - Wd entries (Wd = min(W, S); the last Wd
//    entries are protected) ranked by the new token's attention row over the whole list
//    (the step's own fp32 softmax), GQA mean, then the pool over the position-sorted
//    candidates: one entry per list per step. This is the cakekv last-query rule, except
//    that pooling runs over position order instead of cakekv's slot order (slots are
//    reused as entries leave), and the GQA mean precedes the pool (one pool per list, not
//    per query head; the same for the linear average). decode_evict=none lets the cache grow.
#include "kv/policies/cake/cake-budget.h"
#include "kv/policies/cake/cake-score.h"
#include "kv/policies/common/policy-make.h"
#include "kv/policies/common/policy-state.h"
#include "core/error.h"
#include "model/model.h"

#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

extern const struct policy_ops policy_cake;

#define CAKE_KEYS "window, pool (max|avg), kernel, gqa (mean|max), gamma, tau1, tau2, cascade (0|1), decode_evict (fixed|none)"

struct cake {
    struct kv_policy   base;
    struct ws_opts     o;
    double             gamma, tau1, tau2;
    int32_t            cascade;
    int                decode_none;
    // the prefill call under way
    int32_t            n_layer, n_head_kv;
    int                evicting;   // this call compresses
    int32_t            protect;
    int64_t            total;      // (B - protect) L
    struct cake_layer *layers;     // (n_layer) scored layers of this call
    double            *log_pref;   // (n_layer)
    int64_t           *cap, *b;    // (n_layer)
    // decode
    int32_t           *frozen;     // (n_layer) list size per layer
    int                has_frozen; // a prefill call has set frozen
};

static const struct policy_opt cake_opts[] = {
    { .key = "gamma", .type = POLICY_OPT_DOUBLE, .offset = offsetof(struct cake, gamma), .lo = 0.0, .hi = 1e12 },
    { .key = "tau1", .type = POLICY_OPT_DOUBLE, .offset = offsetof(struct cake, tau1), .lo = 1e-3, .hi = 1e3 },
    { .key = "tau2", .type = POLICY_OPT_DOUBLE, .offset = offsetof(struct cake, tau2), .lo = 1e-3, .hi = 1e3 },
    { .key = "cascade", .type = POLICY_OPT_INT, .offset = offsetof(struct cake, cascade), .lo = 0, .hi = 1 },
    { .key = "decode_evict", .type = POLICY_OPT_CHOICE, .offset = offsetof(struct cake, decode_none),
      .choices = "fixed|none" },
};

static void cake_free(struct kv_policy *base) {
    struct cake *p = (struct cake *)base;
    if (p->layers)
        for (int l = 0; l < p->n_layer; l++) cake_layer_free(&p->layers[l], p->n_head_kv);
    free(p->layers); free(p->log_pref); free(p->cap); free(p->b); free(p->frozen);
    free(p);
}

static void cake_defaults(struct kv_policy *base) {
    struct cake *p = (struct cake *)base;
    p->gamma = 200.0;
    p->tau1 = p->tau2 = 1.0;
    p->cascade = 1;
    p->o.pool = WS_POOL_MAX;
    p->o.kernel = 7;
}

static const struct policy_maker cake_maker = {
    .ops = &policy_cake,
    .size = sizeof(struct cake),
    .accepted = CAKE_KEYS,
    .opts = cake_opts,
    .n_opts = (int)(sizeof(cake_opts) / sizeof(cake_opts[0])),
    .window_opts = offsetof(struct cake, o),
    .defaults = cake_defaults,
};

static pykv_status cake_init(const struct policy_config *cfg, struct kv_policy **out) {
    return policy_make(&cake_maker, cfg, out);
}

// Per-call state, allocated on the first prefill end (the model's shape is known then).
static pykv_status cake_alloc(struct cake *p, int32_t n_layer, int32_t n_head_kv) {
    if (p->layers) return PYKV_OK;
    p->n_layer = n_layer;
    p->n_head_kv = n_head_kv;
    const size_t L = (size_t)n_layer;
    p->layers = calloc(L, sizeof(*p->layers));
    p->log_pref = calloc(L, sizeof(double));
    p->cap = calloc(L, sizeof(int64_t));
    p->b = calloc(L, sizeof(int64_t));
    p->frozen = calloc(L, sizeof(int32_t));
    if (!p->layers || !p->log_pref || !p->cap || !p->b || !p->frozen) {
        free(p->layers); free(p->log_pref); free(p->cap); free(p->b); free(p->frozen);
        p->layers = NULL; p->log_pref = NULL; p->cap = NULL; p->b = NULL; p->frozen = NULL;
        return pykv_error(PYKV_ERR_NOMEM, "out of memory");
    }
    return PYKV_OK;
}

static void drop_scores(struct cake *p) {
    for (int l = 0; l < p->n_layer; l++) cake_layer_free(&p->layers[l], p->n_head_kv);
}

// Shrink every KV head of layer l to its top b candidates by the stored indicator; the list
// itself is compacted when apply is set (ws_cascade_keep_top).
static pykv_status shrink_layer(struct cake *p, const struct policy_event *ev, int l, int64_t b, int apply) {
    struct cake_layer *cl = &p->layers[l];
    struct policy_event evl = *ev;
    evl.layer = l;
    for (int g = 0; g < p->n_head_kv; g++)
        PYKV_TRY(ws_cascade_keep_top(&evl, g, &cl->heads[g], b, apply));
    return PYKV_OK;
}

static void freeze(struct cake *p, int uniform, int32_t B) {
    for (int l = 0; l < p->n_layer; l++)
        p->frozen[l] = uniform ? B : (int32_t)(p->b[l] + p->protect);
    p->has_frozen = 1;
}

static pykv_status cake_prefill_layer(struct cake *p, const struct policy_event *ev) {
    const int m = ev->layer, L = ev->hp->n_layer;
    PYKV_TRY(cake_alloc(p, ev->hp->n_layer, ev->hp->n_head_kv));
    if (m == 0) {   // a new call: reset
        drop_scores(p);
        const int32_t B = ws_budget(&p->base.cfg, ev);
        PYKV_TRY(ws_check_budget("cake", B, p->o.window));
        p->protect = ws_window_of(ev, p->o.window).protect;
        p->evicting = ev->n_past > B;
        p->total = ((int64_t)B - p->protect) * L;
        if (!p->evicting) freeze(p, 1, B);
    }
    if (!p->evicting) return PYKV_OK;

    struct ws_window w = ws_window_of(ev, p->o.window);
    struct cake_layer *cl = &p->layers[m];
    PYKV_TRY(cake_score_layer(ev, w, &p->o, p->gamma, p->tau1, p->tau2, cl));
    p->log_pref[m] = cl->log_pref;
    int64_t cap = INT64_MAX;
    for (int g = 0; g < p->n_head_kv; g++) if (cl->heads[g].n_cand < cap) cap = cl->heads[g].n_cand;
    p->cap[m] = cap;

    const int last = m == L - 1;
    if (!p->cascade && !last) return PYKV_OK;
    PYKV_TRY(cake_share(m + 1, p->log_pref, p->cap, p->total, last ? CAKE_SHARE_FINAL : CAKE_SHARE_BOUND, p->b));
    // the lists are compacted at their own layer's step and at the last (and between when
    // 1.5x their share); other steps narrow the selection in host memory
    for (int l = 0; l <= m; l++) PYKV_TRY(shrink_layer(p, ev, l, p->b[l], l == m || last));
    if (last) {
        freeze(p, 0, 0);
        drop_scores(p);
    }
    return PYKV_OK;
}

// One decode step of list g of ev->layer (decode_list: run by the forward pass as soon as the
// list has attended, while other threads attend the layer's other lists). The new token's
// attention row per query head is the step's attention itself (attn_colsum, the forward
// pass's fp32 softmax over the whole list); GQA reduce, pool over the candidates (the list is
// in position order: prefill compactions keep it, decode appends), keep the top S - Wd.
static pykv_status cake_decode_list(struct kv_policy *base, const struct policy_event *ev, int32_t g) {
    struct cake *p = (struct cake *)base;
    if (p->decode_none) return PYKV_OK;
    int32_t S;
    if (p->has_frozen) S = p->frozen[ev->layer];
    else if (p->base.cfg.budget > 0) S = p->base.cfg.budget;
    else return PYKV_OK;
    const struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
    if (l->n <= S) return PYKV_OK;
    if (!ev->attn_colsum) return pykv_error(PYKV_ERR_INTERNAL, "cake: the decode step gave no attention sums");

    const int32_t Wd = p->o.window < S ? p->o.window : S, nc = l->n - Wd;
    const int32_t G = ev->hp->n_head / ev->hp->n_head_kv;
    float *reduced = malloc((size_t)2 * (size_t)nc * sizeof(float));   // reduced, pooled
    if (!reduced) return pykv_error(PYKV_ERR_NOMEM, "cake: out of memory in the decode eviction");
    float *pooled = reduced + nc;
    ws_gqa_reduce(ev->attn_colsum + (size_t)g * G * ev->attn_colsum_stride, ev->attn_colsum_stride, G, nc, p->o.gqa,
                  reduced);
    ws_pool1d(reduced, nc, p->o.kernel, p->o.pool, pooled);
    const pykv_status st = ws_keep_top(ev, g, pooled, nc, (int64_t)S - Wd);
    free(reduced);
    return st;
}

static pykv_status cake_after_layer(struct kv_policy *base, const struct policy_event *ev) {
    struct cake *p = (struct cake *)base;
    if (ws_is_prefill_end(ev)) return cake_prefill_layer(p, ev);
    return PYKV_OK;   // decode steps: cake_decode_list
}

// pykv_reset: decoding goes back to the size a fresh context would use.
static void cake_reset(struct kv_policy *base) { ((struct cake *)base)->has_frozen = 0; }

// Saved state: whether a prefill froze the list sizes, and each layer's size.
static void cake_state_write(const struct kv_policy *base, const struct kv_cache *c, struct state_writer *w) {
    const struct cake *p = (const struct cake *)base;
    state_put_i32(w, p->has_frozen);
    for (int32_t l = 0; l < c->n_layer; l++) state_put_i32(w, p->has_frozen ? p->frozen[l] : 0);
}

static pykv_status cake_state_read(struct kv_policy *base, const struct kv_cache *c, const int32_t *list_n,
                                   struct state_reader *r, int apply) {
    (void)list_n;
    struct cake *p = (struct cake *)base;
    int32_t has_frozen;
    PYKV_TRY(policy_state_ints("cake", "frozen flag", r, &has_frozen, 1, 0, 1));
    if (apply) PYKV_TRY(cake_alloc(p, c->n_layer, c->n_head_kv));
    PYKV_TRY(policy_state_ints("cake", "layer size", r, apply ? p->frozen : NULL, c->n_layer, 0, c->max_entries));
    if (apply) p->has_frozen = has_frozen;
    return PYKV_OK;
}

static int32_t cake_last_chunk_min(const struct kv_policy *base) { return ((const struct cake *)base)->o.window; }

const struct policy_ops policy_cake = {
    .name = "cake",
    .description = "CAKE: layer budgets from attention entropy and variance, cascaded during prefill; "
                   "mean+variance token indicator; fixed cache size while decoding",
    .init = cake_init,
    .free = cake_free,
    .after_layer = cake_after_layer,
    .decode_list = cake_decode_list,
    .last_chunk_min = cake_last_chunk_min,
    .reset = cake_reset,
    .state_write = cake_state_write,
    .state_read = cake_state_read,
    .needs = POLICY_NEEDS_DECODE_ATTENTION_SUMS | POLICY_NEEDS_STEP_ROOM,
    .min_budget = ws_min_budget,
    .options = "window=32, pool=max, kernel=7, gqa=mean, gamma=200, tau1=1, tau2=1, cascade=1, "
               "decode_evict=fixed, evict_every_chunk=0",
    .choose = "long generations in a fixed memory, with layer budgets from attention",
    .default_budget_frac = POLICY_DEFAULT_BUDGET_FRAC,
    .default_budget_min = POLICY_DEFAULT_BUDGET_MIN,
    .budget_floor = POLICY_BUDGET_FLOOR,
    .device_lists = 1,
};
