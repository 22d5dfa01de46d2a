// snapkv.c - SnapKV (docs/policies.md#snapkv): at the end of each prefill call, per layer, the
// last W queries score the earlier entries; every KV head keeps its top B - W candidates
// plus the W window entries.
//
// Choices ([decide] / [ours]):
//  * Defaults W=32, max pooling with kernel 7, GQA mean; order mean over the window rows ->
//    GQA reduce -> pool (the Ada-KV/LAVa baseline setting). Arguments: window, pool
//    (max|avg), kernel (odd), gqa (mean|max).
//  * Runs in after_layer of the last chunk of a multi-token call. Decode steps
//    append without eviction: the cache grows by one entry per list per step.
//  * A later multi-token call (eval(context) then eval(question)) is a new prefill and is
//    compressed again at its end; its window is its last min(W, tokens) tokens.
//  * No eviction while the sequence holds <= B tokens; ties go to the lower position.
//  * kvpress's SnapKVPress defaults to W=64 and average pooling with kernel 5, and pools
//    before the GQA mean: with average pooling the order does not matter (both are linear),
//    with max pooling it does. With window=64, pool=avg, kernel=5 this policy keeps the
//    entries SnapKVPress keeps (tests/python/test_kvpress_existing.py).
#include "kv/policies/common/window-scores.h"
#include "kv/policies/common/policy-make.h"
#include "core/error.h"
#include "model/model.h"

#include <stddef.h>

extern const struct policy_ops policy_snapkv;

#define SNAPKV_KEYS "window, pool (max|avg), kernel, gqa (mean|max)"

struct snapkv {
    struct kv_policy base;
    struct ws_opts   o;
};

static const struct policy_maker snapkv_maker = {
    .ops = &policy_snapkv,
    .size = sizeof(struct snapkv),
    .accepted = SNAPKV_KEYS,
    .window_opts = offsetof(struct snapkv, o),
};

static pykv_status snapkv_init(const struct policy_config *cfg, struct kv_policy **out) {
    return policy_make(&snapkv_maker, cfg, out);
}

static pykv_status snapkv_after_layer(struct kv_policy *base, const struct policy_event *ev) {
    struct snapkv *p = (struct snapkv *)base;
    if (!ws_is_prefill_end(ev)) return PYKV_OK;
    const int32_t B = ws_budget(&base->cfg, ev);
    PYKV_TRY(ws_check_budget("snapkv", B, p->o.window));
    if (ev->n_past <= B) return PYKV_OK;
    struct ws_window w = ws_window_of(ev, p->o.window);
    int any = 0;
    for (int g = 0; g < ev->hp->n_head_kv; g++) any |= kv_cache_list(ev->cache, ev->layer, g)->n > B;
    if (!any) return PYKV_OK;

    return ws_layer_keep_top(ev, &p->o, w, (int64_t)B - w.protect);
}

static int32_t snapkv_last_chunk_min(const struct kv_policy *base) { return ((const struct snapkv *)base)->o.window; }

const struct policy_ops policy_snapkv = {
    .name = "snapkv",
    .description = "SnapKV: the last W prompt queries pick each KV head's top entries at the end of the prompt",
    .init = snapkv_init,
    .free = policy_free_state,
    .after_layer = snapkv_after_layer,
    .last_chunk_min = snapkv_last_chunk_min,
    .min_budget = ws_min_budget,
    .options = "window=32, pool=max, kernel=7, gqa=mean, evict_every_chunk=0",
    .choose = "a long prompt with the question at its end: the question's attention keeps what it asks for",
    .default_budget_frac = POLICY_DEFAULT_BUDGET_FRAC,
    .default_budget_min = POLICY_DEFAULT_BUDGET_MIN,
    .budget_floor = POLICY_BUDGET_FLOOR,
    .device_lists = 1,
};
