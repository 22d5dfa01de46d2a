// policy-make.c - a policy's state from its table of options (policy-make.h).
#include "kv/policies/common/policy-make.h"
#include "kv/policies/common/policy-args.h"
#include "kv/policies/common/window-scores.h"
#include "core/error.h"

#include <stdlib.h>
#include <string.h>

struct make_state {
    const struct policy_maker *m;
    char                      *state;   // the policy's state, as bytes for the offsets
};

static pykv_status set_opt(const char *policy, const struct policy_opt *o, char *state, const char *value) {
    void *field = state + o->offset;
    switch (o->type) {
    case POLICY_OPT_INT:    return policy_arg_int(policy, o->key, value, (int64_t)o->lo, (int64_t)o->hi, field);
    case POLICY_OPT_DOUBLE: return policy_arg_double(policy, o->key, value, o->lo, o->hi, field);
    case POLICY_OPT_CHOICE: return policy_arg_choice(policy, o->key, value, o->choices, field);
    }
    return pykv_error(PYKV_ERR_INTERNAL, "policy '%s': option '%s' has an unknown type", policy, o->key);
}

static pykv_status parse_one(void *arg, const char *key, const char *value) {
    const struct make_state *ms = arg;
    const struct policy_maker *m = ms->m;
    const char *policy = m->ops->name;
    if (m->window_opts) {
        int handled = 0;
        PYKV_TRY(ws_opts_arg(policy, (struct ws_opts *)(ms->state + m->window_opts), key, value, &handled));
        if (handled) return PYKV_OK;
    }
    for (int i = 0; i < m->n_opts; i++)
        if (strcmp(key, m->opts[i].key) == 0) return set_opt(policy, &m->opts[i], ms->state, value);
    return policy_arg_unknown(policy, key, m->accepted);
}

static pykv_status setup(const struct policy_maker *m, const struct policy_config *cfg, struct kv_policy *p) {
    struct make_state ms = { m, (char *)p };
    struct ws_opts *ws = m->window_opts ? (struct ws_opts *)(ms.state + m->window_opts) : NULL;
    if (ws) ws_opts_default(ws);
    if (m->defaults) m->defaults(p);
    PYKV_TRY(policy_args_parse(m->ops->name, cfg->args, m->accepted, parse_one, &ms));
    if (ws) PYKV_TRY(ws_opts_finish(m->ops->name, ws, cfg));
    return m->finish ? m->finish(p, cfg) : PYKV_OK;
}

pykv_status policy_make(const struct policy_maker *m, const struct policy_config *cfg, struct kv_policy **out) {
    struct kv_policy *p = calloc(1, m->size);
    if (!p) return pykv_error(PYKV_ERR_NOMEM, "out of memory");
    p->ops = m->ops;
    const pykv_status st = setup(m, cfg, p);
    if (st != PYKV_OK) {
        m->ops->free(p);
        return st;
    }
    *out = p;
    return PYKV_OK;
}

void policy_free_state(struct kv_policy *p) { free(p); }
