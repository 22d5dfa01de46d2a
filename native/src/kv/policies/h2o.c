// h2o.c - H2O (heavy hitters + recent window); docs/policies.md#h2o.
//
// Score: s[j] = the attention entry j has received from every query so far (prompt and
// generated), per KV head the mean over its query heads (GQA mean), accumulated in the order
// of the queries; no normalisation by the number of queries that can see j (the
// KVCache-Factory form, not kvpress's ObservedAttention average) and no pooling.
// kvpress's ObservedAttentionPress divides each entry's sum by the n - j queries that see
// it, which favours late entries, and has no recent window; changed to the plain sum and
// the recent window below, it keeps the same entries as this policy
// (tests/python/test_kvpress_existing.py).
//
// Schedule: scores accumulate after every layer of every chunk (the forward pass sums the
// attention per entry: POLICY_NEEDS_ATTENTION_SUMS). At the end of a prefill call each list
// keeps its `recent` newest entries plus the B - recent highest scores among the others;
// at every decode step a list longer than B drops its lowest-scored non-recent entry,
// so the cache stays at B entries per (layer, KV head): decode does not grow it.
//
// [decide] recent (the heavy/recent split) defaults to B / 2, the even split of the H2O
// paper; --policy-arg recent=N sets it (0 <= N < B). Ties go to the lower position.
// A saved state (pykv_state_save) keeps the accumulators and the budget.
#include "core/error.h"
#include "model/model.h"
#include "kv/policy.h"
#include "kv/policies/common/policy-make.h"
#include "kv/policies/common/policy-state.h"
#include "kv/policies/common/window-scores.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

extern const struct policy_ops policy_h2o;

#define H2O_ARGS "recent"

struct h2o {
    struct kv_policy base;
    int32_t          recent_arg;   // -1 = B / 2
    int32_t          budget;       // B of the last prefill; 0 before one
    int32_t          n_lists;
    float          **scores;       // per (layer, KV head): one accumulator per list entry
    int32_t         *n_scored;     // entries of the list that have an accumulator
    int32_t         *cap;
};

static const struct policy_opt h2o_opts[] = {
    { .key = "recent", .type = POLICY_OPT_INT, .offset = offsetof(struct h2o, recent_arg), .lo = 0, .hi = INT32_MAX },
};

static void h2o_free(struct kv_policy *base) {
    struct h2o *p = (struct h2o *)base;
    if (p->scores)
        for (int32_t i = 0; i < p->n_lists; i++) free(p->scores[i]);
    free(p->scores);
    free(p->n_scored);
    free(p->cap);
    free(p);
}

static void h2o_defaults(struct kv_policy *base) { ((struct h2o *)base)->recent_arg = -1; }

static pykv_status h2o_finish(struct kv_policy *base, const struct policy_config *cfg) {
    const struct h2o *p = (const struct h2o *)base;
    if (cfg->budget > 0 && p->recent_arg >= cfg->budget)
        return pykv_error(PYKV_ERR_INVALID_ARG, "policy 'h2o': recent=%d must be smaller than the budget %d",
                          p->recent_arg, cfg->budget);
    return PYKV_OK;
}

static const struct policy_maker h2o_maker = {
    .ops = &policy_h2o,
    .size = sizeof(struct h2o),
    .accepted = H2O_ARGS,
    .opts = h2o_opts,
    .n_opts = (int)(sizeof(h2o_opts) / sizeof(h2o_opts[0])),
    .defaults = h2o_defaults,
    .finish = h2o_finish,
};

static pykv_status h2o_init(const struct policy_config *cfg, struct kv_policy **out) {
    return policy_make(&h2o_maker, cfg, out);
}

static void h2o_reset(struct kv_policy *base) {
    struct h2o *p = (struct h2o *)base;
    if (p->n_scored) memset(p->n_scored, 0, (size_t)p->n_lists * sizeof(int32_t));
    p->budget = 0;
}

static pykv_status h2o_lists(struct h2o *p, int32_t n_lists) {
    if (p->scores) return PYKV_OK;
    p->n_lists = n_lists;
    p->scores = calloc((size_t)n_lists, sizeof(float *));
    p->n_scored = calloc((size_t)n_lists, sizeof(int32_t));
    p->cap = calloc((size_t)n_lists, sizeof(int32_t));
    return p->scores && p->n_scored && p->cap ? PYKV_OK : pykv_error(PYKV_ERR_NOMEM, "out of memory for H2O scores");
}

