// policy.c - the registry of eviction policies, in the order users see them.
#include "policy.h"
#include "error.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
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
};

#define N_POLICIES ((int)(sizeof(registry) / sizeof(registry[0])))

const struct policy_ops *policy_registry_get(int i) { return (i >= 0 && i < N_POLICIES) ? registry[i] : NULL; }

const struct policy_ops *policy_find(const char *name) {
    for (int i = 0; i < N_POLICIES; i++)
        if (strcmp(registry[i]->name, name) == 0) return registry[i];
    char names[256] = "";
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

int32_t policy_budget(const struct policy_config *cfg, int32_t n_prompt) {
    // The fraction arrives as a float (0.1f is 0.100000001): a tiny allowance keeps
    // 10% of 200 at 20 rather than 21.
    int64_t b = cfg->budget > 0 ? cfg->budget : (int64_t)ceil((double)cfg->budget_frac * n_prompt - 1e-4);
    if (b < 1) b = 1;
    return b > INT32_MAX ? INT32_MAX : (int32_t)b;
}
