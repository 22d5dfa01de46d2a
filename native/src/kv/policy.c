// policy.c - the registry of eviction policies, in the order users see them.
#include "kv/policy.h"
#include "core/error.h"
#include "core/log.h"
#include "kv/policies/common/policy-args.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern const struct policy_ops policy_full;
extern const struct policy_ops policy_streamingllm;
extern const struct policy_ops policy_h2o;
extern const struct policy_ops policy_snapkv;
extern const struct policy_ops policy_pyramidkv;
extern const struct policy_ops policy_adakv;
extern const struct policy_ops policy_cake;
extern const struct policy_ops policy_lava;
extern const struct policy_ops policy_ems;
extern const struct policy_ops policy_take;
extern const struct policy_ops policy_knorm;
extern const struct policy_ops policy_keydiff;
extern const struct policy_ops policy_random;
extern const struct policy_ops policy_tova;
extern const struct policy_ops policy_lagkv;
extern const struct policy_ops policy_chunkkv;
extern const struct policy_ops policy_finch;
extern const struct policy_ops policy_expected_attention;
extern const struct policy_ops policy_criticalkv;
extern const struct policy_ops policy_criticaladakv;
extern const struct policy_ops policy_kvzip;

static const struct policy_ops *const registry[] = {
    &policy_full,
    &policy_streamingllm,
    &policy_h2o,
    &policy_snapkv,
    &policy_pyramidkv,
    &policy_adakv,
    &policy_cake,
    &policy_lava,
    &policy_ems,
    &policy_take,
    &policy_knorm,
    &policy_keydiff,
    &policy_random,
    &policy_tova,
    &policy_lagkv,
    &policy_chunkkv,
    &policy_finch,
    &policy_expected_attention,
    &policy_criticalkv,
    &policy_criticaladakv,
    &policy_kvzip,
};

#define N_POLICIES ((int)(sizeof(registry) / sizeof(registry[0])))

const struct policy_ops *policy_registry_get(int i) { return (i >= 0 && i < N_POLICIES) ? registry[i] : NULL; }

const struct policy_ops *policy_find(const char *name) {
    for (int i = 0; i < N_POLICIES; i++)
        if (strcmp(registry[i]->name, name) == 0) return registry[i];
    char names[640] = "";   // every name (the message buffer holds 1024)
    for (int i = 0; i < N_POLICIES; i++) {
        if (i) strncat(names, ", ", sizeof(names) - strlen(names) - 1);
        strncat(names, registry[i]->name, sizeof(names) - strlen(names) - 1);
    }
    pykv_error(PYKV_ERR_INVALID_ARG, "unknown KV policy '%s' (available: %s)", name, names);
    return NULL;
}

int32_t pykv_policy_count(void) { return N_POLICIES; }

const char *pykv_policy_name(int32_t i) {
    const struct policy_ops *p = policy_registry_get(i);
    return p ? p->name : NULL;
}

const char *pykv_policy_description(int32_t i) {
    const struct policy_ops *p = policy_registry_get(i);
    return p ? p->description : NULL;
}

void policy_notice(struct policy_notices *ns, enum policy_notice_kind kind, const char *fmt, ...) {
    if (!ns || (ns->said & (1u << kind))) return;
    ns->said |= 1u << kind;
    char *text = ns->text[ns->n++];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(ns->text[0]), fmt, ap);
    va_end(ap);
    LOG_WARN("%s", text);
}

int32_t policy_floor(const struct kv_policy *p) {
    int32_t floor = p->ops->budget_floor;
    int32_t least = p->ops->min_budget ? p->ops->min_budget(p) : 1;
    return least > floor ? least : floor;
}

static int64_t share_of(double frac, int32_t n_prompt) {
    // The fraction arrives as a float (0.1f is 0.100000001): a tiny allowance keeps
    // 10% of 200 at 20 rather than 21.
    return (int64_t)ceil(frac * n_prompt - 1e-4);
}

