// window-opts.c - options and budget rules shared by the window policies.
//
// [decide] choices (docs/policies.md#the-observation-window):
//  * window= (constructor) and the policy argument window= are the same setting; giving
//    both with different values is an error.
//  * A budget given as a fraction is a fraction of the sequence at the end of the current
//    prefill call (ev->n_past); for the first call that is the prompt.
//  * With no budget given, the policy's default applies (policy_budget: a share of the
//    prompt with a floor in entries, from the policy's descriptor).
#include "kv/policies/common/window-scores.h"
#include "kv/policies/common/policy-args.h"
#include "core/error.h"

#include <string.h>

void ws_opts_default(struct ws_opts *o) {
    o->window = -1;   // unset until ws_opts_finish
    o->pool = WS_POOL_MAX;
    o->kernel = 7;
    o->gqa = WS_GQA_MEAN;
}

pykv_status ws_opts_arg(const char *policy, struct ws_opts *o, const char *key, const char *value, int *handled) {
    *handled = 1;
    int choice = 0;
    if (strcmp(key, "window") == 0) return policy_arg_int(policy, key, value, 1, 1 << 24, &o->window);
    if (strcmp(key, "kernel") == 0) return policy_arg_int(policy, key, value, 1, 1025, &o->kernel);
    if (strcmp(key, "pool") == 0) {
        PYKV_TRY(policy_arg_choice(policy, key, value, "max|avg", &choice));
        o->pool = (enum ws_pool)choice;
        return PYKV_OK;
    }
    if (strcmp(key, "gqa") == 0) {
        PYKV_TRY(policy_arg_choice(policy, key, value, "mean|max", &choice));
        o->gqa = (enum ws_gqa)choice;
        return PYKV_OK;
    }
    *handled = 0;
    return PYKV_OK;
}

pykv_status ws_opts_finish(const char *policy, struct ws_opts *o, const struct policy_config *cfg) {
    if (cfg->window >= 0) {
        if (o->window >= 0 && o->window != cfg->window)
            return pykv_error(PYKV_ERR_INVALID_ARG, "policy '%s': window=%d and the policy argument window=%d disagree",
                              policy, cfg->window, o->window);
        if (cfg->window < 1)
            return pykv_error(PYKV_ERR_INVALID_ARG, "policy '%s': the window must be at least 1 (its queries score "
                              "the cache), got %d", policy, cfg->window);
        o->window = cfg->window;
    }
    if (o->window < 0) o->window = 32;
    if (o->kernel % 2 == 0)
        return pykv_error(PYKV_ERR_INVALID_ARG, "policy '%s': the pooling kernel must be odd, got %d", policy, o->kernel);
    if (cfg->sink > 0)
        return pykv_error(PYKV_ERR_INVALID_ARG, "policy '%s' has no sink tokens (sink=%d); use streamingllm for sinks",
                          policy, cfg->sink);
    if (cfg->budget > 0) PYKV_TRY(ws_check_budget(policy, cfg->budget, o->window));
    return PYKV_OK;
}

pykv_status ws_check_budget(const char *policy, int32_t B, int32_t W) {
    if (B <= W)
        return pykv_error(PYKV_ERR_INVALID_ARG, "policy '%s': the budget (%d entries per layer and KV head) must be "
                          "larger than the window W=%d it includes", policy, B, W);
    return PYKV_OK;
}

int32_t ws_budget(const struct policy_config *cfg, const struct policy_event *ev) {
    return policy_budget(cfg, ev->n_past_end);
}

int32_t ws_min_budget(const struct kv_policy *p) { return p->ops->last_chunk_min(p) + 1; }
