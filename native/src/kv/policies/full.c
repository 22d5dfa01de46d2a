// full.c - the `full` policy: keeps every entry (the reference the others are judged by).
#include "core/error.h"
#include "kv/policy.h"

extern const struct policy_ops policy_full;

#include <stdlib.h>

static pykv_status full_init(const struct policy_config *cfg, struct kv_policy **out) {
    (void)cfg;   // full keeps every entry: no budget applies
    struct kv_policy *p = calloc(1, sizeof(*p));
    if (!p) return pykv_error(PYKV_ERR_NOMEM, "out of memory");
    p->ops = &policy_full;
    *out = p;
    return PYKV_OK;
}

static void full_free(struct kv_policy *p) { free(p); }

const struct policy_ops policy_full = {
    .name = "full",
    .description = "keep every entry: no eviction",
    .init = full_init,
    .free = full_free,
    .keeps_every_entry = 1,
    .device_lists = 1,
    .options = "",
    .choose = "the exact model: nothing is evicted and the cache grows with every token (a budget is an error)",
};
