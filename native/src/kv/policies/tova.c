// tova.c - TOVA (docs/policies.md#tova): the newest query's attention decides. At the end of
// each prefill call every list keeps its newest entry and the B - 1 others the last prompt
// token attends to most; at every decode step a list longer than B drops the entry the new
// token attends to least, so the cache stays at B entries per (layer, KV head).
//
// Paper: "Transformers are Multi-State RNNs" (Oren et al., arXiv:2401.06104), Token Omission
// Via Attention. Score of entry j: the newest query's softmax attention to j, averaged over
// the query heads (heads=layer: all the layer's heads, as the paper and kvpress's TOVAPress,
// so every KV head of a layer keeps the same positions; heads=group: the KV head's own
// query heads). Question-aware when the prompt ends with the question.
//
// Options: heads=layer|group (default layer), evict_every_chunk=0.
// Choices:
//  * The newest entry is never dropped: kvpress gives it the largest score at the end of the
//    prefill, and decode steps do the same (the paper's cache may drop the new token itself).
//  * Prefill scores come from the last token's query (ws_softmax_row, fp32); decode steps
//    read the attention the forward pass computed (POLICY_NEEDS_DECODE_ATTENTION_SUMS), so
//    they cost no extra pass. Ties go to the lower position.
//  * B is fixed by each prefill call (a share of the sequence then) and kept by the decode
//    steps and in saved states; decoding with no prefill before uses an absolute budget.
#include "kv/policies/common/policy-make.h"
#include "kv/policies/common/policy-state.h"
#include "kv/policies/common/window-scores.h"
#include "core/error.h"
#include "core/threadpool.h"
#include "model/model.h"

#include <stddef.h>
#include <stdlib.h>

extern const struct policy_ops policy_tova;

enum tova_heads { TOVA_HEADS_LAYER = 0, TOVA_HEADS_GROUP = 1 };   // order of "layer|group"

struct tova {
    struct kv_policy base;
    int              heads;    // enum tova_heads
    int32_t          budget;   // B of the last prefill; 0 before one
};

static const struct policy_opt tova_opts[] = {
    { .key = "heads", .type = POLICY_OPT_CHOICE, .offset = offsetof(struct tova, heads), .choices = "layer|group" },
};

static const struct policy_maker tova_maker = {
    .ops = &policy_tova,
    .size = sizeof(struct tova),
    .accepted = "heads (layer|group)",
    .opts = tova_opts,
    .n_opts = (int)(sizeof(tova_opts) / sizeof(tova_opts[0])),
};

static pykv_status tova_init(const struct policy_config *cfg, struct kv_policy **out) {
    return policy_make(&tova_maker, cfg, out);
}

// The attention rows of one layer's query heads: row h holds head h's weights over the
// entries of its KV head's list (n_max floats a row).
struct head_rows {
    const struct policy_event *ev;
    float                     *w;
    int32_t                    n_max;
};

static void last_query_task(void *arg, int ith, int nth) {
    const struct head_rows *job = arg;
    const struct policy_event *ev = job->ev;
    const int group = ev->hp->n_head / ev->hp->n_head_kv;
    long h0, h1;
    split_range(ev->hp->n_head, ith, nth, &h0, &h1);
    for (long h = h0; h < h1; h++) {
        const struct kv_list *l = kv_cache_list(ev->cache, ev->layer, (int)h / group);
        ws_softmax_row(ev, l, (int)h, ev->T - 1, job->w + (size_t)h * job->n_max);
    }
}

// Nonzero when every list of the layer holds n entries (heads=layer needs one index space;
// the layer's lists always agree under it, as they lose the same entries).
static int lists_agree(const struct policy_event *ev, int32_t n) {
    for (int g = 0; g < ev->hp->n_head_kv; g++)
        if (kv_cache_list(ev->cache, ev->layer, g)->n != n) return 0;
    return 1;
}

