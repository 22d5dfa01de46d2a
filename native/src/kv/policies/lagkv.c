// lagkv.c - LagKV (docs/policies.md#lagkv): at the end of each prefill call every list keeps
// its first `sink` entries, its newest partition and the entries of each earlier partition
// that stand out most from the partition after it.
//
// Paper: "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are Important"
// (Liang et al., arXiv:2504.04704). Score, with kvpress's LagKVPress's rule and defaults: a
// list of n entries splits into the `sink` first, then P = (n - sink) / lag whole partitions
// of `lag` entries, then the rest. Partition p < P - 1 is scored against partition p + 1 (its
// lag reference): for keys, and apart for values, each channel is scaled by the reference's
// min and max, x' = (x - min) / (max - min), the entry's spread is the standard deviation of
// its d scaled channels (unbiased), and a softmax over the partition turns the spreads into
// weights; the entry's score is the mean of its key and value weights. With cross=0 (the
// default) the score is then the entry's rank inside its partition divided by lag, so
// every partition keeps about the same share; cross=1 compares the weights across
// partitions. The sinks, partition P - 1 and the rest (lag to 2 lag - 1 entries) score 1,
// above every other score. A list shorter than sink + 2 lag keeps its sinks and its newest
// entries (kvpress's scores for it: 1 for the sinks, rising with the position after them).
// No query and no attention are read: question-agnostic.
//
// Options: sink=4 (or the constructor's sink=), lag=128, cross=0|1 (default 0),
// evict_every_chunk=0. The budget must exceed sink.
// Choices:
//  * A budget too small for the sinks and the unscored tail keeps the sinks and the newest
//    entries, as for a short list (kvpress breaks the ties among its score-1 entries in
//    torch's top-k order).
//  * A channel whose reference has max == min scales to 0 (kvpress divides by zero).
//  * Ties (equal ranks in different partitions) go to the lower position; kvpress leaves
//    them to torch's top-k, so the two may keep different entries of the one rank that
//    straddles the budget.
//  * Schedule as Knorm: the last chunk of a multi-token call cuts every list longer than B;
//    decode steps append without eviction; a later prefill call scores the whole list
//    again, its partitions counted from the list's first entry.
#include "kv/policies/common/entry-scores.h"
#include "kv/policies/common/policy-make.h"
#include "kv/policies/common/window-scores.h"
#include "core/error.h"
#include "model/model.h"

#include <math.h>
#include <stddef.h>

extern const struct policy_ops policy_lagkv;

struct lagkv {
    struct kv_policy base;
    int32_t          sink;
    int32_t          lag;
    int              cross;
    int32_t          B;   // the budget of the current prefill call, for the scorers
};

static const struct policy_opt lagkv_opts[] = {
    { .key = "sink", .type = POLICY_OPT_INT, .offset = offsetof(struct lagkv, sink), .lo = 0, .hi = 1 << 24 },
    { .key = "lag", .type = POLICY_OPT_INT, .offset = offsetof(struct lagkv, lag), .lo = 2, .hi = 1 << 20 },
    { .key = "cross", .type = POLICY_OPT_CHOICE, .offset = offsetof(struct lagkv, cross), .choices = "0|1" },
};

static void lagkv_defaults(struct kv_policy *base) {
    struct lagkv *p = (struct lagkv *)base;
    p->sink = -1;
    p->lag = 128;
}

// The constructor's sink= and the argument sink= must agree; a budget must exceed the sinks.
static pykv_status lagkv_finish(struct kv_policy *base, const struct policy_config *cfg) {
    struct lagkv *p = (struct lagkv *)base;
    if (cfg->sink >= 0 && p->sink >= 0 && cfg->sink != p->sink)
        return pykv_error(PYKV_ERR_INVALID_ARG, "policy 'lagkv': sink=%d and the policy argument sink=%d disagree",
                          cfg->sink, p->sink);
    if (p->sink < 0) p->sink = cfg->sink >= 0 ? cfg->sink : 4;
    if (cfg->budget > 0 && cfg->budget <= p->sink)
        return pykv_error(PYKV_ERR_INVALID_ARG, "policy 'lagkv': the budget (%d entries per layer and KV head) must be "
                          "larger than the %d sink tokens it includes", cfg->budget, p->sink);
    return PYKV_OK;
}

static const struct policy_maker lagkv_maker = {
    .ops = &policy_lagkv,
    .size = sizeof(struct lagkv),
    .accepted = "sink, lag, cross (0|1)",
    .opts = lagkv_opts,
    .n_opts = (int)(sizeof(lagkv_opts) / sizeof(lagkv_opts[0])),
    .defaults = lagkv_defaults,
    .finish = lagkv_finish,
};

static pykv_status lagkv_init(const struct policy_config *cfg, struct kv_policy **out) {
    return policy_make(&lagkv_maker, cfg, out);
}

// Row j of a list's keys (values when of_values) as floats.
static const float *row_of(const struct kv_list *l, int of_values, int32_t j, int32_t d, float *tmp) {
    return of_values ? kv_value_f32(l, j, d, tmp) : kv_key_f32(l, j, d, tmp);
}

