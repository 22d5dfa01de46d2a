// policy-state.h - reading a policy's part of a saved state (policy.h state_read): the
// checks every policy makes, with one wording for what is wrong.
#pragma once
#include <stdint.h>
#include "pykv.h"
#include "kv/state-io.h"

// PYKV_ERR_INVALID_ARG: "not a usable state: the <policy> policy's <what> is bad".
pykv_status policy_state_corrupt(const char *policy, const char *what);

// n finite floats into out (NULL: only checked and skipped).
pykv_status policy_state_floats(const char *policy, struct state_reader *r, float *out, int32_t n);

// n integers, each in [lo, hi], into out (NULL: only checked and skipped).
pykv_status policy_state_ints(const char *policy, const char *what, struct state_reader *r, int32_t *out, int32_t n,
                              int32_t lo, int32_t hi);