// Each list longer than B keeps its newest entry and the top B - 1 of the others, scored by
// the mean of rows (one row of weights per query head, stride apart) over the heads that
// average: all the layer's, or the KV head's own group.
static pykv_status keep_top(const struct tova *p, const struct policy_event *ev, const float *rows, size_t stride,
                            int32_t B) {
    const int n_head = ev->hp->n_head, group = n_head / ev->hp->n_head_kv;
    const int32_t n0 = kv_cache_list(ev->cache, ev->layer, 0)->n;
    // the layer-wide mean is taken once, before any list of the layer loses an entry
    const int layer_wide = p->heads == TOVA_HEADS_LAYER && lists_agree(ev, n0);
    float *s = malloc(stride * sizeof(float));
    if (!s) return pykv_error(PYKV_ERR_NOMEM, "out of memory in TOVA");
    if (layer_wide) ws_gqa_reduce(rows, (int64_t)stride, n_head, n0 - 1, WS_GQA_MEAN, s);
    pykv_status st = PYKV_OK;
    for (int g = 0; g < ev->hp->n_head_kv && st == PYKV_OK; g++) {
        const int32_t n = kv_cache_list(ev->cache, ev->layer, g)->n;
        if (n <= B) continue;
        if (!layer_wide) ws_gqa_reduce(rows + (size_t)g * group * stride, (int64_t)stride, group, n - 1, WS_GQA_MEAN, s);
        st = ws_keep_top(ev, g, s, n - 1, B - 1);
    }
    free(s);
    return st;
}

static pykv_status evict_prefill(struct tova *p, const struct policy_event *ev, int32_t B) {
    int32_t n_max = 0;
    for (int g = 0; g < ev->hp->n_head_kv; g++) {
        const int32_t n = kv_cache_list(ev->cache, ev->layer, g)->n;
        n_max = n > n_max ? n : n_max;
    }
    if (n_max <= B) return PYKV_OK;
    struct head_rows job = { ev, malloc((size_t)ev->hp->n_head * (size_t)n_max * sizeof(float)), n_max };
    if (!job.w) return pykv_error(PYKV_ERR_NOMEM, "out of memory in TOVA");
    pykv_status st = PYKV_OK;
    if (ev->q_device) st = ws_attention_sums_device(ev, 1, job.w, (size_t)n_max);   // the last query's row
    else threadpool_run(ev->pool, last_query_task, &job);
    if (st == PYKV_OK) st = keep_top(p, ev, job.w, (size_t)n_max, B);
    free(job.w);
    return st;
}

static pykv_status tova_after_layer(struct kv_policy *base, const struct policy_event *ev) {
    struct tova *p = (struct tova *)base;
    if (ws_is_prefill_end(ev)) {
        p->budget = ws_budget(&base->cfg, ev);
        return evict_prefill(p, ev, p->budget);
    }
    if (ev->n_prompt != 1 || ev->T != 1 || !ev->attn_colsum) return PYKV_OK;
    if (p->budget == 0) p->budget = base->cfg.budget > 0 ? base->cfg.budget : 0;   // no prefill before
    if (p->budget == 0) return PYKV_OK;
    return keep_top(p, ev, ev->attn_colsum, (size_t)ev->attn_colsum_stride, p->budget);
}

static void tova_reset(struct kv_policy *base) { ((struct tova *)base)->budget = 0; }

// Saved state: the budget the last prefill fixed.
static void tova_state_write(const struct kv_policy *base, const struct kv_cache *c, struct state_writer *w) {
    (void)c;
    state_put_i32(w, ((const struct tova *)base)->budget);
}

static pykv_status tova_state_read(struct kv_policy *base, const struct kv_cache *c, const int32_t *list_n,
                                   struct state_reader *r, int apply) {
    (void)list_n;
    int32_t B;
    PYKV_TRY(policy_state_ints("tova", "budget", r, &B, 1, 0, c->max_entries));
    if (apply) ((struct tova *)base)->budget = B;
    return PYKV_OK;
}

const struct policy_ops policy_tova = {
    .name = "tova",
    .description = "TOVA: the newest token's attention keeps each layer's top entries; fixed budget while decoding",
    .init = tova_init,
    .free = policy_free_state,
    .after_layer = tova_after_layer,
    .reset = tova_reset,
    .state_write = tova_state_write,
    .state_read = tova_state_read,
    .needs = POLICY_NEEDS_DECODE_ATTENTION_SUMS | POLICY_NEEDS_STEP_ROOM,
    .options = "heads=layer, evict_every_chunk=0",
    .choose = "a fixed memory while generating, decided by the newest token alone: cheap, and strong when "
              "the prompt ends with the question",
    .default_budget_frac = POLICY_DEFAULT_BUDGET_FRAC,
    .default_budget_min = POLICY_DEFAULT_BUDGET_MIN,
    .budget_floor = POLICY_BUDGET_FLOOR,
    .device_lists = 1,
};