// The softmax weights w[0..lag) of partition [a, a + lag) of the keys or values, scaled by
// the reference partition [a + lag, a + 2 lag).
static void partition_weights(const struct kv_list *l, int of_values, int32_t a, int32_t lag, int32_t d, float *w) {
    float lo[PYKV_MAX_HEAD_DIM], hi[PYKV_MAX_HEAD_DIM], tmp[PYKV_MAX_HEAD_DIM];
    for (int32_t j = a + lag; j < a + 2 * lag; j++) {
        const float *x = row_of(l, of_values, j, d, tmp);
        for (int32_t c = 0; c < d; c++) {
            if (j == a + lag || x[c] < lo[c]) lo[c] = x[c];
            if (j == a + lag || x[c] > hi[c]) hi[c] = x[c];
        }
    }
    double top = -INFINITY;
    for (int32_t i = 0; i < lag; i++) {
        const float *x = row_of(l, of_values, a + i, d, tmp);
        double y[PYKV_MAX_HEAD_DIM], sum = 0.0, sq = 0.0;
        for (int32_t c = 0; c < d; c++) {
            const double range = (double)hi[c] - lo[c];
            y[c] = range > 0.0 ? ((double)x[c] - lo[c]) / range : 0.0;
            sum += y[c];
        }
        const double mean = sum / d;
        for (int32_t c = 0; c < d; c++) sq += (y[c] - mean) * (y[c] - mean);
        w[i] = (float)(d > 1 ? sqrt(sq / (d - 1)) : 0.0);
        top = w[i] > top ? w[i] : top;
    }
    double total = 0.0;
    for (int32_t i = 0; i < lag; i++) total += exp(w[i] - top);
    for (int32_t i = 0; i < lag; i++) w[i] = (float)(exp(w[i] - top) / total);
}

// s[0..lag) becomes each entry's rank inside the partition (0 = lowest; ties -> the lower
// index ranks lower) divided by lag.
static void ranks_of(float *s, int32_t lag, float *rank) {
    for (int32_t i = 0; i < lag; i++) {
        int32_t below = 0;
        for (int32_t k = 0; k < lag; k++) below += s[k] < s[i] || (s[k] == s[i] && k < i);
        rank[i] = (float)below / (float)lag;
    }
    for (int32_t i = 0; i < lag; i++) s[i] = rank[i];
}

static void lagkv_score(const struct kv_policy *base, const struct policy_event *ev, int32_t g,
                        const struct kv_list *l, float *s, float *tmp) {
    (void)g;
    const struct lagkv *p = (const struct lagkv *)base;
    const int32_t n = l->n, S = p->sink, lag = p->lag, d = ev->hp->head_dim;
    const int32_t n_parts = n >= S ? (n - S) / lag : 0;
    const int32_t end = S + n_parts * lag, tail = n - end + lag;
    for (int32_t j = 0; j < n; j++) s[j] = 1.0f;
    if (n < S + 2 * lag || p->B < S + tail) {
        // sinks, then the newest entries
        for (int32_t j = S; j < n; j++) s[j] = (float)(j - S) / (float)(n - S);
        return;
    }
    for (int32_t a = S; a + lag < end; a += lag) {
        float *wk = s + a, *wv = tmp;
        partition_weights(l, 0, a, lag, d, wk);
        partition_weights(l, 1, a, lag, d, wv);
        for (int32_t i = 0; i < lag; i++) wk[i] = (wk[i] + wv[i]) / 2.0f;
        if (!p->cross) ranks_of(wk, lag, tmp + lag);
    }
}

static pykv_status lagkv_after_layer(struct kv_policy *base, const struct policy_event *ev) {
    struct lagkv *p = (struct lagkv *)base;
    if (!ws_is_prefill_end(ev)) return PYKV_OK;
    p->B = ws_budget(&base->cfg, ev);
    if (p->B <= p->sink)
        return pykv_error(PYKV_ERR_INVALID_ARG, "policy 'lagkv': the budget (%d entries per layer and KV head) must be "
                          "larger than the %d sink tokens it includes", p->B, p->sink);
    const struct es_device on_device = { .rule = ES_LAGKV, .sink = p->sink, .lag = p->lag, .cross = p->cross };
    return es_layer_keep_top(base, ev, p->B, lagkv_score, &on_device);
}

static int32_t lagkv_min_budget(const struct kv_policy *base) { return ((const struct lagkv *)base)->sink + 1; }

const struct policy_ops policy_lagkv = {
    .name = "lagkv",
    .description = "LagKV: sinks, the newest partition, and the entries that differ most from the partition after them",
    .init = lagkv_init,
    .free = policy_free_state,
    .after_layer = lagkv_after_layer,
    .min_budget = lagkv_min_budget,
    .options = "sink=4, lag=128, cross=0, evict_every_chunk=0",
    .choose = "a question-agnostic cache without attention scores that keeps a share of every stretch of "
              "the prompt",
    .default_budget_frac = POLICY_DEFAULT_BUDGET_FRAC,
    .default_budget_min = POLICY_DEFAULT_BUDGET_MIN,
    .budget_floor = POLICY_BUDGET_FLOOR,
    .device_lists = 1,
};