// List i now holds n entries: give the new ones (appended by this chunk) a zero accumulator.
// A list shorter than before was rolled back after a cancelled chunk: its surviving entries
// keep theirs.
static pykv_status track_new_entries(struct h2o *p, int32_t i, int32_t n) {
    if (n < p->n_scored[i]) p->n_scored[i] = n;
    if (n > p->cap[i]) {
        int32_t cap = n + n / 4 + 16;
        float *s = realloc(p->scores[i], (size_t)cap * sizeof(float));
        if (!s) return pykv_error(PYKV_ERR_NOMEM, "out of memory for H2O scores");
        p->scores[i] = s;
        p->cap[i] = cap;
    }
    memset(p->scores[i] + p->n_scored[i], 0, (size_t)(n - p->n_scored[i]) * sizeof(float));
    p->n_scored[i] = n;
    return PYKV_OK;
}

static void accumulate(float *s, const struct policy_event *ev, int32_t g, int32_t n) {
    const int32_t group = ev->hp->n_head / ev->hp->n_head_kv;
    const float inv = 1.0f / (float)group;
    for (int32_t r = 0; r < group; r++) {
        const float *col = ev->attn_colsum + (size_t)(g * group + r) * ev->attn_colsum_stride;
        for (int32_t j = 0; j < n; j++) s[j] += col[j] * inv;
    }
}

// Keep the entries at ascending indices keep[0..n_keep) of list i, scores included.
static pykv_status retain(struct h2o *p, const struct policy_event *ev, int32_t i, struct kv_list *l,
                          const int32_t *keep, int32_t n_keep) {
    kv_compact_rows(p->scores[i], sizeof(float), keep, n_keep);
    p->n_scored[i] = n_keep;
    return kv_list_retain(ev->cache, l, keep, n_keep);
}

// End of prefill: the top B - recent of the non-recent entries, and the recent ones.
static pykv_status evict_to_budget(struct h2o *p, const struct policy_event *ev, int32_t i, struct kv_list *l,
                                   int32_t recent) {
    const int32_t n = l->n, n_cand = n - recent, B = p->budget;
    int64_t *chosen = malloc((size_t)(n_cand > 0 ? n_cand : 1) * sizeof(int64_t));
    int32_t *keep = malloc((size_t)B * sizeof(int32_t));
    pykv_status st = (chosen && keep) ? PYKV_OK : pykv_error(PYKV_ERR_NOMEM, "out of memory in H2O eviction");
    int64_t n_chosen = 0;
    if (st == PYKV_OK) st = ws_select_top(p->scores[i], n_cand, B - recent, chosen, &n_chosen);
    if (st == PYKV_OK) {
        int32_t m = 0;
        for (int64_t j = 0; j < n_chosen; j++) keep[m++] = (int32_t)chosen[j];
        for (int32_t j = n_cand; j < n; j++) keep[m++] = j;
        st = retain(p, ev, i, l, keep, m);
    }
    free(chosen);
    free(keep);
    return st;
}

// Decode step: drop the lowest-scored non-recent entry (ties -> the lower position).
static pykv_status evict_one(struct h2o *p, const struct policy_event *ev, int32_t i, struct kv_list *l,
                             int32_t recent) {
    const float *s = p->scores[i];
    int32_t worst = 0;
    for (int32_t j = 1; j < l->n - recent; j++)
        if (s[j] < s[worst]) worst = j;
    int32_t *keep = malloc((size_t)l->n * sizeof(int32_t));
    if (!keep) return pykv_error(PYKV_ERR_NOMEM, "out of memory in H2O eviction");
    int32_t m = 0;
    for (int32_t j = 0; j < l->n; j++) if (j != worst) keep[m++] = j;
    pykv_status st = retain(p, ev, i, l, keep, m);
    free(keep);
    return st;
}

