// policy-state.c - see policy-state.h.
#include "kv/policies/common/policy-state.h"
#include "core/error.h"

#include <math.h>

pykv_status policy_state_corrupt(const char *policy, const char *what) {
    return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_state_load: not a usable state: the %s policy's %s is bad", policy,
                      what);
}

pykv_status policy_state_floats(const char *policy, struct state_reader *r, float *out, int32_t n) {
    for (int32_t j = 0; j < n; j++) {
        float x;
        if (!state_take(r, &x, sizeof(x))) return policy_state_corrupt(policy, "part (cut short)");
        if (!isfinite(x)) return policy_state_corrupt(policy, "score (not finite)");
        if (out) out[j] = x;
    }
    return PYKV_OK;
}

pykv_status policy_state_ints(const char *policy, const char *what, struct state_reader *r, int32_t *out, int32_t n,
                              int32_t lo, int32_t hi) {
    for (int32_t j = 0; j < n; j++) {
        int32_t x;
        if (!state_take_i32(r, &x) || x < lo || x > hi) return policy_state_corrupt(policy, what);
        if (out) out[j] = x;
    }
    return PYKV_OK;
}
