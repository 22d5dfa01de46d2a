// policy-make.h - making a policy's state: allocate it, set its defaults, parse its arguments
// ("k=v,k=v") against a table of its options, check them, and free it again on failure.
//
// A policy describes itself with a struct policy_maker; its init is then one call to
// policy_make. Policies whose state holds no allocations of its own free it with
// policy_free_state.
#pragma once
#include <stddef.h>
#include "kv/policy.h"

enum policy_opt_type {
    POLICY_OPT_INT,      // an int32_t in [lo, hi]
    POLICY_OPT_DOUBLE,   // a double in [lo, hi]
    POLICY_OPT_CHOICE,   // an int: the index of the value among choices ("fixed|none")
};

// One argument of a policy: its key, the field of the policy's state it sets (offsetof the
// state's struct), and what it accepts.
struct policy_opt {
    const char          *key;
    enum policy_opt_type type;
    size_t               offset;
    double               lo, hi;    // INT, DOUBLE
    const char          *choices;   // CHOICE
};

struct policy_maker {
    const struct policy_ops *ops;          // the policy (its name is used in messages)
    size_t                   size;         // its state's size; the state starts with struct kv_policy
    const char              *accepted;     // every key it takes, for the messages
    const struct policy_opt *opts;         // its own arguments
    int                      n_opts;
    // offsetof its struct ws_opts when it takes the window policies' shared arguments
    // (window, pool, kernel, gqa: defaults set before `defaults`, checked with ws_opts_finish
    // after parsing); 0 when it does not
    size_t                   window_opts;
    // Its defaults, set on the zeroed state before parsing (NULL: all zero).
    void                   (*defaults)(struct kv_policy *p);
    // After parsing: checks across options and against cfg, derived fields (NULL: none).
    pykv_status            (*finish)(struct kv_policy *p, const struct policy_config *cfg);
};

// Make the policy m describes from cfg (its args); on failure nothing is left allocated.
pykv_status policy_make(const struct policy_maker *m, const struct policy_config *cfg, struct kv_policy **out);

// The free of a policy whose state holds no allocations of its own.
void policy_free_state(struct kv_policy *p);