static pykv_status h2o_after_layer(struct kv_policy *base, const struct policy_event *ev) {
    struct h2o *p = (struct h2o *)base;
    const int32_t n_head_kv = ev->hp->n_head_kv;
    PYKV_TRY(h2o_lists(p, ev->hp->n_layer * n_head_kv));
    const int prefill_end = ev->n_prompt > 1 && ev->is_last_chunk;
    if (prefill_end) {
        p->budget = policy_budget(&base->cfg, ev->n_prompt);
        int32_t recent = p->recent_arg >= 0 ? p->recent_arg : p->budget / 2;
        if (recent >= p->budget)
            return pykv_error(PYKV_ERR_INVALID_ARG, "policy 'h2o': recent=%d must be smaller than the budget %d",
                              recent, p->budget);
    } else if (ev->n_prompt == 1 && p->budget == 0 && base->cfg.budget > 0) {
        p->budget = base->cfg.budget;   // decoding with no prefill before: the absolute budget
    }
    const int32_t recent = p->recent_arg >= 0 ? p->recent_arg : p->budget / 2;
    for (int32_t g = 0; g < n_head_kv; g++) {
        int32_t i = ev->layer * n_head_kv + g;
        struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
        PYKV_TRY(track_new_entries(p, i, l->n));
        accumulate(p->scores[i], ev, g, l->n);
        if (p->budget == 0 || l->n <= p->budget || recent >= p->budget) continue;
        if (prefill_end) PYKV_TRY(evict_to_budget(p, ev, i, l, recent));
        else if (ev->n_prompt == 1) PYKV_TRY(evict_one(p, ev, i, l, recent));
    }
    return PYKV_OK;
}

// Saved state: the budget, then every list's accumulators (one per entry; 0 for entries
// not scored yet, as the next step would give them).
static void h2o_state_write(const struct kv_policy *base, const struct kv_cache *c, struct state_writer *w) {
    const struct h2o *p = (const struct h2o *)base;
    state_put_i32(w, p->budget);
    for (int32_t i = 0; i < c->n_layer * c->n_head_kv; i++) {
        const int32_t n = c->lists[i].n, scored = p->scores ? (p->n_scored[i] < n ? p->n_scored[i] : n) : 0;
        if (scored) state_put(w, p->scores[i], (size_t)scored * sizeof(float));
        for (int32_t j = scored; j < n; j++) state_put(w, &(float){ 0.0f }, sizeof(float));
    }
}

static pykv_status h2o_state_read(struct kv_policy *base, const struct kv_cache *c, const int32_t *list_n,
                                  struct state_reader *r, int apply) {
    struct h2o *p = (struct h2o *)base;
    const int32_t n_lists = c->n_layer * c->n_head_kv;
    int32_t budget;
    PYKV_TRY(policy_state_ints("h2o", "budget", r, &budget, 1, 0, INT32_MAX));
    if (apply) {
        PYKV_TRY(h2o_lists(p, n_lists));
        p->budget = budget;
    }
    for (int32_t i = 0; i < n_lists; i++) {
        const int32_t n = list_n[i];
        if (apply) {
            p->n_scored[i] = 0;
            PYKV_TRY(track_new_entries(p, i, n));
        }
        PYKV_TRY(policy_state_floats("h2o", r, apply ? p->scores[i] : NULL, n));
    }
    return PYKV_OK;
}

const struct policy_ops policy_h2o = {
    .name = "h2o",
    .description = "heavy hitters: accumulated attention plus a recent window; fixed budget while decoding",
    .init = h2o_init,
    .free = h2o_free,
    .after_layer = h2o_after_layer,
    .reset = h2o_reset,
    .state_write = h2o_state_write,
    .state_read = h2o_state_read,
    .needs = POLICY_NEEDS_ATTENTION_SUMS | POLICY_NEEDS_STEP_ROOM,
    .options = "recent=B/2, evict_every_chunk=0",
    .choose = "a fixed memory while generating, scored by the attention every token received; "
              "weak at retrieving one fact from a long prompt",
    .default_budget_frac = POLICY_DEFAULT_BUDGET_FRAC,
    .default_budget_min = POLICY_DEFAULT_BUDGET_MIN,
    .budget_floor = POLICY_BUDGET_FLOOR,
    .device_lists = 1,
};