int32_t policy_budget(const struct policy_config *cfg, int32_t n_prompt) {
    int64_t b;
    if (cfg->budget > 0) {
        b = cfg->budget;
    } else if (cfg->budget_frac > 0.0f) {
        b = share_of(cfg->budget_frac, n_prompt);
        if (b < cfg->floor) {
            policy_notice(cfg->notices, NOTICE_BUDGET_FLOOR,
                          "budget %.4g%% of a %d-token prompt is %lld entries, fewer than policy '%s' works with: "
                          "raised to %d entries per layer and KV head", (double)cfg->budget_frac * 100.0, n_prompt,
                          (long long)b, cfg->name ? cfg->name : "?", cfg->floor);
            b = cfg->floor;
        }
    } else {
        b = share_of(cfg->default_frac, n_prompt);
        if (b < cfg->default_min) b = cfg->default_min;
        // a prompt longer than the cache: the default leaves half of it for what follows
        if (cfg->cap > 0 && n_prompt > cfg->cap && b > cfg->cap / 2) b = cfg->cap / 2;
    }
    if (cfg->cap > 0 && b > cfg->cap) {
        if (n_prompt > cfg->cap)
            policy_notice(cfg->notices, NOTICE_BUDGET_CAP,
                          "the budget (%lld entries per layer and KV head) is more than the cache holds (n_ctx=%d): "
                          "the cache keeps %d", (long long)b, cfg->cap, cfg->cap);
        b = cfg->cap;
    }
    if (b < 1) b = 1;
    return b > INT32_MAX ? INT32_MAX : (int32_t)b;
}

pykv_status pykv_policy_get_info(int32_t i, struct pykv_policy_info *info) {
    const struct policy_ops *p = policy_registry_get(i);
    if (!info) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_policy_get_info: info is NULL");
    if (info->struct_size != sizeof(*info))
        return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_policy_info.struct_size is %zu, expected %zu (header/library "
                          "mismatch)", info->struct_size, sizeof(*info));
    if (!p) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_policy_get_info: no policy %d (there are %d)", i, N_POLICIES);
    info->name = p->name;
    info->description = p->description;
    info->options = p->options ? p->options : "";
    info->choose = p->choose ? p->choose : "";
    info->default_budget_frac = p->default_budget_frac;
    info->default_budget_min = p->default_budget_min;
    info->budget_floor = p->budget_floor;
    info->evicts = !p->keeps_every_entry;
    info->evicts_while_reading = p->evicts_while_reading;
    info->evicts_every_step = (p->needs & POLICY_NEEDS_STEP_ROOM) != 0;
    info->runs_on_gpu = policy_runs_on_gpu(p);
    return PYKV_OK;
}

struct split_state {
    char *rest;        // the arguments left for the policy, "k=v,k=v"
    int  *every_chunk;
    const char *policy;
};

static pykv_status split_one(void *state, const char *key, const char *value) {
    struct split_state *ss = state;
    if (strcmp(key, "evict_every_chunk") == 0) {
        int choice = 0;
        PYKV_TRY(policy_arg_choice(ss->policy, key, value, "0|1", &choice));
        *ss->every_chunk = choice;
        return PYKV_OK;
    }
    if (ss->rest[0]) strcat(ss->rest, ",");
    strcat(ss->rest, key);
    strcat(ss->rest, "=");
    strcat(ss->rest, value);
    return PYKV_OK;
}

pykv_status policy_split_args(const char *policy, const char *args, char **rest, int *every_chunk) {
    *rest = NULL;
    *every_chunk = 0;
    if (!args) return PYKV_OK;
    // each pair comes back trimmed, so the rest is never longer than args
    struct split_state ss = { calloc(strlen(args) + 1, 1), every_chunk, policy };
    if (!ss.rest) return pykv_error(PYKV_ERR_NOMEM, "out of memory");
    pykv_status st = policy_args_parse(policy, args, "evict_every_chunk (0|1) and the policy's own", split_one, &ss);
    if (st != PYKV_OK) {
        free(ss.rest);
        return st;
    }
    *rest = ss.rest;
    return PYKV_OK;
}
